"""The learner's trainer: a rollout's segments -> one batch per kind of policy -> the PPO update on each.

The kinds of policy are one list (`PolicyPart`: a `PolicyBatch` of learner_node/update.py, the critic that
trains with it and its loss settings); the update trains each part in turn, candidate choices first, with the
one policy optimizer and the part's own critic. What the batches took and dropped adds up in one
`Intake` (learner_node/intake.py). No Redis, no sockets: the learner (learner_node/worker.py) feeds it segments.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from common.learner_figures import CyclePhase, UpdateFigure
from common.segments import CandidateObservation, Segment
from common.shared_settings import PolicyStamp
from learner_node.config import LearnerConfig
from learner_node.core_algos import AdaptiveKLController
from learner_node.cycle import CycleClock
from learner_node.intake import Intake
from learner_node.optim import adam
from learner_node.policy import LearnerPolicy
from learner_node.rollout import CandidateBatch, EpisodeReturns, Rollout, build_rollout
from learner_node.token_update import GenerationBatch, GenerationUpdate, build_generation_batch, split_by_mode
from learner_node.undo import TrainableSnapshot
from learner_node.update import LossSettings, PolicyBatch, ppo_update
from models import scoring

log = logging.getLogger("learner_node.worker.trainer")  # under the worker's logger, as before the split

UNSCORABLE_LOG_INTERVAL_S = 60.0  # at most one log line this often about next observations the model cannot score


@dataclass
class Critic:
    """A value head and its optimizer; `name` is its optimizer's in a checkpoint."""

    name: str
    head: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.head.parameters())


@dataclass
class PolicyPart:
    """One kind of policy in an update: its batch, the critic trained with it, its loss settings."""

    batch: PolicyBatch
    critic: Critic
    settings: LossSettings
    adapts_kl: bool = False  # its KL to the reference moves the adaptive KL coefficient ([learner] kl_target)


@dataclass
class Batches:
    """A rollout built for the update: the candidate choices, the generated responses, and what they hold."""

    rollout: Rollout
    generated: GenerationBatch
    intake: Intake


