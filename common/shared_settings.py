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

Nothing here imports torch: the broker and the uniform actor load these too.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check, option, section
from common.options import DTYPE_NAMES, NORMALISATIONS, SCORING_PATHS


@section("policy")
@dataclass(kw_only=True)
class PolicySpec:
    """the policy as actor and learner must both see it"""

    model: str = option("", "causal LM: a local directory or a Hugging Face id; the actor serves the uniform random policy when empty")
    lora_rank: int = option(8, "rank of the LoRA adapter the learner trains (0: train all weights, for tiny models)")
    lora_alpha: int = option(16, "LoRA alpha")
    dtype: str = option(
        "auto", "base model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16; the adapter stays float32"
    )
    normalisation: str = option("word", "how a candidate's summed log-probability is normalised: token, word (PPOAPI's default) or sum")
    temperature: float = option(1.0, "softmax temperature over the normalised candidate scores")
    scoring_path: str = option("auto", "how candidates are scored: auto (checked at start), packed, kv_batch or per_candidate")

    def __post_init__(self) -> None:
        check(self.lora_rank >= 0, f"`lora_rank` must be 0 or more, got {self.lora_rank}")
        check(self.lora_alpha > 0, f"`lora_alpha` must be positive, got {self.lora_alpha}")
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
