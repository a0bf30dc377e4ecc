"""The learner's models sharded with FSDP2 over 2 gloo ranks (learner_node/sharding.py) against one process.

One job on 2 ranks per kind of policy (`KINDS`: a LoRA adapter alone, or with modules trained in full beside
it, on a Llama whose head is its own; all weights of a Qwen2 whose head is its embedding table) does what the
learner would: shard,
gather the weights (`full_state_chunks`), run the real update (learner_node/token_update.py's
`generation_update`, which is learner_node/update.py's `ppo_update`) on a fixed batch, gather again, write a
sharded checkpoint, undo the update (`TrainableSnapshot`), then run a candidate update. Each test holds one of
its results against the same thing done in this process, unsharded. The ranks are forked from this process,
which has imported torch and transformers already (a spawned rank spends seconds importing them again), and
are killed if they have not ended within JOB_TIMEOUT_S: ranks that enter different collectives wait for ever.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.segments import CandidateObservation, GeneratedResponse, GenerateObservation, Segment, Transition
from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.optim import adam
from learner_node.packed_forward import pack, response_logprobs
from learner_node.policy import LearnerPolicy
from learner_node.rollout import build_rollout, candidate_update
from learner_node.sharding import (
    TrainState,
    full_state_chunks,
    load_sharded,
    policy_names,
    save_sharded,
    shard,
    transformer_blocks,
)
from learner_node.token_update import build_generation_batch, generation_update
from learner_node.undo import TrainableSnapshot
from models.policy_model import ModelSpec, load_policy, policy_state_dict
from tests.processes import free_port

WORLD = 2
JOB_TIMEOUT_S = 120.0  # forked ranks (no imports) on a few steps of the tiny models over gloo: 3-10 s alone; x12
LR = 1e-2  # large: a wrong gradient moves a weight by about one step, far past the 1e-5 the tests allow
KINDS = {  # (tiny model, LoRA rank, modules trained in full beside the adapter)
    "lora": ("llama", 4, ()),  # a real model's default: every trained tensor sharded (fused Adam on DTensors)
    "lora_head": ("llama", 4, ("lm_head", "model.norm")),  # a tiny model's default: the head and final norm whole beside it
    "full": ("qwen2", 0, ()),  # all weights, the head tied to the embedding table; the reference is a sharded copy
}
CFG = UpdateConfig(update_epochs=2, policy_minibatch=4, value_minibatch=4, value_epochs=2, target_kl=0.0, max_grad_norm=1.0)
CANDIDATE_CFG = UpdateConfig(update_epochs=2, policy_minibatch=4, micro_batch=1, value_minibatch=4, target_kl=0.0, max_grad_norm=1.0)
# 16 tokens a forward: the ranks' shares of a minibatch are cut into different numbers of micro-batches
GEN = GenerationConfig(micro_batch_tokens=16, kl_coef=0.05, ent_coef=0.01, value_clip=0.2, value_hidden=[16])


def transition(prompt: list[int], response: list[int], reward: float, done: bool) -> Transition:
    """A generated response as the broker stores it; behaviour log-probabilities that are not the model's, so the
    ratios, clipping and behaviour weights all take part."""
    return Transition(
        obs=GenerateObservation(prompt, {"max_new_tokens": 16}),
        action=0,
        logprob=-1.0,
        probs=[],
        policy_version=0,
        mode="generate",
        reward=reward,
        done=done,
        truncated=False,
        generation=GeneratedResponse(
            response,
            [-5.3 - 0.1 * (k % 5) for k in range(len(response))],  # about a random tiny model's (-log 259)
            "length",
            1.0 if len(response) % 2 else 0.8,
            top_p=1.0,
        ),
    )


def fixed_batch() -> Any:
    """8 responses of 1 to 11 tokens after prompts of 2 to 12 (the masks ragged, the ranks' micro-batches and
    forwards uneven); one chain of two turns, and one turn that bootstraps from the next prompt's value."""
    g = torch.Generator().manual_seed(3)
    lengths = [(2, 1), (12, 11), (5, 3), (3, 7), (9, 2), (4, 9), (7, 5), (2, 4)]
    rewards = (1.0, -0.5, 0.25, 0.0, 1.0, -1.0, 0.5, 0.75)
    turns = [
        transition(
            torch.randint(3, 250, (p,), generator=g).tolist(), torch.randint(3, 250, (r,), generator=g).tolist(), reward, i not in (0, 2)
        )
        for i, ((p, r), reward) in enumerate(zip(lengths, rewards))
    ]
    segments = [
        Segment("s0", "t0", 0, "done", True, False, None, turns[0:2]),  # turn 0 goes on in turn 1
        Segment("s1", "t1", 0, "length", False, False, GenerateObservation([5, 6, 7], {}), [turns[2]]),
        *[Segment(f"s{i}", f"t{i}", 0, "done", True, False, None, [turns[i]]) for i in range(3, 8)],
    ]
    batch = build_generation_batch(segments, current_version=0, max_policy_lag=4)
    assert len(batch) == 8 and [c.next_prompt for c in batch.chains][1] == [5, 6, 7]
    return batch


