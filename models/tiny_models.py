"""Tiny causal LMs built locally from a config, for tests, benchmarks and the demo.

Nothing is downloaded. Three tokenizers, each written with save_pretrained so it
loads through the same `from_pretrained` path a real model's does:

- `byte`: every UTF-8 byte is a token, no merges (plus BOS/EOS/PAD). Token
  boundaries never matter with it, which is why it is not enough to test them.
- `bpe`: a byte-level BPE as GPT-2, Llama 3 and Qwen2 have (GPT-2's pre-tokenizer
  regex, so " click" is one word with its space), trained on `CORPUS` with the
  `tokenizers` library.
- `sentencepiece`: a SentencePiece BPE as Llama 2 and Mistral have (word-start
  marker, byte fallback), trained on `CORPUS` with the `sentencepiece` package.

The model gets random weights from its config.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "gpt2")
# What a tiny model trains in full beside its LoRA adapter (`lora_trainable`): its random LM head and
# final norm. A pretrained model's head already maps features to words; a random one's does not,
# and LoRA on the layers below cannot make up for it (the policy barely moves).
LORA_TRAINABLE = {"llama": ("lm_head", "model.norm"), "qwen2": ("lm_head", "model.norm"), "gpt2": ("lm_head", "ln_f")}
# The policy learning rate such a model trains at by default (`[learner] policy_lr = 0`), with LoRA and
# with all weights: random weights need steps far larger than a pretrained model's 1e-5 (LoRA) / 1e-6
# (all weights), which would leave the policy where it started for the length of a demo. LoRA's was 1e-3
# until `ppoz bench stability` ran the say-the-word task for 8,000 responses: at 1e-3 the policy reached
# 0.95 and then fell back (to 0.5 to 0.8) in most runs, at 3e-4 it took twice as many responses and stayed
# (docs/benchmarks.md, "Does it stay learned").
TINY_POLICY_LR = 3e-4
MARKER = "ppoz_tiny.json"  # in a tiny model's directory: how it was built (and that its weights are random)
TOKENIZERS = ("byte", "bpe", "sentencepiece", "words", "numbers", "repeat")
# The whole vocabulary of the `words` tokenizer: toy generation tasks (say the word the prompt names) that a
# random tiny model can learn in minutes, where a byte-level one would first have to find each letter by chance.
WORDS = ("say", "the", "word", "please", "now", "and", "then", "stop", "red", "green", "blue", "yellow", "black", "white", "pink", "grey")
# The `numbers` tokenizer's vocabulary: "what is two plus three" -> "five", the arithmetic demo's task.
NUMBER_WORDS = ("what", "is", "plus", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# The `repeat` tokenizer's vocabulary: "say seven one six times" -> "seven" 16 times, numbers said digit by digit
# (ppoz bench train's long task).
DIGIT_WORDS = NUMBER_WORDS[3:]
REPEAT_WORDS = ("say", "times", *DIGIT_WORDS)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]

# Text like what the policy reads and chooses (Kea's prompts and events, a text game's), so the
# trained tokenizers have whole-word tokens for it and boundaries that matter.
CORPUS = [
    "Task: explore the app. Screen: MainActivity with [0] Cart [1] Search [2] Settings.",
    "Which action should I choose next? I shall choose No. 1: TouchEvent(view=Search)",
    "0: TouchEvent(view=Cart) 1: LongTouchEvent(view=Settings) 2: KeyEvent(BACK) 3: ScrollEvent(down)",
    "click the button to open settings, press back and scroll down the list",
    "type hello world in the search box, then click search and open the first result",
    "You are in a dark room. There is a door to the north and a key on the table.",
    "take key, open door, go north, go south, look, inventory, drop key",
]


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar for writing even a 1 MB model: noise in the output of `ppoz demo`."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def build_byte_tokenizer(path: str | Path):
    """A byte-level tokenizer (ids 0-2 special, 3-258 the bytes) saved under `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space: " Cart" and "Cart" stay different tokens, as in GPT-2 and Llama-3 style BPE.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


def build_bpe_tokenizer(path: str | Path, vocab_size: int = 512):
    """A byte-level BPE with GPT-2's pre-tokenizer, trained on CORPUS, saved under `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


