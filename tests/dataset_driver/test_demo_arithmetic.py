"""`ppoz demo --task arithmetic`, shortened to 12,000 responses: the validation reward rises and stays above the untrained
model's."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ppoz.demo_arithmetic import sums
from rewards.functions import first_word_score
from tests.processes import ppoz


@pytest.mark.slow
@pytest.mark.timeout(900)  # past the demo's timeout below, so its output is shown
def test_the_arithmetic_demo_learns_and_stays_learned(tmp_path) -> None:
    out = tmp_path / "demo"
    # ends by work, not by time: 12,000 responses (375 rollouts of 32) and the learner's updates on them, however busy
    # the machine; --minutes is only its deadline (2.6 minutes on the 2-core VM beside two memory benches)
    responses, rollout = 12_000, 32
    flags = ["--responses", str(responses), "--minutes", "12", "--report-every", "10", "--out", str(out), "--json"]
    run = ppoz("demo", "--task", "arithmetic", *flags, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "train" / "progress.jsonl").read_text().splitlines()]
    rewards = [row["reward_mean"] for row in rows if row["reward_mean"] is not None]
    trace = f"val {summary['val_before']:.2f} -> {summary['val_after']:.2f}; training reward {' '.join(f'{r:.2f}' for r in rewards)}"
    assert summary["samples"] == responses, f"the run stopped early, at its deadline: {summary['samples']} responses; {trace}"
    # every rollout trained, bar a few left out as too stale (none in the runs seen: 375 updates)
    assert summary["unrewarded"] == 0 and summary["learner"]["version"] >= 0.95 * responses / rollout, trace
    chance = 1 / 17  # one word of the tokenizer's 17 tokens (13 words, 4 special)
    assert summary["val_before"] <= 0.2, trace  # untrained: near chance
    # learned (greedy validation over all 25 sums), and the sampled reward held up over the last third of the run.
    # After 12,000 responses (beside two benches, 2026-12-08): val 0.04 -> 0.80, the last three reports 0.74-0.78.
    # The bars are the means of several reports (each one a small sample), not one touching them: the last third at
    # 5 times chance, the last three at 0.4; a policy back at chance averages ~0.06 there.
    assert summary["val_after"] >= summary["val_before"] + 0.3, trace
    assert statistics.mean(rewards[-len(rewards) // 3 :]) >= 5 * chance and statistics.mean(rewards[-3:]) >= 0.4, trace
    # all weights trained: the summary points to them (no adapter), and the closing lines say where
    assert summary["adapter"] is None and summary["weights"].endswith("policy.safetensors"), summary
    assert (out / "train").exists() and Path(summary["weights"]).is_file() and f"weights in {summary['weights']}" in run.stdout


def test_the_dataset_and_its_reward() -> None:
    rows = sums()
    assert len(rows) == 25 and rows[7] == {"prompt": "what is one plus two", "ground_truth": "three", "data_source": "arithmetic_words"}
    assert first_word_score("", "three four", "three") == 1.0 and first_word_score("", "four three", "three") == 0.0


def test_the_demo_flags_reach_the_run(tmp_path) -> None:
    """--clients, --seed, --device and --model are the run's, not ignored (issue 29)."""
    import argparse

    import tomllib

    from ppoz.demo_arithmetic import settings

    given = argparse.Namespace(advantage="grpo", clients=3, seed=7, device="cpu", model="some/model", report_every=10.0, responses=640)
    stack, cfg = settings(given, tmp_path, "some/model")
    table = tomllib.loads(stack)
    assert cfg.workers == 3 and cfg.seed == 7 and cfg.rollout_n == 4 and cfg.max_samples == 640
    assert table["actor"]["device"] == "cpu" and table["learner"]["device"] == "cpu"
    assert table["policy"]["lora_rank"] == 8  # a model of one's own trains a rank-8 adapter (at its default lr, 1e-5)
    default = argparse.Namespace(advantage="gae", clients=None, seed=0, device="auto", model="", report_every=10.0, responses=0)
    stack, cfg = settings(default, tmp_path, "tiny")
    assert cfg.workers == 8 and cfg.max_samples == 0 and tomllib.loads(stack)["policy"]["lora_rank"] == 0
