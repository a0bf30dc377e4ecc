"""A full snapshot fetched while the actor generates, then swapped in between two decode steps (LLMPolicy.staging,
worker.catch_up, WeightFollower.fetched), from a directory store named by a relative path.

The fetch is held half-way by the store, and the running responses must go on decoding meanwhile. Once it
is in, each token must come from exactly one version's weights: those sampled before the swap are the old
weights' greedy continuation, those after it what the new weights alone write after the same prefix
(transformers' own `generate` on another copy of the model, sharing nothing with the actor). Tied
embeddings (qwen2) are one tensor under two names, and swapped once.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from actor_node.llm_policy import LLMPolicy, SamplingConfig
from actor_node.weight_follower import WeightFollower
from actor_node.worker import catch_up
from common import weights
from models.policy_model import ModelSpec, load_policy, policy_state_items
from tests.actor_node.test_engine_against_generate import byte_prompt, job


def full_weights(folder: str, seed: int) -> dict[str, torch.Tensor]:
    """Every weight of the model, moved well away from the folder's (the versions write different text), as the
    learner publishes them: a tied embedding once."""
    model, _ = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    return dict(policy_state_items(model, tied_once=True))


def greedy_after(folder: str, state: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    model, _ = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    model.load_state_dict(state, strict=False)  # a tied head is the embedding's
    ones = torch.ones(1, len(ids), dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=ones, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


class HeldStore(weights.DirectorySnapshots):
    """A directory store whose chunks are read only once `release` is set (a slow network file system)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.reading = threading.Event()

    def open_chunk(self, run: str, version: int, index: int) -> Any:
        self.reading.set()
        if not self.release.wait(30):
            raise TimeoutError("the test never released the store")
        return super().open_chunk(run, version, index)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_full_snapshot_is_fetched_while_rows_decode_and_swapped_in_between_two_steps(
    tiny_models, redis_client, key_prefix, tmp_path, monkeypatch, arch
) -> None:
    monkeypatch.chdir(tmp_path)  # the store is named relative to the working directory, outside the repository
    folder = tiny_models[arch]
    old, new = full_weights(folder, seed=1), full_weights(folder, seed=2)
    model, tokenizer = load_policy(ModelSpec(model=folder, device="cpu", lora_rank=0))
    policy = LLMPolicy(model, tokenizer, SamplingConfig(max_generate_rows=4, max_generate_positions=256))
    policy.set_weights(old, 1, "run-a")
    engine = policy.generation_engine()
    budgets = {0: 30, 1: 12, 2: 40}  # different lengths; job 1 ends soon after the swap
    jobs = [job(i, byte_prompt(n, seed=i), max_new_tokens=budgets[i], stop=[]) for i, n in enumerate((9, 40, 23))]
    engine.add(jobs)
    for _ in range(6):
        engine.step()
    store = HeldStore("snapshots")
    weights.store_snapshot(redis_client, key_prefix, 2, new, "full", "run-a", store=store, chunk_bytes=64 << 10)
    follower = WeightFollower(redis_client, key_prefix, poll_s=0.0, weights_dir="snapshots")
    follower.store = store
    staging = policy.staging("full")
    assert staging is not None
    if arch == "qwen2":  # tied: one staging tensor under both names, and one tensor in the snapshot
        assert staging["lm_head.weight"] is staging["model.embed_tokens.weight"]
        assert "lm_head.weight" not in new and "model.embed_tokens.weight" in new
    staged_ptrs = {name: t.data_ptr() for name, t in staging.items()}
    # The fetch starts and is held: the loop goes on generating.
    assert not catch_up(policy, follower, generating=True)
    assert store.reading.wait(10), "the fetch did not start"
    assert follower.fetching is not None, follower.refused
    progressed = {r.job["job"]: len(r.response_ids) for r in engine.rows}
    for _ in range(3):
        assert not catch_up(policy, follower, generating=True)
        engine.step()
    before = {r.job["job"]: len(r.response_ids) for r in engine.rows}
    assert all(before[i] == progressed[i] + 3 for i in before), "decoding stalled while the snapshot was fetched"
    store.release.set()
    deadline_turns, applied = 0, False
    while not applied:
        follower.fetching[1].exception(timeout=30)  # the fetch is done (or failed): the next turn applies it
        applied = catch_up(policy, follower, generating=True)
        deadline_turns += 1
        assert deadline_turns < 3
    assert policy.policy_version == 2 and engine.swaps == 1
    # The serving tensors are the staged ones now (no copy), and the old ones are the next staging copy.
    live = dict(model.named_parameters())
    for name, param in live.items():
        assert param.data_ptr() == staged_ptrs[name], name
        assert torch.equal(param, new[name]), name
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (arch == "qwen2")
    answers: dict[int, Any] = {}
    while engine.active:
        answers.update((j["job"], a) for j, a in engine.step())
    for i, request in enumerate(jobs):
        answer, n, k = answers[i], budgets[i], before[i]
        assert answer.token_versions == [1] * k + [2] * (n - k), f"job {i}"
        prompt = tokenizer(request["obs"]["prompt"])["input_ids"]
        assert answer.response_ids[:k] == greedy_after(folder, old, prompt, k), f"job {i}: before the swap"
        continued = greedy_after(folder, new, prompt + answer.response_ids[:k], n - k)
        assert answer.response_ids[k:] == continued, f"job {i}: after the swap, as the new weights write"
    # A third version goes into the buffers the second replaced, and is swapped in the same way.
    third = full_weights(folder, seed=3)
    weights.store_snapshot(redis_client, key_prefix, 3, third, "full", "run-a", store=store, chunk_bytes=64 << 10)
    assert catch_up(policy, follower, wait=True) and policy.policy_version == 3
    assert all(torch.equal(p, third[name]) for name, p in model.named_parameters())
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    follower.close()
