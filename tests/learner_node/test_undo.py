"""The undo snapshot (learner_node/undo.py): what it holds where, and what restoring it writes back.

A sharded full fine-tune's snapshot must keep no copy of its shards on the GPU (7B on 4 ranks: 20 GB a rank), and
restoring must write the values back into the tensors the model and optimizer hold (a DTensor stays a DTensor with
its sharding; no second set of moments on the GPU), dropping what the update created."""

from __future__ import annotations

import torch

from learner_node.optim import adam
from learner_node.undo import TrainableSnapshot


def _stepped(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad: float) -> None:
    for p in params:
        p.grad = torch.full_like(p, grad)
    opt.step()
    opt.zero_grad()


def test_a_sharded_snapshot_keeps_no_shard_on_the_gpu() -> None:
    """Rank 0 of 2 (fake tensors and collectives, the CPU standing for the GPU: tools/bench/meta_trace.py, in a
    process of its own as it asks): a sharded layer and its Adam moments are copied to the host (meta here, so that
    it is not counted), none on the GPU. Cloned where they are, the copies would be 3 shards' bytes: weight, two
    moments."""
    from tools.bench.memory_sharded import in_own_process

    work, device, shape = in_own_process(sharded_snapshot)
    assert work == 0, f"{work} bytes of the snapshot on the GPU"
    assert device == "meta" and shape == (128, 256)  # the rank's shard, not the whole weight


def sharded_snapshot() -> tuple[int, str, tuple[int, ...]]:
    """(bytes the snapshot adds on the GPU, where its weight copy is, its shape)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tools.bench.memory_peak import peak_memory
    from tools.bench.meta_trace import fake_ranks

    with fake_ranks(2) as mesh:
        layer = fully_shard(torch.nn.Linear(256, 256, bias=False), mesh=mesh)
        params = list(layer.parameters())
        assert isinstance(params[0], DTensor) and params[0].to_local().shape == (128, 256)
        opt = adam(params, 1e-3)
        _stepped(opt, params, 1.0)
        taken: list[TrainableSnapshot] = []
        gpu = peak_memory(lambda: taken.append(TrainableSnapshot.of([opt])), device="cpu")
        (saved,) = [t for _, t in taken[0].params]
        return gpu.work, saved.device.type, tuple(saved.shape)


def test_restoring_writes_back_into_the_same_tensors_and_drops_what_the_update_made() -> None:
    """A bf16 parameter under MasterWeightAdam (its float32 residual is optimizer state) and a float32 one that had
    no state before the update: after three steps are undone, the weights, moments, step counts and residual are
    exactly as before, in the very tensors the optimizer held, and the state the update created is gone."""
    stepped = torch.nn.Parameter(torch.linspace(-1, 1, 64, dtype=torch.bfloat16))
    fresh = torch.nn.Parameter(torch.linspace(0, 2, 32))
    opt = adam([stepped, fresh], 1e-2)
    stepped.grad = torch.full_like(stepped, 0.3)
    opt.step()  # `stepped` has moments, a step count and a residual; `fresh` (no gradient) has no state yet
    opt.zero_grad()
    before = {k: v.clone() for k, v in opt.state[stepped].items()}
    tensors = {k: id(v) for k, v in opt.state[stepped].items()}
    weights = (stepped.detach().clone(), fresh.detach().clone())
    snapshot = TrainableSnapshot.of([opt])
    for grad in (5.0, -7.0, 11.0):
        _stepped(opt, [stepped, fresh], grad)
    assert fresh in opt.state and not torch.equal(stepped.detach(), weights[0])
    opt.param_groups[0]["lr"] = 0.5
    snapshot.restore()
    assert torch.equal(stepped.detach(), weights[0]) and torch.equal(fresh.detach(), weights[1])
    assert fresh not in opt.state, "the state the undone update created is kept"
    assert set(opt.state[stepped]) == set(before)
    for key, value in opt.state[stepped].items():
        assert id(value) == tensors[key], f"{key} was replaced, not written back"
        assert torch.equal(value, before[key]), key
    assert opt.param_groups[0]["lr"] == 1e-2


def test_a_sharded_parameter_and_its_moments_come_back_as_shards() -> None:
    """Rank 0 of 2 on real CPU tensors (collectives fake), taking the GPU's way (copies to the host): after an undone
    step the DTensor weight and moments hold their values from before, in the same DTensors, still sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from learner_node import undo
    from tools.bench.meta_trace import fake_ranks

    with fake_ranks(2, fake_tensors=False) as mesh:
        torch.manual_seed(0)
        layer = fully_shard(torch.nn.Linear(16, 16, bias=False), mesh=mesh)
        (weight,) = layer.parameters()
        opt = adam([weight], 1e-2)
        _stepped(opt, [weight], 1.0)
        before = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in opt.state[weight].items()}
        shard = weight.to_local().clone()
        on_host, undo.UNDO_ON_HOST = undo.UNDO_ON_HOST, (*undo.UNDO_ON_HOST, "cpu")
        try:
            snapshot = TrainableSnapshot.of([opt])
        finally:
            undo.UNDO_ON_HOST = on_host
        assert all(not isinstance(t, DTensor) for _, t in snapshot.params)
        _stepped(opt, [weight], -3.0)
        snapshot.restore()
        assert isinstance(weight, DTensor) and torch.equal(weight.to_local(), shard)
        for key, value in opt.state[weight].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            assert isinstance(value, DTensor) or key == "step"
            assert torch.equal(local, before[key]), key
