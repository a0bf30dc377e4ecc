"""The work `ppoz bench train` gives both legs: a model, training and validation prompts, a reward, a budget.

- `demo`: the arithmetic demo's (ppoz/demo_arithmetic.py): "what is two plus three" -> "five" on the tiny
  numbers-llama model, `first_word`, 2 new tokens; validated on the 25 sums it trains on.
- `long`: a word said N times, "say seven one six times" -> "seven" 16 times, for N from 16 to 255, so the
  rewarded answers run from 16 to 255 tokens, differently per prompt; the reward (`repeat_score`) counts the
  response's words that are the word asked for over the longer of the answer and the response, so it needs
  the whole response: every right word counts, every word short of N or past it costs, and only the answer
  itself scores 1. 256 new tokens. A tiny Llama (hidden 128, 4 layers) with the `repeat` word tokenizer;
  216 training prompts (lengths), 24 held-out lengths (every tenth) validated greedily.
- `real-shape`: the `long` task on a model with Qwen2.5-0.5B's configuration (hidden 896, 24 layers, 14 heads
  with 2 KV heads, intermediate 4,864, vocabulary 151,936, tied embeddings, rope theta 1e6), random weights
  built here, and a byte-level BPE tokenizer as Qwen2's trained on the task's text and padded with filler
  words to the whole vocabulary (its ids are the model's). Random weights write filler words to the end of
  the budget: throughput only, no validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.tiny_models import DIGIT_WORDS, SPECIAL_TOKENS

CACHE = Path.home() / ".cache" / "ppoz"
REPEAT_SOURCE = "repeat_words"
REPEAT_WORD = "seven"  # one word for every prompt: the task is the length (with a word per prompt to copy, the tiny
# model had learned nothing in 150 s: validation 0.00 after, responses of ~200 random words)
REPEAT_TIMES = (16, 255)  # answers of 16 to 255 words, then the end token: max_new_tokens 256
REAL_SHAPE_VOCAB = 151_936  # Qwen2.5's
VAL_TIMES = frozenset(range(20, 255, 10))  # held out: 24 lengths the policy never trains on


def say(number: int) -> str:
    """A number in digit words: 130 -> 'one three zero'."""
    return " ".join(DIGIT_WORDS[int(d)] for d in str(number))


def repeat_row(word: str, times: int) -> dict[str, Any]:
    """'say seven one six times' -> 'seven seven ... seven' (16 words)."""
    return {"prompt": f"say {word} {say(times)} times", "ground_truth": " ".join([word] * times), "data_source": REPEAT_SOURCE}


def repeat_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The response's words that are the word asked for, among its first N (the answer's length), over the longer of
    the answer and the response: each right word counts wherever it stands, every word short of N or past it costs.
    1 only for the answer itself."""
    said, answer = solution_str.split(), str(ground_truth).split()
    right = sum(1 for word in said[: len(answer)] if word == answer[0]) if answer else 0  # a word past the answer is never right
    return right / max(len(answer), len(said), 1)


def train_repeat_rows() -> list[dict[str, Any]]:
    return [repeat_row(REPEAT_WORD, n) for n in range(REPEAT_TIMES[0], REPEAT_TIMES[1] + 1) if n not in VAL_TIMES]


def val_repeat_rows() -> list[dict[str, Any]]:
    return [repeat_row(REPEAT_WORD, n) for n in sorted(VAL_TIMES)]


def numbers_model() -> Path:
    from models.tiny_models import build_tiny_model

    return build_tiny_model(CACHE / "numbers-llama", "llama", tokenizer="numbers")


def repeat_model() -> Path:
    from models.tiny_models import build_tiny_model

    return build_tiny_model(CACHE / "repeat-llama", "llama", tokenizer="repeat", hidden=128, layers=4)


