"""The learner's configuration (TOML table [learner], or flags of `ppoz learner`; the shared [policy] and [store] tables)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check, curve_allowed_keys, curve_key_pair, local_path, nested, option, section
from common.options import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, OBJECTIVES, POLICY_LOSSES
from common.security import check_server_settings, is_local_endpoint
from common.shared_settings import PolicySpec, StoreSettings


def check_policy_loss(name: str, option_name: str) -> None:
    check(name in POLICY_LOSSES, f"`{option_name}` must be one of {', '.join(POLICY_LOSSES)}, got {name!r}")


@dataclass(kw_only=True)
class UpdateConfig:
    """The settings of one PPO update (learner_node/update.py). The learner's config extends it:
    a [learner] table or `ppoz learner` flags set them, and tests build one alone."""

    update_epochs: int = option(2, "policy passes over each rollout")
    policy_minibatch: int = option(16, "transitions per policy optimizer step")
    micro_batch: int = option(4, "transitions per forward/backward (gradient accumulation up to policy_minibatch)")
    value_minibatch: int = option(32, "transitions per critic optimizer step")
    clip_coef: float = option(0.2, "PPO ratio clipping")
    policy_loss: str = option(
        "clipped", "candidate choices' policy loss: clipped (PPO's surrogate) or dual-clip (without a bound here: the same)"
    )
    objective: str = option(
        "decoupled",
        "decoupled: clip against the learner's weights at the update's start, weight stale samples by "
        "min(prox/behaviour, behaviour_weight_cap) (docs/design.md); ppo: clip against the behaviour policy",
    )
    behaviour_weight_cap: float = option(5.0, "decoupled: cap of the importance weight prox/behaviour (truncated IS)")
    value_epochs: int = option(8, "critic passes over each rollout (on cached features: no model forward)")
    value_clip: float = option(0.0, "value clipping around the old values, in return units (0: off)")
    ent_coef: float = option(0.01, "entropy bonus coefficient")
    vf_coef: float = option(1.0, "value loss scale (the critic has its own optimizer: this only scales its step)")
    kl_coef: float = option(0.0, "coefficient of the KL penalty to the reference policy (the base, adapter off)")
    target_kl: float = option(0.02, "stop an update's policy epochs once approx KL to the proximal policy exceeds this (0: never)")
    max_grad_norm: float = option(0.5, "gradient clipping norm")
    seed: int = option(0, "random seed (model initialisation; minibatch permutations, fresh every update)")

    def __post_init__(self) -> None:
        check(self.objective in OBJECTIVES, f"`objective` must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        check_policy_loss(self.policy_loss, "policy_loss")
        check(self.behaviour_weight_cap >= 1, f"`behaviour_weight_cap` must be at least 1, got {self.behaviour_weight_cap}")
        for name in ("update_epochs", "value_epochs", "policy_minibatch", "micro_batch", "value_minibatch"):
            check(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        for name in ("clip_coef", "max_grad_norm"):
            check(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        for name in ("value_clip", "ent_coef", "vf_coef", "kl_coef", "target_kl"):  # None (tests) reads as 0: off
            check((getattr(self, name) or 0) >= 0, f"`{name}` must be 0 or more, got {getattr(self, name)}")


@section("generation")
@dataclass(kw_only=True)
class GenerationConfig:
    """token-level PPO on generated responses (generate transitions)"""

    advantage: str = option(
        "gae",
        "gae: a token critic and GAE; grpo or rloo: no critic, each response's reward is its group-relative advantage,"
        " computed by the drivers over the rollout_n responses to one prompt (`ppoz train`; docs/train.md)",
    )
    grpo_scale_by_std: bool = option(
        True, "grpo: divide by the group's reward std (verl's norm_adv_by_std_in_grpo; off: Dr. GRPO's centring only)"
    )
    gamma: float = option(1.0, "discount per response token")
    gae_lambda: float = option(0.95, "GAE lambda over response tokens")
    kl_coef: float = option(0.001, "coefficient of the KL to the reference (the base, adapter off), per token")
    kl_in_reward: bool = option(True, "the KL penalty goes into each token's reward (InstructGPT); off: into the loss")
    kl_estimator: str = option(
        "k1",
        "per-token KL estimator: k1 (log ratio), k2 (half its square) or k3 ((r - 1) - log r); in the loss (kl_in_reward"
        " off) k2 or k3: the gradient of k1 is the score function, zero in expectation",
    )
    clip_low: float = option(0.2, "the ratio may fall to 1 - clip_low")
    clip_high: float = option(0.2, "the ratio may rise to 1 + clip_high (above clip_low: DAPO's clip-higher)")
    clip_ratio_c: float = option(3.0, "dual clip: a token with a negative advantage loses at most clip_ratio_c * |A|")
    policy_loss: str = option("dual-clip", "generated responses' policy loss: dual-clip (bounded by clip_ratio_c) or clipped")
    loss_aggregation: str = option("token-mean", "token-mean, seq-mean-token-sum or seq-mean-token-mean")
    value_clip: float = option(0.5, "value clipping around the old token values (0: off)")
    value_huber_delta: float = option(0.0, "Huber value loss with this delta (0: squared error)")
    ent_coef: float = option(0.0, "entropy bonus per token (over the whole vocabulary)")
    micro_batch_tokens: int = option(8192, "most tokens (prompts and responses packed in one row) per forward")
    value_hidden: list = option([256], "hidden layer sizes of the per-token value head MLP (on the frozen base's features)")

    def __post_init__(self) -> None:
        check(0 < self.gamma <= 1, f"`gamma` must be in (0, 1], got {self.gamma}")
        check(0 <= self.gae_lambda <= 1, f"`gae_lambda` must be in [0, 1], got {self.gae_lambda}")
        check(
            self.advantage in ADVANTAGE_ESTIMATORS,
            f"`advantage` must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {self.advantage!r}",
        )
        check(
            self.advantage == "gae" or not self.kl_in_reward or self.kl_coef == 0,
            f"`advantage` {self.advantage} takes the KL to the reference in the loss, as GRPO does (the drivers turn rewards"
            f" into advantages before the learner sees them): set kl_in_reward = false (with kl_estimator k3), or kl_coef = 0;"
            f" `ppoz train --advantage {self.advantage}` sets both",
        )
        check(self.kl_estimator in KL_ESTIMATORS, f"`kl_estimator` must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        check(
            self.loss_aggregation in LOSS_AGGREGATIONS,
            f"`loss_aggregation` must be one of {', '.join(LOSS_AGGREGATIONS)}, got {self.loss_aggregation!r}",
        )
        check(
            self.kl_in_reward or self.kl_estimator != "k1" or self.kl_coef == 0,
            "`kl_estimator` k1 in the loss (kl_in_reward off) pulls nothing towards the reference: its gradient is the"
            " score function, zero in expectation over sampled tokens; use k2 or k3 there (or keep kl_in_reward)",
        )
        check(0 < self.clip_low < 1, f"`clip_low` must be in (0, 1), got {self.clip_low}")
        check(self.clip_high > 0, f"`clip_high` must be positive, got {self.clip_high}")
        check(self.clip_ratio_c > 1, f"`clip_ratio_c` must be above 1, got {self.clip_ratio_c}")
        check_policy_loss(self.policy_loss, "policy_loss")
        for name in ("kl_coef", "value_clip", "value_huber_delta", "ent_coef"):
            check(getattr(self, name) >= 0, f"`{name}` must be 0 or more, got {getattr(self, name)}")
        check(self.micro_batch_tokens >= 16, f"`micro_batch_tokens` must be at least 16, got {self.micro_batch_tokens}")
        check(
            all(isinstance(h, int) and h > 0 for h in self.value_hidden), f"`value_hidden` must be positive ints, got {self.value_hidden}"
        )


PARALLELISMS = ("auto", "ddp", "fsdp")
FSDP_FROM_PARAMETERS = 1_000_000_000  # parallelism auto, all weights trained: Adam's moments alone are then 8 GB a rank


@section("learner")
@dataclass(kw_only=True)
class LearnerConfig(UpdateConfig):
    # --- the policy: the [policy] table the actors read too; the device is this process's own ---
    policy: PolicySpec = nested(PolicySpec)  # [policy]: model, LoRA, dtype, normalisation, temperature, scoring path
    generation: GenerationConfig = nested(GenerationConfig, "gen_")  # [generation]: token-level PPO on generate transitions
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:N")
    parallelism: str = option(
        "auto",
        "with several ranks (torchrun, accelerate launch): ddp (every rank holds the whole model, gradients averaged),"
        " fsdp (FSDP2: each rank holds 1/N of every transformer block's weights, gradients and Adam moments; bf16 compute"
        " on GPU) or auto (fsdp when all weights of a model of 1B parameters or more are trained, unless resuming a ddp checkpoint;"
        " else ddp); one rank: ignored",
    )
    # --- data ---
    store: StoreSettings = nested(StoreSettings)  # [store]: the Redis of the segment stream (its URL required here)
    consumer: str = option("learner-0", "this learner's consumer name; keep it across restarts so its pending segments come back to it")
    claim_idle_ms: int = option(60_000, "segments left pending this long by another (dead) consumer are taken over")
    rollout_batch: int = option(64, "transitions per update")
    rollout_timeout_s: float = option(
        0.0,
        "train on the transitions in hand once a rollout has waited this long (0: always wait for rollout_batch)",
    )
    max_policy_lag: int = option(
        8,
        "transitions from a behaviour policy more than this many versions old are dropped and counted; "
        "younger stale ones are trained on, corrected by the decoupled objective",
    )
    # --- algorithm ---
    gamma: float = option(0.99, "discount factor")
    gae_lambda: float = option(0.95, "GAE lambda")
    kl_target: float = option(0.0, "if > 0, adapt kl_coef towards this KL to the reference (Ziegler et al.)")
    policy_lr: float = option(
        0.0,
        "policy learning rate; 0: by the model and adapter: 1e-5 with LoRA on all linear layers (about 10x a full "
        "fine-tune's), 1e-6 with --lora-rank 0; a random tiny model (`ppoz tiny-model`) 3e-4 either way",
    )
    value_lr: float = option(1e-3, "critic (value head MLP) learning rate")
    max_discarded_updates: int = option(
        3, "the learner stops after this many updates in a row were left out because a loss, gradient or weight was not finite"
    )
    warmup_updates: int = option(0, "first updates train only the critic (with GRPO, which has none: nothing)")
    value_hidden: list = option([1024, 512], "hidden layer sizes of the value head MLP")
    gradient_checkpointing: str = option(
        "auto",
        "recompute each decoder layer's activations in the backward pass of the policy update, for generated responses "
        "and choices among candidates alike (less memory for long responses and prompts, about a third more compute): "
        "on, off, or auto (on where the learner runs on a GPU)",
    )
    # --- checkpoints, publication, logs ---
    checkpoint_dir: str = option("runs/learner/checkpoints", "where checkpoints go", path=local_path)
    keep_checkpoints: int = option(3, "checkpoints kept")
    checkpoint_every: int = option(
        1,
        "a checkpoint is begun after an update once this many updates have passed since the last one began, or"
        " checkpoint_every_s, whichever comes first, and the one before is on disk: it is copied, then written while"
        " training goes on, and the stream entries it holds are acknowledged once it is (0: by time alone)",
    )
    checkpoint_every_s: float = option(
        0.0, "seconds after which a checkpoint is begun whatever the updates (0: by updates alone); see checkpoint_every"
    )
    resume: bool = option(False, "restore the newest checkpoint and go on from it")
    weights_bind: str = option("tcp://127.0.0.1:5557", "endpoint the learner binds to announce new weights (PUB)")
    weights_serve: str = option(
        "",
        "endpoint the learner binds to serve its weight snapshots' chunks to actors on other hosts (the actors' "
        "weights_source), e.g. tcp://*:5558; each host fetches a version once (empty: off)",
    )
    curve_secret_key: str = curve_key_pair("the learner's", " for the weight PUB; empty: no encryption (docs/security.md)")
    curve_allowed_actors: str = curve_allowed_keys("actors allowed to subscribe")
    tensorboard_dir: str = option("runs/learner/tb", "TensorBoard log directory (empty: off)", path=local_path)
    max_updates: int = option(0, "stop after this many updates (0: run until stopped)")
    read_block_ms: int = option(1000, "longest a read of the stream blocks")

    def resolved_policy_lr(self) -> float:
        """`policy_lr`, or the model's default when it is 0."""
        from models.tiny_models import default_policy_lr

        return self.policy_lr or default_policy_lr(self.policy.model, self.policy.lora_rank)

    def checkpoints_layers(self, device: str) -> bool:
        """Whether the learner on `device` (a resolved torch device) recomputes layers in the backward pass."""
        return self.gradient_checkpointing == "on" or (self.gradient_checkpointing == "auto" and device.startswith("cuda"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.policy.model != "", "`model` is required: a local directory or a Hugging Face id ([policy] model, or --model)")
        check(self.store.redis_url != "", "`redis_url` is required: the Redis the broker writes segments to")
        check(self.rollout_batch > 0, f"`rollout_batch` must be positive, got {self.rollout_batch}")
        check(self.rollout_timeout_s >= 0, f"`rollout_timeout_s` must be 0 or more, got {self.rollout_timeout_s}")
        check(self.max_policy_lag >= 0, f"`max_policy_lag` must be 0 or more, got {self.max_policy_lag}")
        check(
            self.gradient_checkpointing in ("auto", "on", "off"),
            f"`gradient_checkpointing` must be auto, on or off, got {self.gradient_checkpointing!r}",
        )
        check(0 < self.gamma <= 1, f"`gamma` must be in (0, 1], got {self.gamma}")
        check(0 <= self.gae_lambda <= 1, f"`gae_lambda` must be in [0, 1], got {self.gae_lambda}")
        check(self.policy_lr >= 0, f"`policy_lr` must be 0 (by the model) or positive, got {self.policy_lr}")
        for name in ("keep_checkpoints", "read_block_ms", "value_lr"):
            check(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        check(self.checkpoint_every >= 0, f"`checkpoint_every` must be 0 or more, got {self.checkpoint_every}")
        check(
            0 <= self.checkpoint_every_s < self.claim_idle_ms / 2000,
            f"`checkpoint_every_s` must be 0 or more and below half of claim_idle_ms ({self.claim_idle_ms} ms: the entries a"
            f" checkpoint will hold stay pending until it is written, and another learner takes over entries pending that"
            f" long), got {self.checkpoint_every_s}",
        )
        check(
            self.checkpoint_every > 0 or self.checkpoint_every_s > 0,
            "`checkpoint_every` and `checkpoint_every_s` cannot both be 0: nothing trained would ever be acknowledged",
        )
        for name in ("kl_target", "warmup_updates", "max_updates"):
            check(getattr(self, name) >= 0, f"`{name}` must be 0 or more, got {getattr(self, name)}")
        check(self.max_discarded_updates >= 1, f"`max_discarded_updates` must be at least 1, got {self.max_discarded_updates}")
        check(
            all(isinstance(h, int) and h > 0 for h in self.value_hidden), f"`value_hidden` must be positive ints, got {self.value_hidden}"
        )
        check(self.parallelism in PARALLELISMS, f"`parallelism` must be one of {', '.join(PARALLELISMS)}, got {self.parallelism!r}")
        check("://" in self.weights_bind, f"`weights_bind` must be a ZeroMQ endpoint, got {self.weights_bind!r}")
        check(
            not self.weights_serve or "://" in self.weights_serve, f"`weights_serve` must be a ZeroMQ endpoint, got {self.weights_serve!r}"
        )
        check(
            not self.weights_serve or bool(self.curve_secret_key) or is_local_endpoint(self.weights_serve),
            f"`weights_serve` = {self.weights_serve!r} is reachable from other machines, and without CURVE anyone there could"
            " read the policy's weights: set curve_secret_key and curve_allowed_actors (docs/security.md), or bind a"
            " loopback address",
        )
        check_server_settings(self.curve_secret_key, {"curve_allowed_actors": self.curve_allowed_actors})
