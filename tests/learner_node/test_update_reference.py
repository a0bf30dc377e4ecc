"""The token-level PPO update against a naive reference written here, one sample and one token at a time.

`generation_update` packs prompts and responses into rows (position ids restarting per sequence), runs the LM head in
checkpointed chunks, pads every per-token quantity to [B, T], accumulates gradients over micro-batches with
each one's share of the minibatch's loss, and keeps the loss terms in learner_node/core_algos.py. The
reference below shares none of that: one plain `model(input_ids)` forward per sample, Python loops over
tokens for the KL, the per-token rewards, GAE over each chain, the whitening, the clipped and dual-clipped
surrogate, the behaviour weight and the aggregations (docs/design.md, "The token-level objective"), and
autograd on the resulting scalar. With one SGD step for the policy and one for the critic, the post-update
weights must be `p - lr * grad` of that scalar: a mistake in any term, in the micro-batch shares or in the
packing moves them. Every micro-batch budget must give the one-big-batch weights.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from learner_node.config import GenerationConfig, UpdateConfig
from learner_node.policy import LearnerPolicy
from learner_node.token_update import Chain, GenerationBatch, GenerationUpdate, generation_update
from models.policy_model import ModelSpec, load_policy

TOL = 1e-5  # float32 weights after one step, learner vs reference
POLICY_LR = 0.5
VALUE_LR = 0.2
NO_CLIP = 1e9  # max_grad_norm that never clips
CLIP_LOW, CLIP_HIGH, DUAL_C = 0.2, 0.28, 2.0  # clip-higher, and a dual-clip bound the stale tokens reach
WEIGHT_CAP = 2.0  # behaviour_weight_cap: some stale tokens have prox / behaviour above it

# Eight responses, lengths 1 to 64, prompts 1 to 40 tokens (the longest prompt + response: 40 + 64 = 104 tokens).
PROMPT_LENGTHS = [5, 40, 1, 17, 9, 3, 25, 11]
RESPONSE_LENGTHS = [1, 64, 7, 12, 3, 20, 5, 9]
TEMPERATURES = [1.0, 0.7, 1.3, 1.0, 0.7, 1.3, 1.0, 0.7]
LAGS = [0, 2, 0, 1, 3, 0, 1, 0]  # lag > 0: stale, behaviour log-probs not the learner's
REWARDS = [0.4, 1.0, -0.5, -0.3, 2.0, -1.0, 0.7, -0.2]  # GRPO: these are the group-relative advantages
DONES = [False, False, True, False, True, False, True, False]
# (samples, length of the next prompt or None): [0, 1] two turns then a bootstrap; [3, 4] two turns then done;
# [5] bootstraps from a one-token prompt; [2] and [6] end with done; [7] bootstraps.
CHAINS = [([0, 1], 6), ([2], None), ([3, 4], None), ([5], 1), ([6], None), ([7], 13)]


# --- set-up ------------------------------------------------------------------------------------------
def make_policy(path: str) -> LearnerPolicy:
    """A tiny Llama with a rank-4 adapter whose lora_B is no longer 0 (so the policy is not the reference and the
    KL to it is not 0), and a small token value head; the same weights on every call."""
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=path, device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, [8], token_value_hidden=[16])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lp.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return lp


def token_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Naive: one plain forward of prompt + response; position len(prompt) - 1 + j predicts response[j]. Per token:
    log softmax(logits / T)[token] and the entropy of softmax(logits / T), as 0-d tensors (gradients if enabled)."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    picked, entropies = [], []
    for j, token in enumerate(response):
        row = logp_all[len(prompt) - 1 + j]
        picked.append(row[token])
        entropies.append(-(row.exp() * row).sum())
    return picked, entropies


def base_hidden(model: Any, tokens: list[int]) -> torch.Tensor:
    """Naive critic features: the base's (adapter off) last hidden state at every position of `tokens`."""
    with torch.no_grad(), model.disable_adapter():
        return model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0].float()


