"""A local reward model: tiny ones built and saved here, loaded through from_pretrained as a real one is."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

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
