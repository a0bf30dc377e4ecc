"""Composite rewards: weighted sums of the real components, failures carried as no reward, normalisation and clipping."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from ppoz.bench.judge_stand_in import chat_server
from rewards.composite import CompositeReward, Item, RunningMoments, prompt_text
from rewards.functions import default_compute_score, math_score
from rewards.judge import Judge, JudgeConfig
from rewards.reward_model import RewardModel, RewardModelConfig


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