def make_batch(model: Any, advantage: str) -> GenerationBatch:
    """The batch, by hand: on-policy samples carry the model's own log-probs as behaviour, stale ones those plus a
    deterministic shift of up to +-1.5 nats (ratios prox / behaviour from 0.22 to 4.5: clipped, dual-clipped,
    capped)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 251, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    responses = [torch.randint(3, 251, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    behaviour = []
    for i, (p, r, temp) in enumerate(zip(prompts, responses, TEMPERATURES)):
        with torch.no_grad():
            own = [float(x) for x in token_logprobs(model, p, r, temp)[0]]
        shift = [1.5 * math.sin(1.7 * i + 0.9 * j + 0.3) if LAGS[i] else 0.0 for j in range(len(r))]
        behaviour.append([x + s for x, s in zip(own, shift)])
    chains = [Chain(list(s), None if k is None else torch.randint(3, 251, (k,), generator=g).tolist()) for s, k in CHAINS]
    return GenerationBatch(
        prompts=prompts,
        responses=responses,
        behaviour=behaviour,
        temperatures=list(TEMPERATURES),
        rewards=list(REWARDS),
        dones=list(DONES),
        lags=list(LAGS),
        chains=chains,
    )


@dataclass(frozen=True)
class Case:
    name: str
    advantage: str = "gae"
    kl_in_reward: bool = True
    kl_estimator: str = "k1"
    aggregation: str = "token-mean"
    objective: str = "decoupled"
    budget: int = 4096  # micro_batch_tokens
    max_grad_norm: float = NO_CLIP
    ent_coef: float = 0.01
    kl_coef: float = 0.1
    gamma: float = 0.95
    gae_lambda: float = 0.9
    value_clip: float = 0.5

    def generation(self) -> GenerationConfig:
        return GenerationConfig(
            advantage=self.advantage,
            gamma=self.gamma,
            gae_lambda=self.gae_lambda,
            kl_coef=self.kl_coef,
            kl_in_reward=self.kl_in_reward,
            kl_estimator=self.kl_estimator,
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            clip_ratio_c=DUAL_C,
            loss_aggregation=self.aggregation,
            value_clip=self.value_clip,
            ent_coef=self.ent_coef,
            micro_batch_tokens=self.budget,
        )

    def update(self) -> UpdateConfig:
        # one optimizer step each: every sample in one minibatch, one epoch, no target-KL stop
        return UpdateConfig(
            update_epochs=1,
            policy_minibatch=64,
            value_epochs=1,
            value_minibatch=64,
            target_kl=0.0,
            objective=self.objective,
            behaviour_weight_cap=WEIGHT_CAP,
            vf_coef=0.5,
            max_grad_norm=self.max_grad_norm,
        )


# Budgets: 4096 = one micro-batch and one forward; 128 = several micro-batches of a few samples; 112 = just above
# the longest prompt + response (104); 16 = every sample alone (a longer one gets a row of its own).
CASES = [
    Case("gae-k1-reward-token-mean-decoupled-one-micro-batch"),
    Case("gae-k1-reward-seq-sum-ppo-128", aggregation="seq-mean-token-sum", objective="ppo", budget=128),
    Case("gae-k3-loss-seq-mean-decoupled-16", kl_in_reward=False, kl_estimator="k3", aggregation="seq-mean-token-mean", budget=16),
    Case(
        "gae-k2-loss-token-mean-ppo-112-grad-clipped", kl_in_reward=False, kl_estimator="k2", objective="ppo", budget=112, max_grad_norm=0.1
    ),
    Case(
        "gae-k1-reward-seq-mean-ppo-16-gamma1",
        aggregation="seq-mean-token-mean",
        objective="ppo",
        budget=16,
        gamma=1.0,
        gae_lambda=0.95,
        value_clip=0.0,
    ),
    Case(
        "gae-k3-loss-seq-sum-decoupled-112",
        kl_in_reward=False,
        kl_estimator="k3",
        aggregation="seq-mean-token-sum",
        budget=112,
        ent_coef=0.0,
    ),
    Case("grpo-k3-token-mean-decoupled-128", advantage="grpo", kl_in_reward=False, kl_estimator="k3", budget=128),
    Case(
        "grpo-k3-seq-sum-ppo-16",
        advantage="grpo",
        kl_in_reward=False,
        kl_estimator="k3",
        aggregation="seq-mean-token-sum",
        objective="ppo",
        budget=16,
    ),
]


# --- the naive reference ---------------------------------------------------------------------------------
def kl_token(kind: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref; k2 = (ref - logp)^2 / 2; k3 = exp(ref - logp) - 1 - (ref - logp), its log-ratio clamped
    to +-20 and the estimate to +-10."""
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (ref - logp) ** 2
    log_r = torch.clamp(ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(log_r) - 1.0 - log_r, -10.0, 10.0)


