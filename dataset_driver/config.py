"""`[train]`: what `ppoz train` reads (the dataset, the rewards, the drivers); the PPO settings stay in
`[learner]` and `[generation]` (their names against verl's: docs/train.md)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from common.config import check, code_path, local_path, option, section
from common.security import ClientKeys, check_client_settings, client_keys
from rewards.config import DEFAULT_REWARD_FN_TIMEOUT_S, RewardSources


@section("train")
@dataclass
class TrainConfig(RewardSources):  # reward_model, judge_model, ...: rewards/config.py, shared with [reward_service]
    data: str = option(
        "", "the training prompts: JSON, JSONL or Parquet records {prompt, ground_truth, data_source, extra_info}", path=local_path
    )
    val: str = option("", "validation prompts in the same format (empty: no validation)", path=local_path)
    val_size: int = option(0, "validate on the first N validation records (0: all of them)")
    val_every_s: float = option(
        0.0,
        "validate also every this many seconds of training, beside the drivers; progress.jsonl's val_reward (0: before and after only)",
    )
    chat_template: bool = option(False, "send plain-text prompts as a user message through the model's chat template")
    strict: bool = option(False, "a bad record stops the run (default: skipped, counted and named)")
    epochs: int = option(1, "passes over the training prompts (0: until stopped)")
    rollout_n: int = option(1, "responses sampled per prompt, asked for at once (verl's rollout.n)")
    shuffle: bool = option(True, "each epoch in its own seeded order (false: file order)")
    seed: int = option(0, "the order of the prompts and the sampling seeds")
    max_samples: int = option(0, "stop after this many responses (0: when the epochs end)")
    resume: bool = option(True, "start where the last run with this output directory stopped")
    workers: int = option(
        8,
        "driver threads, each with a client and a task per response of its group, whose requests go at once"
        " (keep [actor] max_generate_rows >= workers x rollout_n)",
    )
    max_new_tokens: int = option(256, "response budget in tokens (verl's response_length)")
    temperature: float = option(1.0, "sampling temperature of the responses trained on (validation is greedy)")
    top_p: float = option(1.0, "nucleus sampling of the responses trained on")
    stop: list = option([], "stop strings of the responses")
    reward_fn: str = option(
        "",
        "module:function (found in the working directory too, as under `python -m`), path/file.py:function, or a built-in:"
        " default (by data_source), math, exact_match, first_word;"
        " empty: `default` unless a reward model or judge is set",
        path=code_path,
    )
    reward_service: str = option(
        "",
        "a `ppoz reward-server` endpoint (e.g. tcp://rewards-host:5560): rm_score and judge_score come from it, and"
        " reward_model and judge_model stay empty here",
    )
    reward_service_timeout_s: float = option(60.0, "longest wait for one answer of the reward service before the request is sent again")
    reward_service_retries: int = option(2, "times an unanswered request to the reward service is sent again (then: unrewarded)")
    reward_service_curve_key: str = option(
        "",
        "CURVE: the reward service's public key file (NAME.key from `ppoz keygen`); set, the drivers connect to it with CURVE",
        path=local_path,
    )
    reward_service_curve_secret_key: str = option(
        "",
        "CURVE: the drivers' key pair file (NAME.key_secret), whose NAME.key is in the service's curve_allowed_clients;"
        ' empty: a fresh pair, which only a service accepting "*" lets in',
        path=local_path,
    )
    weights: dict = option({}, "reward component weights (TOML only), e.g. {rule_score = 0.3, rm_score = 0.7}; empty: 1.0 each", cli=False)
    reward_normalise: str = option("none", "none, or running: (r - mean) / std over the rewards so far")
    reward_clip: float = option(0.0, "|reward| <= this after normalisation (0: no clipping)")
    reward_fn_timeout_s: float = option(
        DEFAULT_REWARD_FN_TIMEOUT_S,
        "longest one call of the reward function may take; past it that response is unrewarded and the call is abandoned",
    )
    output_dir: str = option("outputs", "where the run's state, figures, curve and final adapter go", path=local_path)
    deadline_s: float = option(300.0, "longest wait for one response, retries included")
    reward_timeout_s: float = option(
        300.0,
        "longest wait for one response's reward (a judge's retries included); past it: unrewarded (keep it below [broker] session_ttl_s)",
    )
    report_every_s: float = option(10.0, "seconds between progress lines")
    drain_timeout_s: float = option(
        300.0,
        "on one machine, once the drivers are done: longest wait for the learner to train what they sent (a learner with"
        " [learner] rollout_timeout_s = 0 is not waited for once less than one rollout_batch is left)",
    )

    def __post_init__(self) -> None:
        self.check_reward_sources()
        check(self.epochs >= 0, f"[train] epochs = {self.epochs}: must be 0 (until stopped) or more")
        check(self.rollout_n >= 1, f"[train] rollout_n = {self.rollout_n}: must be at least 1")
        check(self.workers >= 1, f"[train] workers = {self.workers}: must be at least 1")
        check(self.max_new_tokens >= 1, f"[train] max_new_tokens = {self.max_new_tokens}: must be at least 1")
        check(self.max_samples >= 0 and self.val_size >= 0, "[train] max_samples and val_size must be 0 or more")
        check(self.temperature > 0, f"[train] temperature = {self.temperature}: responses trained on must be sampled (> 0)")
        check(0 < self.top_p <= 1, f"[train] top_p = {self.top_p}: must be in (0, 1]")
        check(self.reward_normalise in ("none", "running"), f"[train] reward_normalise = {self.reward_normalise!r}: none or running")
        check(self.reward_clip >= 0, f"[train] reward_clip = {self.reward_clip}: must be 0 (none) or more")
        check(
            math.isfinite(self.reward_fn_timeout_s) and self.reward_fn_timeout_s > 0,
            f"[train] reward_fn_timeout_s = {self.reward_fn_timeout_s}: must be a positive number of seconds",
        )
        check(
            self.deadline_s > 0 and self.report_every_s > 0 and self.reward_timeout_s > 0,
            "[train] deadline_s, reward_timeout_s and report_every_s must be positive",
        )
        check(all(isinstance(s, str) and s for s in self.stop), f"[train] stop = {self.stop!r}: non-empty strings")
        check(
            math.isfinite(self.val_every_s) and self.val_every_s >= 0,
            f"[train] val_every_s = {self.val_every_s}: must be 0 (before and after only) or a number of seconds",
        )
        check(self.drain_timeout_s >= 0, f"[train] drain_timeout_s = {self.drain_timeout_s}: must be 0 or more")
        for name, weight in self.weights.items():
            check(isinstance(weight, (int, float)) and not isinstance(weight, bool), f"[train] weights.{name} = {weight!r}: a number")
        if self.reward_service:
            for name in ("reward_model", "judge_model"):
                check(
                    not getattr(self, name),
                    f"[train] {name} = {getattr(self, name)!r} and reward_service = {self.reward_service!r}: the service hosts the"
                    f" reward model and the judge ([reward_service] {name}); leave [train] {name} empty",
                )
            timeout, retries = self.reward_service_timeout_s, self.reward_service_retries
            check(timeout > 0, f"[train] reward_service_timeout_s = {timeout}: must be positive")
            check(retries >= 0, f"[train] reward_service_retries = {retries}: must be 0 or more")
        check_client_settings(self.reward_service_curve_secret_key, {"reward_service_curve_key": self.reward_service_curve_key})

    def reward_weights(self, service_components: Collection[str] = ()) -> dict[str, float]:
        """The weights given, or 1.0 for each configured source (the built-in function when none is);
        `service_components`: what the reward service hosts (rm_score, judge_score), when one is used."""
        if self.weights:
            return {k: float(v) for k, v in self.weights.items()}
        out = {}
        if self.reward_fn:
            out["rule_score"] = 1.0
        if self.reward_model or "rm_score" in service_components:
            out["rm_score"] = 1.0
        if self.judge_model or "judge_score" in service_components:
            out["judge_score"] = 1.0
        return out or {"rule_score": 1.0}  # nothing set: the built-in reward `data_source` picks

    def reward_service_keys(self) -> ClientKeys | None:
        """The drivers' CURVE keys for the reward service; None: plain ZeroMQ."""
        return client_keys(
            self.reward_service_curve_secret_key,
            self.reward_service_curve_key,
            ("reward_service_curve_secret_key", "reward_service_curve_key"),
        )
