"""Float32 master weights for parameters trained in 16 bits (learner_node/optim.py), against torch's own Adam
on float32 copies: the reference shares none of the code under test."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from learner_node.optim import RESIDUAL, MasterWeightAdam, adam
from learner_node.packed_forward import response_logprobs
from learner_node.sharding import TrainState, load_sharded, save_sharded
from models.policy_model import ModelSpec, load_policy

LR = 1e-6  # a full fine-tune's learning rate: below bfloat16's resolution for every weight of magnitude 2^-10 or more


def bf16_parameter(n: int = 4096, seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter((torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16))


def gradients(n: int, steps: int) -> list[torch.Tensor]:
    """Gradients that keep most signs from step to step, as a policy's do over a few updates."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(n, generator=g)
    return [(base + 0.3 * torch.randn(n, generator=g)).to(torch.bfloat16) for _ in range(steps)]


def master(p: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    residual = opt.state[p].get(RESIDUAL)
    return p.detach().float() + (residual if residual is not None else 0.0)


@pytest.mark.parametrize("fused", [None, True])
def test_bf16_weights_follow_float32_adam_exactly(fused: bool | None) -> None:
    p = bf16_parameter()
    reference = torch.nn.Parameter(p.detach().float().clone())
    opt = MasterWeightAdam([p], lr=LR, eps=1e-5, fused=fused)
    ref_opt = torch.optim.Adam([reference], lr=LR, eps=1e-5, fused=fused)
    start = p.detach().clone()
    for step, grad in enumerate(gradients(p.numel(), 40)):
        before = master(p, opt)
        p.grad, reference.grad = grad.clone(), grad.float()
        opt.step()
        ref_opt.step()
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16  # the model computes in 16 bits still
        assert torch.equal(master(p, opt), reference.detach()), step  # the master is float32 Adam's weight
        assert torch.equal(p.detach(), reference.detach().to(torch.bfloat16)), step  # and the model holds its rounding
        assert float((master(p, opt) != before).float().mean()) > 0.99, step  # nearly every weight moves every step
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert 0.3 < float((p.detach() != start).float().mean())  # 40 steps of 1e-6 have moved many bf16 weights


def test_plain_adam_on_bf16_weights_stands_still_at_a_fine_tunes_rate() -> None:
    # why MasterWeightAdam exists: the same steps with torch's Adam on the 16-bit weights leave nearly all of them
    p = bf16_parameter()
    start = p.detach().clone()
    opt = torch.optim.Adam([p], lr=LR, eps=1e-5)
    for grad in gradients(p.numel(), 40):
        p.grad = grad.clone()
        opt.step()
    assert float((p.detach() != start).float().mean()) < 0.05


def test_adam_picks_master_weights_for_16_bit_parameters_only() -> None:
    assert type(adam([torch.nn.Parameter(torch.zeros(3))], 1e-3)) is torch.optim.Adam
    assert type(adam([torch.nn.Parameter(torch.zeros(3)), bf16_parameter(3)], 1e-3)) is MasterWeightAdam
    float32 = torch.nn.Parameter(torch.ones(4))
    half = bf16_parameter(4)
    opt = adam([float32, half], 1e-1)
    float32.grad, half.grad = torch.ones(4), torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert RESIDUAL not in opt.state[float32] and float32.dtype == torch.float32  # stepped as plain Adam steps it
    assert torch.allclose(float32.detach(), torch.full((4,), 0.9))


def test_a_saved_optimizer_resumes_with_its_float32_state(tmp_path: Path) -> None:
    grads = gradients(512, 12)
    p = bf16_parameter(512)
    opt = MasterWeightAdam([p], lr=LR, eps=1e-5)
    for grad in grads[:6]:
        p.grad = grad.clone()
        opt.step()
    torch.save({"p": p.detach(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    for grad in grads[6:]:  # the run goes on ...
        p.grad = grad.clone()
        opt.step()
    resumed = torch.nn.Parameter(saved["p"].clone())  # ... and a resumed one does the same steps
    opt2 = MasterWeightAdam([resumed], lr=LR, eps=1e-5)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[resumed][RESIDUAL].dtype == torch.float32 and opt2.state[resumed]["exp_avg_sq"].dtype == torch.float32
    for grad in grads[6:]:
        resumed.grad = grad.clone()
        opt2.step()
    assert torch.equal(master(resumed, opt2), master(p, opt))


def test_a_dcp_checkpoint_keeps_the_residuals(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 8).to(torch.bfloat16)
    opt = adam(model.parameters(), LR)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt.step()
    want = {name: master(p, opt) for name, p in model.named_parameters()}
    with warnings.catch_warnings():  # one process, no process group: what this test means to do
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        save_sharded(tmp_path / "dcp", {"policy": TrainState(model, opt)})
    fresh = torch.nn.Linear(64, 8).to(torch.bfloat16)
    fresh_opt = adam(fresh.parameters(), LR)
    load_sharded(tmp_path / "dcp", {"policy": TrainState(fresh, fresh_opt)})
    for name, p in fresh.named_parameters():
        assert torch.equal(master(p, fresh_opt), want[name]), name


def test_a_bf16_full_fine_tune_moves_its_master_weights_every_update(tiny_models: dict[str, str]) -> None:
    """All weights of a bfloat16 model (tied embedding and head, norms, blocks) at lr 1e-6: each update moves
    the float32 masters of nearly every weight; torch's Adam on the 16-bit weights moved about 1 in 50."""
    model, _ = load_policy(ModelSpec(model=tiny_models["qwen2"], device="cpu", lora_rank=0, dtype="bfloat16"))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = adam(trained, LR)
    assert isinstance(opt, MasterWeightAdam)
    prompts, responses = [[3, 9, 4, 11, 7], [5, 6], [8, 2, 10, 12]], [[4, 5, 6, 7], [9, 4], [3, 3, 8]]
    for update in range(3):
        before = [master(p, opt) for p in trained]
        logp, _ = response_logprobs(model, prompts, responses, [1.0, 1.0, 1.0], 64)
        (-torch.cat(logp).sum()).backward()
        with_grad = [p.grad is not None and bool((p.grad != 0).any()) for p in trained]
        opt.step()
        opt.zero_grad()
        moved = sum(int((master(p, opt) != b).sum()) for p, b, g in zip(trained, before, with_grad) if g)
        total = sum(p.numel() for p, g in zip(trained, with_grad) if g)
        assert moved / total > 0.9, (update, moved / total)


def test_a_parameter_without_a_gradient_is_left_alone_and_trains_once_it_has_one() -> None:
    # an expert no token was routed to has no gradient this step: no state for it, and no crash when it has one
    a, b = bf16_parameter(4, seed=1), bf16_parameter(4, seed=2)
    opt = adam([a, b], 1e-3)
    b_before = b.detach().clone()
    a.grad = torch.ones_like(a)
    opt.step()
    opt.zero_grad()
    assert RESIDUAL not in opt.state[b] and torch.equal(b.detach(), b_before)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert opt.state[b]["exp_avg"].dtype == torch.float32 and not torch.equal(master(b, opt), b_before.float())


def test_a_trained_16_bit_head_is_never_served_from_a_stale_float32_copy() -> None:
    # torch's fused Adam writes a weight without bumping its version counter: a kept copy would be the old head
    from models.scoring import head_logits

    head = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    opt = adam([head.weight], 1e-2)
    hidden = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        head_logits(head, hidden)
    head_logits(head, hidden).sum().backward()
    opt.step()
    with torch.no_grad():
        assert torch.equal(head_logits(head, hidden), torch.nn.functional.linear(hidden.float(), head.weight.float()))


def test_masters_are_stepped_a_slice_at_a_time_with_the_same_result(monkeypatch) -> None:
    """Six bf16 parameters of 40,000 elements and a float32 one: stepped in slices of 100,000 16-bit elements, the
    float32 masters and gradients alive at once are a slice's (counted by tools/bench/memory_peak.py), and every
    parameter, moment and residual ends as one step over all of them at once leaves it."""
    import learner_node.optim as optim
    from tools.bench.memory_peak import peak_memory

    def run(slice_elements: int) -> tuple[list[torch.Tensor], dict[str, float], int]:
        monkeypatch.setattr(optim, "MASTER_SLICE", slice_elements)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(200, 200).to(torch.bfloat16)) for _ in range(6)]
        params.append(torch.nn.Parameter(torch.randn(50)))
        opt = adam(params, 1e-2)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (-1) ** step)
            peak = peak_memory(opt.step).work
        return [p.detach().clone() for p in params], {str(i): float(master(p, opt).sum()) for i, p in enumerate(params)}, peak

    whole, whole_masters, whole_peak = run(1 << 40)
    sliced, sliced_masters, sliced_peak = run(100_000)
    for a, b in zip(whole, sliced, strict=True):
        assert torch.equal(a, b)
    assert whole_masters == sliced_masters
    float32_of_all = 6 * 40_000 * 4 * 2  # every master and gradient at once
    assert whole_peak >= float32_of_all
    assert sliced_peak <= float32_of_all / 2, f"{sliced_peak} bytes in slices against {whole_peak} at once"


def test_an_update_snapshot_of_gpu_parameters_goes_to_the_host() -> None:
    """A full fine-tune's parameters and Adam moments on a GPU (fake CUDA tensors: FakeTensorMode makes them on a
    CPU-only torch): the copies that undo a non-finite update are made on the host, none on the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from learner_node.undo import TrainableSnapshot
    from tools.bench.memory_peak import peak_memory

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.randn(256, 256, device="cuda")) for _ in range(4)]
        opt = torch.optim.Adam(params, 1e-3)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()  # Adam moments on the GPU
        taken: list[TrainableSnapshot] = []
        gpu = peak_memory(lambda: taken.append(TrainableSnapshot.of([opt])), device="cuda:0")
        snapshot = taken[0]
        assert gpu.work == 0, f"{gpu.work} bytes of the snapshot on the GPU"
        assert all(saved.device.type == "cpu" for _, saved in snapshot.params)
        states = [t for _, state, _ in snapshot.optimizer_states for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert states and all(t.device.type == "cpu" for t in states)


def test_micro_batch_gradients_of_a_16_bit_parameter_are_summed_in_float32() -> None:
    """32 micro-batches each giving a bf16 parameter the gradient 1 + 2^-6 (exact in bf16): the step gets 32.5, their
    float32 sum (learner_node/gradients.py). autograd's own accumulation in bf16 rounds the partial sums (bf16's
    spacing is 2^-6 from 2 on and coarser after), and gives 32.25."""
    from learner_node import gradients
    from learner_node.update import minibatch_epochs

    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = adam([p], 1e-3)
    seen: list[torch.Tensor] = []
    real_step = opt.step
    opt.step = lambda *a, **k: (seen.append(gradients.grad(p).clone()), real_step())[1]  # type: ignore[method-assign]

    def step(ids: list[int], minibatch: list[int], weight: float = 1.0) -> dict[str, float]:
        (p.float().sum() * (1 + 2**-6)).backward()
        return {}

    minibatch_epochs(32, 1, 32, torch.Generator().manual_seed(0), lambda ids: [[i] for i in ids], step, (), [p], opt, 1e9)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], torch.full((4,), 32.5))
    in_bf16 = torch.zeros((), dtype=torch.bfloat16)
    for _ in range(32):
        in_bf16 += torch.tensor(1 + 2**-6, dtype=torch.bfloat16)
    assert float(in_bf16) == 32.25  # what the step got before
    assert getattr(p, gradients.MAIN_GRAD) is None and p.grad is None  # nothing carried into the next step
