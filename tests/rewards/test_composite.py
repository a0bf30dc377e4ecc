"""Composite rewards: weighted sums of the real components, failures carried as no reward, normalisation and clipping."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rewards.composite import CompositeReward, Item, RunningMoments, prompt_text
from rewards.functions import default_compute_score, math_score
from rewards.judge import Judge, JudgeConfig
from rewards.reward_model import RewardModel, RewardModelConfig
from tools.bench.judge_stand_in import chat_server

ROOT = Path(__file__).resolve().parents[2]


def test_a_weighted_sum_of_a_rule_and_a_reward_model(tiny_reward_model) -> None:
    rm = RewardModel(RewardModelConfig(tiny_reward_model()))
    items = [Item("What is 2+3?", "\\boxed{5}", "5", "arithmetic"), Item("What is 2+2?", "5", "4", "arithmetic")]
    reward = CompositeReward({"rm_score": 0.7, "rule_score": 0.3}, reward_fn=default_compute_score, reward_model=rm)
    scored = reward.score(items)
    rm_scores = rm.score([(i.prompt, i.response) for i in items])
    assert [s.components for s in scored] == [{"rule_score": 1.0, "rm_score": rm_scores[0]}, {"rule_score": 0.0, "rm_score": rm_scores[1]}]
    assert [s.reward for s in scored] == pytest.approx([0.3 + 0.7 * rm_scores[0], 0.7 * rm_scores[1]], abs=1e-9)


def test_a_component_that_fails_leaves_the_response_without_a_reward() -> None:
    replies = iter(["Score: 1", "no verdict here"])
    with chat_server(lambda body, n: next(replies)) as server:
        judge = Judge(JudgeConfig(model="j", base_url=server.base_url, retries=0, concurrency=1))
        reward = CompositeReward({"judge_score": 0.5, "rule_score": 0.5}, reward_fn=math_score, judge=judge)
        scored = reward.score(
            [
                Item("p", "\\boxed{3}", "3", "math", where="a.jsonl line 1"),
                Item("p", "\\boxed{3}", "three", "math", where="a.jsonl line 2"),  # the rule cannot read the truth
                Item("q", "\\boxed{4}", "4", "math", where="a.jsonl line 3"),  # the judge's reply is unreadable
            ]
        )
    assert scored[0].reward == 1.0 and scored[0].error == ""
    assert scored[1].reward is None and "ground truth 'three' is not a number" in scored[1].error
    assert scored[2].reward is None and "no `Score: N`" in scored[2].error
    assert len(server.requests) == 2  # the judge was not asked about a response the rule had already failed


def as_number(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str)


def test_running_normalisation_and_clipping_by_hand() -> None:
    reward = CompositeReward({"rule_score": 1.0}, reward_fn=as_number, normalise="running")
    first = [s.reward for s in reward.score([Item("p", str(v)) for v in (1, 2, 3)])]
    std = math.sqrt(2 / 3)  # population std of 1, 2, 3
    assert first == pytest.approx([-1 / std, 0.0, 1 / std])
    assert [s.reward for s in reward.score([Item("p", "9")], raw=True)] == [9.0]  # raw: neither normalised nor counted
    second = reward.score([Item("p", "4")])[0].reward
    assert second == pytest.approx((4 - 2.5) / math.sqrt(1.25))  # over 1, 2, 3, 4: mean 2.5, variance 1.25
    clipped = CompositeReward({"rule_score": 2.0}, reward_fn=as_number, clip=3.0)
    assert [s.reward for s in clipped.score([Item("p", v) for v in ("-5", "1", "5")])] == [-3.0, 2.0, 3.0]


def test_running_moments_match_the_whole_sample() -> None:
    rng = random.Random(0)
    values = [rng.gauss(3, 2) for _ in range(200)]
    moments = RunningMoments()
    for start in range(0, 200, 17):
        moments.update(values[start : start + 17])
    assert moments.mean == pytest.approx(statistics.fmean(values)) and moments.std == pytest.approx(statistics.pstdev(values))


def test_settings_that_cannot_reward_are_named() -> None:
    fn = default_compute_score
    for kwargs, words in [
        (dict(weights={"bleu": 1.0}, reward_fn=fn), "unknown components \\['bleu'\\]"),
        (dict(weights={"rule_score": 0.0}, reward_fn=fn), "all 0"),
        (dict(weights={"rm_score": 1.0}, reward_fn=fn), "rm_score is set but a reward model is not configured"),
        (dict(weights={"rule_score": 1.0}, reward_fn=fn, normalise="batch"), "normalise"),
        (dict(weights={"rule_score": 1.0}, reward_fn=fn, clip=-1.0), "clip"),
    ]:
        with pytest.raises(ValueError, match=words):
            CompositeReward(**kwargs)
    assert prompt_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == "user: hi\nassistant: yo"


# --- issue 28: no bad number becomes a reward; a reward function cannot hang the scorer ----------------------
def scored_in_time(reward: CompositeReward, items: list[Item], within_s: float = 20.0) -> list:
    """`reward.score(items)` on a thread of its own, failing the test if it has not returned within `within_s` (the
    default: a batch with a hung call costs its 1 s reward_fn_timeout_s and ms more alone; x20)."""
    out: list = []
    scorer = threading.Thread(target=lambda: out.append(reward.score(items)), daemon=True)
    scorer.start()
    scorer.join(within_s)
    assert not scorer.is_alive(), f"scoring did not return within {within_s} s"
    return out[0]


def test_a_reward_function_out_of_range_leaves_its_response_unrewarded_counted_and_logged(caplog) -> None:
    caplog.set_level("WARNING", logger="rewards.composite")
    reward = CompositeReward({"rule_score": 1.0}, reward_fn=as_number, clip=5.0)
    values = ["1e300", "nan", "2", "-inf", "1000001", "1e6"]
    scored = reward.score([Item("p", v, where=f"train.jsonl line {n}") for n, v in enumerate(values, 1)])
    assert [s.reward for s in scored] == [None, None, 2.0, None, None, 5.0]  # clip bounds good rewards only
    assert scored[0].error == (
        "train.jsonl line 1: the reward function's score 1e+300 is outside the accepted range [-1000000.0, 1000000.0] (max_abs_reward)"
    )
    assert scored[1].error == "train.jsonl line 2: the reward function's score nan is not a finite number"
    assert "train.jsonl line 4" in scored[3].error and "-inf" in scored[3].error
    assert reward.unrewarded == Counter({"rule_score/out_of_range": 2, "rule_score/not_finite": 2})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(f"train.jsonl line {n}" in logged for n in (1, 2, 4, 5)) and "line 3" not in logged
    smaller = CompositeReward({"rule_score": 1.0}, reward_fn=as_number, max_abs_reward=10)
    assert [s.reward for s in smaller.score([Item("p", "10"), Item("p", "11")])] == [10.0, None]
    with pytest.raises(ValueError, match="max_abs_reward"):
        CompositeReward({"rule_score": 1.0}, reward_fn=as_number, max_abs_reward=math.inf)


def test_a_weighted_sum_past_the_bound_is_refused_and_a_nan_total_never_becomes_the_clip() -> None:
    """With clip set, max(-clip, min(clip, nan)) is +clip: a NaN or inf total used to be trained on as the best reward."""
    overflowing = CompositeReward({"rule_score": 1e303}, reward_fn=as_number, clip=5.0)
    scored = overflowing.score([Item("p", "1e6", where="a.jsonl line 1"), Item("p", "0", where="a.jsonl line 2")])
    assert [s.reward for s in scored] == [None, 0.0]
    assert scored[0].error == "a.jsonl line 1: weighted_sum inf is not a finite number"
    heavy = CompositeReward({"rule_score": 10.0}, reward_fn=as_number, normalise="running")
    scored = heavy.score([Item("p", "2e5"), Item("p", "1"), Item("p", "3")])
    assert scored[0].reward is None and "weighted_sum 2000000.0 is outside the accepted range" in scored[0].error
    assert heavy.moments.count == 2 and heavy.moments.mean == pytest.approx(20.0)  # the refused total never reached them
    assert heavy.unrewarded == Counter({"weighted_sum/out_of_range": 1}) and overflowing.unrewarded == Counter(
        {"weighted_sum/not_finite": 1}
    )


def test_running_moments_leave_out_values_that_are_not_finite() -> None:
    moments = RunningMoments()
    moments.update([1.0, math.nan, 3.0, math.inf, -math.inf])
    assert (moments.count, moments.mean, moments.std) == (2, 2.0, 1.0)
    moments.update([math.nan])
    assert moments.count == 2 and math.isfinite(moments.mean)


def poisoned(rm: RewardModel, text: str) -> None:
    """Make the model's score NaN for any input holding `text`'s token: its embedding row is NaN (rows of a batch never mix)."""
    tokenizer = AutoTokenizer.from_pretrained(rm.cfg.path)
    (token,) = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        rm.model.get_input_embeddings().weight[token] = math.nan


def test_a_reward_model_score_that_is_nan_or_out_of_range_leaves_that_response_alone_unrewarded(tiny_reward_model) -> None:
    rm = RewardModel(RewardModelConfig(tiny_reward_model(), batch_size=8))
    poisoned(rm, "~")
    items = [Item("Say hi.", "hi", where="d.jsonl line 1"), Item("Say hi.", "h~i", where="d.jsonl line 2"), Item("Name one.", "one")]
    assert math.isnan(rm.score([("Say hi.", "h~i")])[0])  # the model itself does give NaN for it
    reward = CompositeReward({"rm_score": 1.0}, reward_model=rm, clip=5.0, normalise="running")
    scored = reward.score(items)
    assert scored[1].reward is None and scored[1].error == "d.jsonl line 2: rm_score nan is not a finite number"
    assert scored[0].reward is not None and scored[2].reward is not None  # its batch's others are rewarded
    assert all(math.isfinite(s.reward) for s in (scored[0], scored[2])) and reward.moments.count == 2
    with torch.no_grad():
        rm.model.classifier.bias.fill_(1e7)  # every score past the bound
    scored = CompositeReward({"rm_score": 1.0}, reward_model=rm, clip=5.0).score(items[:1])
    assert scored[0].reward is None and "rm_score 10000000.0 is outside the accepted range [-1000000.0, 1000000.0]" in scored[0].error


def forever_or_exit(data_source, solution_str, ground_truth, extra_info=None):
    """A user's reward function with a bug for some responses: it hangs, or it ends the process as it thinks."""
    if solution_str == "hang":
        threading.Event().wait()  # never returns
    if solution_str == "exit":
        raise SystemExit(3)
    if solution_str == "interrupt":
        raise KeyboardInterrupt
    return float(solution_str)


