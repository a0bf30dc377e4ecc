"""The reward model and judge settings, written once for the two places that host them:

    [train]           a driver that loads the reward model and asks the judge itself
    [reward_service]  `ppoz reward-server`, which hosts them for every driver of a farm (rewards/service/)

Both tables use the same keys (`reward_model`, `judge_model`, ...) with the same meaning, because both
configs inherit them from `RewardSources`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config import check, curve_key_pair, local_path_or_any, local_path_or_id, option, section
from common.protocol import DEFAULT_MAX_ABS_REWARD, is_reward_bound
from common.security import check_server_settings, is_local_endpoint

if TYPE_CHECKING:
    from rewards.judge import JudgeConfig
    from rewards.reward_model import RewardModelConfig

DEFAULT_SERVICE_ENDPOINT = "tcp://127.0.0.1:5560"
DEFAULT_REWARD_FN_TIMEOUT_S = 30.0


@dataclass
class RewardSources:
    """The reward model (rm_score) and LLM judge (judge_score) settings, each off while its name is empty, and the
    bounds every reward source is held to (a value past them leaves its response unrewarded, never clipped)."""

    reward_model: str = option("", "a local AutoModelForSequenceClassification directory (rm_score)", path=local_path_or_id)
    reward_model_device: str = option("cpu", "the reward model's device")
    judge_model: str = option("", "the LLM judge's model name (judge_score); empty: no judge")
    judge_provider: str = option("openai", "dashscope, openai, gemini or claude (keys from their usual variables)")
    judge_base_url: str = option("", "an OpenAI-compatible endpoint of your own (overrides the provider's)")
    judge_api_key_env: str = option("", "the variable holding the judge's key (default: the provider's; with judge_base_url: none)")
    judge_preset: str = option("math", "math, code, dialogue or safety")
    judge_concurrency: int = option(8, "judge requests in flight at once")
    judge_timeout_s: float = option(60.0, "one judge request's timeout")
    max_abs_reward: float = option(
        DEFAULT_MAX_ABS_REWARD,
        "the largest |value| a reward function, reward model, judge or the weighted sum may give; a larger or"
        " non-finite one leaves that response unrewarded (counted, logged), never clipped",
    )

    def check_reward_sources(self) -> None:
        """For the embedding config's __post_init__: the judge's numbers (its provider and preset are checked
        by JudgeConfig when the judge is built, with the provider's list in the message)."""
        table = getattr(type(self), "section_name", "reward")
        check(self.judge_concurrency >= 1, f"[{table}] judge_concurrency = {self.judge_concurrency}: must be at least 1")
        check(self.judge_timeout_s > 0, f"[{table}] judge_timeout_s = {self.judge_timeout_s}: must be positive")
        check(
            is_reward_bound(self.max_abs_reward),
            f"[{table}] max_abs_reward = {self.max_abs_reward}: must be a positive finite number",
        )

    def reward_model_config(self, batch_size: int = 8) -> RewardModelConfig:
        from rewards.reward_model import RewardModelConfig

        return RewardModelConfig(self.reward_model, device=self.reward_model_device, batch_size=batch_size)

    def judge_config(self) -> JudgeConfig:
        from rewards.judge import JudgeConfig

        return JudgeConfig(
            model=self.judge_model,
            provider=self.judge_provider,
            base_url=self.judge_base_url,
            api_key_env=self.judge_api_key_env,
            preset=self.judge_preset,
            concurrency=self.judge_concurrency,
            timeout_s=self.judge_timeout_s,
        )


@section("reward_service")
@dataclass
class RewardServiceConfig(RewardSources):
    """`ppoz reward-server`: one reward model and/or judge that every driver of a farm calls."""

    bind: str = option(DEFAULT_SERVICE_ENDPOINT, "ZeroMQ endpoint the service binds (ROUTER); drivers set [train] reward_service to it")
    batch_size: int = option(32, "most pairs in one forward of the reward model; requests of several drivers are scored together up to it")
    batch_wait_ms: float = option(5.0, "how long the reward model waits for more drivers' requests to fill a batch")
    judge_workers: int = option(
        16,
        "judge calls in flight at once, for the items of every driver's requests, shared round-robin among the requests;"
        " at most judge_concurrency (more would only wait inside the judge, first come first served)",
    )
    max_items: int = option(1024, "most pairs or items in one request; more get `too_large`")
    max_request_bytes: int = option(64 * 1024 * 1024, "largest request accepted; larger ones get `too_large`")
    max_pending: int = option(1024, "most requests waiting or being scored; past it new ones get `overloaded`")
    queue_timeout_s: float = option(
        300.0, "a request still waiting to be scored after this long gets `timeout` (its driver has given up by then)"
    )
    retry_after_ms: int = option(500, "the `retry_after_ms` sent with `overloaded`")
    drain_timeout_s: float = option(30.0, "on SIGTERM, how long requests in progress may take to finish before the service exits anyway")
    curve_secret_key: str = curve_key_pair("the service's", "; required to bind an address other machines can reach (docs/security.md)")
    curve_allowed_clients: str = option(
        "",
        'CURVE: a directory of the drivers\' NAME.key files allowed to connect, or "*" for any key (encryption only)',
        path=local_path_or_any,
    )

    def __post_init__(self) -> None:
        self.check_reward_sources()
        check(bool(self.reward_model or self.judge_model), "[reward_service] hosts nothing: set reward_model, judge_model or both")
        check(bool(self.bind), "[reward_service] bind is empty: the service needs an endpoint, e.g. tcp://127.0.0.1:5560")
        check(self.batch_size >= 1, f"[reward_service] batch_size = {self.batch_size}: must be at least 1")
        check(self.batch_wait_ms >= 0, f"[reward_service] batch_wait_ms = {self.batch_wait_ms}: must be 0 or more")
        check(self.judge_workers >= 1, f"[reward_service] judge_workers = {self.judge_workers}: must be at least 1")
        check(self.max_items >= 1, f"[reward_service] max_items = {self.max_items}: must be at least 1")
        check(self.max_request_bytes >= 1024, f"[reward_service] max_request_bytes = {self.max_request_bytes}: must be at least 1024")
        check(self.max_pending >= 1, f"[reward_service] max_pending = {self.max_pending}: must be at least 1")
        check(self.queue_timeout_s > 0, f"[reward_service] queue_timeout_s = {self.queue_timeout_s}: must be positive")
        check(self.retry_after_ms >= 0, f"[reward_service] retry_after_ms = {self.retry_after_ms}: must be 0 or more")
        check(self.drain_timeout_s >= 0, f"[reward_service] drain_timeout_s = {self.drain_timeout_s}: must be 0 or more")
        check_server_settings(self.curve_secret_key, {"curve_allowed_clients": self.curve_allowed_clients})
        check(
            bool(self.curve_secret_key) or is_local_endpoint(self.bind),
            f"[reward_service] bind = {self.bind!r} is reachable from other machines, and without CURVE anyone there could"
            " spend the judge's key and read every verdict: set curve_secret_key and curve_allowed_clients"
            " (docs/security.md), or bind a loopback address such as tcp://127.0.0.1:5560",
        )
