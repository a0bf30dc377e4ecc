"""The decode step at bucketed shapes (actor_node/decode_step.py).

A captured CUDA graph needs fixed shapes and no host read-back inside the step. On a CPU the
step runs at the same padded shapes, eagerly: these tests check that the padding (placeholder
rows, a wider attention read) leaves every real row's logits as an exact-shape forward computes
them, and, on the meta device (where any host read-back of a tensor raises), that the step and
the sampling after it read nothing back before their one copy of results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from actor_node import sampling
from actor_node.decode_step import INPUTS, row_bucket, width_bucket
from actor_node.generation_engine import GenerationEngine
from models import scoring
from models.policy_model import ModelSpec, load_policy
from tests.actor_node.test_engine_against_generate import byte_prompt, job


def test_row_buckets_by_hand() -> None:
    assert [row_bucket(n, 64) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 25, 63, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 32, 64, 64]
    assert row_bucket(13, 12) == 12  # never past the slots there are
    assert row_bucket(3, 3) == 3


def test_width_buckets_by_hand_and_their_waste() -> None:
    widths = (1, 32, 33, 255, 256, 257, 300, 513, 1025, 4000)
    assert [width_bucket(w, 4096) for w in widths] == [32, 32, 64, 256, 256, 320, 320, 640, 1280, 4096]
    assert width_bucket(4000, 4001) == 4001  # never past the cache's capacity
    assert len({width_bucket(w, 4096) for w in range(1, 4097)}) <= 28  # graphs per row bucket at a 4,096-position capacity
    for w in range(1, 4097):
        b = width_bucket(w, 4096)
        assert w <= b <= 4096
        assert b - w < 32 or b <= 1.25 * w, w  # past 128 positions, at most a quarter more than needed


def _engine_with_rows(model: Any, tokenizer: Any, prompts: list[int]) -> GenerationEngine:
    """An engine whose rows have prefilled prompts of these lengths and sampled their first token."""
    engine = GenerationEngine(model, tokenizer, max_rows=8, max_positions=512)
    engine.add([job(i, byte_prompt(n, seed=i), 50) for i, n in enumerate(prompts)])
    while any(not r.response_ids for r in engine.rows):
        engine.step()
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_padded_rows_and_width_leave_each_real_rows_logits_as_an_exact_forward_computes_them(arch, tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models[arch], device="cpu", lora_rank=0))
    engine = _engine_with_rows(model, tokenizer, [5, 77, 40, 130, 9])  # 5 rows: a bucket of 8
    assert engine.active == 5
    real = [True, False, True, True, False]  # two placeholders among the real rows: rows still prefilling ride so
    ids = [r.response_ids[-1] for r in engine.rows]
    positions = [r.filled if keep else 0 for r, keep in zip(engine.rows, real)]
    width = max(positions) + 1  # 130 + a few: a bucket of 160
    assert width_bucket(width, engine.capacity) > width and row_bucket(5, engine.max_rows) == 8
    held = [engine.kv.read(slot, engine.rows[slot].filled) for slot in (1, 4)]  # the placeholders' own KV
    with torch.inference_mode():  # the padded step first: the exact one writes the same KV where it belongs
        inputs = torch.zeros(5, len(INPUTS), dtype=torch.float64)
        inputs[:, 0], inputs[:, 1], inputs[:, 2] = torch.tensor(ids), torch.tensor(positions), torch.tensor(real)
        padded, on_device = engine.decode_step.run(inputs, width)
        for slot, kept in zip((1, 4), held):  # a placeholder writes to the sink column only
            for (k0, v0), (k1, v1) in zip(kept, engine.kv.read(slot, engine.rows[slot].filled)):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
        hidden = engine._forward(
            list(range(5)), torch.tensor(ids)[:, None], torch.tensor(positions)[:, None], torch.tensor(real)[:, None], width
        )
        exact = engine.post(scoring.head_logits(engine.head, hidden[:, 0]))
    assert padded.shape == (8, exact.shape[1])
    for b in (0, 2, 3):  # a placeholder's output is dropped: not compared
        torch.testing.assert_close(padded[b], exact[b], rtol=1e-5, atol=1e-5)
    assert on_device["real"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # the bucket's padding: placeholders


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_and_its_sampling_read_nothing_back_on_the_host(arch, tiny_models) -> None:
    """On the meta device a tensor has no data: any `.item()`, `bool(tensor)` or `.tolist()` in the step raises,
    as a host synchronisation would break a CUDA graph's capture."""
    config = AutoConfig.from_pretrained(tiny_models[arch])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    engine = GenerationEngine(model, AutoTokenizer.from_pretrained(tiny_models[arch]), max_rows=16, max_positions=256)
    heads = config.num_key_value_heads
    engine.kv._allocate(torch.zeros(1, heads, 1, config.hidden_size // config.num_attention_heads, device="meta"))
    inputs = torch.zeros(len(INPUTS), 11, dtype=torch.float64)  # 11 rows: a bucket of 16; 10 decode
    inputs[:3] = torch.tensor([[5.0] * 11, list(range(0, 110, 10)), [1.0] * 10 + [0.0]])
    inputs[3:7] = torch.tensor([[1.0] * 11, [0.9] * 11, [5.0] * 11, [0.5] * 11])
    inputs[7] = torch.tensor(list(range(10)) + [0.0])
    with torch.inference_mode():
        logits, on_device = engine.decode_step.run(inputs.T.contiguous(), 101)
        picked = on_device["picked"][:10].long()  # as the engine samples: the decoding rows only
        settings = torch.stack([on_device[name] for name in INPUTS[3:7]])[:, picked]
        tokens, logprobs, failed = sampling.sample(logits[picked], *settings[:2], settings[2].long(), settings[3], any_filtered=True)
    assert logits.device.type == "meta" and logits.shape == (16, config.vocab_size)
    assert tokens.shape == logprobs.shape == failed.shape == (10,)
