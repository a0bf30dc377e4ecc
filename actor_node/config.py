"""The actor's configuration (TOML table [actor], or flags of `ppoz actor`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import check, option, section
from common.options import DTYPE_NAMES as DTYPES
from common.options import NORMALISATIONS
from common.options import SCORING_PATHS as PATHS
from common.security import check_client_settings


@section("actor")
@dataclass
class ActorConfig:
    broker: str = option("tcp://127.0.0.1:5556", "the broker's actor endpoint (its `backend`) to connect to")
    name: str = option("", "name shown in the broker's status (default: actor-<random>)")
    model: str = option("", "causal LM to serve: a local directory or a Hugging Face id; empty serves the uniform random policy (a baseline)")
    lora_rank: int = option(8, "rank of the LoRA adapter the learner trains (0: the learner trains all weights); must match the learner")
    lora_alpha: int = option(16, "LoRA alpha; must match the learner")
    device: str = option("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    normalisation: str = option("word", "how a candidate's summed log-probability is normalised: token, word (PPOAPI's default) or sum")
    temperature: float = option(1.0, "softmax temperature over the normalised candidate scores")
    greedy: bool = option(False, "evaluation mode: always pick the most probable candidate instead of sampling")
    scoring_path: str = option("auto", "auto (checked at start), packed, kv_batch or per_candidate")
    prefix_cache_mb: float = option(512.0, "memory for the KV of recent prompt prefixes reused across steps (0: off)")
    credits: int = option(16, "most requests the broker may hand this actor at once")
    max_batch: int = option(8, "most requests scored in one forward")
    max_batch_tokens: int = option(32768, "most tokens (context + candidates) in one forward")
    rag: bool = option(True, "rag_step: put retrieved context (the task's recent steps, the corpus) into the prompt before scoring; off: rag_step scores the plain observation")
    rag_corpus_dir: str = option("", "rag_step: folder of .md/.txt documents (app knowledge, testing guides) indexed at start; empty: history only")
    rag_chunk_tokens: int = option(128, "rag_step: corpus chunk length, in tokens of the policy's tokenizer")
    rag_chunk_overlap: int = option(32, "rag_step: tokens shared by consecutive chunks")
    rag_top_k: int = option(4, "rag_step: most snippets (documents and history together) put into the prompt")
    rag_max_context_tokens: int = option(256, "rag_step: most tokens the added context block may take")
    rag_history_len: int = option(8, "rag_step: most recent steps of the task considered (the broker keeps its own rag_history_len)")
    rag_embedder: str = option("", "rag_step: a sentence-transformers style encoder (local directory) to embed with; empty: the policy's base model, mean-pooled, adapter off")
    rag_embed_batch: int = option(16, "rag_step: texts embedded per forward")
    rag_query_chars: int = option(2000, "rag_step: characters of a prompt's end that are embedded; keep equal to the broker's rag_history_chars so a step's history entry reuses its cached embedding")
    redis_url: str = option("", "Redis holding the learner's weight snapshots (empty: start from the base model, follow nothing)")
    key_prefix: str = option("ppoz", "Redis key prefix shared with the broker and learner")
    weights: str = option("", "the learner's weight announcement endpoint (PUB), e.g. tcp://127.0.0.1:5557")
    weights_poll_s: float = option(5.0, "how often to check Redis for a newer snapshot in case an announcement was missed")
    heartbeat_ms: int = option(1000, "heartbeat interval towards the broker")
    heartbeat_liveness: int = option(3, "the broker is taken as gone after this many silent intervals; the actor reconnects")
    seed: int = option(0, "random seed for sampling")
    curve_secret_key: str = option("", "CURVE: this actor's key pair file (NAME.key_secret from `ppoz keygen`); its NAME.key goes in the broker's and learner's curve_allowed_actors")
    curve_broker_key: str = option("", "CURVE: the broker's public key file (NAME.key); set, the connection to the broker is encrypted (docs/security.md)")
    curve_learner_key: str = option("", "CURVE: the learner's public key file (NAME.key); set, the weight announcements (`weights`) are received encrypted")

    def __post_init__(self) -> None:
        check("://" in self.broker, f"`broker` must be a ZeroMQ endpoint such as tcp://127.0.0.1:5556, got {self.broker!r}")
        check(self.lora_rank >= 0, f"`lora_rank` must be 0 or more, got {self.lora_rank}")
        check(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"), f"`device` must be auto, cpu or cuda[:N], got {self.device!r}")
        check(self.dtype == "auto" or self.dtype in DTYPES, f"`dtype` must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check(self.normalisation in NORMALISATIONS, f"`normalisation` must be one of {', '.join(NORMALISATIONS)}, got {self.normalisation!r}")
        check(self.temperature > 0, f"`temperature` must be positive, got {self.temperature}")
        check(self.scoring_path == "auto" or self.scoring_path in PATHS, f"`scoring_path` must be auto or one of {', '.join(PATHS)}, got {self.scoring_path!r}")
        check(self.prefix_cache_mb >= 0, f"`prefix_cache_mb` must be 0 or more, got {self.prefix_cache_mb}")
        check(self.max_batch_tokens > 0, f"`max_batch_tokens` must be positive, got {self.max_batch_tokens}")
        check(self.weights_poll_s > 0, f"`weights_poll_s` must be positive, got {self.weights_poll_s}")
        check(not self.weights or "://" in self.weights, f"`weights` must be a ZeroMQ endpoint, got {self.weights!r}")
        check(self.rag_chunk_tokens > 0, f"`rag_chunk_tokens` must be positive, got {self.rag_chunk_tokens}")
        check(0 <= self.rag_chunk_overlap < self.rag_chunk_tokens,
              f"`rag_chunk_overlap` must be 0 or more and less than `rag_chunk_tokens` ({self.rag_chunk_tokens}), got {self.rag_chunk_overlap}")
        check(self.rag_top_k > 0, f"`rag_top_k` must be positive, got {self.rag_top_k}")
        check(self.rag_max_context_tokens > 0, f"`rag_max_context_tokens` must be positive, got {self.rag_max_context_tokens}")
        check(self.rag_history_len >= 0, f"`rag_history_len` must be 0 or more, got {self.rag_history_len}")
        check(self.rag_query_chars > 0, f"`rag_query_chars` must be positive, got {self.rag_query_chars}")
        check(self.rag_embed_batch > 0, f"`rag_embed_batch` must be positive, got {self.rag_embed_batch}")
        check(self.credits > 0, f"`credits` must be positive, got {self.credits}")
        check(self.max_batch > 0, f"`max_batch` must be positive, got {self.max_batch}")
        check(self.heartbeat_ms >= 10, f"`heartbeat_ms` must be at least 10, got {self.heartbeat_ms}")
        check(self.heartbeat_liveness >= 2, f"`heartbeat_liveness` must be at least 2, got {self.heartbeat_liveness}")
        check(not self.curve_learner_key or bool(self.weights), "`curve_learner_key` is set but `weights` is empty: no weight endpoint to connect to")
        check(not self.rag_corpus_dir or Path(self.rag_corpus_dir).is_dir(), f"`rag_corpus_dir` {self.rag_corpus_dir!r} is not a directory")
        check(not self.rag_embedder or Path(self.rag_embedder).is_dir(), f"`rag_embedder` {self.rag_embedder!r} is not a model directory")
        check_client_settings(self.curve_secret_key, {"curve_broker_key": self.curve_broker_key, "curve_learner_key": self.curve_learner_key})

    def retrieval(self) -> "RetrievalConfig":
        from actor_node.retrieval import RetrievalConfig

        return RetrievalConfig(corpus_dir=self.rag_corpus_dir, chunk_tokens=self.rag_chunk_tokens, chunk_overlap=self.rag_chunk_overlap,
                               top_k=self.rag_top_k, max_context_tokens=self.rag_max_context_tokens, history_len=self.rag_history_len,
                               embed_batch=self.rag_embed_batch, query_chars=self.rag_query_chars)  # fmt: skip
