"""`ppoz demo --task arithmetic`, shortened: the validation reward rises and stays above the untrained model's."""

from __future__ import annotations

import json
import statistics

import pytest

from ppoz.demo_arithmetic import sums
from rewards.functions import first_word_score
from tests.processes import ppoz


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_arithmetic_demo_learns_and_stays_learned(tmp_path) -> None:
    out = tmp_path / "demo"
    run = ppoz("demo", "--task", "arithmetic", "--minutes", "2", "--report-every", "10", "--out", str(out), "--json", timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "train" / "progress.jsonl").read_text().splitlines()]
    rewards = [row["reward_mean"] for row in rows if row["reward_mean"] is not None]
    trace = f"val {summary['val_before']:.2f} -> {summary['val_after']:.2f}; training reward {' '.join(f'{r:.2f}' for r in rewards)}"
    chance = 1 / 17  # one word of the tokenizer's 17 tokens (13 words, 4 special)
    assert summary["val_before"] <= 0.2, trace  # untrained: near chance
    # learned (greedy validation over all 25 sums), and the sampled reward held up over the last third of the run.
    # The run is two minutes of wall time, so how far it gets depends on the CPU it is given: alone on the 2-core
    # VM its last three reports averaged 0.40 (val 0.04 -> 0.40); beside the kill-and-resume test in a fresh-clone
    # CI run, 0.24 (val 0.04 -> 0.28). The bar, 0.2, is 3.4 times chance over the last three reports.
    assert summary["val_after"] >= summary["val_before"] + 0.2, trace
    assert min(rewards[-len(rewards) // 3 :]) >= 3 * chance and statistics.mean(rewards[-3:]) >= 0.2, trace
    assert summary["unrewarded"] == 0 and summary["learner"]["version"] >= 20, trace


def test_the_dataset_and_its_reward() -> None:
    rows = sums()
    assert len(rows) == 25 and rows[7] == {"prompt": "what is one plus two", "ground_truth": "three", "data_source": "arithmetic_words"}
    assert first_word_score("", "three four", "three") == 1.0 and first_word_score("", "four three", "three") == 0.0
