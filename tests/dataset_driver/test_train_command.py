"""`ppoz train` on one machine: it starts the stack as processes (embedded Redis, broker, actor, learner),
drives it with the dataset, validates before and after, and ends with the summary as JSON. It runs GRPO
(`--advantage grpo`): the demo's test runs the default, GAE, through the same path. A judge (a local
stand-in of the chat-completions API) is served by the stack's own reward service, which the drivers call."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.dataset_driver.test_driver import COLOURS
from tests.dataset_driver.test_run import write_dataset
from tests.helpers import wait_for
from tests.processes import free_port, ppoz, start_ppoz


@pytest.mark.slow
@pytest.mark.timeout(600)  # past the run's timeout below, so its output is shown
def test_ppoz_train_runs_a_stack_on_this_machine_and_reports(tmp_path, tiny_model) -> None:
    import contextlib

    from tools.bench.judge_stand_in import chat_server

    judged: list[int] = []
    stack = contextlib.ExitStack()
    model = tiny_model("llama", tokenizer="words")
    write_dataset(tmp_path / "train.jsonl", 8)
    write_dataset(tmp_path / "val.jsonl", 8)
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.split()[:1] == [ground_truth])\n"
    )
    front, back, weights, rewards = free_port(), free_port(), free_port(), free_port()
    config = tmp_path / "train.toml"
    api = stack.enter_context(chat_server(lambda body, n: judged.append(n) or "Score: 0"))  # type: ignore[func-returns-value]
    config.write_text(
        f"[policy]\nlora_rank = 4\n"
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nsegment_len = 1\n'
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\nrollout_batch = 16\npolicy_minibatch = 16\n'
        'tensorboard_dir = ""\n'
        "[generation]\nvalue_hidden = [64]\n"
        "[actor]\nweights_poll_s = 1.0\n"
        "[up]\nactors = 1\nstop_timeout_s = 60\nreward_service = true\n"  # a component's exit: 1-5 s alone; x12
        f'[reward_service]\nbind = "tcp://127.0.0.1:{rewards}"\njudge_model = "judge-1"\njudge_base_url = "{api.base_url}"\n'
        f'[train]\nworkers = 4\nmax_new_tokens = 2\nreport_every_s = 5\noutput_dir = "{tmp_path / "out"}"\n'
        "weights = {rule_score = 1.0, judge_score = 1.0}\n"
    )
    with stack:
        data = ["--data", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "val.jsonl")]
        reward = ["--reward-fn", f"{tmp_path / 'reward.py'}:compute_score"]
        grpo = ["--advantage", "grpo", "--rollout-n", "2"]
        model_and_config = ["--config", str(config), "--model", str(model)]
        run_for = ["--epochs", "0", "--max-samples", "96"]
        # the whole stack's start (torch processes at once on two cores), 96 samples, validations, the stop: 9 s on the
        # 2-core VM beside other work; x60
        run = ppoz("train", *model_and_config, *data, *reward, *run_for, *grpo, "--json", timeout=540, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 96 and summary["rewarded"] == 96 and summary["unrewarded"] == 0
    assert summary["groups"] == 48 and "uniform_groups" in run.stdout
    # the judge was asked through the reward service the stack started, which ppoz train's drivers called,
    # about each of the four prompts (not once per sample: the judge answers a repeated prompt and
    # response from its cache, and an untrained model often writes the same two words twice)
    assert "reward service ready on" in run.stdout + run.stderr
    asked = [json.dumps(body) for body, _ in api.requests]
    assert len(judged) == len(asked) and all(any(f"say the word {c}" in a for a in asked) for c in COLOURS[:4])
    # the learner started here was told: it trains without a critic (no value loss) and does not disagree
    assert "give both the same setting" not in run.stderr and "value_loss" not in summary["learner"], summary["learner"]
    assert 0.0 <= summary["val_before"] <= 1.0 and 0.0 <= summary["val_after"] <= 1.0
    assert summary["learner"].get("version", 0) >= 1, summary  # the learner trained on what the drivers sent
    assert "validation reward before" in run.stdout and "samples " in run.stdout
    # the learner's last checkpoint under the run's outputs, its adapter in peft's format
    assert summary["adapter"].startswith(str(tmp_path / "out" / "checkpoints"))
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(summary["adapter"]).r == 4
    from PIL import Image

    from ppoz.curve import CURVE_COLOUR, VALIDATION_COLOUR

    with Image.open(summary["curve"]) as image:  # the reward over time and the two validation points
        assert image.format == "PNG"
        counts = {colour: n for n, colour in image.convert("RGB").getcolors(maxcolors=1 << 24)}
        for colour in (CURVE_COLOUR, VALIDATION_COLOUR):
            assert counts.get(tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5)), 0) > 50, f"nothing drawn in {colour}"


@pytest.mark.slow
def test_ppoz_train_drives_a_farms_broker(stack, redis_url, redis_client, key_prefix, tmp_path) -> None:
    """`--broker`: nothing is started; the drivers feed the farm's broker (here one in this process, with an actor),
    and the learner's figures are read from the farm's Redis (here written as a learner would)."""
    from common.learner_figures import write_latest
    from tests.broker.test_broker import segments

    write_dataset(tmp_path / "train.jsonl", 4)
    write_latest(redis_client, key_prefix, {"version": 7.0, "generation/kl_ref": 0.002, "generation/group_relative": 0.0})
    farm = ["--broker", stack.frontend, "--redis-url", redis_url, "--key-prefix", key_prefix]
    run_for = ["--max-samples", "8", "--epochs", "0", "--workers", "2", "--max-new-tokens", "2", "--report-every-s", "0.5"]
    out = ["--output-dir", str(tmp_path / "out")]
    args = ["train", *farm, "--data", str(tmp_path / "train.jsonl"), "--reward-fn", "first_word", *run_for, *out]
    # against a farm (the broker and actor threads here): a start and 8 two-token responses, a few s alone; x50
    run = ppoz(*args, "--json", timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 8 and summary["rewarded"] == 8 and summary["learner"]["version"] == 7.0
    assert "version 7" in run.stdout and "kl 0.002" in run.stdout  # the farm learner's figures in the progress line
    assert sum(len(s.transitions) for s in segments(redis_client, key_prefix)) == 8  # the turns went to the farm's stream
    assert "give both the same setting" not in run.stderr
    # GRPO drivers against this (GAE) learner: said, naming both settings
    grpo = ppoz(*args, "--advantage", "grpo", "--rollout-n", "2", "--no-resume", "--json", timeout=240, cwd=tmp_path)  # as above
    assert grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    assert "advantage = gae but these drivers send group-relative advantages (grpo)" in grpo.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)  # past the run's timeout below (the suite's 300 s would cut it first and hide its output)
def test_a_run_whose_learner_never_updated_says_so_and_fails(tmp_path, tiny_model) -> None:
    """Here fewer responses than one rollout batch: the learner started for the run applies no update, and
    `ppoz train` says so and exits 1 instead of reporting an untrained policy as a finished run."""
    model = tiny_model("llama", tokenizer="words")
    write_dataset(tmp_path / "train.jsonl", 4)
    front, back, weights = free_port(), free_port(), free_port()
    config = tmp_path / "train.toml"
    config.write_text(
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\nsegment_len = 1\n'
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\nrollout_batch = 64\ntensorboard_dir = ""\n'
        "[generation]\nvalue_hidden = [16]\n"
        f'[up]\nactors = 1\n[train]\nworkers = 2\nmax_new_tokens = 2\nreport_every_s = 1\noutput_dir = "{tmp_path / "out"}"\n'
    )
    model_and_config = ["--config", str(config), "--model", model]
    data, reward = ["--data", str(tmp_path / "train.jsonl")], ["--reward-fn", "tests.dataset_driver.test_run:first_word"]
    run_for = ["--epochs", "0", "--max-samples", "8"]
    # the whole stack's start, 8 samples, the stop: 6 s on the 2-core VM beside other work; x50
    run = ppoz("train", *model_and_config, *data, *reward, *run_for, "--json", timeout=300, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "the learner applied no update (8 responses, policy version 0): the learner's log lines above say why" in run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 8 and summary["rewarded"] == 8
    # output_dir/summary.json is the summary printed, what `ppoz train` adds at its end included (docs/train.md)
    assert {"curve", "checkpoint", "adapter", "weights"} <= summary.keys(), summary
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    assert [p.name for p in (tmp_path / "out").iterdir() if "summary" in p.name] == ["summary.json"]  # no half-written one left


def local_config(tmp_path, extra: str = "") -> str:
    """A one-machine config on free ports (nothing here is meant to start)."""
    front, back, weights = free_port(), free_port(), free_port()
    config = tmp_path / "train.toml"
    config.write_text(
        f'[broker]\nfrontend = "tcp://127.0.0.1:{front}"\nbackend = "tcp://127.0.0.1:{back}"\n{extra}'
        f'[learner]\nweights_bind = "tcp://127.0.0.1:{weights}"\ntensorboard_dir = ""\n'
        f'[up]\nactors = 1\n[train]\nworkers = 2\nmax_new_tokens = 2\noutput_dir = "{tmp_path / "out"}"\n'
    )
    return str(config)


STARTED = ("embedded redis-server", "started broker")  # what `ppoz train` logs once it starts the stack


def test_a_wrong_reward_function_or_a_record_over_the_brokers_limits_stops_the_run_before_anything_starts(tmp_path) -> None:
    import time

    write_dataset(tmp_path / "train.jsonl", 4)
    config = local_config(tmp_path, "max_prompt_chars = 60\n")
    data = ["--config", config, "--model", "unused", "--data", str(tmp_path / "train.jsonl")]
    began = time.monotonic()
    # each refused before anything starts: 2-3 s alone (x40 the timeout; x20 the bound below, which a stack's start
    # would pass)
    run = ppoz("train", *data, "--reward-fn", "rewardz.py:compute_score", timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert (
        f"ppoz train: --reward-fn '{tmp_path / 'rewardz.py'}:compute_score': no file {tmp_path / 'rewardz.py'}" in run.stderr
    )  # made absolute
    assert not any(s in run.stdout + run.stderr for s in STARTED) and time.monotonic() - began < 60
    (tmp_path / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    run = ppoz("train", *data, "--reward-fn", "reward.py:compute_score", timeout=120, cwd=tmp_path)  # refused, as above
    assert run.returncode == 2 and "reward.py has no function 'compute_score'" in run.stderr, run.stderr[-2000:]
    # a record over the broker's limits ([broker] max_prompt_chars here), named with its line and the limit
    with (tmp_path / "train.jsonl").open("a") as f:
        f.write("\n" + json.dumps({"prompt": "say " + "red " * 20, "ground_truth": "red"}))
    run = ppoz("train", *data, "--reward-fn", "first_word", "--strict", timeout=120, cwd=tmp_path)  # refused, as above
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "train.jsonl line 5: over the broker's limits: `prompt` has 84 characters, the limit is 60" in run.stderr
    assert not any(s in run.stdout + run.stderr for s in STARTED)


def test_a_port_another_process_holds_is_named_before_anything_starts(tmp_path, tiny_model) -> None:
    import os
    import re
    import socket

    write_dataset(tmp_path / "train.jsonl", 4)
    config = local_config(tmp_path)
    port = int(re.search(r"frontend = \"tcp://127.0.0.1:(\d+)\"", (tmp_path / "train.toml").read_text()).group(1))
    with socket.socket() as holder:  # this test's own listening socket, on the broker's client port
        holder.bind(("127.0.0.1", port))
        holder.listen()
        args = ["--config", config, "--model", tiny_model("llama", tokenizer="words"), "--data", str(tmp_path / "train.jsonl")]
        run = ppoz("train", *args, "--reward-fn", "first_word", timeout=120, cwd=tmp_path)  # refused at start: 2-3 s alone; x40
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"broker.frontend = tcp://127.0.0.1:{port}: port {port} is taken (Address already in use) by pid {os.getpid()}" in run.stderr
    assert "started broker" not in run.stdout + run.stderr


@pytest.mark.slow
def test_a_run_that_rewarded_nothing_fails_and_its_summary_is_strict_json(stack, tmp_path) -> None:
    """`math` refuses records without a ground truth: no response is rewarded, validation included (its mean is
    undefined). The run exits 1 naming the first reason, and summary.json says null where it once said NaN."""
    records = [{"prompt": f"say the word {c}", "data_source": "colours"} for c in COLOURS[:4]]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    farm = ["--broker", stack.frontend, "--epochs", "1", "--workers", "2", "--max-new-tokens", "2", "--report-every-s", "0.5"]
    data = ["--data", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "train.jsonl"), "--reward-fn", "math"]
    # against a farm: 4 responses and their validation, a few s alone; x50
    run = ppoz("train", *farm, *data, "--output-dir", str(tmp_path / "out"), "--json", timeout=240, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ppoz train: none of the 4 responses was rewarded, so nothing was trained on; the first reason:" in run.stderr

    def strict(text: str):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    summary = strict((tmp_path / "out" / "summary.json").read_text())
    assert summary["rewarded"] == 0 and summary["unrewarded"] == 4
    assert summary["val_before"] is None and summary["val_after"] is None and summary["reward_mean"] is None
    printed = strict(run.stdout.strip().splitlines()[-1])  # --json: the same summary, the curve's path included
    assert printed == summary and "curve" in summary
    for line in (tmp_path / "out" / "progress.jsonl").read_text().splitlines():
        strict(line)


HOSTILE_REWARD_FN = """
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    colour = extra_info["colour"]
    if colour == "red":
        return 1e300  # finite, and absurd: its square overflows any advantage
    if colour == "green":
        return math.nan
    if colour == "blue":
        raise SystemExit(3)  # a user's sys.exit() in a reward function
    if colour == "yellow":
        time.sleep(10_000)  # never returns within the run
    return -1e300 if colour == "black" else 1.0