def shaped_tokenizer(path: Path) -> None:
    """A byte-level BPE as Qwen2's (transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer, whatever the
    folder says), trained on the repeat task's text, its vocabulary filled with filler words to REAL_SHAPE_VOCAB
    ids (`<|endoftext|>`, which Qwen2Tokenizer adds, among them), so every id the model can write decodes."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([f"{r['prompt']} {r['ground_truth']}" for r in train_repeat_rows()[::10]], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    learned = len(vocab)
    vocab.update({f"Ġw{i}": learned + i for i in range(REAL_SHAPE_VOCAB - learned - 1)})
    vocab["<|endoftext|>"] = REAL_SHAPE_VOCAB - 1
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(str(path))


# Real models' configurations (their config.json), random weights: (hidden, intermediate, layers, heads, KV heads,
# the dtype the weights are saved in). "tiny-qwen2": the same architecture and vocabulary at a CPU test's width.
MODEL_SHAPES: dict[str, tuple[int, int, int, int, int, str]] = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, "float32"),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, "bfloat16"),  # 3.1 GB in bf16 (6.2 in float32)
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, "bfloat16"),  # 15.2 GB in bf16; its head is its own, not the embedding's
    "tiny-qwen2": (64, 128, 2, 4, 2, "float32"),
}
UNTIED = frozenset({"qwen2.5-7b"})  # shapes whose LM head is a weight of its own (Qwen2.5-7B's config.json)


def shape_config(shape: str, layers: int | None = None) -> Any:
    """The Qwen2Config of `shape` (MODEL_SHAPES), with `layers` decoder layers instead of the model's own if given."""
    from transformers import Qwen2Config

    hidden, intermediate, own_layers, heads, kv_heads, _ = MODEL_SHAPES[shape]
    return Qwen2Config(
        vocab_size=REAL_SHAPE_VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=own_layers if layers is None else layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=shape not in UNTIED,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def real_shape_model(shape: str = "qwen2.5-0.5b") -> Path:
    """A model of `shape`'s configuration (MODEL_SHAPES: Qwen2.5's, tied embeddings, a 151,936-token vocabulary)
    with random weights (seed 0) and shaped_tokenizer, built once into the cache."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    dtype = MODEL_SHAPES[shape][-1]
    path = CACHE / f"{shape}-shape"
    marker = path / "ppoz-bench-shape.json"
    name = "Qwen2.5-0.5B" if shape == "qwen2.5-0.5b" else shape  # as caches built before the other shapes record it
    spec = {"shape": name, "vocab": REAL_SHAPE_VOCAB, "seed": 0, "tokenizer": "bpe"}
    if dtype != "float32":
        spec["dtype"] = dtype
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    shaped_tokenizer(path)
    config = shape_config(shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    marker.write_text(json.dumps(spec))
    return path


@dataclass(frozen=True)
class TrainTask:
    name: str
    about: str
    model: Callable[[], Path]
    train_rows: Callable[[], list[dict[str, Any]]]
    val_rows: Callable[[], list[dict[str, Any]]]  # greedy validation prompts (none: throughput only)
    reward_fn: str  # as --reward-fn takes it
    max_new_tokens: int
    policy_lr: float  # all weights train (lora_rank 0), at this constant rate in both legs
    target: float | None  # the validation reward whose first time is reported (None: no validation)
    seconds: float  # the default budget of one run


def _sums() -> list[dict[str, Any]]:
    from ppoz.demo_arithmetic import sums

    return sums()


TASKS = {
    "demo": TrainTask(
        "demo", "the arithmetic demo: 25 sums in words, 2 new tokens", numbers_model, _sums, _sums, "first_word", 2, 3e-4, 0.7, 150.0
    ),
    "long": TrainTask(
        "long",
        "a digit word said 16 to 255 times: answers of 16-255 tokens, 256 new tokens",
        repeat_model,
        train_repeat_rows,
        val_repeat_rows,
        "tools.bench.train_tasks:repeat_score",
        256,
        3e-4,
        0.5,  # saying the word to the end of the budget for every prompt scores 0.53: learned length control is above it
        150.0,
    ),
    "real-shape": TrainTask(
        "real-shape",
        "the long task on Qwen2.5-0.5B's shape (random weights: throughput only)",
        real_shape_model,
        train_repeat_rows,
        list,
        "tools.bench.train_tasks:repeat_score",
        256,
        1e-6,
        None,
        240.0,  # on 2 CPU cores: a rollout of 32 responses of 256 tokens takes about 3 minutes to generate
    ),
}