def test_a_reward_function_that_hangs_or_exits_costs_its_response_alone(caplog) -> None:
    caplog.set_level("ERROR", logger="rewards.composite")
    reward = CompositeReward({"rule_score": 1.0}, reward_fn=forever_or_exit, reward_fn_timeout_s=1.0)
    started = time.monotonic()
    items = [Item("p", r, where=f"t.jsonl line {n}") for n, r in enumerate(["1", "hang", "exit", "interrupt", "2"], 1)]
    scored = scored_in_time(reward, items)
    assert time.monotonic() - started < 5  # the hung call cost its deadline, 1 s, and no more (4 s for a loaded machine)
    assert [s.reward for s in scored] == [1.0, None, None, None, 2.0]
    assert scored[1].error == "t.jsonl line 2: the reward function did not return within 1 s (reward_fn_timeout_s); the call was abandoned"
    assert scored[2].error == "t.jsonl line 3: the reward function raised SystemExit: 3"
    assert scored[3].error.startswith("t.jsonl line 4: the reward function raised KeyboardInterrupt")
    assert "Traceback" in caplog.text and "SystemExit: 3" in caplog.text  # the traceback, in the log
    assert reward.unrewarded == Counter({"rule_score/timed_out": 1, "rule_score/raised": 2}) and reward.runner.abandoned == 1
    # The scorer goes on: the next batch is scored at once, while the abandoned call still hangs on its own thread.
    assert [s.reward for s in scored_in_time(reward, [Item("p", "3"), Item("p", "4")], within_s=5)] == [3.0, 4.0]  # ms; x1000


