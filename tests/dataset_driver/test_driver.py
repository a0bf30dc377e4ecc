"""Dataset drivers against a real broker, a real LLM actor (tiny model) and Redis: rewards computed in the
driver and stored with the turn, unrewarded turns never stored, resume where a run stopped, validation not trained."""

from __future__ import annotations

import pytest

from dataset_driver.data import PromptOrder, PromptRecord
from dataset_driver.driver import BatchingScorer, Sampling, drive, validate
from rewards.composite import CompositeReward
from rewards.functions import RewardError
from tests.broker.test_broker import segments
from tests.helpers import wait_for

COLOURS = ["red", "green", "blue", "yellow"]


def first_word_is(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "refuse":
        raise RewardError("this record's reward cannot be computed")
    return {"score": float(solution_str.split()[:1] == [ground_truth]), "length": len(solution_str.split())}


def records(n: int, refuse_every: int = 0) -> list[PromptRecord]:
    out = []
    for i in range(n):
        colour = COLOURS[i % len(COLOURS)]
        truth = "refuse" if refuse_every and i % refuse_every == refuse_every - 1 else colour
        out.append(PromptRecord(f"say the word {colour}", truth, "colours", {}, f"t.jsonl line {i + 1}"))
    return out


def test_each_turn_is_rewarded_in_the_driver_and_stored_with_its_reward(stack, redis_client, key_prefix) -> None:
    data = records(8, refuse_every=4)  # records 3 and 7 cannot be rewarded
    order = PromptOrder(len(data), epochs=1, rollout_n=2, seed=0)
    reward = CompositeReward({"rule_score": 1.0}, reward_fn=first_word_is)
    scorer = BatchingScorer(reward, max_batch=4)
    try:
        progress = drive(stack.frontend, data, order, scorer, Sampling(max_new_tokens=2), workers=3)
    finally:
        scorer.close()
    assert progress.done == set(range(16)) and progress.resume_from == 16
    assert progress.rewarded == 12 and progress.unrewarded == 4  # 2 records x rollout_n 2 without a reward
    assert sorted(progress.errors) == sorted(f"t.jsonl line {n}: this record's reward cannot be computed" for n in (4, 4, 8, 8))

    def stored_turns():
        turns = [t for s in segments(redis_client, key_prefix) for t in s.transitions]
        return turns if len(turns) == 12 else None

    stored = wait_for(stored_turns, timeout=30, what="the 12 rewarded turns in the stream")  # acknowledged already: ms; x1000
    assert all(t.done and t.mode == "generate" for t in stored)
    assert sorted(t.reward for t in stored) == sorted(r for r in progress.recent)  # the driver's rewards, as sent
    counters = stack.broker.metrics
    assert counters["broker/detached"] >= 4  # each unrewarded turn: its task detached, the step dropped


def test_a_record_the_actor_refuses_fails_alone(stack) -> None:
    data = records(4)
    data[1] = PromptRecord("say the word " + "red " * 9000, "red", "colours", {}, "t.jsonl line 2")  # over the model's context
    scorer = BatchingScorer(CompositeReward({"rule_score": 1.0}, reward_fn=first_word_is))
    try:
        progress = drive(stack.frontend, data, PromptOrder(4, shuffle=False), scorer, Sampling(max_new_tokens=2), workers=1)
    finally:
        scorer.close()
    assert progress.done == {0, 1, 2, 3} and progress.rewarded == 3 and progress.unrewarded == 1
    assert progress.errors[0].startswith("t.jsonl line 2: BadRequest") and "limit" in progress.errors[0]


def test_a_reward_that_does_not_come_in_time_leaves_the_turn_unrewarded(stack) -> None:
    import time

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(1.5)  # past the 0.3 s reward timeout under test
        return 1.0

    scorer = BatchingScorer(CompositeReward({"rule_score": 1.0}, reward_fn=slow), max_batch=1)
    try:
        progress = drive(
            stack.frontend, records(2), PromptOrder(2, shuffle=False), scorer, Sampling(max_new_tokens=2), workers=1, reward_timeout_s=0.3
        )  # the reward timeout under test, which the 1.5 s function misses
    finally:
        scorer.close()
    assert progress.done == {0, 1} and progress.unrewarded == 2 and progress.errors[0] == "t.jsonl line 1: no reward within 0.3 s"


def test_a_run_resumes_where_it_stopped_and_validation_is_not_trained(stack, redis_client, key_prefix) -> None:
    data = records(6)
    order = PromptOrder(len(data), epochs=2, rollout_n=1, seed=3)
    reward = CompositeReward({"rule_score": 1.0}, reward_fn=first_word_is)
    scorer = BatchingScorer(reward)
    try:
        first = drive(stack.frontend, data, order, scorer, Sampling(max_new_tokens=2), workers=2, limit=5)
        assert first.done == set(range(5)) and first.resume_from == 5
        second = drive(stack.frontend, data, order, scorer, Sampling(max_new_tokens=2), workers=2, start=first.resume_from)
    finally:
        scorer.close()
    assert second.done == set(range(5, 12)) and second.rewarded + second.unrewarded == 7
    # acknowledged already: ms; x1000
    wait_for(lambda: sum(len(s.transitions) for s in segments(redis_client, key_prefix)) == 12, timeout=30, what="12 turns stored")
    result = validate(stack.frontend, data, reward, max_new_tokens=2, workers=2)
    # --chat-template: the prompt goes as a user message; this model's tokenizer has no template, and says so
    refused = validate(stack.frontend, data[:2], reward, max_new_tokens=2, chat_template=True, workers=1)
    assert refused["scored"] == 0 and refused["unscored"] == 2 and "chat template" in refused["unscored_reasons"][0]
    assert result["scored"] == 6 and result["unscored"] == 0 and 0.0 <= result["mean_reward"] <= 1.0
    assert sum(len(s.transitions) for s in segments(redis_client, key_prefix)) == 12  # validation stored nothing


def test_grpo_sends_each_groups_advantages_and_skips_groups_that_cannot_be_compared(stack, redis_client, key_prefix) -> None:
    """rollout_n responses to one prompt are a group: each is sent with (r - mean) / (std + eps) over its group's
    rewards (dataset_driver/group_advantage.py). A group whose responses all scored alike is sent with advantages 0; one with a
    single rewarded response is not trained on at all."""
    import collections
    import threading

    from dataset_driver.group_advantage import GroupAdvantage

    calls: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def reward_fn(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            calls[ground_truth] += 1
            if ground_truth == "lone" and calls[ground_truth] > 1:
                raise RewardError("only the first response of this prompt is rewarded")
            return 1.0 if ground_truth in ("same", "lone") else float(calls[ground_truth])  # 1, 2, 3 in a group

    data = [
        PromptRecord(f"say the word {c}", c, "colours", {}, f"t.jsonl line {i + 1}") for i, c in enumerate(["red", "green", "same", "lone"])
    ]
    scorer = BatchingScorer(CompositeReward({"rule_score": 1.0}, reward_fn=reward_fn), max_batch=8)
    try:
        progress = drive(
            stack.frontend,
            data,
            PromptOrder(4, rollout_n=3, seed=1),
            scorer,
            Sampling(max_new_tokens=4),
            workers=2,
            grouping=GroupAdvantage(),
        )
    finally:
        scorer.close()
    assert progress.done == set(range(12)) and progress.rewarded == 10 and progress.unrewarded == 2
    assert (progress.groups, progress.uniform_groups, progress.lone) == (4, 1, 1)

    def stored_turns():
        turns = [t for s in segments(redis_client, key_prefix) for t in s.transitions]
        return turns if len(turns) == 9 else None  # the lone prompt's 3 responses are not stored

    by_prompt: dict[tuple[int, ...], list[float]] = collections.defaultdict(list)
    for t in wait_for(stored_turns, timeout=30, what="3 groups of 3 turns in the stream"):  # acknowledged already: ms; x1000
        by_prompt[tuple(t.obs.prompt_ids)].append(t.reward)
    assert len(by_prompt) == 3 and all(len(v) == 3 for v in by_prompt.values())
    # rewards 1, 2, 3: mean 2, sample std 1, advantages -1, 0, 1 (over 1 + eps); the group that scored alike: 0s
    got = sorted(sorted(v) for v in by_prompt.values())
    assert got[0] == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)]) and got[1] == got[0] and got[2] == [0.0, 0.0, 0.0]


