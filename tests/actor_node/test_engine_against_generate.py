"""The generation engine's greedy text against transformers' own one-request-at-a-time `model.generate`.

Requests of 1 to 1,000 prompt tokens, different budgets and stop strings, arriving while others decode,
finishing at different steps; prompts longer than the prefill budget (so they prefill in chunks beside
decoding rows); Llama with LoRA, GPT-2 (learned positions), Mistral (a sliding window in every layer) and
Qwen2 (a sliding window in one layer of two). `model.generate` shares nothing with the engine: it runs its
own cache (transformers' DynamicCache, sliding-window layers included) and masks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from actor_node.generation_engine import GenerationEngine
from models.policy_model import ModelSpec, load_policy
from tests.actor_node.test_generation import with_nonzero_adapter


def byte_prompt(n: int, seed: int) -> str:
    """A prompt of n tokens with the byte tokenizer: the start token and n - 1 letters."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(n - 1))


def job(i: int, prompt: str, max_new_tokens: int, **sampling: Any) -> dict[str, Any]:
    settings = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
    return {"job": i, "task_id": f"t{i}", "obs": {"prompt": prompt, "sampling": settings}}


def drive(engine: GenerationEngine, arrivals: dict[int, list[dict[str, Any]]]) -> tuple[dict[int, Any], dict[int, int]]:
    """Add arrivals[s] before step s (as rows free up); every answer by job id, and the step each finished at."""
    answers: dict[int, Any] = {}
    finished_at: dict[int, int] = {}
    waiting: list[dict[str, Any]] = []
    step = 0
    while engine.active or waiting or any(s >= step for s in arrivals):
        waiting += arrivals.pop(step, [])
        joining, waiting = waiting[: engine.free], waiting[engine.free :]
        answers.update((j["job"], a) for j, a in engine.add(joining))
        for j, a in engine.step():
            answers[j["job"]] = a
            finished_at[j["job"]] = step
        step += 1
        assert step < 5000, "the engine never finished"
    return answers, finished_at


def reference(model: Any, tokenizer: Any, request: dict[str, Any]) -> tuple[list[int], str]:
    """(response tokens, text) of one request alone through model.generate, greedy, cut at the first stop string."""
    settings = request["obs"]["sampling"]
    ids = tokenizer(request["obs"]["prompt"], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=settings["max_new_tokens"],
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    response = out[0, ids.shape[1] :].tolist()
    for k in range(1, len(response) + 1):
        text = tokenizer.decode(response[:k], skip_special_tokens=True)
        found = [at for stop in settings.get("stop", []) if (at := text.find(stop)) >= 0]
        if found:
            return response[:k], text[: min(found)]
    return response, tokenizer.decode(response, skip_special_tokens=True)


def mixed_requests(tokenizer: Any, longest: int) -> dict[int, list[dict[str, Any]]]:
    """Requests of 1 to `longest` prompt tokens arriving over the first steps, with budgets of 1 to 40 tokens;
    a few with a stop string taken from the middle of their own greedy text (set by the caller)."""
    lengths = [1, 2, 7, 33, 120, longest // 2, longest, 5, 64, 300 if longest >= 300 else longest - 3]
    budgets = [12, 1, 40, 7, 25, 9, 16, 33, 3, 20]
    arrivals: dict[int, list[dict[str, Any]]] = {}
    for i, (n, budget) in enumerate(zip(lengths, budgets)):
        arrivals.setdefault([0, 0, 0, 2, 3, 3, 5, 9, 14, 20][i], []).append(job(i, byte_prompt(n, seed=i), budget))
    return arrivals


def with_stops(model: Any, tokenizer: Any, arrivals: dict[int, list[dict[str, Any]]]) -> dict[int, tuple[list[int], str]]:
    """Give jobs 2, 4 and 7 a stop string from the middle of their greedy text; every job's expected answer."""
    expected = {}
    for jobs in arrivals.values():
        for request in jobs:
            tokens, text = reference(model, tokenizer, request)
            if request["job"] in (2, 4, 7) and len(text) > 8:
                stop = text[len(text) // 2 : len(text) // 2 + 2]
                request["obs"]["sampling"]["stop"] = ["never there", stop]
                tokens, text = reference(model, tokenizer, request)
                assert text.find(stop) == -1
            expected[request["job"]] = (tokens, text)
    return expected


def check_against_generate(model: Any, tokenizer: Any, longest: int, **engine_settings: Any) -> GenerationEngine:
    arrivals = mixed_requests(tokenizer, longest)
    expected = with_stops(model, tokenizer, arrivals)
    engine = GenerationEngine(model, tokenizer, **engine_settings)
    answers, finished_at = drive(engine, arrivals)
    for i, (tokens, text) in expected.items():
        assert answers[i].response_ids == tokens and answers[i].text == text, f"job {i}"
    assert len(set(finished_at.values())) >= 5  # rows left at different steps, others joined in between
    assert {answers[i].finish_reason for i in (2, 4, 7)} <= {"stop", "eos"}
    return engine


@pytest.fixture(scope="module")
def lora_llama(tiny_models):
    return with_nonzero_adapter(tiny_models["llama"])


def test_llama_with_lora_equals_generate_with_long_prompts_prefilled_in_chunks(lora_llama) -> None:
    model, tokenizer = lora_llama
    engine = check_against_generate(model, tokenizer, longest=1000, max_rows=4, prefill_tokens=96, max_positions=1100)
    assert engine.prefilled_tokens == sum([1, 2, 7, 33, 120, 500, 1000, 5, 64, 300])  # each prompt computed once
    assert engine.active == 0 and engine.free == 4  # every slot returned
    before = engine.kv.nbytes
    check_against_generate(model, tokenizer, longest=1000, max_rows=4, prefill_tokens=4096, max_positions=1100)
    assert engine.kv.nbytes == before  # allocated once: a second run allocates nothing more


def test_gpt2_equals_generate(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["gpt2"], device="cpu", lora_rank=0))
    check_against_generate(model, tokenizer, longest=700, max_rows=3, prefill_tokens=128, max_positions=800)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_sliding_window_model_equals_generate_past_its_window(kind, tiny_models, tmp_path) -> None:
    from tests.learner_node.test_generation_update import sliding_window_model

    model = sliding_window_model(kind, tmp_path / kind)
    _, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))  # the same byte vocabulary
    engine = check_against_generate(model, tokenizer, longest=200, max_rows=4, prefill_tokens=48, max_positions=250)
    assert engine.masks.window == 16 if kind == "mistral" else engine.masks.windows == {"full_attention": None, "sliding_attention": 16}
    # The window matters: the same weights attending to everything write other text for the long prompts.
    full = sliding_window_model(kind, tmp_path / "full", window=None)
    long = job(0, byte_prompt(200, seed=6), 16)
    assert reference(model, tokenizer, long)[0] != reference(full, tokenizer, long)[0]


