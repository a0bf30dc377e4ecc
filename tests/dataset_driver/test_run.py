"""A training run's driver side against a real broker, LLM actor and Redis: validation before and after,
the figures written, the resume state honoured, and the reward sources built from [train]."""

from __future__ import annotations

import json
import time

import pytest

from dataset_driver.config import TrainConfig
from dataset_driver.run import build_reward, run_training
from tests.dataset_driver.test_driver import COLOURS
from tools.bench.judge_stand_in import chat_server


def write_dataset(path, n: int) -> None:
    lines = [{"prompt": f"say the word {COLOURS[i % 4]}", "ground_truth": COLOURS[i % 4], "data_source": "colours"} for i in range(n)]
    path.write_text("\n".join(json.dumps(line) for line in lines))


def first_word(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.split()[:1] == [ground_truth])


def small_run(tmp_path, records: int, **settings) -> TrainConfig:
    """A short run on `records` colour prompts (train.jsonl), 2 workers, 2-token responses, the first-word reward."""
    write_dataset(tmp_path / "train.jsonl", records)
    defaults = dict(workers=2, max_new_tokens=2, reward_fn="tests.dataset_driver.test_run:first_word", report_every_s=0.5)
    return TrainConfig(data=str(tmp_path / "train.jsonl"), output_dir=str(tmp_path / "out"), **{**defaults, **settings})


def test_a_run_validates_trains_writes_its_figures_and_resumes(stack, tmp_path) -> None:
    write_dataset(tmp_path / "val.jsonl", 4)
    cfg = small_run(tmp_path, 6, val=str(tmp_path / "val.jsonl"), epochs=2, rollout_n=2, max_samples=10)
    lines: list[str] = []
    summary = run_training(cfg, stack.frontend, echo=lines.append)
    assert summary["samples"] == 10 and summary["rewarded"] == 10 and summary["resume_from"] == 10
    assert 0.0 <= summary["val_before"] <= 1.0 and 0.0 <= summary["val_after"] <= 1.0
    assert any(line.startswith("samples ") and "reward_mean" in line for line in lines)
    assert any(line.startswith("samples 10/10 (100%)") for line in lines)
    assert json.loads((tmp_path / "out" / "driver_state.json").read_text())["resume_from"] == 10
    assert (tmp_path / "out" / "progress.jsonl").read_text().count("\n") >= 1
    # The next run with the same output directory goes on at sample 10, to the order's end (2 epochs x 6 x 2 = 24).
    again = run_training(TrainConfig(**{**cfg.__dict__, "max_samples": 0}), stack.frontend, echo=lines.append)
    assert again["start"] == 10 and again["samples"] == 14 and again["resume_from"] == 24
    assert "ppoz train: resuming at sample 10" in lines
    times = [json.loads(line)["time"] for line in (tmp_path / "out" / "progress.jsonl").read_text().splitlines()]
    assert times == sorted(times) and len(times) >= 2  # the resumed run's rows go on after the first run's
    # Another order (another seed) does not take that state: it starts again.
    other = run_training(TrainConfig(**{**cfg.__dict__, "seed": 5, "val": ""}), stack.frontend, echo=lines.append)
    assert other["start"] == 0 and other["samples"] == 10
    rows = [json.loads(line) for line in (tmp_path / "out" / "progress.jsonl").read_text().splitlines()]
    assert rows[0]["time"] < times[-1] and max(r["samples"] for r in rows) <= 10  # a run from the start writes it anew
    in_file_order = run_training(TrainConfig(**{**cfg.__dict__, "seed": 5, "val": "", "shuffle": False}), stack.frontend, echo=lines.append)
    assert in_file_order["start"] == 0  # nor does the same seed in file order


def test_the_reward_sources_come_from_train_settings(tiny_reward_model) -> None:
    rm = tiny_reward_model()
    with chat_server(lambda body, n: "Score: 1") as server:
        cfg = TrainConfig(
            data="x.jsonl",
            reward_fn="math",
            reward_model=str(rm),
            judge_model="judge",
            judge_base_url=server.base_url,
            weights={"rule_score": 0.5, "rm_score": 0.25, "judge_score": 0.25},
        )
        reward = build_reward(cfg)
        from rewards.composite import Item

        (scored,) = reward.score([Item("What is 1+1?", "\\boxed{2}", "2", "math")])
    assert set(scored.components) == {"rule_score", "rm_score", "judge_score"}
    assert scored.reward == pytest.approx(0.5 + 0.25 * scored.components["rm_score"] + 0.25)
    # a reward model alone is the reward (its records may have no ground truth); a named function joins it
    assert TrainConfig(data="x", reward_model="m").reward_weights() == {"rm_score": 1.0}
    assert TrainConfig(data="x", reward_model="m", reward_fn="math").reward_weights() == {"rule_score": 1.0, "rm_score": 1.0}
    assert TrainConfig(data="x").reward_weights() == {"rule_score": 1.0}  # nothing set: the built-in by data_source
    for bad, words in [(dict(rollout_n=0), "rollout_n"), (dict(temperature=0.0), "sampled"), (dict(weights={"rm_score": "a"}), "a number")]:
        with pytest.raises(ValueError, match=words):
            TrainConfig(data="x", **bad)


