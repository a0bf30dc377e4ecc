"""One PPO update on a tiny model: ratio 1 on the first minibatch, learning direction, and 1 vs 2 processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.segments import CandidateObservation
from learner_node.config import UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.rollout import build_rollout, candidate_update
from models.policy_model import ModelSpec, load_policy
from tests.learner_node.helpers import BANDIT, on_policy_segments
from tests.processes import free_port


def make(path: str, lora_rank: int = 4, lr: float = 1e-2):
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=path, device="cpu", lora_rank=lora_rank))
    lp = LearnerPolicy(model, tok, "token", 1.0, [32, 16])
    return lp, torch.optim.Adam(lp.trainable_parameters(), lr=lr), torch.optim.Adam(lp.value_head.parameters(), lr=1e-3)


def rollout_for(lp: LearnerPolicy, n: int = 16):
    segments = on_policy_segments(lp.model, lp.tokenizer, n)

    def value_of(observations):
        return lp.values(observations)[1].tolist()

    return build_rollout(segments, value_of, 0.99, 0.95, current_version=0, max_policy_lag=0)


def green_prob(lp: LearnerPolicy) -> float:
    with torch.no_grad():
        return float(lp.logp_all([lp.tokenize(CandidateObservation.from_wire(BANDIT))])[0][1].exp())


def test_ratio_is_one_on_the_first_minibatch_and_the_update_moves_towards_reward(tiny_models):
    lp, popt, vopt = make(tiny_models["llama"])
    rollout = rollout_for(lp)
    assert 0 < sum(a == 1 for a in rollout.actions) < len(rollout)  # both rewarded and unrewarded samples
    before = green_prob(lp)
    metrics = candidate_update(lp, popt, vopt, rollout, UpdateConfig(update_epochs=2, policy_minibatch=8, micro_batch=4, target_kl=None))
    assert metrics["losses/on_policy_logprob_dev"] < 1e-4  # the learner recomputes exactly what the actor sampled from
    assert metrics["losses/optimizer_steps"] == 4
    assert green_prob(lp) > before
    for key in (
        "losses/policy_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/approx_kl",
        "losses/clipfrac",
        "losses/explained_variance",
        "losses/kl_ref",
    ):
        assert key in metrics


def test_target_kl_stops_after_a_full_optimizer_step(tiny_models):
    lp, popt, vopt = make(tiny_models["llama"], lr=0.2)
    metrics = candidate_update(
        lp, popt, vopt, rollout_for(lp), UpdateConfig(update_epochs=4, policy_minibatch=4, micro_batch=2, target_kl=1e-6)
    )
    assert metrics["losses/early_stop"] == 1.0
    # The first minibatch sees ratio 1 (KL 0); the second sees the first step's change, exceeds the
    # target and stops the update after its own step is applied (of 4 epochs x 4 minibatches).
    assert metrics["losses/optimizer_steps"] == 2


def test_warmup_trains_only_the_critic(tiny_models):
    lp, popt, vopt = make(tiny_models["llama"])
    rollout = rollout_for(lp)
    policy_before = [p.detach().clone() for p in lp.trainable_parameters()]
    head_before = [p.detach().clone() for p in lp.value_head.parameters()]
    metrics = candidate_update(lp, popt, vopt, rollout, UpdateConfig(), train_policy=False)
    assert "losses/policy_loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(policy_before, lp.trainable_parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(head_before, lp.value_head.parameters()))


def _rank_update(rank: int, world: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        lp, popt, vopt = make(path)
        candidate_update(lp, popt, vopt, rollout_for(lp), UpdateConfig(update_epochs=2, policy_minibatch=8, micro_batch=2, target_kl=None))
        if rank == 0:
            torch.save([p.detach() for p in lp.trainable_parameters()] + [p.detach() for p in lp.value_head.parameters()], out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_end_an_update_like_one(tiny_models, tmp_path):
    out = str(tmp_path / "two.pt")
    mp.spawn(_rank_update, args=(2, free_port(), tiny_models["llama"], out), nprocs=2, join=True)
    two = torch.load(out)
    lp, popt, vopt = make(tiny_models["llama"])
    candidate_update(lp, popt, vopt, rollout_for(lp), UpdateConfig(update_epochs=2, policy_minibatch=8, micro_batch=2, target_kl=None))
    one = [p.detach() for p in lp.trainable_parameters()] + [p.detach() for p in lp.value_head.parameters()]
    assert len(one) == len(two)
    for a, b in zip(one, two):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