def test_a_groups_requests_travel_together_and_the_actor_computes_their_prompt_once(
    start_broker, start_actor, make_client, words_llm
) -> None:
    """With grouping, a worker sends its group's rollout_n generate requests at once (a client per member): they
    reach the actor together, which prefills the shared prompt once and copies it to the other rows. Sent one
    after another, each would arrive after the one before had finished, and nothing would be shared."""
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from dataset_driver.group_advantage import GroupAdvantage
    from tests.helpers import actors_ready

    model, tokenizer = words_llm
    broker = start_broker(segment_len=4)
    policy = LLMPolicy(model, tokenizer, SamplingConfig(seed=1))
    start_actor(broker.backend, credits=8, policy=policy)
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), what="the actor to register")
    data = [PromptRecord(f"say the word {c} again and again", c, "colours", {}, f"t.jsonl line {i + 1}") for i, c in enumerate(COLOURS)]
    scorer = BatchingScorer(CompositeReward({"rule_score": 1.0}, reward_fn=first_word_is), max_batch=8)
    try:
        progress = drive(
            broker.frontend,
            data,
            PromptOrder(4, rollout_n=4, seed=1),
            scorer,
            Sampling(max_new_tokens=6),
            workers=1,
            grouping=GroupAdvantage(),
        )
    finally:
        scorer.close()
    assert progress.done == set(range(16)) and progress.groups == 4
    shared = policy.generation_engine().shared_prompts
    assert shared >= 8, f"{shared} of the 12 followers' prompts were copied from their group's leader"


