"""Settings that two processes must agree on, each one dataclass and one TOML table.

`PolicySpec` (`[policy]`) is what makes the actor's and the learner's log-probability
of a candidate the same function: the model and its adapter, the dtype, how candidate
scores are normalised and tempered, the scoring path. Both configs embed it
(common/config.py, `nested`), so a file states it once; flags keep their names
(`--model`, `--lora-rank`, ...). What may differ per process (the device, for one)
stays in each component's own table.

`RetrievalConfig` (`[retrieval]`) is rag_step's retrieval: the actor retrieves with it and
the broker keeps each task's history by it (`history_len` steps, the last `query_chars`
characters of each prompt), so the history the broker sends is the history the actor
expects. Flags are `--rag-...` on both commands.

`StoreSettings` (`[store]`) is the Redis every process meets in: its URL, the key prefix
that separates farms sharing one Redis, the segment stream and its consumer group. The
broker writes the stream, the learner reads it and writes weight snapshots, the actors read
those (their chunks in Redis, or in `weights_dir`, a directory they all mount), `ppoz up` and
`ppoz train` read figures and marks: all under the same keys. What an
empty URL means is each process's own (the broker starts an embedded redis-server, an actor
follows no weights, the learner refuses to start), so each component checks that itself.

Nothing here imports torch: the broker and the uniform actor load these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import check, local_path, local_path_or_id, option, section
from common.options import DTYPE_NAMES, NORMALISATIONS, SCORING_PATHS
from common.redis_server import password_in_url
from common.segments import RedisKeys

AUTO = "auto"  # a setting resolved from the model at load time (lora_trainable)


@section("policy")
@dataclass(kw_only=True)
class PolicySpec:
    """the policy as actor and learner must both see it"""

    model: str = option(
        "",
        "causal LM: a local directory or a Hugging Face id; the actor serves the uniform random policy when empty",
        path=local_path_or_id,
    )
    lora_rank: int = option(8, "rank of the LoRA adapter the learner trains (0: train all weights, for tiny models)")
    lora_alpha: int = option(16, "LoRA alpha")
    lora_trainable: list[str] = option(
        [AUTO],
        "modules trained in full beside the adapter (peft's modules_to_save, matched by name suffix), e.g. lm_head and"
        " model.norm; auto: the head and final norm of a random tiny model (`ppoz tiny-model`), which must learn,"
        " none for any other model, whose head already maps features to words",
    )
    dtype: str = option(
        "auto", "base model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16; the adapter stays float32"
    )
    normalisation: str = option(
        "token",
        "how a candidate's summed log-probability is normalised: token (the mean per token), word (PPOAPI's and TWOSOME's"
        " default, for short phrase actions: on Kea's long event strings it makes the policy all but deterministic) or sum",
    )
    temperature: float = option(1.0, "softmax temperature over the normalised candidate scores")
    scoring_path: str = option("auto", "how candidates are scored: auto (checked at start), packed, kv_batch or per_candidate")

    def __post_init__(self) -> None:
        check(self.lora_rank >= 0, f"`lora_rank` must be 0 or more, got {self.lora_rank}")
        check(self.lora_alpha > 0, f"`lora_alpha` must be positive, got {self.lora_alpha}")
        check(
            AUTO not in self.lora_trainable or self.lora_trainable == [AUTO],
            f'`lora_trainable` is either ["{AUTO}"] or a list of module names, got {self.lora_trainable}',
        )
        check(
            self.dtype == "auto" or self.dtype in DTYPE_NAMES,
            f"`dtype` must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}",
        )
        check(
            self.normalisation in NORMALISATIONS, f"`normalisation` must be one of {', '.join(NORMALISATIONS)}, got {self.normalisation!r}"
        )
        check(self.temperature > 0, f"`temperature` must be positive, got {self.temperature}")
        check(
            self.scoring_path == "auto" or self.scoring_path in SCORING_PATHS,
            f"`scoring_path` must be auto or one of {', '.join(SCORING_PATHS)}, got {self.scoring_path!r}",
        )


@section("retrieval")
@dataclass(kw_only=True)
class RetrievalConfig:
    """rag_step's retrieval, as broker and actor must both see it"""

    corpus_dir: str = option(
        "",
        "actor: folder of .md/.txt documents (app knowledge, testing guides) indexed at start, searched recursively; empty: history only",
        path=local_path,
    )
    chunk_tokens: int = option(128, "actor: corpus chunk length, in tokens of the policy's tokenizer")
    chunk_overlap: int = option(32, "actor: tokens shared by consecutive chunks, so a passage cut by one boundary is whole in the next")
    top_k: int = option(4, "actor: most snippets (documents and history together) put into the prompt")
    max_context_tokens: int = option(256, "actor: most tokens the whole added block (header and snippets) may take")
    history_len: int = option(
        8,
        "recent steps of a task (prompt end, action, reward) the broker keeps in Redis and sends "
        "with each rag_step, and the actor retrieves from; 0: none",
    )
    query_chars: int = option(
        2000,
        "characters of a prompt's end that are embedded (actor) and kept of each history entry's prompt (broker): "
        "equal by construction, so a history entry is embedded with exactly its own step's query text and comes from the cache",
    )
    embedder: str = option(
        "",
        "actor: a sentence-transformers style encoder (local directory) to embed with; empty: the "
        "policy's base model, mean-pooled, adapter off",
        path=local_path_or_id,
    )
    embed_batch: int = option(16, "actor: texts per embedding forward")

    def __post_init__(self) -> None:
        check(self.chunk_tokens > 0, f"`chunk_tokens` must be positive, got {self.chunk_tokens}")
        check(
            0 <= self.chunk_overlap < self.chunk_tokens,
            f"`chunk_overlap` must be 0 or more and less than `chunk_tokens` ({self.chunk_tokens}), got {self.chunk_overlap}",
        )
        check(self.top_k > 0, f"`top_k` must be positive, got {self.top_k}")
        check(self.max_context_tokens > 0, f"`max_context_tokens` must be positive, got {self.max_context_tokens}")
        check(self.history_len >= 0, f"`history_len` must be 0 or more, got {self.history_len}")
        check(self.query_chars > 0, f"`query_chars` must be positive, got {self.query_chars}")
        check(self.embed_batch > 0, f"`embed_batch` must be positive, got {self.embed_batch}")