def test_a_hung_reward_function_neither_holds_up_the_drivers_scorer_nor_keeps_the_process_from_exiting() -> None:
    """Through dataset_driver/scorer.py's BatchingScorer, in a process of its own: the futures are answered, and the process
    exits at once although the function still hangs (before, the scorer's pool thread was joined at exit: forever)."""
    script = textwrap.dedent(
        """
        import threading
        from rewards.composite import CompositeReward, Item
        from dataset_driver.scorer import BatchingScorer

        def forever_or_exit(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "hang":
                threading.Event().wait()
            if solution_str == "exit":
                raise SystemExit(3)
            return float(solution_str)

        reward = CompositeReward({"rule_score": 1.0}, reward_fn=forever_or_exit, reward_fn_timeout_s=1.0)
        scorer = BatchingScorer(reward, max_batch=1)
        futures = [scorer.submit(Item("p", r)) for r in ("hang", "exit", "5")]
        print([(f.result(timeout=20).reward, f.result().error) for f in futures], flush=True)  # the 1 s timeout, then ms
        """
    )
    started = time.monotonic()
    # a process importing the reward code (3-6 s alone) and scoring past one 1 s timeout; x10
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(None, 'the reward function did not return within 1 s" in done.stdout and "(5.0, '')" in done.stdout
    assert "(None, 'the reward function raised SystemExit" in done.stdout
    assert time.monotonic() - started < 30  # it exits when its work is done, not when the hung call would (never)


class ExitingRewardModel:
    """A reward model stand-in whose score() ends its thread with SystemExit (the driver's scorer is under test)."""

    def score(self, pairs):
        raise SystemExit("the reward model gave up")


def test_the_drivers_scorer_answers_every_response_even_when_scoring_raises_systemexit() -> None:
    from dataset_driver.scorer import BatchingScorer

    scorer = BatchingScorer(CompositeReward({"rm_score": 1.0}, reward_model=ExitingRewardModel()), max_batch=2)
    futures = [scorer.submit(Item("p", str(n))) for n in range(3)]
    results = [f.result(timeout=10) for f in futures]  # before: never answered, each response waited reward_timeout_s (now ms)
    assert all(r.reward is None and "scoring failed: SystemExit: the reward model gave up" in r.error for r in results)
    scorer.close()