def test_groups_of_several_workers_with_short_and_long_prompts_each_meet_in_the_actor_and_arrive_once(
    start_broker, start_actor, make_client, words_llm, redis_client, key_prefix, monkeypatch
) -> None:
    """Three workers play their groups at once, with prompts of 5 to 305 tokens mixed: the members of each group
    still reach the actor together and take their prompt's KV from its first member (another group's long prompt
    in prefill beside them does not split them), and every response is generated, rewarded, fed back and stored
    exactly once."""
    import collections
    import threading

    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from dataset_driver.group_advantage import GroupAdvantage
    from tests.helpers import actors_ready

    model, tokenizer = words_llm
    broker = start_broker(segment_len=4)
    policy = LLMPolicy(model, tokenizer, SamplingConfig(seed=1))
    engine = policy.generation_engine()
    arrived: collections.Counter[tuple[int, ...]] = collections.Counter()  # requests that reached the engine, by prompt
    shared: collections.Counter[tuple[int, ...]] = collections.Counter()  # prompts copied from a group's leader, by prompt
    lock = threading.Lock()
    make_row, copy_prompt = engine._row, engine._copy_prompt

    def counted_row(job, now):
        row = make_row(job, now)
        with lock:
            arrived[tuple(row.prompt_ids)] += 1
        return row

    def counted_copy(source, row):
        copy_prompt(source, row)
        with lock:
            shared[tuple(row.prompt_ids)] += 1

    monkeypatch.setattr(engine, "_row", counted_row)  # counted, then done as ever
    monkeypatch.setattr(engine, "_copy_prompt", counted_copy)
    start_actor(broker.backend, credits=16, policy=policy)  # the actor's default: as many requests as it has rows
    wait_for(lambda: actors_ready(make_client(broker.frontend), 1), what="the actor to register")
    filler = ["please", "now", "and", "then", "stop", "black", "white", "pink", "grey"]
    shapes = [("red", 0), ("green", 300), ("blue", 40), ("yellow", 300), ("red", 2), ("green", 120)]  # filler words after
    data = [
        PromptRecord(
            " ".join(["say the word", colour, *(filler[(i + j) % len(filler)] for j in range(n))]),
            colour,
            "colours",
            {},
            f"t.jsonl line {i + 1}",
        )
        for i, (colour, n) in enumerate(shapes)
    ]
    prompts = [tuple(tokenizer(r.prompt)["input_ids"]) for r in data]
    assert len(set(prompts)) == len(data) and min(map(len, prompts)) <= 5 and max(map(len, prompts)) >= 300
    rollout_n, workers = 4, 3
    scorer = BatchingScorer(CompositeReward({"rule_score": 1.0}, reward_fn=first_word_is), max_batch=16)
    try:
        progress = drive(
            broker.frontend,
            data,
            PromptOrder(len(data), rollout_n=rollout_n, seed=2),
            scorer,
            Sampling(max_new_tokens=6),
            workers=workers,
            grouping=GroupAdvantage(),
        )
    finally:
        scorer.close()
    total = len(data) * rollout_n
    assert progress.done == set(range(total)) and progress.rewarded == total and progress.unrewarded == 0, progress.errors
    assert progress.groups == len(data) and not progress.stopped_workers
    assert arrived == {prompt: rollout_n for prompt in prompts}, "each response generated once"
    # Each follower's prompt is copied from its leader (all of them in every run seen); one straggler a group is let
    # pass, a member descheduled past the leader's few tokens on a loaded machine. Sent one after another: none.
    apart = {
        f"{r.where} ({len(prompt)} tokens)": rollout_n - 1 - shared[prompt]
        for r, prompt in zip(data, prompts)
        if shared[prompt] < rollout_n - 2
    }
    assert not apart, f"groups whose members computed their prompt again (how many): {apart}"
    assert engine.shared_prompts == sum(shared.values())  # the measure the test above reads, counted by prompt here
    assert broker.broker.metrics["broker/feedbacks"] == total  # each answered before drive() returned

    def stored_turns():
        turns = [t for s in segments(redis_client, key_prefix) for t in s.transitions]
        return turns if len(turns) >= total else None

    stored = wait_for(stored_turns, timeout=30, what=f"the {total} turns in the stream")  # acknowledged already: ms; x1000
    assert collections.Counter(tuple(t.obs.prompt_ids) for t in stored) == {prompt: rollout_n for prompt in prompts}


