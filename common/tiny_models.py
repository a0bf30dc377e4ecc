"""Tiny causal LMs built locally from a config, for tests, benchmarks and the demo.

Nothing is downloaded: the tokenizer is byte-level (every UTF-8 byte is a
token, plus BOS/EOS/PAD), built with the `tokenizers` library, and the model
gets random weights from its config. Both are written with save_pretrained so
they load through the same `from_pretrained` path a real model takes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "gpt2")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


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
    if arch == "llama":
        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            **common,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, n_inner=intermediate, **common)
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


def build_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Build and save a tiny model + byte tokenizer under `path` (reused if already there)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    marker = path / "ppoz_tiny.json"
    spec = {"arch": arch, "seed": seed, **config_overrides}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_overrides))
    model.save_pretrained(str(path))
    marker.write_text(json.dumps(spec))
    log.info("built a tiny %s model (%d parameters) in %s", arch, sum(p.numel() for p in model.parameters()), path)
    return path
