"""The actor's generation engine: the tokens it samples, the log-probabilities it logs, and when it stops.

The yardstick for every log-probability is the model's own `model(input_ids).logits` over prompt +
response, computed here (it shares nothing with the engine's decoder-and-head path or its KV cache).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from actor_node.generation_engine import GenerationEngine
from actor_node.responses import DeadlineExceeded, GenerationError, SamplingParams
from models.policy_model import ModelSpec, load_policy


def own_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(model(prompt + response).logits / T) at each response token."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + j, t] for j, t in enumerate(response)])


def job(i: int, prompt: str = "", deadline_ms: int = 60_000, **sampling: Any) -> dict[str, Any]:
    settings = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "stop": [], "seed": i, **sampling}
    return {"job": i, "task_id": f"t{i}", "obs": {"prompt": prompt or f"prompt number {i}: say something", "sampling": settings}}


def run(engine: GenerationEngine, jobs: list[dict[str, Any]], join_after: int = 0, later: list[dict[str, Any]] | None = None):
    """Add `jobs`, step; after `join_after` steps add `later` (they join the running batch); all answers by job id."""
    answers = dict((j["job"], a) for j, a in engine.add(jobs))
    steps = 0
    while engine.active or later:
        if later and steps >= join_after:
            answers.update((j["job"], a) for j, a in engine.add(later))
            later = None
        answers.update((j["job"], a) for j, a in engine.step())
        steps += 1
    return answers


def with_nonzero_adapter(model_dir: str) -> tuple[Any, Any]:
    """A tiny model with a rank-4 adapter whose B is not zero: the engine must score with it on."""
    model, tokenizer = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def policy(request, tiny_models):
    return with_nonzero_adapter(tiny_models[request.param])


def test_logged_logprobs_are_the_models_own_for_requests_that_join_a_running_batch(policy) -> None:
    model, tokenizer = policy
    engine = GenerationEngine(model, tokenizer, max_rows=8, prefix_cache_mb=64)
    first = [job(0, max_new_tokens=12), job(1, "a short one", max_new_tokens=5, temperature=0.7)]
    later = [job(2, "a much longer prompt than the others, joining after three steps", max_new_tokens=9, temperature=1.4)]
    answers = run(engine, first, join_after=3, later=later)
    assert sorted(answers) == [0, 1, 2]
    for i, temperature in ((0, 1.0), (1, 0.7), (2, 1.4)):
        g = answers[i]
        assert not isinstance(g, Exception), g
        assert g.prompt_ids == tokenizer(first[i]["obs"]["prompt"] if i < 2 else later[0]["obs"]["prompt"])["input_ids"]
        expected = own_logprobs(model, g.prompt_ids, g.response_ids, temperature)
        assert float((expected - torch.tensor(g.logprobs)).abs().max()) < 1e-4, i
        assert g.logprob == pytest.approx(sum(g.logprobs))


def test_a_cached_prompt_prefix_gives_the_same_logprobs(policy) -> None:
    model, tokenizer = policy
    engine = GenerationEngine(model, tokenizer, max_rows=4, prefix_cache_mb=64)
    prompt = "the same long prompt for several samples of one question, " * 2
    a = run(engine, [job(0, prompt)])[0]
    b = run(engine, [job(1, prompt)])[1]  # a second sample: the prompt's KV comes from the cache
    assert engine.cache.hits >= 1 and engine.cache.reused_tokens >= len(a.prompt_ids) - 1
    for g in (a, b):
        expected = own_logprobs(model, g.prompt_ids, g.response_ids)
        assert float((expected - torch.tensor(g.logprobs)).abs().max()) < 1e-4


def test_a_seeded_request_gives_the_same_response_alone_or_in_a_batch(policy) -> None:
    model, tokenizer = policy
    alone = run(GenerationEngine(model, tokenizer), [job(7, "seeded", max_new_tokens=10)])[7]
    crowd = run(GenerationEngine(model, tokenizer), [job(5), job(7, "seeded", max_new_tokens=10), job(9, "x" * 40)])[7]
    assert alone.response_ids == crowd.response_ids


def test_finish_reasons_stop_strings_and_greedy(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    engine = GenerationEngine(model, tokenizer)
    g = run(engine, [job(0, max_new_tokens=6)])[0]
    assert g.finish_reason == "length" and len(g.response_ids) == 6
    greedy = run(engine, [job(1, temperature=0.0, max_new_tokens=6)])[1]
    with torch.inference_mode():
        ids = greedy.prompt_ids
        for token in greedy.response_ids:  # each token is the argmax of the model's own logits
            assert token == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids = ids + [token]
    assert greedy.logprobs == [0.0] * 6
    # A stop string: the response ends at the token that completes it, and the text stops before it.
    text = tokenizer.decode(greedy.response_ids, skip_special_tokens=True)
    stop = text[2:4]
    stopped = run(engine, [job(1, temperature=0.0, max_new_tokens=6, stop=[stop])])[1]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.find(stop)]
    assert tokenizer.decode(stopped.response_ids, skip_special_tokens=True).find(stop) >= 0
    # Far into a long response (the engine reads only the newest tokens for stop strings): it stops at the
    # first token whose prefix text holds the stop string, found here by decoding every prefix whole.
    long = run(engine, [job(3, max_new_tokens=80)])[3]
    text = tokenizer.decode(long.response_ids, skip_special_tokens=True)
    at = next(j for j in range(len(text) // 2, len(text) - 3) if text.find(text[j : j + 3]) == j)
    stop = text[at : at + 3]
    first = next(k for k in range(1, 81) if stop in tokenizer.decode(long.response_ids[:k], skip_special_tokens=True))
    assert first > SamplingParams(max_new_tokens=1, stop=(stop,)).stop_window  # beyond the window's reach from the start
    stopped = run(engine, [job(3, max_new_tokens=80, stop=["never in this text", stop])])[3]
    assert stopped.finish_reason == "stop" and stopped.response_ids == long.response_ids[:first] and stopped.text == text[:at]
    # The end-of-sequence token ends a response and is kept in its tokens (the policy learns to stop).
    engine.end_ids = {greedy.response_ids[2]}
    ended = run(engine, [job(1, temperature=0.0, max_new_tokens=6)])[1]
    assert ended.finish_reason == "eos" and ended.response_ids == greedy.response_ids[:3]


def test_the_deadline_answers_a_request_without_holding_the_others(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    engine = GenerationEngine(model, tokenizer)
    # 4,000 tokens take seconds even on a quiet machine (400 took less than the 200 ms deadline on one)
    slow = job(0, max_new_tokens=4000)
    slow["deadline_ms"] = 200
    answered = dict((j["job"], a) for j, a in engine.add([slow, job(1, max_new_tokens=4)]))
    started = time.monotonic()
    while engine.active:
        answered.update((j["job"], a) for j, a in engine.step())
    assert isinstance(answered[0], DeadlineExceeded)
    assert answered[1].finish_reason == "length"
    # the 200 ms deadline and a few steps: under 0.5 s alone; x60. The assertions above, not this bound, tell a
    # deadline that worked from 4,000 tokens written
    assert time.monotonic() - started < 30


def test_bad_requests_fail_alone_naming_the_limit(tiny_models) -> None:
    from transformers import AutoConfig

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["gpt2"], device="cpu", lora_rank=0))
    limit = AutoConfig.from_pretrained(tiny_models["gpt2"]).n_positions
    engine = GenerationEngine(model, tokenizer, max_rows=4, max_positions=limit)
    long_prompt = job(0, "word " * (limit // 5), max_new_tokens=limit)
    chat = {"job": 1, "task_id": "t1", "obs": {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_new_tokens": 4}}}
    answers = dict((j["job"], a) for j, a in engine.add([long_prompt, chat, job(2, max_new_tokens=3)]))
    assert isinstance(answers[0], GenerationError) and f"limit of {limit}" in str(answers[0])
    assert isinstance(answers[1], GenerationError) and "chat template" in str(answers[1])
    while engine.active:
        answers.update((j["job"], a) for j, a in engine.step())
    assert answers[2].finish_reason == "length"
    # An engine reserving fewer positions per row than the model takes names its own limit.
    small = GenerationEngine(model, tokenizer, max_rows=4, max_positions=64)
    over = dict((j["job"], a) for j, a in small.add([job(3, "word " * 10, max_new_tokens=40)]))[3]
    assert isinstance(over, GenerationError) and "the actor's limit (max_generate_positions) of 64" in str(over)


def test_chat_messages_go_through_the_tokenizers_template(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    engine = GenerationEngine(model, tokenizer)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = {"job": 0, "task_id": "t", "obs": {"messages": messages, "sampling": {"max_new_tokens": 3}}}
    g = run(engine, [chat])[0]
    assert tokenizer.decode(g.prompt_ids) == "<system>be brief\n<user>hello\n<assistant>"


def test_messages_a_chat_template_refuses_fail_alone(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    engine = GenerationEngine(model, tokenizer)
    refused = {"job": 0, "task_id": "t", "obs": {"messages": [{"role": "system", "content": "x"}], "sampling": {"max_new_tokens": 3}}}
    fine = {"job": 1, "task_id": "u", "obs": {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_new_tokens": 3}}}
    answers = run(engine, [refused, fine])
    assert isinstance(answers[0], GenerationError) and "System role not supported" in str(answers[0])
    assert answers[1].finish_reason == "length"


def test_the_actor_loop_survives_a_failing_engine_and_answers_what_it_held(tiny_models, start_broker, start_actor, make_client) -> None:
    """A generation that fails in the engine (here: out of memory, once) answers its requests `internal`, which
    the client retries; the actor serves on."""
    from actor_node.llm_policy import LLMPolicy, SamplingConfig
    from tests.helpers import actors_ready, wait_for

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tokenizer, SamplingConfig())
    engine = policy.generation_engine()
    real_step, failures = engine.step, []

    def step_failing_once():
        if not failures:
            failures.append(1)
            raise MemoryError("out of memory (a stand-in)")
        return real_step()

    engine.step = step_failing_once  # type: ignore[method-assign]
    broker = start_broker()
    actor = start_actor(broker.backend, policy=policy)
    # the failed step, the retry, 4 tokens of the tiny model on an actor thread of this process: under 0.5 s alone; x60
    client = make_client(broker.frontend, deadline=60, attempt_timeout=30)
    wait_for(lambda: actors_ready(client, 1), what="the actor")
    reply = client.generate(client.attach(), "hello", max_new_tokens=4)
    assert failures == [1] and reply["n_tokens"] == 4  # the retry was served after the failure
    assert actor.thread.is_alive() and engine.active == 0
