"""A prompt that cannot fit is refused before it is tokenized: no token covers more characters than the tokenizer's
longest spelling, so more characters (white space not counted) than capacity x that means more tokens (issue 30)."""

from __future__ import annotations

import random
import time

import pytest

from actor_node.generation_engine import GenerationEngine
from actor_node.responses import GenerationError, prompt_chars
from models.policy_model import ModelSpec, load_policy
from models.scoring import longest_token_chars
from tests.actor_node.test_engine_against_generate import job


def texts(seed: int) -> list[str]:
    """Shapes users send: words, long runs of one letter, runs of spaces and newlines, digits, non-ASCII, emoji."""
    rng = random.Random(seed)
    words = ["the", "emulator", "clicked", "button", "SettingsActivity", "42", "é", "ß", "中文", "🙂", "tab\t", "x" * 40]
    out = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 300))) for _ in range(20)]
    out += ["a" * 5000, "a" + " " * 3000 + "b", "\n".join(["line"] * 500), "0123456789" * 300, "🙂" * 700, "中" * 900]
    return out


@pytest.mark.parametrize("tokenizer", ["byte", "bpe", "sentencepiece", "words", "numbers"])
def test_no_token_covers_more_characters_than_the_longest_spelling(tiny_model, tokenizer) -> None:
    """The bound the refusal rests on, for each kind of tokenizer built here: tokens >= characters / longest. The
    word-level ones break it (an unknown 40-letter word is one token), so they get no bound."""
    _, tok = load_policy(ModelSpec(model=tiny_model("llama", tokenizer=tokenizer), device="cpu", lora_rank=0))
    longest = longest_token_chars(tok)
    if tokenizer in ("words", "numbers"):  # a whole unknown word is one token: no bound, no refusal before tokenizing
        assert longest is None
        return
    assert longest is not None and longest >= 1
    vocab = tok.get_vocab()
    widest = tok.decode([vocab[max(vocab, key=len)]])  # the longest spelling's own text: the bound is tight on it
    for text in [*texts(seed=len(tokenizer)), widest * 50, " ".join([widest] * 50)]:
        n = len(tok(text)["input_ids"])
        chars = prompt_chars({"prompt": text})
        assert n * longest >= chars, f"{tokenizer}: {n} tokens of at most {longest} characters for {chars} characters: {text[:80]!r}"


def test_a_999k_character_prompt_is_refused_before_tokenizing_and_the_small_one_beside_it_is_served(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["gpt2"], device="cpu", lora_rank=0))
    engine = GenerationEngine(model, tokenizer, max_rows=4, max_positions=256)
    huge = job(0, "word " * 199_800, 4)  # 999,000 characters
    messages = {**job(1, "", 4), "obs": {**job(1, "", 4)["obs"], "messages": [{"role": "user", "content": "x" * 999_000}]}}
    messages["obs"].pop("prompt", None)
    small = job(2, "hello there", 4)
    started = time.perf_counter()
    answered = engine.add([huge, messages, small])
    took = time.perf_counter() - started
    assert [j for j, _ in answered] == [huge, messages] and all(isinstance(e, GenerationError) for _, e in answered)
    for _, error in answered:
        assert "cannot fit in 256 positions" in str(error) and "refused before tokenizing" in str(error), str(error)
    # A timing claim, kept: refused before tokenizing. Measured on the 2-core VM under load: 25-30 ms for the refusals
    # and the small prompt's prefill (x17 to the bound), 2.5 s to tokenize the huge prompt once (5 times the bound)
    assert took < 0.5, f"the refusals took {took:.2f} s (tokenizing 999,000 characters takes seconds)"
    assert [row.job for row in engine.rows] == [small]
    # the bound is no cap on prompts that fit: one of 240 tokens (of 256) is served
    fits = job(3, "hello " * 40, 2)
    assert engine.add([fits]) == [] and [row.job for row in engine.rows] == [small, fits]
