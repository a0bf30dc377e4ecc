"""`ppoz train` end to end on responses of real lengths: up to 64 new tokens, rewarded answers of 1 to 6 words.

The task: "what is N" -> count up from zero to N ("what is three" -> "zero one two three"), said in the
numbers tokenizer's words. The reward credits the words counted right from the start and stopping where the
count ends: matched prefix / max(target words, response words), so a rewarded answer's length is its
target's and the untrained model's rambling (tens of tokens: the end token is one of 17) earns little. The
learner sees responses from 1 to 64 tokens in minibatches split into micro-batches of 64 tokens: the shapes
that crashed it at its first update (issue 27). Every update must apply and the greedy validation reward rise.
"""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.learner_figures import GENERATION
from ppoz.demo_arithmetic import NUMBERS
from tests.processes import free_port, ppoz

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    said, target = solution_str.split(), ground_truth.split()
    matched = 0
    for a, b in zip(said, target):
        if a != b:
            break
        matched += 1
    return matched / max(len(target), len(said))
"""


def counting(top: int) -> list[dict[str, str]]:
    return [{"prompt": f"what is {NUMBERS[n]}", "ground_truth": " ".join(NUMBERS[: n + 1])} for n in range(top)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # past the run's timeout below, so its output is shown
def test_ppoz_train_on_responses_of_up_to_64_tokens_applies_every_update_and_learns(tmp_path, tiny_model) -> None:
    model = tiny_model("llama", tokenizer="numbers")
    rows = counting(6)
    assert sorted({len(r["ground_truth"].split()) for r in rows}) == [1, 2, 3, 4, 5, 6]  # rewarded answers of six lengths
    (tmp_path / "count.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)
    front, back, weights = free_port(), free_port(), free_port()
    config = tmp_path / "train.toml"
    config.write_text(
        "[policy]\nlora_rank = 0\n"
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nsegment_len = 1\n'
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\nrollout_batch = 32\npolicy_minibatch = 8\n'
        f'tensorboard_dir = "{tmp_path / "tb"}"\n'
        "[generation]\nvalue_hidden = [64]\nmicro_batch_tokens = 64\n"
        "[actor]\nweights_poll_s = 1.0\n"
        "[up]\nactors = 1\nstop_timeout_s = 60\n"  # a component's exit after SIGTERM: 1-5 s alone; x12
        f'[train]\nworkers = 8\nmax_new_tokens = 64\nreport_every_s = 10\noutput_dir = "{tmp_path / "out"}"\n'
    )
    data = ["--data", str(tmp_path / "count.jsonl"), "--val", str(tmp_path / "count.jsonl")]
    reward = ["--reward-fn", f"{tmp_path / 'reward.py'}:compute_score"]
    # the whole stack's start, 1,600 responses of up to 64 tokens, validations and the stop: 76 s alone; x11
    limits = ["--epochs", "0", "--max-samples", "1600", "--json"]
    run = ppoz("train", "--config", str(config), "--model", model, *data, *reward, *limits, timeout=840, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    # Every update's mean response length, from the learner's own TensorBoard scalars: the progress lines sample
    # the learner's latest figures every report_every_s, and a quiet machine's run was over in one report.
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    lengths = [round(e.value, 1) for e in events.Scalars(f"{GENERATION}/response_length")]
    trace = f"val {summary['val_before']:.3f} -> {summary['val_after']:.3f}; mean response lengths by update {lengths}"
    print(trace)
    # no update crashed the learner (its supervisor would restart it) and every rollout was trained on, but for
    # the last few, which may still be in the stream or the learner's hands when the summary reads its version
    assert "Traceback" not in output and "restart" not in output.lower(), output[-4000:]
    assert summary["unrewarded"] == 0 and summary["learner"]["version"] >= summary["rewarded"] // 32 - 3, (summary, trace)
    assert max(lengths) > 5, trace  # the learner trained on long responses, not only on the short ones it learns
    assert summary["val_after"] >= summary["val_before"] + 0.2, trace
