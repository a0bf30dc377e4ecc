"""The broker's configuration (TOML table [broker], or flags of `ppoz broker`; the shared [store] and [retrieval] tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config import check, curve_allowed_keys, curve_key_pair, nested, option, section
from common.protocol import DEFAULT_MAX_ABS_REWARD, Limits, is_reward_bound
from common.security import check_server_settings
from common.shared_settings import RetrievalConfig, StoreSettings


@section("broker")
@dataclass
class BrokerConfig:
    frontend: str = option("tcp://127.0.0.1:5555", "ZeroMQ endpoint the broker binds for clients (ROUTER)")
    backend: str = option("tcp://127.0.0.1:5556", "ZeroMQ endpoint the broker binds for actors (ROUTER)")
    store: StoreSettings = nested(StoreSettings)  # [store]: Redis URL, key prefix, stream; an empty URL starts an embedded redis-server
    segment_len: int = option(32, "transitions per trajectory segment before it closes and goes to the stream")
    segment_max_versions: int = option(
        2,
        "a segment also closes once a step is scored this many policy versions after its first transition, so that a"
        " slow client's transitions reach the learner within its lag bound rather than when the segment is full; 0: by length only",
    )
    session_ttl_s: float = option(600.0, "a session with no request for this long expires; its data is flushed as a truncated segment")
    request_timeout_ms: int = option(30_000, "longest time a client request may wait for an answer before it gets a `timeout` error")
    generate_timeout_ms: int = option(
        300_000, "generate: the default and the longest deadline of a request (a response takes as many forwards as it has tokens)"
    )
    max_new_tokens: int = option(4096, "generate: the largest response budget (`sampling.max_new_tokens`) a request may ask for")
    max_stop_strings: int = option(8, "generate: most strings in `sampling.stop`")
    max_stop_chars: int = option(256, "generate: most characters in one stop string")
    max_messages: int = option(256, "generate: most entries in `messages`")
    max_abs_reward: float = option(
        DEFAULT_MAX_ABS_REWARD, "feedback: the largest |reward| accepted; a larger or non-finite one gets `bad_request`"
    )
    heartbeat_ms: int = option(1000, "heartbeat interval towards actors")
    metrics_bind: str = option("", "HOST:PORT for a Prometheus text endpoint (GET /metrics), e.g. 127.0.0.1:9101; empty: off")
    drain_timeout_s: float = option(10.0, "on SIGTERM, how long steps in flight may take to finish before the broker exits anyway")
    heartbeat_liveness: int = option(3, "an actor silent for this many heartbeat intervals is dead; its jobs go to another actor")
    actor_job_timeout_ms: int = option(
        20_000,
        "an actor holding a scoring job this long with no progress (its heartbeats' count unchanged, no job answered) "
        "is taken as hung, or a generate job this long past its deadline; its jobs go elsewhere",
    )
    storage_timeout_ms: int = option(5000, "a Redis write not answered within this is taken as failed: its requests get `internal`")
    max_queue: int = option(
        10_000,
        "step requests queued for actors past which a client holding its share of them is refused (`ask`: wait, a step:"
        " `overloaded`); never more than twice this in all",
    )
    max_sessions: int = option(
        100_000,
        "most sessions open at once (each holds keys in Redis); past it a new `attach` gets `overloaded` until one is detached or expires",
    )
    max_stream_backlog: int = option(
        -1,
        "`ask` answers wait, and steps wait in the queue (step_hold_share), while the segment stream holds more"
        " transitions no learner has read yet than this (what it has read and waits for its checkpoint does not count);"
        " -1: the limit the learner publishes (what it trains within its policy-lag bound), 0: no limit",
    )
    step_hold_share: float = option(
        0.25,
        "a step or generate that comes while the stream backlog is over its limit (whether its client asked or not)"
        " waits in the queue until the learner has read the backlog down, for at most this share of its deadline"
        " (7.5 s of a step's default 30 s, under the clients' 10 s attempt timeout), then goes to an actor anyway:"
        " clients that never `ask` are slowed to the learner's pace instead of sending it steps too old to train; 0: never",
    )
    retry_after_ms: int = option(1000, "the `retry_after_ms` the broker suggests when it applies back-pressure")
    ask_hold_ms: int = option(
        500,
        "an `ask` met by the stream backlog is held up to this long and answered `ok` as soon as the learner has read"
        " (else `wait` with retry_after_ms 1, to ask again at once): clients resume within moments of the learner, not"
        " after a retry_after_ms sleep; 0: answer at once. Keep it well below the clients' attempt timeout",
    )
    max_message_bytes: int = option(4 * 1024 * 1024, "largest request accepted; larger ones get `too_large`")
    max_actions: int = option(256, "most candidate actions in one observation")
    max_action_chars: int = option(4096, "most characters in one candidate action")
    max_prompt_chars: int = option(1_000_000, "most characters in prompt + question")
    rag_max_context_chars: int = option(64_000, "rag_step: most characters of retrieved context an actor may append to a prompt")
    retrieval: RetrievalConfig = nested(RetrievalConfig, "rag_")  # [retrieval]: the history the broker keeps is the one the actor expects
    curve_secret_key: str = curve_key_pair("the broker's", "; empty: no encryption (docs/security.md)")
    curve_allowed_clients: str = curve_allowed_keys("clients allowed on `frontend`")
    curve_allowed_actors: str = curve_allowed_keys("actors allowed on `backend`")

    def __post_init__(self) -> None:
        check(self.segment_len > 0, f"`segment_len` must be positive, got {self.segment_len}")
        check(self.segment_max_versions >= 0, f"`segment_max_versions` must be 0 or more, got {self.segment_max_versions}")
        check(self.session_ttl_s > 0, f"`session_ttl_s` must be positive, got {self.session_ttl_s}")
        check(self.drain_timeout_s >= 0, f"`drain_timeout_s` must be 0 or more, got {self.drain_timeout_s}")
        check(self.request_timeout_ms > 0, f"`request_timeout_ms` must be positive, got {self.request_timeout_ms}")
        check(self.generate_timeout_ms > 0, f"`generate_timeout_ms` must be positive, got {self.generate_timeout_ms}")
        for name in ("max_new_tokens", "max_stop_strings", "max_stop_chars", "max_messages"):
            check(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        check(
            is_reward_bound(self.max_abs_reward),
            f"`max_abs_reward` must be a positive finite number, got {self.max_abs_reward}",
        )
        check(self.heartbeat_ms >= 10, f"`heartbeat_ms` must be at least 10, got {self.heartbeat_ms}")
        check(self.heartbeat_liveness >= 2, f"`heartbeat_liveness` must be at least 2, got {self.heartbeat_liveness}")
        check(self.actor_job_timeout_ms > 0, f"`actor_job_timeout_ms` must be positive, got {self.actor_job_timeout_ms}")
        check(self.storage_timeout_ms > 0, f"`storage_timeout_ms` must be positive, got {self.storage_timeout_ms}")
        check(self.max_queue > 0, f"`max_queue` must be positive, got {self.max_queue}")
        check(self.max_sessions > 0, f"`max_sessions` must be positive, got {self.max_sessions}")
        check(self.rag_max_context_chars >= 0, f"`rag_max_context_chars` must be 0 or more, got {self.rag_max_context_chars}")
        check(
            self.max_stream_backlog >= -1,
            f"`max_stream_backlog` must be -1 (the learner's limit), 0 (none) or a positive count, got {self.max_stream_backlog}",
        )
        check(0 <= self.step_hold_share < 1, f"`step_hold_share` must be at least 0 and below 1, got {self.step_hold_share}")
        check(self.retry_after_ms > 0, f"`retry_after_ms` must be positive, got {self.retry_after_ms}")
        check(0 <= self.ask_hold_ms <= 5000, f"`ask_hold_ms` must be 0 to 5000 (below clients' attempt timeouts), got {self.ask_hold_ms}")
        check(self.max_message_bytes >= 1024, f"`max_message_bytes` must be at least 1024, got {self.max_message_bytes}")
        check(self.max_actions > 0, f"`max_actions` must be positive, got {self.max_actions}")
        check(self.max_action_chars > 0, f"`max_action_chars` must be positive, got {self.max_action_chars}")
        check(self.max_prompt_chars > 0, f"`max_prompt_chars` must be positive, got {self.max_prompt_chars}")
        for name in ("frontend", "backend"):
            value = getattr(self, name)
            check("://" in value, f"`{name}` must be a ZeroMQ endpoint such as tcp://127.0.0.1:5555, got {value!r}")
        check_server_settings(
            self.curve_secret_key, {"curve_allowed_clients": self.curve_allowed_clients, "curve_allowed_actors": self.curve_allowed_actors}
        )

    MOVED_KEYS: ClassVar[dict[str, tuple[str, str]]] = {"rag_history_chars": ("retrieval", "query_chars")}

    @property
    def rag_history_len(self) -> int:
        """rag_step: recent steps kept per task ([retrieval] history_len)."""
        return self.retrieval.history_len

    @property
    def rag_history_chars(self) -> int:
        """rag_step: characters kept of each history entry's prompt ([retrieval] query_chars, what the actor embeds)."""
        return self.retrieval.query_chars

    @property
    def limits(self) -> Limits:
        return Limits(
            max_message_bytes=self.max_message_bytes,
            max_actions=self.max_actions,
            max_action_chars=self.max_action_chars,
            max_prompt_chars=self.max_prompt_chars,
            max_new_tokens=self.max_new_tokens,
            max_stop_strings=self.max_stop_strings,
            max_stop_chars=self.max_stop_chars,
            max_messages=self.max_messages,
            max_abs_reward=self.max_abs_reward,
        )
