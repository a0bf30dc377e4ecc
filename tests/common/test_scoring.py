"""Candidate scoring: exact against the naive reference on several architectures, and the shared tokenization."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common import scoring as s

OBSERVATIONS = [
    (
        "Task: explore. Screen: MainActivity with [0] Cart [1] Search.",
        "Which action should I choose next? I shall choose No. ",
        ["0: TouchEvent(view=Cart)", "1: TouchEvent(view=Search) with a much longer description of the view", "x", "KillAppEvent()"],
    ),
    ("Écran: Réglages — ünïcödé 画面", "", [" leading space", "ü", "BACK"]),
    ("short", " q ", ["a", "b"]),
]


def load(path: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval(), AutoTokenizer.from_pretrained(path)


def items(tokenizer):
    return [s.tokenize_observation(tokenizer, *obs) for obs in OBSERVATIONS]


def test_tokenization_is_context_then_each_candidate_alone(tiny_models):
    _, tok = load(tiny_models["llama"])
    for prompt, question, actions in OBSERVATIONS:
        item = s.tokenize_observation(tok, prompt, question, actions)
        assert list(item.context) == tok(prompt + question)["input_ids"]
        assert item.context[0] == tok.bos_token_id
        for ids, text in zip(item.actions, actions):
            assert list(ids) == tok(text, add_special_tokens=False)["input_ids"]
            # byte-level: the boundary loses nothing, leading spaces and non-ASCII included
            assert tok.decode(list(item.context) + list(ids), skip_special_tokens=True) == prompt + question + text
        assert item.words == tuple(max(1, len(a.split())) for a in actions)


def test_empty_candidate_or_list_is_refused(tiny_models):
    _, tok = load(tiny_models["llama"])
    with pytest.raises(s.ScoringError, match="candidate 1"):
        s.tokenize_observation(tok, "p", "q", ["a", ""])
    with pytest.raises(s.ScoringError):
        s.tokenize_observation(tok, "p", "q", [])


def test_first_token_is_scored_from_the_last_context_position(tiny_models):
    """One-token candidates get log p(token | context) from a full-vocabulary log-softmax, not 0."""
    model, tok = load(tiny_models["llama"])
    item = s.tokenize_observation(tok, "Screen", " choose: ", ["a", "b", "c"])
    with torch.inference_mode():
        got = s.score_packed(model, [item])[0]
        logits = model(input_ids=torch.tensor([item.context])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)[[a[0] for a in item.actions]]
    assert torch.allclose(got, expected, atol=1e-5)
    assert (got < 0).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("path", ["packed", "kv_batch"])
def test_paths_equal_the_reference(tiny_models, arch, attn, path):
    model, tok = load(tiny_models[arch], attn)
    batch = items(tok)  # mixed context lengths, one-token and long candidates in one batch
    with torch.inference_mode():
        reference = s.score_per_candidate(model, batch)
        got = s.score(model, batch, path)
        alone = [s.score(model, [item], path)[0] for item in batch]
    for g, a, r in zip(got, alone, reference):
        assert g.shape == r.shape
        assert torch.allclose(g, r, atol=1e-4), (g - r).abs().max()
        assert torch.allclose(a, r, atol=1e-4)  # batching changes nothing


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_prefix_gives_the_uncached_result(tiny_models, arch):
    model, tok = load(tiny_models[arch])
    batch = items(tok)
    with torch.inference_mode():
        plain, kvs = s.score_packed_kv(model, batch)
        for m in (1, 5, len(batch[0].context) - 1):
            prefix = [(k[:, :, :m], v[:, :, :m]) for k, v in kvs[0]]
            cached = s.score_packed(model, batch, past=[(prefix, m), None, None])
            for c, p in zip(cached, plain):
                assert torch.allclose(c, p, atol=1e-4)
        # a longer prompt that extends the cached one (the history grows)
        longer = s.tokenize_observation(tok, OBSERVATIONS[0][0] + " then more history", OBSERVATIONS[0][1], OBSERVATIONS[0][2])
        common = 0
        while longer.context[common] == batch[0].context[common]:
            common += 1
        prefix = [(k[:, :, :common], v[:, :, :common]) for k, v in kvs[0]]
        assert torch.allclose(
            s.score_packed(model, [longer], past=[(prefix, common)])[0], s.score_per_candidate(model, [longer])[0], atol=1e-4
        )


def causal_only_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that ignores any given mask and applies plain causal masking (aligned to the end of
    the keys, as with a KV cache), like FlashAttention-2 on unpadded input."""
    q, k = query.shape[2], key.shape[2]
    causal = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(diagonal=k - q)
    return sdpa_attention_forward(module, query, key, value, causal[None, None], is_causal=False, **kwargs)


def test_select_path_falls_back_when_the_model_ignores_4d_masks(tiny_models):
    AttentionInterface.register("ppoz_test_causal_only", causal_only_attention)
    model, tok = load(tiny_models["llama"], "ppoz_test_causal_only")
    with torch.inference_mode():
        packed = s.score_packed(model, items(tok))
        reference = s.score_per_candidate(model, items(tok))
    assert max(float((a - b).abs().max()) for a, b in zip(packed, reference)) > 1e-3  # candidates saw each other
    assert s.select_path(model) == "kv_batch"
    model, _ = load(tiny_models["llama"])
    assert s.select_path(model) == "packed"
    assert s.select_path(model, "per_candidate") == "per_candidate"


def test_normalisation_and_policy_on_hand_computed_values():
    item = s.Tokenized((1, 2), ((5,), (6, 7), (8, 9, 10)), (1, 1, 3))
    sums = torch.tensor([-1.0, -4.0, -6.0])
    assert torch.allclose(s.normalise(sums, item, "sum"), sums)
    assert torch.allclose(s.normalise(sums, item, "token"), torch.tensor([-1.0, -2.0, -2.0]))
    assert torch.allclose(s.normalise(sums, item, "word"), torch.tensor([-1.0, -4.0, -2.0]))
    logp = s.policy_logprobs(torch.tensor([-1.0, -2.0, -2.0]), temperature=0.5)
    expected = torch.log(torch.exp(torch.tensor([-2.0, -4.0, -4.0])) / torch.exp(torch.tensor([-2.0, -4.0, -4.0])).sum())
    assert torch.allclose(logp, expected)
    with pytest.raises(ValueError, match="normalisation"):
        s.normalise(sums, item, "chars")


def test_gradients_flow_through_the_packed_path(tiny_models):
    """The learner trains on the same function: the packed scores are differentiable."""
    model, tok = load(tiny_models["qwen2"])
    total = sum(x.sum() for x in s.score_packed(model, items(tok)))
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
