"""A local reward model: tiny ones built and saved here, loaded through from_pretrained as a real one is."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models.tiny_models import TOKENIZER_BUILDERS, WORDS
from rewards.functions import RewardError
from rewards.reward_model import RewardModel, RewardModelConfig

PAIRS = [
    ("What is 2+3?", "5"),
    ("Name a colour.", "Blue, and a much longer answer that pads the others in its batch"),
    ("Say hi.", "hi"),
    ("An empty response:", ""),
    ("Write one word.", "word"),
]


@pytest.fixture(params=["deberta-v2", "llama"])
def reward_model_dir(request, tiny_reward_model):
    return tiny_reward_model(request.param)


def own_score(path: str, prompt: str, response: str) -> float:
    """The model's own forward on the tokenizer's text pair, one pair alone (no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return float(model(**tokenizer(prompt, response, return_tensors="pt")).logits[0, 0])


def test_batched_scores_are_each_pairs_own_score(reward_model_dir) -> None:
    rm = RewardModel(RewardModelConfig(reward_model_dir, batch_size=3))
    assert rm.format == "pair"
    scores = rm.score(PAIRS)
    expected = [own_score(reward_model_dir, p, r) for p, r in PAIRS]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) > 1  # a random head still tells the pairs apart
    assert rm.score(PAIRS[::-1]) == pytest.approx(scores[::-1], abs=1e-5)  # the batch's other members do not matter


def test_a_chat_template_is_used_when_the_tokenizer_has_one(tmp_path, tiny_reward_model) -> None:
    path = shutil.copytree(tiny_reward_model("llama"), tmp_path / "chat-rm")  # a copy: its tokenizer gets a chat template
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    rm = RewardModel(RewardModelConfig(str(path)))
    assert rm.format == "chat"
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        # the rendered template, tokenized as apply_chat_template does (the template writes any special tokens itself)
        rendered = tokenizer("<user>Say hi.\n<assistant>hi\n", add_special_tokens=False, return_tensors="pt")
        expected = float(model(**rendered).logits[0, 0])
    assert rm.score([("Say hi.", "hi")]) == pytest.approx([expected], abs=1e-5)
    assert RewardModel(RewardModelConfig(str(path), format="pair")).format == "pair"


def test_over_length_pairs_are_cut_and_counted_not_failed(reward_model_dir) -> None:
    rm = RewardModel(RewardModelConfig(reward_model_dir, max_length=32))
    scores = rm.score([("p" * 100, "r" * 100), ("short", "ok")])
    assert len(scores) == 2 and rm.truncated == 1
    assert scores[1] == pytest.approx(own_score(reward_model_dir, "short", "ok"), abs=1e-5)


def test_bad_settings_are_named(reward_model_dir, tmp_path) -> None:
    with pytest.raises(RewardError, match="has 1 labels; `label_index` 1 is not one"):
        RewardModel(RewardModelConfig(reward_model_dir, label_index=1))
    with pytest.raises(RewardError, match="cannot be loaded as a sequence classifier"):
        RewardModel(RewardModelConfig(str(tmp_path / "nothing-here")))
    with pytest.raises(RewardError, match="needs a tokenizer with a chat template"):
        RewardModel(RewardModelConfig(reward_model_dir, format="chat"))
    for bad, words in [(dict(batch_size=0), "batch_size"), (dict(format="xml"), "format"), (dict(dtype="int8"), "dtype")]:
        with pytest.raises(ValueError, match=words):
            RewardModelConfig(reward_model_dir, **bad)