@section("store")
@dataclass(kw_only=True)
class StoreSettings:
    """the Redis (and the weights directory) that broker, actors and learner share"""

    redis_url: str = option(
        "",
        "Redis URL (redis://host:port/db or unix:///path), without a password (PPOZ_REDIS_PASSWORD); empty: the broker"
        " and `ppoz up` start an embedded redis-server, an actor follows no weights (base model only), the learner refuses to start",
    )
    key_prefix: str = option("ppoz", "prefix of every Redis key, so several farms can share one Redis")
    stream_key: str = option("segments", "name (after the prefix) of the Redis Stream the broker writes closed segments to")
    consumer_group: str = option("learners", "consumer group on the stream: the broker creates it, the learners read through it")
    weights_dir: str = option(
        "",
        "a directory for the weight snapshots' chunks: on one host a tmpfs (/dev/shm/...: shared memory, the fastest), across"
        " hosts one every process mounts (NFS, a parallel file system); empty: the chunks are Redis keys, which needs about"
        " (weights_kept + 1) x the snapshot's size of Redis memory (docs/farm.md)",
        path=local_path,
    )
    weights_kept: int = option(3, "weight snapshots kept, newest first: an actor still reading one a newer replaced can finish")

    def __post_init__(self) -> None:
        for name in ("key_prefix", "stream_key", "consumer_group"):  # parts of Redis key names and stream commands
            value = getattr(self, name)
            check(value != "" and " " not in value, f"`{name}` must be a non-empty word, got {value!r}")
        check(not (secret := password_in_url(self.redis_url)), secret or "")
        check(self.weights_kept >= 1, f"`weights_kept` must be 1 or more, got {self.weights_kept}")

    @property
    def keys(self) -> RedisKeys:
        """Every Redis key of this deployment."""
        return RedisKeys(self.key_prefix, self.stream_key)


@dataclass(frozen=True, kw_only=True)
class PolicyStamp:
    """What one choice was scored with: the actor sends it with every result, the broker stores it
    with the transition, and the learner trains only on transitions scored as it scores.

    `run` is the learner run whose weights scored it ("" before the actor loaded any snapshot:
    the base weights). `path` is informative: every path computes the same function (checked at
    start), so the learner does not compare it. The other fields define the behaviour policy.
    """

    run: str
    normalisation: str
    temperature: float
    lora_rank: int
    greedy: bool
    path: str = ""

    COMPARED = ("run", "normalisation", "temperature", "lora_rank", "greedy")

    def to_wire(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "normalisation": self.normalisation,
            "temperature": self.temperature,
            "lora_rank": self.lora_rank,
            "greedy": self.greedy,
            "path": self.path,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PolicyStamp:
        """Raises ValueError naming the field that is missing or of the wrong type."""
        kinds: dict[str, Any] = {
            "run": str,
            "normalisation": str,
            "temperature": (int, float),
            "lora_rank": int,
            "greedy": bool,
            "path": str,
        }
        for name, kind in kinds.items():
            value = d.get(name, "" if name == "path" else None)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"policy stamp field `{name}` must be {kind}, got {value!r}")
        return cls(
            run=str(d["run"]),
            normalisation=str(d["normalisation"]),
            temperature=float(d["temperature"]),
            lora_rank=int(d["lora_rank"]),
            greedy=bool(d["greedy"]),
            path=str(d.get("path", "")),
        )

    def disagreement(self, learner: PolicyStamp, version: int, fields: tuple[str, ...] = COMPARED) -> str | None:
        """The first of `fields` where this choice's policy (scored at `version`) differs from the learner's, else None.

        The base weights (run "", an actor that has loaded no snapshot yet) at version 0 are every run's
        version 0 (a fresh adapter is the identity, trainable copies start as the base's): they agree,
        and their lag decides whether they are trained."""
        for name in fields:
            if getattr(self, name) != getattr(learner, name):
                if name == "run" and self.run == "" and version == 0:
                    continue
                return name
        return None