"""


@pytest.mark.slow
def test_absurd_rewards_hanging_and_exiting_reward_functions_leave_those_samples_unrewarded(
    stack, redis_client, key_prefix, tmp_path
) -> None:
    """Issue 28, through the whole driver path: a reward function that returns 1e300, -1e300 or NaN, raises
    SystemExit or never returns costs those samples their reward, counted by cause; the run finishes (in
    seconds, not at the sleeper's end), every other sample is rewarded, and the farm's stream holds only
    finite rewards within the bound."""
    from tests.broker.test_broker import segments

    colours = ["red", "green", "blue", "yellow", "black", "white", "grey", "pink"]
    records = [{"prompt": f"say the word {c}", "extra_info": {"colour": c}} for c in colours]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "hostile.py").write_text(HOSTILE_REWARD_FN)
    farm = ["--broker", stack.frontend, "--epochs", "1", "--workers", "2", "--max-new-tokens", "2", "--report-every-s", "0.5"]
    data = ["--data", str(tmp_path / "train.jsonl"), "--reward-fn", f"{tmp_path / 'hostile.py'}:compute_score"]
    started = time.monotonic()
    run = ppoz(  # against a farm: 8 responses and a 2 s reward timeout, a few s alone; x50
        "train", *farm, *data, "--reward-fn-timeout-s", "2", "--output-dir", str(tmp_path / "out"), "--json", timeout=240, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.monotonic() - started < 120  # the sleeper was abandoned after 2 s, not waited for (its 10,000 s)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rewarded"] == 3 and summary["unrewarded"] == 5, summary
    assert summary["unrewarded_by_cause"] == {
        "rule_score/not_finite": 1,
        "rule_score/out_of_range": 2,
        "rule_score/raised": 1,
        "rule_score/timed_out": 1,
    }
    assert "SystemExit" in run.stderr and "did not return within 2 s" in run.stderr
    rewards = [t.reward for s in segments(redis_client, key_prefix) for t in s.transitions]
    assert sorted(rewards) == [1.0, 1.0, 1.0]  # only the good ones reached training


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_reward_function_hangs_within_seconds(stack, tmp_path) -> None:
    """Every call of this reward function sleeps far past the run; its deadline (600 s) is not what ends the
    run: SIGTERM abandons the call in progress and what is queued, and the process exits in seconds."""
    records = [{"prompt": f"say the word {c}"} for c in COLOURS]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    called = tmp_path / "sleeper.called"  # written by the reward function as it is called, before it hangs
    (tmp_path / "sleeper.py").write_text(
        f"import pathlib, time\n\ndef compute_score(**kwargs):\n    pathlib.Path({str(called)!r}).touch()\n    time.sleep(10_000)\n"
    )
    farm = ["--broker", stack.frontend, "--epochs", "1", "--workers", "2", "--max-new-tokens", "2", "--report-every-s", "0.5"]
    data = ["--data", str(tmp_path / "train.jsonl"), "--reward-fn", f"{tmp_path / 'sleeper.py'}:compute_score"]
    log = tmp_path / "run.log"
    proc = start_ppoz("train", *farm, *data, "--reward-fn-timeout-s", "600", "--output-dir", str(tmp_path / "out"), log=log, cwd=tmp_path)
    try:
        # a start against a farm and its first report (0.5 s): 3-5 s alone; x24
        wait_for(lambda: "samples 0/" in log.read_text(), timeout=120, what="the run's first progress line")
        # the scorer is inside a call that never returns: waited for (it was a 1 s sleep, which a loaded machine could
        # end before the first call); a response and its call, under 1 s alone; x60
        wait_for(called.exists, timeout=60, what="the reward function's first call")
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)  # past the bound below, so that a slow stop fails by its measure, not by TimeoutExpired
        took = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # in seconds (2-5 s alone), not at the call's 600 s deadline: the bound was 15 s, 60 s tells the two apart as well
    assert took < 60, f"SIGTERM took {took:.1f} s with a hung reward function:\n{log.read_text()[-3000:]}"
    assert "the drivers stopped" in log.read_text()


@pytest.mark.slow
def test_a_reward_module_in_the_working_directory_is_found_by_the_ppoz_command(stack, tmp_path) -> None:
    """docs/train.md's `--reward-fn my_rewards:compute_score` against a farm, run as a user runs it: the `ppoz`
    console script of the environment (whose import path starts at its own folder; `python -m` would start at the
    working directory), in the folder that holds my_rewards.py, with relative paths. Before: "cannot import"."""
    import subprocess
    import sys
    from pathlib import Path

    write_dataset(tmp_path / "train.jsonl", 4)
    (tmp_path / "my_rewards.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25")
    command = Path(sys.executable).parent / "ppoz"  # the console script pip wrote, as on a user's PATH
    farm = ["--broker", stack.frontend, "--max-samples", "4", "--epochs", "0", "--workers", "2", "--max-new-tokens", "2"]
    args = ["train", *farm, "--data", "train.jsonl", "--reward-fn", "my_rewards:compute_score", "--output-dir", "out", "--json"]
    # about 2 s alone (4 two-token responses); 240 s as for this file's other farm runs, on a machine busy with others
    run = subprocess.run([str(command), *args], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["rewarded"] == 4 and summary["reward_mean"] == 0.25, summary  # my_rewards.compute_score's reward