# --- issue 30: a text too long to matter is cut before it is tokenized, to what truncation keeps ----------------------
@pytest.fixture(scope="module")
def reward_model_with(tiny_reward_model, tmp_path_factory) -> Callable[..., str]:
    """A tiny reward model with one of the tiny tokenizers (models.tiny_models): `reward_model_with("bpe")`."""
    built: dict[tuple[str, str], str] = {}

    def get(tokenizer: str, arch: str = "deberta-v2") -> str:
        if tokenizer == "byte":
            return tiny_reward_model(arch)
        if (tokenizer, arch) not in built:
            path = tmp_path_factory.mktemp(f"reward-{arch}-{tokenizer}")
            shutil.copytree(tiny_reward_model(arch), path, dirs_exist_ok=True)
            for old in [*path.glob("tokenizer*"), *path.glob("special_tokens_map.json")]:
                old.unlink()
            tok = TOKENIZER_BUILDERS[tokenizer](path)
            model = AutoModelForSequenceClassification.from_pretrained(path)
            model.resize_token_embeddings(len(tok), mean_resizing=False)
            model.save_pretrained(path)
            built[tokenizer, arch] = str(path)
        return built[tokenizer, arch]

    return get


class Watched:
    """A tokenizer that notes the longest text it was given (a chat: its contents together)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __call__(self, *texts: str, **settings: Any) -> Any:
        self.longest = max(self.longest, *(len(t) for t in texts if isinstance(t, str)))
        return self.tokenizer(*texts, **settings)

    def apply_chat_template(self, messages: list[dict[str, str]], **settings: Any) -> Any:
        self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return self.tokenizer.apply_chat_template(messages, **settings)


def watched(rm: RewardModel) -> Watched:
    seen = Watched(rm.tokenizer)
    rm.tokenizer = seen
    return seen


def text(rng: random.Random, chars: int) -> str:
    """Shapes users send: words, runs of one letter, of spaces, of newlines, of punctuation; digits, non-ASCII, emoji."""
    words = ["the", "emulator", "clicked", "button", "SettingsActivity", "42", "1234567", "é", "ß", "中文", "🙂", "don't", "tab\t"]
    words += ["x" * 40, "\n\n", "...", "  ", "=" * 30, "<s>"]
    out: list[str] = []
    size = 0
    while size < chars:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out)


def scores_of(path: str, rows: list[list[int]]) -> list[float]:
    """The model's own forward on each row of ids alone."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in rows]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe", "sentencepiece"])
def test_a_huge_text_is_cut_before_tokenizing_to_the_end_truncation_keeps_and_scores_the_same(reward_model_with, tokenizer) -> None:
    """A text of more than max_length x (the longest token's characters) cannot fit, so only its end that the
    tokenizer's longest-first truncation (left side) keeps is tokenized. The score, and the very tokens, equal
    those of the tokenizer's own truncation of the whole pair: a byte-level BPE as GPT-2's, Llama 3's and Qwen's,
    a SentencePiece BPE as Llama 2's, and bytes alone. A 30 MB pair took 50 to 70 s to tokenize whole."""
    path = reward_model_with(tokenizer)
    rm = RewardModel(RewardModelConfig(path, max_length=64))  # room for 64 tokens: even, so no odd token to give
    tok = AutoTokenizer.from_pretrained(path)
    tok.truncation_side = "left"
    assert rm.text_bound is not None and rm.counts_white_space, "these tokenizers keep every character: all of them count"
    rng = random.Random(len(tokenizer))
    # (the whole pair's own truncation pairs every overflowing piece of one text with every one of the other's: the
    # references here keep both texts' product small)
    pairs = [(text(rng, 200_000), "ok"), ("A short prompt.", text(rng, 200_000)), (text(rng, 3_000), text(rng, 3_000))]
    for chars in (3_000, 20_000):
        huge, short, long = text(rng, chars), text(rng, rng.choice([1, 30, 200])), text(rng, 400)
        pairs += [(huge, short), (short, huge), (huge, long), (long, huge), (huge, "")]
    pairs += [("x" * 30_000, "ok"), ("ok", " " * 30_000), ("\n" * 30_000, "ok"), ("🙂" * 30_000, "ok"), (("y" * 500 + " ") * 60, "ok")]
    seen = watched(rm)
    wholes = []
    for prompt, response in pairs:
        before = rm.truncated
        ids = rm._encode(prompt, response)
        wholes.append(list(tok(prompt, response, truncation="longest_first", max_length=64)["input_ids"]))
        assert ids == wholes[-1], (tokenizer, len(prompt), len(response))
        assert rm.truncated == before + 1
    assert seen.longest <= 2 * rm.text_bound + 1, f"a text of {seen.longest} characters was tokenized; the bound is {rm.text_bound}"
    some = [0, 1, 2, 3, 12]  # 200,000 characters beside a short text and after one, both long, 3,000, 20,000 alone
    assert rm.score([pairs[i] for i in some]) == pytest.approx(scores_of(path, [wholes[i] for i in some]), abs=1e-5)