def aggregate(per_sample: list[list[Any]], mode: str) -> Any:
    """token-mean: every token's sum over the number of tokens; seq-mean-token-sum: the mean over responses of each
    one's sum; seq-mean-token-mean: the mean over responses of each one's mean."""
    if mode == "token-mean":
        return sum(sum(s) for s in per_sample) / sum(len(s) for s in per_sample)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in per_sample) / len(per_sample)
    assert mode == "seq-mean-token-mean"
    return sum(sum(s) / len(s) for s in per_sample) / len(per_sample)


def gae_chain(rewards: list[float], values: list[float], dones: list[bool], next_value: float, gamma: float, lam: float) -> list[float]:
    """delta_t = r_t + gamma V_{t+1} (1 - done_t) - V_t;  A_t = delta_t + gamma lam (1 - done_t) A_{t+1}."""
    advantages = [0.0] * len(rewards)
    following, running = next_value, 0.0
    for t in reversed(range(len(rewards))):
        keep = 0.0 if dones[t] else 1.0
        delta = rewards[t] + gamma * following * keep - values[t]
        running = delta + gamma * lam * keep * running
        advantages[t] = running
        following = values[t]
    return advantages


def whiten(per_sample: list[list[float]]) -> list[list[float]]:
    """(A - mean) / (std + 1e-8) over every token of the batch, std with n - 1."""
    flat = [a for s in per_sample for a in s]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1))
    return [[(a - mean) / (std + 1e-8) for a in s] for s in per_sample]


def sgd_step(
    params: list[tuple[str, torch.nn.Parameter]], loss: torch.Tensor, lr: float, max_norm: float
) -> tuple[dict[str, torch.Tensor], float]:
    """p - lr * g, g clipped to a total norm of `max_norm` (scaled by max_norm / (norm + 1e-6) where that is below 1)."""
    grads = torch.autograd.grad(loss, [p for _, p in params])
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = min(1.0, max_norm / (norm + 1e-6))
    return {name: (p - lr * scale * g).detach() for (name, p), g in zip(params, grads)}, norm


@dataclass
class Reference:
    policy: dict[str, torch.Tensor]  # trainable (LoRA) weights after the step
    head: dict[str, torch.Tensor]  # token value head weights after the step
    figures: dict[str, float]
    prox: list[list[float]]
    values: list[list[float]] = field(default_factory=list)
    returns: list[list[float]] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)  # as trained on (whitened with GAE)
    policy_grad_norm: float = 0.0
    dual_clipped: int = 0