def build_sentencepiece_tokenizer(path: str | Path, vocab_size: int = 512):
    """A SentencePiece BPE (Llama 2 style: word-start marker, byte fallback) trained on CORPUS, saved under `path`."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    (path / "tokenizer.model").write_bytes(model.getvalue())
    settings = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = AutoTokenizer.from_pretrained(str(path))  # converted to a fast tokenizer from the SentencePiece model
    tok.save_pretrained(str(path))
    return tok


def build_words_tokenizer(path: str | Path, words: tuple[str, ...] = WORDS):
    """A word-level tokenizer over `words` (whitespace-split, one token per word), saved under `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def build_numbers_tokenizer(path: str | Path):
    """A word-level tokenizer over NUMBER_WORDS: sums in words for the arithmetic demo."""
    return build_words_tokenizer(path, NUMBER_WORDS)


def build_repeat_tokenizer(path: str | Path):
    """A word-level tokenizer over REPEAT_WORDS: a digit word said N times (ppoz bench train's long task)."""
    return build_words_tokenizer(path, REPEAT_WORDS)


TOKENIZER_BUILDERS = {
    "byte": build_byte_tokenizer,
    "bpe": build_bpe_tokenizer,
    "sentencepiece": build_sentencepiece_tokenizer,
    "words": build_words_tokenizer,
    "numbers": build_numbers_tokenizer,
    "repeat": build_repeat_tokenizer,
}


def tiny_config(
    arch: str,
    vocab_size: int = 259,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 8192,
):
    """A small config of the given architecture (llama, qwen2 or gpt2)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    intermediate = intermediate or 4 * hidden
    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch in ("llama", "qwen2"):  # the same layout; Qwen2 ties its head to the embeddings
        config_class = LlamaConfig if arch == "llama" else Qwen2Config
        return config_class(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=arch == "qwen2",
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, n_inner=intermediate, **common)
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


def build_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, tokenizer: str = "byte", **config_overrides) -> Path:
    """Build and save a tiny model + tokenizer (byte, bpe or sentencepiece) under `path` (reused if already there)."""
    import torch  # here, not at the top: `ppoz`'s parser reads this module's names, and `ppoz broker` needs no torch
    from transformers import AutoModelForCausalLM

    if tokenizer not in TOKENIZER_BUILDERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; known: {', '.join(TOKENIZERS)}")
    path = Path(path)
    marker = path / MARKER
    spec = {"arch": arch, "seed": seed, **config_overrides}
    if tokenizer != "byte":
        spec["tokenizer"] = tokenizer
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = TOKENIZER_BUILDERS[tokenizer](path)
    if tokenizer != "byte":
        config_overrides.setdefault("vocab_size", len(tok))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_overrides))
    with _no_progress_bars():
        model.save_pretrained(str(path))
    marker.write_text(json.dumps(spec))
    log.info("built a tiny %s model (%d parameters) in %s", arch, sum(p.numel() for p in model.parameters()), path)
    return path


REWARD_ARCHITECTURES = ("deberta-v2", "llama")


def build_tiny_reward_model(path: str | Path, arch: str = "deberta-v2", seed: int = 0) -> Path:
    """A tiny sequence-classification model (one label: the reward) with the byte tokenizer, saved under
    `path` and loaded as a real reward model is (`AutoModelForSequenceClassification.from_pretrained`).
    `deberta-v2` is an encoder as OpenAssistant's DeBERTa reward models are; `llama` a decoder that
    pools the last token, as Skywork's and most chat reward models do."""
    import torch
    from transformers import AutoModelForSequenceClassification, DebertaV2Config

    if arch not in REWARD_ARCHITECTURES:
        raise ValueError(f"unknown reward model architecture {arch!r}; known: {', '.join(REWARD_ARCHITECTURES)}")
    path = Path(path)
    marker = path / MARKER
    spec = {"arch": arch, "seed": seed, "head": "reward"}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer(path)
    if arch == "deberta-v2":
        size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
        config = DebertaV2Config.from_dict({"vocab_size": 259, "max_position_embeddings": 512, "pad_token_id": 0, **size})
    else:
        config = tiny_config("llama")
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with _no_progress_bars():
        model.save_pretrained(str(path))
    marker.write_text(json.dumps(spec))
    log.info("built a tiny %s reward model (%d parameters) in %s", arch, sum(p.numel() for p in model.parameters()), path)
    return path


def tiny_model_arch(model: str) -> str | None:
    """The architecture of a model directory PPOZ built with random weights (it holds MARKER), else None."""
    marker = Path(model) / MARKER
    if not marker.is_file():
        return None
    try:
        return str(json.loads(marker.read_text())["arch"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{marker} is not a tiny model's build record: {e}") from e


def default_lora_trainable(model: str) -> tuple[str, ...]:
    """`lora_trainable = ["auto"]`: a random tiny model's head and final norm; nothing for any other model."""
    arch = tiny_model_arch(model)
    return LORA_TRAINABLE.get(arch, ()) if arch else ()


def default_policy_lr(model: str, lora_rank: int) -> float:
    """`policy_lr = 0`: the learning rate for this model and adapter (docs/design.md, the LoRA defaults)."""
    if tiny_model_arch(model):
        return TINY_POLICY_LR
    return 1e-5 if lora_rank else 1e-6