def test_the_scorer_overlaps_batches_at_a_slow_judge_but_runs_the_reward_function_one_batch_at_a_time() -> None:
    """A judge answers in seconds: a batch that arrives while another is at the judge goes to the judge too
    (up to `batches_in_flight`), instead of waiting for the first batch's slowest answer. The reward function
    (a user's, maybe not thread-safe) never runs in two threads at once."""
    import threading
    import time

    from rewards.composite import Item
    from rewards.judge import Verdict

    release = threading.Event()
    lock = threading.Lock()
    waiting: list[int] = []  # judge calls waiting for `release`
    rule_now, rule_peak = [0], [0]

    class HeldJudge:  # a stand-in for the remote judge: answers when released
        def judge_many(self, items):
            with lock:
                waiting.append(len(items))
            release.wait(30)  # the test releases it within a second alone; a bound for a failing test
            return [Verdict(1.0, 10.0, "Score: 10") for _ in items]

    def rule(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            rule_now[0] += 1
            rule_peak[0] = max(rule_peak[0], rule_now[0])
        time.sleep(0.01)
        with lock:
            rule_now[0] -= 1
        return 1.0

    for in_flight, overlapping in ((3, True), (1, False)):
        release.clear()
        waiting.clear()
        reward = CompositeReward({"rule_score": 1.0, "judge_score": 1.0}, reward_fn=rule, judge=HeldJudge())
        scorer = BatchingScorer(reward, max_batch=4, wait_s=0.0, batches_in_flight=in_flight)
        first = scorer.submit(Item("p", "r0", "t"))
        wait_for(lambda: len(waiting) == 1, timeout=10, what="the first batch at the judge")  # a scorer thread's: ms; x1000
        later = [scorer.submit(Item("p", f"r{i}", "t")) for i in range(1, 9)]
        if overlapping:  # the later responses reach the judge while the first batch is still there
            wait_for(lambda: sum(waiting) == 9, timeout=10, what="every response at the judge at once")  # as above
        else:
            time.sleep(0.3)  # a look for a batch that must not come, not a deadline
            assert waiting == [1], "one batch at a time: the others wait for the first"
        release.set()
        assert [f.result(timeout=10).reward for f in [first, *later]] == [2.0] * 9  # released: ms each; x1000
        scorer.close()
    assert rule_peak[0] == 1
