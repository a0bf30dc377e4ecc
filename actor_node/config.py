"""The actor's configuration (TOML table [actor], or flags of `ppoz actor`; the shared [policy], [retrieval] and [store] tables)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import check, curve_broker_key, curve_key_pair, curve_public_key, nested, option, section
from common.security import check_client_settings
from common.shared_settings import PolicySpec, RetrievalConfig, StoreSettings


@section("actor")
@dataclass
class ActorConfig:
    broker: str = option("tcp://127.0.0.1:5556", "the broker's actor endpoint (its `backend`) to connect to")
    name: str = option("", "name shown in the broker's status (default: actor-<random>)")
    policy: PolicySpec = nested(PolicySpec)  # [policy]: model, LoRA, dtype, normalisation, temperature, scoring path
    device: str = option("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    greedy: bool = option(False, "evaluation mode: always pick the most probable candidate instead of sampling")
    prefix_cache_mb: float = option(512.0, "memory for the KV of recent prompt prefixes reused across steps (0: off)")
    credits: int = option(16, "most requests the broker may hand this actor at once")
    max_batch: int = option(8, "most requests scored in one forward")
    max_batch_tokens: int = option(32768, "most tokens (context + candidates) in one forward")
    max_generate_rows: int = option(16, "generate: most responses decoded at once; more requests wait for a row (keep credits >= this)")
    max_generate_positions: int = option(
        4096,
        "generate: KV positions reserved per row (prompt + max_new_tokens; capped at the model's limit); the KV cache "
        "holds max_generate_rows x this, allocated on first use",
    )
    prefill_tokens: int = option(2048, "generate: most prompt tokens (padded) computed per step; longer prompts prefill in chunks")
    fold_lora: bool = option(
        True, "generate: fold the LoRA adapter into the base weights while responses run (faster; restored exactly after)"
    )
    capture_decode: bool = option(
        True,
        "generate: on a GPU, replay each decode step as a CUDA graph captured per (rows, width) bucket (a model that "
        "cannot be captured decodes eagerly, with a warning); off: always eager",
    )
    stage_weights: bool = option(
        True,
        "a full snapshot is fetched, while the actor serves, into a second copy of the weights (memory: one more model) "
        "and swapped in between two steps; off: fetched to the CPU and copied in (the copy pauses generation)",
    )
    weights_source: str = option(
        "",
        "the learner's snapshot server ([learner] weights_serve, e.g. tcp://learner-host:5558): snapshots are fetched "
        "from it instead of from [store] (an actor on another host than the learner's; empty: from [store])",
    )
    weights_cache: str = option(
        "auto",
        "this host's copy of each snapshot, which its actors share (one fetch per host): a directory; auto: "
        "/dev/shm/ppoz-UID-weights/PREFIX when the snapshots come from Redis or a weights_source, none when they are "
        "read from [store] weights_dir; off: none",
    )
    rag: bool = option(
        True,
        "rag_step: put retrieved context (the task's recent steps, the corpus) into the prompt "
        "before scoring; off: rag_step scores the plain observation",
    )
    retrieval: RetrievalConfig = nested(RetrievalConfig, "rag_")  # [retrieval], flags --rag-...
    store: StoreSettings = nested(StoreSettings)  # [store]: the Redis of the learner's weight snapshots; empty URL: follow nothing
    weights: str = option("", "the learner's weight announcement endpoint (PUB), e.g. tcp://127.0.0.1:5557")
    weights_poll_s: float = option(5.0, "how often to check Redis for a newer snapshot in case an announcement was missed")
    heartbeat_ms: int = option(1000, "heartbeat interval towards the broker")
    heartbeat_liveness: int = option(3, "the broker is taken as gone after this many silent intervals; the actor reconnects")
    seed: int = option(0, "random seed for sampling")
    curve_secret_key: str = curve_key_pair("this actor's", "; its NAME.key goes in the broker's and learner's curve_allowed_actors")
    curve_broker_key: str = curve_broker_key()
    curve_learner_key: str = curve_public_key("the learner's", "the weight announcements (`weights`) are received encrypted")

    def __post_init__(self) -> None:
        check("://" in self.broker, f"`broker` must be a ZeroMQ endpoint such as tcp://127.0.0.1:5556, got {self.broker!r}")
        check(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            f"`device` must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(self.prefix_cache_mb >= 0, f"`prefix_cache_mb` must be 0 or more, got {self.prefix_cache_mb}")
        check(self.max_batch_tokens > 0, f"`max_batch_tokens` must be positive, got {self.max_batch_tokens}")
        check(self.weights_poll_s > 0, f"`weights_poll_s` must be positive, got {self.weights_poll_s}")
        check(not self.weights or "://" in self.weights, f"`weights` must be a ZeroMQ endpoint, got {self.weights!r}")
        check(
            not self.weights_source or "://" in self.weights_source,
            f"`weights_source` must be a ZeroMQ endpoint, got {self.weights_source!r}",
        )
        check(self.credits > 0, f"`credits` must be positive, got {self.credits}")
        check(self.max_batch > 0, f"`max_batch` must be positive, got {self.max_batch}")
        check(self.max_generate_rows > 0, f"`max_generate_rows` must be positive, got {self.max_generate_rows}")
        check(self.max_generate_positions > 1, f"`max_generate_positions` must be 2 or more, got {self.max_generate_positions}")
        check(self.prefill_tokens > 0, f"`prefill_tokens` must be positive, got {self.prefill_tokens}")
        check(self.heartbeat_ms >= 10, f"`heartbeat_ms` must be at least 10, got {self.heartbeat_ms}")
        check(self.heartbeat_liveness >= 2, f"`heartbeat_liveness` must be at least 2, got {self.heartbeat_liveness}")
        check(
            not self.curve_learner_key or bool(self.weights),
            "`curve_learner_key` is set but `weights` is empty: no weight endpoint to connect to",
        )
        # Paths are checked here, on the machine that reads them: a broker sharing the [retrieval] table has no corpus.
        corpus, embedder = self.retrieval.corpus_dir, self.retrieval.embedder
        check(not corpus or Path(corpus).is_dir(), f"`rag_corpus_dir` {corpus!r} is not a directory")
        check(not embedder or Path(embedder).is_dir(), f"`rag_embedder` {embedder!r} is not a model directory")
        check_client_settings(
            self.curve_secret_key, {"curve_broker_key": self.curve_broker_key, "curve_learner_key": self.curve_learner_key}
        )