class Trainer:
    """The optimizers, the adaptive KL coefficient and the critic's values for GAE; builds and trains batches."""

    def __init__(self, cfg: LearnerConfig, lp: LearnerPolicy, is_main: bool) -> None:
        self.cfg = cfg
        self.lp = lp
        self.is_main = is_main
        policy_lr = cfg.resolved_policy_lr()
        log.info("policy learning rate %g%s", policy_lr, "" if cfg.policy_lr else " (by the model: [learner] policy_lr = 0)")
        self.policy_opt = adam(lp.trainable_parameters(), policy_lr)
        self.critic = Critic("value", lp.value_head, adam(lp.value_head.parameters(), cfg.value_lr))
        self.token_critic = Critic("token_value", lp.token_value_head, adam(lp.token_value_head.parameters(), cfg.value_lr))
        self.kl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target or None)
        self.episodes = EpisodeReturns()  # returns of episodes that span segments and rollouts (not checkpointed)
        self._features: dict[int, torch.Tensor] = {}
        self._unscorable_reason = ""  # why the critic could not score the last observation it could not (`values`)
        self._unscorable_unlogged = 0  # next observations left unscored since the last log line about them
        self._unscorable_logged_at = -math.inf

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimizer by its name in a checkpoint."""
        return {"policy": self.policy_opt, **{c.name: c.optimizer for c in (self.critic, self.token_critic)}}

    def snapshot(self) -> TrainableSnapshot:
        """What an update changes, to undo a non-finite one whole."""
        return TrainableSnapshot.of(list(self.optimizers.values()))

    def build(self, segments: list[Segment], version: int, stamp: PolicyStamp) -> Batches:
        """The batches of one rollout's segments: GAE, the lag bound and the stamp checks (rollout.py, token_update.py)."""
        scoring_segments, generate_segments = split_by_mode(segments)
        rollout = build_rollout(
            scoring_segments, self.values, self.cfg.gamma, self.cfg.gae_lambda, version, self.cfg.max_policy_lag, self.episodes, stamp
        )
        generated = build_generation_batch(
            generate_segments, version, self.cfg.max_policy_lag, self.episodes, stamp, self.lp.vocab_size, self.lp.position_limit
        )
        intake = Intake.of(rollout, self._unscorable_reason) + Intake.of(generated)
        self._log_unscorable(intake)
        return Batches(rollout, generated, intake)

    def parts(self, batches: Batches) -> list[PolicyPart]:
        """The kinds of policy this rollout trains, each with a batch to train: candidate choices, then generated
        responses (a loss of its own: candidate and token-level objectives are never mixed in one loss)."""
        cfg, out = self.cfg, []
        if len(batches.rollout):
            features = torch.stack([self._features[id(o)] for o in batches.rollout.obs])  # the frozen base: no second forward
            candidates = CandidateBatch(self.lp, batches.rollout, cfg.micro_batch, features)
            out.append(PolicyPart(candidates, self.critic, LossSettings.candidates(cfg, self.kl.value), adapts_kl=True))
        if len(batches.generated):
            generation = GenerationUpdate(self.lp, batches.generated, cfg.generation)
            out.append(PolicyPart(generation, self.token_critic, LossSettings.generation(cfg, cfg.generation)))
        return out

    def update(self, parts: list[PolicyPart], train_policy: bool, update_index: int, clock: CycleClock | None = None) -> dict[str, float]:
        """The PPO update on each part in turn; its figures under each part's prefix. Raises NonFiniteUpdate before
        anything non-finite is applied (the caller undoes what earlier steps of it applied: `snapshot`). `clock`: the
        learner's cycle profile (the passes without gradients are charged to preparing the batch)."""
        metrics: dict[str, float] = {}
        clock = clock or CycleClock()
        for part in parts:
            with clock.phase(CyclePhase.UPDATE):
                figures = ppo_update(
                    part.batch,
                    self.lp.trainable_parameters(),
                    self.policy_opt,
                    part.critic.parameters(),
                    part.critic.optimizer,
                    part.settings,
                    train_policy,
                    update_index,
                    clock,
                )
            kl_ref = figures.get(UpdateFigure.KL_REF.of(part.batch.prefix), math.nan)
            if part.adapts_kl and train_policy and not math.isnan(kl_ref):
                self.kl.update(kl_ref, len(part.batch))
            metrics.update(figures)
        return metrics

    def values(self, observations: list[CandidateObservation]) -> list[float | None]:
        """Critic values for GAE, None for an observation the model cannot score (`LearnerPolicy.tokenize_checked`:
        a client's next_obs that tokenizes to nothing or runs past the model's positions), which is never fed to
        it; the features are kept (by observation object) for the update's critic epochs."""
        items: list[scoring.Tokenized] = []
        scored: list[int] = []
        for i, obs in enumerate(observations):
            try:
                items.append(self.lp.tokenize_checked(obs))
            except scoring.ScoringError as e:
                self._unscorable_reason = str(e)
                continue
            scored.append(i)
        out: list[float | None] = [None] * len(observations)
        self._features = {}
        if items:
            features, values = self.lp.values_of(items)
            for i, f, v in zip(scored, features, values.cpu().tolist(), strict=True):
                self._features[id(observations[i])] = f
                out[i] = v
        return out

    def _log_unscorable(self, intake: Intake) -> None:
        """One warning, at most every UNSCORABLE_LOG_INTERVAL_S, about the next observations left unscored since the
        last: a client can send one with every feedback, and a line per segment would flood the log. Rank 0 alone
        logs it (every rank builds the same rollout)."""
        if not self.is_main:
            return
        self._unscorable_unlogged += intake.dropped_unscorable_next_obs
        now = time.monotonic()
        if not self._unscorable_unlogged or now - self._unscorable_logged_at < UNSCORABLE_LOG_INTERVAL_S:
            return
        log.warning(
            "%d segments' next observations could not be scored (the last: %s); each was trained as truncated with no "
            "successor, its last transition dropped (counters dropped_unscorable_next_obs and dropped_truncated)",
            self._unscorable_unlogged,
            intake.unscorable_reason,
        )
        self._unscorable_unlogged, self._unscorable_logged_at = 0, now