def test_a_huge_chat_prompt_skips_the_halvings_that_cannot_fit_and_a_huge_response_is_refused_at_once(tmp_path, tiny_reward_model) -> None:
    """A chat keeps the prompt's start, halving it until the whole fits: the halvings still past the bound cannot fit
    and are skipped untokenized; the first that may is where the halving goes on, as it did. A response past the
    bound cannot fit beside any prompt: refused at once, where it was tokenized with each halving of the prompt first."""
    path = shutil.copytree(tiny_reward_model("llama"), tmp_path / "chat-rm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    rm = RewardModel(RewardModelConfig(str(path), max_length=64))
    assert rm.format == "chat" and rm.text_bound is not None

    def halved(prompt: str, response: str) -> list[int]:  # the rule on the whole prompt, as before the bound
        keep, ids = len(prompt), rm._chat_ids(prompt, response)
        while len(ids) > 64:
            keep //= 2
            ids = rm._chat_ids(prompt[:keep], response)
        return ids

    rng = random.Random(7)
    seen = watched(rm)
    for prompt in [text(rng, 200_000), text(rng, 5_000), " " * 100_000 + "end", "x" * 70_001]:
        seen.longest = 0
        ids = rm._encode(prompt, "A short answer.")
        assert seen.longest <= rm.text_bound + len("A short answer."), f"{seen.longest} characters tokenized"
        assert ids == halved(prompt, "A short answer."), len(prompt)
    assert rm.truncated == 4
    seen.longest = 0
    with pytest.raises(RewardError, match="a response alone is longer than the reward model's limit of 64 tokens"):
        rm.score([("Say hi.", text(rng, 1_000_000))])
    assert seen.longest == 0  # refused before any tokenizing


def test_a_long_pair_is_truncated_without_pairing_every_overflowing_piece(reward_model_with) -> None:
    """The tokenizer's own truncation of a text pair pairs each overflowing piece of one text with each of the other's:
    5 s for 5,000 and 20,000 words at 64 tokens (86 s for 20,000 and 50,000 characters of bytes). Each text is now
    tokenized alone and cut by the same longest-first rule: the same tokens, in milliseconds. A word-level tokenizer
    has no character bound, so this is all that keeps its long pairs cheap."""
    path = reward_model_with("words")
    rm = RewardModel(RewardModelConfig(path, max_length=64))
    assert rm.text_bound is None  # an unknown word of any length is one token: no bound on characters
    tok = AutoTokenizer.from_pretrained(path)
    tok.truncation_side = "left"
    rng = random.Random(3)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    for prompt, response in [(words(300), words(1_000)), (words(1_000), words(30)), (words(20), words(700)), (words(10), "")]:
        whole = list(tok(prompt, response, truncation="longest_first", max_length=64)["input_ids"])
        assert rm._encode(prompt, response) == whole
    for rooms in (63, 61):  # an odd room: the odd token goes to the longer text, as the tokenizer gives it
        odd = RewardModel(RewardModelConfig(path, max_length=rooms))
        for prompt, response in [(words(300), words(400)), (words(400), words(300)), (words(300), words(300))]:
            assert odd._encode(prompt, response) == list(tok(prompt, response, truncation="longest_first", max_length=rooms)["input_ids"])
    prompt, response = words(5_000), words(20_000)
    started = time.perf_counter()
    rm.score([(prompt, response)])
    took = time.perf_counter() - started
    # a timing claim, kept (the bound on characters keeps the tokenizer off the texts' whole length); it passed beside
    # two spinners (bin/test --busy 2)
    assert took < 1.0, f"a pair of 5,000 and 20,000 words took {took:.1f} s"