def candidate_rollout() -> Any:
    """7 choices among 2 to 4 candidates of 1 to 9 bytes after prompts of different lengths: in minibatches of 4
    and micro-batches of 1, the last minibatch gives one rank 2 micro-batches and the other 1."""
    prompts = ["Pick one.", "Which colour is the sky on a clear day, would you say?", "Go"]
    actions = [["red", "green", "blue"], ["a", "bb"], ["north", "south", "east", "west by sea"]]
    segments = []
    for i in range(7):
        obs = {"prompt": prompts[i % 3], "question": " Answer: ", "action": actions[i % 3]}
        k = len(obs["action"])
        probs = [1.0 / k] * k
        t = Transition(CandidateObservation.from_wire(obs), i % k, math.log(probs[0]), probs, 0, "step", float(i % 2), True, False)
        segments.append(Segment(f"c{i}", f"c{i}", 0, "done", True, False, None, [t]))
    return build_rollout(segments, lambda observations: [0.1] * len(observations), 0.99, 0.95, current_version=0, max_policy_lag=4)


def learner(model_dir: str, kind: str, sharded: bool) -> tuple[LearnerPolicy, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The policy, its critic and their optimizers as the learner builds them (learner_node/loading.py, trainer.py), sharded
    before the optimizers are made: they must hold the sharded parameters."""
    arch, rank, trainable = KINDS[kind]
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=rank, lora_trainable=trainable))
    lp = LearnerPolicy(model, tok, "token", 1.0, [16], token_value_hidden=GEN.value_hidden)
    if sharded:
        shard(lp.model, mixed_precision=False)
        if lp.frozen is not None:
            shard(lp.frozen, mixed_precision=False)
    return lp, adam(lp.trainable_parameters(), LR), adam(lp.token_value_head.parameters(), LR)


def trained_names(lp: LearnerPolicy) -> dict[str, str]:
    return {name: name for name, p in lp.model.named_parameters() if p.requires_grad}


def adam_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each trained parameter's Adam state by the parameter's name, whole (a sharded moment gathered: a collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            state = opt.state[p]
            out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    return out


def _job(rank: int, world: int, model_dir: str, kind: str, out: str) -> None:
    """One rank of the 2-rank job; rank 0 writes what it gathered to `out`/gathered.pt."""
    lp, popt, vopt = learner(model_dir, kind, sharded=True)
    # copies: a tensor no rank shards is yielded as the model holds it, and the update changes it in place
    published = {k: v.clone() for k, v in full_state_chunks(lp.model, policy_names(lp.model))}
    everything = {k: v.clone() for k, v in full_state_chunks(lp.model)}
    snapshot = TrainableSnapshot.of([popt, vopt])  # what the learner takes to undo an update that was not finite
    metrics = generation_update(lp, popt, vopt, fixed_batch(), CFG, GEN)
    after = {k: v.clone() for k, v in full_state_chunks(lp.model, trained_names(lp))}
    save_sharded(Path(out) / "ckpt", {"policy": TrainState(lp.model, popt), "value": TrainState(lp.token_value_head, vopt)})
    moments, value_moments = adam_state(lp.model, popt), adam_state(lp.token_value_head, vopt)
    value_head = {k: v.clone() for k, v in lp.token_value_head.state_dict().items()}
    snapshot.restore()
    restored = {k: v.clone() for k, v in full_state_chunks(lp.model, trained_names(lp))}
    # from the restored weights and optimizer states (as fresh ones: no step yet), the candidate update
    candidates = candidate_update(lp, popt, adam(lp.value_head.parameters(), LR), candidate_rollout(), CANDIDATE_CFG)
    after_candidates = dict(full_state_chunks(lp.model, trained_names(lp)))
    if rank != 0:
        assert not published and not everything and not after and not restored and not after_candidates  # gathered, not kept
        return
    for name, weight in restored.items():
        assert torch.equal(weight, everything[name]), f"the snapshot did not restore {name}"
    torch.save(
        {
            "published": published,
            "everything": everything,
            "metrics": metrics,
            "after": after,
            "value_head": value_head,
            "moments": moments,
            "value_moments": value_moments,
            "candidates": candidates,
            "after_candidates": after_candidates,
        },
        Path(out) / "gathered.pt",
    )


def _rank(rank: int, world: int, port: int, job: Callable[..., None], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # one core a rank; and no OpenMP pool carried over the fork
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        job(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(job: Callable[..., None], *args: Any, world: int = WORLD, timeout: float = JOB_TIMEOUT_S) -> None:
    """`job(rank, world, *args)` on `world` forked ranks of one gloo process group; fails the test if a rank
    fails, or if they have not all ended within `timeout` (ranks waiting on different collectives never do)."""
    with warnings.catch_warnings():
        # Python 3.12+ warns of any fork from a process with threads (torch's own); the ranks only compute and exit
        warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
        ctx = mp.start_processes(_rank, args=(world, free_port(), job, args), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # a tick; the deadline bounds the wait
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not end within {timeout:.0f} s (a collective that not every rank entered)")


@pytest.fixture(scope="module", params=list(KINDS))
def two_ranks(request: pytest.FixtureRequest, tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kind = request.param
    out = tmp_path_factory.mktemp(f"sharded-{kind}")
    run_ranks(_job, tiny_models[KINDS[kind][0]], kind, str(out))
    return {"kind": kind, "model": tiny_models[KINDS[kind][0]], "dir": out, **torch.load(out / "gathered.pt")}


def test_the_ranks_micro_batches_differ_so_the_padding_passes_are_needed() -> None:
    """The fixed batch is cut into different numbers of micro-batches on the two ranks in some minibatch of the
    policy's epochs (the permutations `ppo_update` draws after the critic's), which without padding passes would
    leave one rank waiting on a collective the other never enters."""
    batch = fixed_batch()
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]  # GenerationUpdate.micro_batches' packing
    rng = torch.Generator().manual_seed(CFG.seed * 1_000_003)
    perms = [torch.randperm(len(batch), generator=rng).tolist() for _ in range(CFG.value_epochs + CFG.update_epochs)]
    counts = [
        [len(pack([lengths[i] for i in perm[s : s + CFG.policy_minibatch][r::WORLD]], GEN.micro_batch_tokens)) for r in range(WORLD)]
        for perm in perms[CFG.value_epochs :]
        for s in range(0, len(batch), CFG.policy_minibatch)
    ]
    assert any(a != b for a, b in counts), counts


@pytest.mark.slow  # the 2-rank job, once per kind for all of these
def test_full_state_chunks_on_two_ranks_are_the_one_process_state_dict(two_ranks: dict[str, Any]) -> None:
    """Gathered one tensor at a time from the shards: exactly the unsharded model's state dict, and exactly what
    the policy publishes today (models.policy_model.policy_state_dict: peft's adapter names with LoRA)."""
    lp, _, _ = learner(two_ranks["model"], two_ranks["kind"], sharded=False)
    own = lp.model.state_dict()
    assert list(two_ranks["everything"]) == list(own)
    for key, value in own.items():
        assert torch.equal(two_ranks["everything"][key], value), key
    published = policy_state_dict(lp.model)
    assert list(two_ranks["published"]) == list(published)
    for key, value in published.items():
        assert torch.equal(two_ranks["published"][key], value), key
    if two_ranks["kind"] != "full":
        assert len(published) < len(own) and any(".lora_A.weight" in key for key in published)


@pytest.mark.slow  # the 2-rank job, once per kind for all of these
def test_one_update_on_two_sharded_ranks_ends_where_one_process_does(two_ranks: dict[str, Any]) -> None:
    lp, popt, vopt = learner(two_ranks["model"], two_ranks["kind"], sharded=False)
    before = {name: p.detach().clone() for name, p in lp.model.named_parameters() if p.requires_grad}
    metrics = generation_update(lp, popt, vopt, fixed_batch(), CFG, GEN)
    assert metrics["generation/optimizer_steps"] == 4
    for key in ("generation/policy_loss", "generation/value_loss", "generation/entropy", "generation/approx_kl"):
        assert two_ranks["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    after = {name: p.detach() for name, p in lp.model.named_parameters() if p.requires_grad}
    assert list(two_ranks["after"]) == list(after)
    moved = 0
    for name, weight in after.items():
        torch.testing.assert_close(two_ranks["after"][name], weight, atol=1e-5, rtol=0, msg=name)
        moved += int(float((weight - before[name]).abs().max()) > 1e-4)
    assert moved == len(after)  # every trained tensor moved by 10 times the tolerance or more
    for name, weight in lp.token_value_head.state_dict().items():
        torch.testing.assert_close(two_ranks["value_head"][name], weight, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # the 2-rank job, once per kind for all of these
def test_a_candidate_update_on_two_sharded_ranks_ends_where_one_process_does(two_ranks: dict[str, Any]) -> None:
    """The other kind of update: choices among candidates, scored by the packed path (a forward of the shared
    context, then one of the candidates on its cache), micro-batches of one choice, uneven over the ranks."""
    lp, popt, _ = learner(two_ranks["model"], two_ranks["kind"], sharded=False)
    metrics = candidate_update(lp, popt, adam(lp.value_head.parameters(), LR), candidate_rollout(), CANDIDATE_CFG)
    assert metrics["losses/optimizer_steps"] == 4
    for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"):
        assert two_ranks["candidates"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    for name, p in lp.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(two_ranks["after_candidates"][name], p.detach(), atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # the 2-rank job, once per kind for all of these
def test_a_checkpoint_of_two_ranks_resumes_in_one_process_with_no_process_group(two_ranks: dict[str, Any]) -> None:
    """Written by 2 ranks, each its shards; read into plain modules and fresh optimizers here, with no process group
    (DCP reads each tensor's shards from both ranks' files): the weights and both Adam moments exactly."""
    assert not dist.is_initialized()
    lp, popt, vopt = learner(two_ranks["model"], two_ranks["kind"], sharded=False)
    fresh = {name: p.detach().clone() for name, p in lp.model.named_parameters() if p.requires_grad}
    load_sharded(two_ranks["dir"] / "ckpt", {"policy": TrainState(lp.model, popt), "value": TrainState(lp.token_value_head, vopt)})
    for name, p in lp.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), two_ranks["after"][name]), name
            assert not torch.equal(p.detach(), fresh[name]), name  # the checkpoint's, not the weights it was built with
    for name, value in lp.token_value_head.state_dict().items():
        assert torch.equal(value, two_ranks["value_head"][name]), name
    for saved, opt, model in ((two_ranks["moments"], popt, lp.model), (two_ranks["value_moments"], vopt, lp.token_value_head)):
        loaded = adam_state(model, opt)
        assert list(loaded) == list(saved)
        for name, state in saved.items():
            assert set(loaded[name]) == set(state) >= {"exp_avg", "exp_avg_sq", "step"}, name
            for key, value in state.items():
                assert torch.equal(loaded[name][key].cpu(), value.cpu()), (name, key)


def _mixed_precision_job(rank: int, world: int, model_dir: str, out: str) -> None:
    model, _ = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=0, dtype="bfloat16"))
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    block_ids = {id(p) for block in transformer_blocks(model) for p in block.parameters()}
    in_blocks = {name for name, p in model.named_parameters() if id(p) in block_ids}  # FSDP makes new parameters
    shard(model, mixed_precision=True)
    masters = {name: (p.dtype, name in in_blocks) for name, p in model.named_parameters()}
    published = {k: v.clone() for k, v in full_state_chunks(model, policy_names(model))}
    if rank == 0:
        torch.save({"loaded": loaded, "masters": masters, "published": published}, out)


@pytest.mark.slow
def test_mixed_precision_trains_float32_masters_and_publishes_the_loaded_dtype(tiny_models: dict[str, str], tmp_path: Path) -> None:
    """With mixed precision (the GPU setting; it runs on gloo too) the trained block weights become float32
    masters; the whole ones (embedding, final norm) keep the loaded dtype, their masters in the optimizer
    (learner_node/optim.py), so they compute as on the actors. Actors serve the model in the dtype it was loaded
    in: what is published is that dtype, at half the bytes."""
    run_ranks(_mixed_precision_job, tiny_models["qwen2"], str(tmp_path / "mixed.pt"))
    got = torch.load(tmp_path / "mixed.pt")
    assert {dtype for dtype, in_block in got["masters"].values() if in_block} == {torch.float32}
    assert {dtype for dtype, in_block in got["masters"].values() if not in_block} == {torch.bfloat16}
    assert list(got["published"]) == list(got["loaded"])
    for name, weight in got["loaded"].items():
        assert weight.dtype == torch.bfloat16 and got["published"][name].dtype == torch.bfloat16, name
        assert torch.equal(got["published"][name], weight), name


def _adapter_precision_job(rank: int, world: int, model_dir: str, out: str) -> None:
    """A LoRA adapter that is not the identity, on a bfloat16 base: log-probabilities unsharded (as an actor
    computes them) and then sharded with mixed precision (as the learner on a GPU does)."""
    torch.manual_seed(0)
    model, _ = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=4, dtype="bfloat16"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # the same on both ranks: one seed
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    prompts, responses = [[3, 9, 4, 11, 7], [5, 6], [8, 2, 10, 12, 3, 4, 5, 6, 7]], [[4, 5, 6, 7], [9], [3, 3, 8]]
    with torch.no_grad():
        actor, _ = response_logprobs(model, prompts, responses, [1.0, 0.7, 1.0], 64)
        shard(model, mixed_precision=True)
        learner_, _ = response_logprobs(model, prompts, responses, [1.0, 0.7, 1.0], 64)
    adapter = [(type(p).__name__, p.dtype) for p in model.parameters() if p.requires_grad]
    if rank == 0:
        torch.save({"actor": actor, "learner": learner_, "adapter": adapter}, out)


@pytest.mark.slow
def test_a_sharded_adapter_computes_what_the_actors_compute_under_mixed_precision(tiny_models: dict[str, str], tmp_path: Path) -> None:
    """peft keeps the adapter in float32 over a bfloat16 base, and actors run it so. Sharded, FSDP's mixed
    precision would gather it in bfloat16 (it did: log-probabilities off by 0.013 here); it stays whole and
    float32, and the sharded learner's log-probabilities are the unsharded model's."""
    run_ranks(_adapter_precision_job, tiny_models["llama"], str(tmp_path / "adapter.pt"))
    got = torch.load(tmp_path / "adapter.pt")
    worst = max(float((a - b).abs().max()) for a, b in zip(got["actor"], got["learner"]))
    assert worst <= 1e-4, worst
    assert got["adapter"] and set(got["adapter"]) == {("Parameter", torch.float32)}