def test_rows_sharing_a_prompt_write_what_unshared_rows_write(lora_llama) -> None:
    """rollout_n-style groups: sampled (seeded) and greedy rows of one prompt, arriving together and while their
    prompt's first row decodes, against the same requests each alone in a fresh engine."""
    model, tokenizer = lora_llama
    prompt = byte_prompt(300, seed=1)

    def request(i: int, **sampling: Any) -> dict[str, Any]:
        return job(i, prompt, 12, **sampling)

    group = [request(0, temperature=1.0, seed=10), request(1, temperature=1.0, seed=11), request(2), request(3, temperature=0.7, seed=12)]
    late = [request(4, temperature=1.0, seed=13), request(5)]
    engine = GenerationEngine(model, tokenizer, max_rows=8, prefill_tokens=64)
    shared, _ = drive(engine, {0: group, 7: late})
    assert engine.prefilled_tokens == 300 and engine.shared_prompts == 5  # one prefill for six rows
    for r in group + late:
        alone, _ = drive(GenerationEngine(model, tokenizer, max_rows=1), {0: [r]})
        assert shared[r["job"]].response_ids == alone[r["job"]].response_ids, r["job"]
        assert torch.allclose(torch.tensor(shared[r["job"]].logprobs), torch.tensor(alone[r["job"]].logprobs), atol=1e-5)
    assert shared[0].response_ids != shared[1].response_ids  # the seeds differ, so do the samples


def test_a_seeded_request_writes_the_same_text_alone_and_in_a_busy_batch(lora_llama) -> None:
    """docs/protocol.md: a seeded request's text depends on its seed and prompt, not on its neighbours
    (unless a last-bit difference in the batch's arithmetic moves a token across a boundary of its draw)."""
    model, tokenizer = lora_llama
    seeded = [job(100 + k, byte_prompt(40 + 30 * k, seed=50 + k), 30, temperature=1.0, top_p=0.9, top_k=50, seed=k) for k in range(4)]
    busy = {0: [job(i, byte_prompt(10 + 97 * i, seed=i), 5 + 9 * i, temperature=1.3, seed=i) for i in range(4)]}
    busy[3] = seeded[:2]
    busy[6] = seeded[2:]
    crowd, _ = drive(GenerationEngine(model, tokenizer, max_rows=5, prefill_tokens=100), busy)
    for r in seeded:
        alone, _ = drive(GenerationEngine(model, tokenizer, max_rows=1), {0: [r]})
        assert crowd[r["job"]].text == alone[r["job"]].text, r["job"]


def test_a_row_that_fails_on_non_finite_values_leaves_a_clean_slot(lora_llama) -> None:
    """Attention reads a slot up to the batch's width, past its own row's length: NaN left behind by a failed
    row would fail the next row given that slot."""
    model, tokenizer = lora_llama
    engine = GenerationEngine(model, tokenizer, max_rows=2)
    long = job(0, byte_prompt(80, seed=1), 30, temperature=1.0, seed=1)
    short = job(1, byte_prompt(10, seed=2), 30, temperature=1.0, top_p=0.5, seed=2)
    engine.add([long, short])
    for _ in range(4):
        engine.step()
    slot = next(r.slot for r in engine.rows if r.job["job"] == 1)
    with torch.inference_mode():
        for keys in engine.kv.keys:  # past the short row's length, inside the long row's width
            keys[slot, :, 40:70] = float("nan")
    failed = dict((j["job"], a) for j, a in engine.step())
    assert "at temperature 1, top_p 0.5, top_k 0 cannot be sampled (not finite)" in str(failed[1])  # every setting named
    later = job(2, byte_prompt(12, seed=3), 10, temperature=1.0, seed=3)
    answers, _ = drive(engine, {0: [later]})
    alone, _ = drive(GenerationEngine(model, tokenizer, max_rows=1), {0: [dict(later)]})
    assert answers[2].response_ids == alone[2].response_ids


def test_a_model_the_engine_cannot_mask_still_starts_and_refuses_generate_by_name(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=0))
    model.config._attn_implementation_internal = "flash_attention_2"  # what from_pretrained records for flash-attn
    try:
        engine = GenerationEngine(model, tokenizer)
        answers = engine.add([job(0, "hello", 4)])
    finally:
        model.config._attn_implementation_internal = "sdpa"
    assert "attn_implementation" in str(answers[0][1]) and engine.active == 0