def test_grpo_runs_whole_groups_and_says_when_the_learner_disagrees(stack, tmp_path, caplog) -> None:
    from dataset_driver.group_advantage import GroupAdvantage
    from ppoz.train import advantage_settings

    cfg = small_run(tmp_path, 4, rollout_n=3, max_samples=12)
    lines: list[str] = []
    learner_on_gae = {"generation/group_relative": 0.0}  # a learner that was not told: it would fit a critic to advantages
    with caplog.at_level("ERROR", logger="dataset_driver.run"):
        summary = run_training(cfg, stack.frontend, lambda: learner_on_gae, echo=lines.append, grouping=GroupAdvantage())
    assert summary["samples"] == 12 and summary["groups"] == 4 and summary["uniform_groups"] + summary["lone"] <= 4
    assert any("uniform_groups" in line for line in lines if line.startswith("samples "))
    assert [r.message for r in caplog.records].count(
        "the learner trains with [generation] advantage = gae but these drivers send group-relative advantages (grpo):"
        " give both the same setting"
    ) == 1
    # a limit that falls inside a group finishes that group: a group is never cut short
    cut = run_training(TrainConfig(**{**cfg.__dict__, "max_samples": 4, "resume": False}), stack.frontend, grouping=GroupAdvantage())
    assert cut["samples"] == 6 and cut["groups"] == 2
    with pytest.raises(ValueError, match="rollout_n = 1: GRPO compares the responses to one prompt"):
        run_training(TrainConfig(**{**cfg.__dict__, "rollout_n": 1}), stack.frontend, grouping=GroupAdvantage())
    # `ppoz train --advantage grpo`: the drivers group, and the learner started here is told, KL in the loss as k3
    grouping, flags = advantage_settings(None, "grpo")
    assert grouping == GroupAdvantage() and flags == ["--gen-advantage", "grpo", "--no-gen-kl-in-reward", "--gen-kl-estimator", "k3"]
    (tmp_path / "k2.toml").write_text("[generation]\nkl_estimator = 'k2'\ngrpo_scale_by_std = false\n")
    grouping, flags = advantage_settings(str(tmp_path / "k2.toml"), "grpo")  # the file's own choices stand
    assert grouping == GroupAdvantage(scale_by_std=False) and flags == ["--gen-advantage", "grpo", "--no-gen-kl-in-reward"]
    assert advantage_settings(str(tmp_path / "k2.toml"), None) == (None, [])
    grouping, flags = advantage_settings(None, "rloo")  # RLOO: the drivers take each response against the others' mean
    assert grouping == GroupAdvantage("rloo") and flags == ["--gen-advantage", "rloo", "--no-gen-kl-in-reward", "--gen-kl-estimator", "k3"]


def test_the_progress_line_shows_the_share_done_and_the_time_left_at_this_runs_pace() -> None:
    from dataset_driver.driver import DriverProgress
    from dataset_driver.run import progress_line

    resumed = DriverProgress(start=100, done={100, 101, 102})  # 3 positions in 30 s: 10 s each
    assert progress_line(103, 112, resumed, 30.0, {}).startswith("samples 103/112 (92%, eta 1m30s)  reward_mean nan")
    assert progress_line(103, None, resumed, 30.0, {}).startswith("samples 103  ")  # epochs 0: no end to count to
    assert progress_line(100, 112, DriverProgress(start=100), 5.0, {}).startswith("samples 100/112 (89%)  ")  # no pace yet


def test_a_resume_point_recorded_with_a_relative_data_path_is_still_found(tmp_path, monkeypatch) -> None:
    """A run from before paths were made absolute recorded `--data train.jsonl` as given: the same command again,
    from the same folder, goes on from where it stopped instead of starting over (`train.jsonl` is the absolute
    path now). Another folder's train.jsonl is another dataset."""
    from dataset_driver.data import PromptOrder
    from dataset_driver.run import read_state

    monkeypatch.chdir(tmp_path)
    order = PromptOrder(25, epochs=2)
    state = {"data": "train.jsonl", "n_records": 25, "epochs": 2, "rollout_n": 1, "seed": 0, "shuffle": True}
    (tmp_path / "driver_state.json").write_text(json.dumps({**state, "run": "abc", "resume_from": 17}))
    assert read_state(tmp_path / "driver_state.json", order, str(tmp_path / "train.jsonl")) == ("abc", 17)
    assert read_state(tmp_path / "driver_state.json", order, str(tmp_path / "other" / "train.jsonl")) == ("", 0)


def slow_first_word(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)  # so the drivers outlive several validations on any machine
    return first_word(data_source, solution_str, ground_truth)


def test_validation_while_training_is_written_to_the_progress_rows_and_the_summary(stack, tmp_path) -> None:
    write_dataset(tmp_path / "val.jsonl", 4)
    cfg = small_run(
        tmp_path,
        8,
        val=str(tmp_path / "val.jsonl"),
        epochs=0,
        max_samples=40,
        val_every_s=0.2,
        reward_fn=f"{__name__}:slow_first_word",
    )
    lines: list[str] = []
    summary = run_training(cfg, stack.frontend, echo=lines.append)
    validations = summary["validations"]
    assert len(validations) >= 2, validations  # 40 rewards of 0.05 s on 2 workers: 1 s at least, validations every 0.2 s
    assert [t for t, _ in validations] == sorted(t for t, _ in validations) and all(0.0 <= v <= 1.0 for _, v in validations)
    rows = [json.loads(line) for line in (tmp_path / "out" / "progress.jsonl").read_text().splitlines()]
    assert [[round(r["time"], 1), r["val_reward"]] for r in rows if "val_reward" in r] == validations
    assert sum(line.startswith("ppoz train: validation reward at ") for line in lines) == len(validations)
    assert summary["response_tokens"] >= summary["samples"]  # every response has a token at least (its end)
    # without validation prompts nothing is validated, whatever val_every_s says
    again = run_training(TrainConfig(**{**cfg.__dict__, "val": "", "resume": False}), stack.frontend, echo=lines.append)
    assert "validations" not in again and "val_before" not in again


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_val_every_s_must_be_zero_or_a_number_of_seconds(tmp_path, value) -> None:
    with pytest.raises(ValueError, match=r"val_every_s"):
        small_run(tmp_path, 2, val_every_s=value)