def naive_update(lp: LearnerPolicy, batch: GenerationBatch, cfg: UpdateConfig, gen: GenerationConfig) -> Reference:
    """The update, one sample and one token at a time, on `lp` (a copy: its weights are left as they were): the
    critic's step on 0.5 (V - R)^2, then the policy's on aggregate(w L) - ent_coef aggregate(H) (+ kl_coef aggregate(KL)
    with the KL in the loss), each `p - lr * g` by autograd on that one scalar."""
    model, head, n = lp.model, lp.token_value_head, len(batch)
    logp, entropy, ref = [], [], []
    for p, r, temp in zip(batch.prompts, batch.responses, batch.temperatures):
        picked, ents = token_logprobs(model, p, r, temp)  # with gradients
        logp.append(picked)
        entropy.append(ents)
        with torch.no_grad(), model.disable_adapter():
            ref.append([x.detach() for x in token_logprobs(model, p, r, temp)[0]])
    prox = [[float(x.detach()) for x in s] for s in logp]  # the learner's weights at the update's start, no gradient
    figures: dict[str, float] = {}
    out = Reference({}, {}, figures, prox)

    # --- advantages ---
    if gen.advantage == "gae":
        features = [base_hidden(model, p + r)[len(p) - 1 : len(p) - 1 + len(r)] for p, r in zip(batch.prompts, batch.responses)]
        values_grad = [[head(f) for f in feats] for feats in features]  # the head on one feature vector at a time
        values = [[float(v.detach()) for v in s] for s in values_grad]
        rewards = []
        for i in range(n):
            tokens = []
            for j in range(len(batch.responses[i])):
                k = float(kl_token(gen.kl_estimator, torch.tensor(prox[i][j]), ref[i][j])) if gen.kl_in_reward else 0.0
                tokens.append(-gen.kl_coef * k + (batch.rewards[i] if j == len(batch.responses[i]) - 1 else 0.0))
            rewards.append(tokens)
        raw = [[0.0] * len(r) for r in batch.responses]
        for chain in batch.chains:
            order = [(i, j) for i in chain.samples for j in range(len(batch.responses[i]))]
            done = [batch.dones[i] and j == len(batch.responses[i]) - 1 for i, j in order]
            next_value = float(head(base_hidden(model, chain.next_prompt)[-1]).detach()) if chain.next_prompt is not None else 0.0
            adv = gae_chain(
                [rewards[i][j] for i, j in order], [values[i][j] for i, j in order], done, next_value, gen.gamma, gen.gae_lambda
            )
            for (i, j), a in zip(order, adv):
                raw[i][j] = a
        returns = [[a + v for a, v in zip(sa, sv)] for sa, sv in zip(raw, values)]
        advantages = whiten(raw)
        out.values, out.returns = values, returns

        # --- the critic: 0.5 (V - R)^2, or the larger of it and the value clipped around the old value ---
        # (one critic step: V is V_old when the gradient is taken, so the clip cannot bind here; it is written out anyway)
        def critic(i: int, j: int) -> torch.Tensor:
            v, old, ret = values_grad[i][j], values[i][j], returns[i][j]
            loss = 0.5 * (v - ret) ** 2
            if gen.value_clip > 0:
                loss = torch.maximum(loss, 0.5 * (old + torch.clamp(v - old, -gen.value_clip, gen.value_clip) - ret) ** 2)
            return loss

        value_loss = aggregate([[critic(i, j) for j in range(len(r))] for i, r in enumerate(batch.responses)], gen.loss_aggregation)
        figures["value_loss"] = float(value_loss.detach())
        out.head, _ = sgd_step(list(head.named_parameters()), cfg.vf_coef * value_loss, VALUE_LR, cfg.max_grad_norm)
    else:  # GRPO: the response's reward is every token's advantage, as given
        advantages = [[batch.rewards[i]] * len(r) for i, r in enumerate(batch.responses)]
    out.advantages = advantages

    # --- the policy ---
    decoupled = cfg.objective == "decoupled"
    surrogate, weights, capped, clipped, dual, kls = [], [], [], [], [], []
    for i in range(n):
        s_sur, s_kl = [], []
        for j in range(len(batch.responses[i])):
            a, mu = advantages[i][j], batch.behaviour[i][j]
            old = prox[i][j] if decoupled else mu
            raw_w = math.exp(prox[i][j] - mu) if decoupled else 1.0
            w = min(raw_w, cfg.behaviour_weight_cap) if decoupled else 1.0
            ratio = torch.exp(torch.clamp(logp[i][j] - old, -20.0, 20.0))
            unclipped = -a * ratio
            clipped_term = -a * torch.clamp(ratio, 1 - gen.clip_low, 1 + gen.clip_high)
            loss = torch.maximum(unclipped, clipped_term)
            clipped.append(float(clipped_term.detach()) > float(unclipped.detach()))
            if a < 0:
                dual.append(float(loss.detach()) > -a * gen.clip_ratio_c)
                loss = torch.minimum(loss, torch.tensor(-a * gen.clip_ratio_c))
            else:
                dual.append(False)
            s_sur.append(w * loss)
            s_kl.append(kl_token(gen.kl_estimator, logp[i][j], ref[i][j]))
            weights.append(w)
            capped.append(raw_w > cfg.behaviour_weight_cap)
        surrogate.append(s_sur)
        kls.append(s_kl)
    policy_loss = aggregate(surrogate, gen.loss_aggregation)
    entropy_term = aggregate(entropy, gen.loss_aggregation)
    kl_term = aggregate(kls, gen.loss_aggregation)
    loss = policy_loss - gen.ent_coef * entropy_term
    if not gen.kl_in_reward:
        loss = loss + gen.kl_coef * kl_term
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    out.policy, out.policy_grad_norm = sgd_step(params, loss, POLICY_LR, cfg.max_grad_norm)
    tokens = len(weights)
    figures.update(
        policy_loss=float(policy_loss.detach()),
        entropy=float(entropy_term.detach()),
        kl_ref=float(kl_term.detach()),
        clipfrac=sum(clipped) / tokens,
        dual_clipfrac=sum(dual) / tokens,
        behaviour_weight=sum(weights) / tokens,
        behaviour_weight_capped=sum(capped) / tokens,
    )
    out.dual_clipped = sum(dual)
    return out


