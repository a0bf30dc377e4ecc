"""New weights applied between two decode steps, with responses running (GenerationEngine.swap).

Each token must come from exactly one version's distribution given everything before it: the tokens
sampled before the swap are the old weights' greedy continuation, and those after it are what the new
weights alone write after the same prefix (transformers' own `generate` on a second copy of the model,
which shares nothing with the engine). A row still prefilling at the swap, a row whose prompt another
row was computing, and a row that has not yet sampled its first token start under the new weights.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from common import weights
from models.policy_model import ModelSpec, load_policy, load_policy_state_dict, policy_state_dict
from tests.actor_node.test_actor import new_snapshot, start_llm_actor  # noqa: F401 - a fixture
from tests.actor_node.test_engine_against_generate import byte_prompt, job
from tests.broker.test_broker import segments
from tests.helpers import actors_ready, wait_for


def lora_spec(tiny_models: dict[str, str]) -> ModelSpec:
    return ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4)


def adapter(tiny_models: dict[str, str], seed: int) -> dict[str, torch.Tensor]:
    """Adapter weights with a non-zero B: the two versions write different text."""
    model, _ = load_policy(lora_spec(tiny_models))
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in policy_state_dict(model).items()}


def greedy_after(tiny_models: dict[str, str], state: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    """The next n greedy tokens after `ids` under these weights, by transformers' `generate` (no eos stop)."""
    model, _ = load_policy(lora_spec(tiny_models))
    load_policy_state_dict(model, state)
    ones = torch.ones(1, len(ids), dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=ones, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_a_swap_between_decode_steps_recomputes_the_running_rows_and_records_each_tokens_version(tiny_models) -> None:
    old, new = adapter(tiny_models, seed=1), adapter(tiny_models, seed=2)
    model, tokenizer = load_policy(lora_spec(tiny_models))
    policy = LLMPolicy(model, tokenizer, SamplingConfig(max_generate_rows=6, max_generate_positions=700, prefill_tokens=64))
    policy.set_weights(old, 1, "run-a")
    engine = policy.generation_engine()
    assert engine.folded is not None  # the fold is undone before the load, and redone after
    budgets = {0: 30, 1: 12, 2: 45, 3: 25, 4: 38}  # responses of different lengths; job 1 ends 3 tokens after the swap

    def never_ends(i: int) -> dict[str, Any]:
        return {"stop": [], "max_new_tokens": budgets[i]}

    early = [job(0, byte_prompt(9, seed=0), **never_ends(0)), job(1, byte_prompt(40, seed=1), **never_ends(1))]
    engine.add(early)
    for _ in range(8):
        engine.step()
    late = [job(2, byte_prompt(600, seed=2), **never_ends(2)), job(3, byte_prompt(17, seed=3), **never_ends(3))]
    twin = job(4, byte_prompt(600, seed=2), **never_ends(4))  # the same prompt as job 2: it waits for 2's prompt KV
    engine.add([*late, twin])
    # job 1 prefilled a step after job 0 (the prefill budget); job 2's prompt is one chunk in (600 tokens, 64 a
    # step); job 3 waits behind it for the budget
    engine.step()
    before = {r.job["job"]: len(r.response_ids) for r in engine.rows}
    states = {r.job["job"]: (r.state, r.filled) for r in engine.rows}
    assert (before[0], before[1]) == (10, 9) and before[2] == before[3] == before[4] == 0
    assert states[2] == ("prefill", 64) and states[4][0] == "waiting"
    policy.set_weights(new, 2, "run-a")
    answers: dict[int, Any] = {}
    while engine.active:
        answers.update((j["job"], a) for j, a in engine.step())
    assert engine.swaps == 1 and engine.recomputed_tokens == (9 + 10 - 1) + (40 + 9 - 1) + 64  # prompt + response but its last
    for i, request in enumerate(early + late + [twin]):
        answer, n, k = answers[i], budgets[i], before[i]
        assert len(answer.response_ids) == n and len(answer.token_versions) == n
        assert answer.token_versions == [1] * k + [2] * (n - k), f"job {i}"
        prompt = tokenizer(request["obs"]["prompt"])["input_ids"]
        if k:
            assert answer.response_ids[:k] == greedy_after(tiny_models, old, prompt, k), f"job {i}: before the swap"
        continued = greedy_after(tiny_models, new, prompt + answer.response_ids[:k], n - k)
        assert answer.response_ids[k:] == continued, f"job {i}: after the swap, as the new weights write"
        assert answer.policy_version == (1 if k else 2)


def test_a_swap_with_no_row_running_changes_only_the_version(tiny_models) -> None:
    model, tokenizer = load_policy(lora_spec(tiny_models))
    policy = LLMPolicy(model, tokenizer, SamplingConfig())
    engine = policy.generation_engine()
    policy.set_weights(adapter(tiny_models, seed=3), 5, "run-b")
    assert engine.version == 5 and engine.recomputed_tokens == 0
    engine.add([job(0, "ab", max_new_tokens=3, stop=[])])
    while engine.active:
        done = engine.step()
    assert done[0][1].token_versions == [5, 5, 5]


def test_an_actor_applies_a_snapshot_mid_response_and_the_transition_records_each_tokens_version(
    broker, start_llm_actor, make_client, redis_client, key_prefix, tiny_models
) -> None:
    """A real actor behind a real broker, following snapshots in Redis: a snapshot stored while a long response is
    generated is applied before the response ends, and the stored transition says which token came from which."""
    start_llm_actor(broker.backend, poll_s=0.1)
    client = make_client(broker.frontend, deadline=60, attempt_timeout=60)
    wait_for(lambda: actors_ready(client, 1), timeout=60, what="the LLM actor")
    state = new_snapshot(tiny_models, seed=5)
    replies: list[dict[str, Any]] = []
    # Each try: a greedy response of up to 2,000 tokens (2-10 s alone), and a snapshot stored 0.5 s after it was asked for. A try
    # whose response began after the snapshot was loaded, or ended before, tries again with the next version.
    for version in range(1, 6):
        task = client.attach()
        asked = threading.Thread(target=lambda t=task: replies.append(client.generate(t, "tell me", max_new_tokens=2000, temperature=0)))
        asked.start()
        time.sleep(0.5)
        weights.store_snapshot(redis_client, key_prefix, version, state, "lora")
        asked.join(120)
        assert not asked.is_alive(), "the response never came"
        client.feedback(task, reward=1.0, done=True)
        (seg,) = wait_for(lambda t=task: [s for s in segments(redis_client, key_prefix) if s.task_id == t], what="the segment")
        versions = seg.transitions[0].generation.token_versions
        assert len(versions) == replies[-1]["n_tokens"] and versions == sorted(versions)
        assert seg.transitions[0].policy_version == replies[-1]["policy_version"] == versions[0]
        if versions[0] < version <= versions[-1]:
            break
    else:
        pytest.fail(f"in 5 tries no snapshot came while a response ran: {[r['policy_version'] for r in replies]}")
    assert set(versions) == {version - 1, version}