# --- the tests ---------------------------------------------------------------------------------------
def trainable(lp: LearnerPolicy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in lp.model.named_parameters() if p.requires_grad}


def head_state(lp: LearnerPolicy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in lp.token_value_head.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rows(x: torch.Tensor, sizes: list[int]) -> list[list[float]]:
    return [x[i, :n].tolist() for i, n in enumerate(sizes)]


def close(got: list[list[float]], want: list[list[float]]) -> float:
    """The largest |got - want| over every token (and the same shape)."""
    assert [len(s) for s in got] == [len(s) for s in want]
    return max(abs(g - w) for sg, sw in zip(got, want) for g, w in zip(sg, sw))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_update_equals_the_naive_per_token_reference(tiny_models, case: Case) -> None:
    """One policy step and one critic step through `generation_update` land on the weights the naive reference's
    autograd gives, whatever the micro-batch budget; its loss figures are the reference's."""
    lp = make_policy(tiny_models["llama"])
    batch = make_batch(lp.model, case.advantage)
    gen, cfg = case.generation(), case.update()
    policy_before, head_before = trainable(lp), head_state(lp)
    want = naive_update(copy.deepcopy(lp), batch, cfg, gen)

    # What the update trains towards, before it trains: the packed forwards' proximal log-probs, the critic's
    # values on the base's features (hidden_states[-1] here, the decoder's last_hidden_state there), returns and
    # the advantages as trained on. A failure here says which part of the targets is off.
    sizes = [len(r) for r in batch.responses]
    targets = GenerationUpdate(lp, batch, gen).targets({})
    assert close(rows(targets.prox_logp, sizes), want.prox) < TOL
    assert close(rows(targets.advantages, sizes), want.advantages) < TOL
    if case.advantage == "gae":
        assert close(rows(targets.old_values, sizes), want.values) < TOL
        assert close(rows(targets.returns, sizes), want.returns) < TOL
    else:
        assert targets.returns is None

    metrics = generation_update(
        lp,
        torch.optim.SGD(lp.trainable_parameters(), lr=POLICY_LR),
        torch.optim.SGD(lp.token_value_head.parameters(), lr=VALUE_LR),
        batch,
        cfg,
        gen,
    )

    assert metrics["generation/optimizer_steps"] == 1.0
    assert metrics["generation/on_policy_logprob_dev"] < TOL  # the naive forward is the packed one on the identity case
    # the step moved the weights by far more than the tolerance, and to where the reference's gradient says
    assert max_diff(trainable(lp), policy_before) > 100 * TOL
    assert max_diff(trainable(lp), want.policy) < TOL
    if case.max_grad_norm != NO_CLIP:
        assert want.policy_grad_norm > 2 * case.max_grad_norm  # the clipping did bind
    for key in ("policy_loss", "entropy", "kl_ref", "clipfrac", "dual_clipfrac", "behaviour_weight", "behaviour_weight_capped"):
        assert metrics[f"generation/{key}"] == pytest.approx(want.figures[key], rel=1e-5, abs=1e-6), key
    if case.objective == "ppo":
        assert want.dual_clipped > 0  # stale tokens with A < 0 and a ratio above DUAL_C: the dual clip binds
    else:
        assert want.figures["behaviour_weight_capped"] > 0  # and the decoupled weight's cap binds
    if case.advantage == "gae":
        assert max_diff(head_state(lp), head_before) > 100 * TOL
        assert max_diff(head_state(lp), want.head) < TOL
        assert metrics["generation/value_loss"] == pytest.approx(want.figures["value_loss"], rel=1e-5, abs=1e-6)
    else:  # GRPO: no critic
        assert "generation/value_loss" not in metrics
        assert max_diff(head_state(lp), head_before) == 0.0


def test_critic_advantages_on_hand_computed_vectors(tiny_models) -> None:
    """GAE over a chain of two responses that bootstraps from its next prompt, and over a one-token response ended by
    `done`, with a critic that says 0.5 everywhere: the numbers are worked out by hand below. The done response is
    given a next prompt too, to show that `done` cuts the bootstrap (nothing is valued after an episode's end)."""
    torch.manual_seed(0)
    model, tok = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, [8], token_value_hidden=[16])
    with torch.no_grad():  # V = 0.5 whatever the features: every weight 0, the last layer's bias 0.5
        for p in lp.token_value_head.parameters():
            p.zero_()
        lp.token_value_head.net[-1].bias.fill_(0.5)
    batch = GenerationBatch(
        prompts=[[5, 6, 7], [8], [9, 10]],
        responses=[[11, 12], [13], [14]],
        behaviour=[[-1.0, -1.0], [-1.0], [-1.0]],
        temperatures=[1.0, 0.7, 1.3],
        rewards=[1.0, 2.0, -1.0],
        dones=[False, False, True],
        lags=[0, 0, 0],
        chains=[Chain([0, 1], [15, 16]), Chain([2], [17])],
    )
    gen = GenerationConfig(gamma=0.9, gae_lambda=0.8, kl_coef=0.0)  # no KL in the rewards: r_t is the score alone
    targets = GenerationUpdate(lp, batch, gen).targets({})
    # gamma = 0.9, gamma * lambda = 0.72, V = 0.5 everywhere.
    # Chain [0, 1]: tokens t0 (sample 0, r 0), t1 (sample 0's last, r 1), t2 (sample 1, r 2), then V(next prompt) = 0.5
    #   delta2 = 2 + 0.9 * 0.5 - 0.5 = 1.95                        A2 = 1.95
    #   delta1 = 1 + 0.9 * 0.5 - 0.5 = 0.95                        A1 = 0.95 + 0.72 * 1.95 = 2.354
    #   delta0 = 0 + 0.9 * 0.5 - 0.5 = -0.05                       A0 = -0.05 + 0.72 * 2.354 = 1.64488
    # Chain [2]: done on its one token: delta = -1 + 0.9 * 0.5 * 0 - 0.5 = -1.5   A3 = -1.5
    #   (had the next prompt bootstrapped it: -1 + 0.45 - 0.5 = -1.05)
    # Returns = A + V: 2.14488, 2.854, 2.45, -1.0
    raw = [1.64488, 2.354, 1.95, -1.5]
    # Whitened over the 4 tokens: mean = 4.44888 / 4 = 1.11222; deviations 0.53266, 1.24178, 0.83778, -2.61222;
    # squares 0.283727, 1.542018, 0.701875, 6.823693, sum 9.351313, / (4 - 1) = 3.117104, std = 1.765532
    # -> 0.301699, 0.703346, 0.474520, -1.479565
    whitened = [0.301699, 0.703346, 0.474520, -1.479565]
    assert sum(raw) / 4 == pytest.approx(1.11222) and math.sqrt(sum((a - 1.11222) ** 2 for a in raw) / 3) == pytest.approx(
        1.765532, abs=1e-6
    )
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    assert torch.equal(targets.mask, mask)
    assert targets.old_values is not None and targets.returns is not None
    torch.testing.assert_close(targets.old_values, 0.5 * mask)
    torch.testing.assert_close(targets.returns, torch.tensor([[2.14488, 2.854], [2.45, 0.0], [-1.0, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        targets.advantages, torch.tensor([[whitened[0], whitened[1]], [whitened[2], 0.0], [whitened[3], 0.0]]), atol=1e-5, rtol=0
    )
