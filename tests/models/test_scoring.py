"""Candidate scoring: every path equals the model's own `model(input_ids).logits`, on several
architectures, dtypes and tokenizers; the path check; the token boundary rule."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from models import scoring as s
from tests.helpers import own_logits_scores

OBSERVATIONS = [
    (
        "Task: explore. Screen: MainActivity with [0] Cart [1] Search.",
        "Which action should I choose next? I shall choose No. ",
        ["0: TouchEvent(view=Cart)", "1: TouchEvent(view=Search) with a much longer description of the view", "x", "KillAppEvent()"],
    ),
    ("Écran: Réglages — ünïcödé 画面", "", [" leading space", "ü", "BACK"]),
    ("short", " q ", ["a", "b"]),
]

# Contexts and candidates where the token boundary matters: a trailing space (" click" is one BPE
# token), none (the candidate continues a word, so SentencePiece must not mark a word start), a newline.
BOUNDARIES = [
    ("I shall choose No. ", ["1: TouchEvent(view=Search)", "click", "s and scroll"]),
    ("Screen: [0] Cart", ["1: TouchEvent(view=Search)", "click", " search", "s and scroll"]),
    ("take key, open door\n", ["go north", " look", "inventory"]),
    ("", ["take key", "look"]),
]


def load(path: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


def items(tokenizer):
    return [s.tokenize_observation(tokenizer, *obs) for obs in OBSERVATIONS]


@pytest.fixture
def trained_tokenizer_models(tiny_model) -> dict[str, str]:
    """Tiny Llama-style models with a byte-level BPE and a SentencePiece tokenizer trained locally."""
    return {kind: tiny_model("llama", tokenizer=kind) for kind in ("bpe", "sentencepiece")}


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_tokens_are_those_of_the_joined_text(tiny_models, trained_tokenizer_models, kind):
    """Context + candidate tokens are the tokens of the text the model reads, prompt + question +
    candidate, BOS included: with a trained BPE the context's trailing space joins the candidate's
    first word, and SentencePiece marks a word start only where the joined text has one."""
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"] if kind == "byte" else trained_tokenizer_models[kind])
    for context, actions in BOUNDARIES + [(p + q, a) for p, q, a in OBSERVATIONS]:
        item = s.tokenize_observation(tok, context, "", actions)
        assert item.context == tuple(tok(context.rstrip())["input_ids"])
        for ids, text in zip(item.actions, actions):
            assert list(item.context) + list(ids) == tok(context + text)["input_ids"], (kind, context, text)
        assert item.words == tuple(max(1, len(a.split())) for a in actions)


def test_the_boundary_rule_changes_what_trained_tokenizers_score(trained_tokenizer_models):
    """Guard for the test above: tokenizing each candidate on its own gives other tokens with both tokenizers."""
    contexts = {"bpe": "I shall choose No. ", "sentencepiece": "Screen: [0] Cart"}  # " click" is one BPE token; "click" no word start
    for kind, path in trained_tokenizer_models.items():
        tok = AutoTokenizer.from_pretrained(path)
        item = s.tokenize_observation(tok, contexts[kind], "", ["click"])
        assert list(item.actions[0]) != tok("click", add_special_tokens=False)["input_ids"], kind


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_scores_with_trained_tokenizers_equal_the_models_own_logits(trained_tokenizer_models, kind):
    model, tok = load(trained_tokenizer_models[kind])
    batch = [s.tokenize_observation(tok, context, "", actions) for context, actions in BOUNDARIES if context]
    with torch.inference_mode():
        got = s.score(model, batch, s.select_path(model))
    for g, item in zip(got, batch):
        assert torch.allclose(g, own_logits_scores(model, item), atol=1e-4)


def test_a_candidate_that_merges_into_the_contexts_last_token_is_tokenized_on_its_own(trained_tokenizer_models):
    """docs/protocol.md, "How the candidates are scored": with no pre-tokenizer boundary at the join ("go nor" +
    "th" is one BPE word) the candidate's tokens are its own, without special tokens, after the unchanged context."""
    tok = AutoTokenizer.from_pretrained(trained_tokenizer_models["bpe"])
    item = s.tokenize_observation(tok, "go nor", "", ["th", "th now"])
    assert list(item.context) + list(item.actions[0]) != tok("go north")["input_ids"]  # it merges: the joined text reads otherwise
    assert item.context == tuple(tok("go nor")["input_ids"])
    assert [list(a) for a in item.actions] == [tok(a, add_special_tokens=False)["input_ids"] for a in ("th", "th now")]


def test_a_word_is_a_run_of_characters_other_than_white_space_and_a_candidate_has_at_least_one(tiny_models):
    """`word` normalisation's count: white space is what str.isspace() says (U+3000 and U+001F are, the zero-width
    space U+200B is not); a candidate of white space only counts 1."""
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    item = s.tokenize_observation(tok, "Screen", ": ", ["pick up  the\ttomato", " ", "a\u3000b\x1fc", "x\u200by"])
    assert item.words == (4, 1, 3, 1)


def test_empty_candidate_or_list_is_refused(tiny_models):
    _, tok = load(tiny_models["llama"])
    with pytest.raises(s.ScoringError, match="candidate 1"):
        s.tokenize_observation(tok, "p", "q", ["a", ""])
    with pytest.raises(s.ScoringError):
        s.tokenize_observation(tok, "p", "q", [])


def test_first_token_is_scored_from_the_last_context_position(tiny_models):
    """One-token candidates get log p(token | context) from a full-vocabulary log-softmax, not 0."""
    model, tok = load(tiny_models["llama"])
    item = s.tokenize_observation(tok, "Screen", " choose:", ["a", "b", "c"])  # no trailing space: one-token candidates
    with torch.inference_mode():
        got = s.score_packed(model, [item])[0]
        logits = model(input_ids=torch.tensor([item.context])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)[[a[0] for a in item.actions]]
    assert torch.allclose(got, expected, atol=1e-5)
    assert (got < 0).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("path", s.PATHS)
def test_paths_equal_the_models_own_logits(tiny_models, arch, attn, path):
    model, tok = load(tiny_models[arch], attn)
    batch = items(tok)  # mixed context lengths, one-token and long candidates in one batch
    with torch.inference_mode():
        got = s.score(model, batch, path)
        alone = [s.score(model, [item], path)[0] for item in batch]
    for g, a, item in zip(got, alone, batch):
        reference = own_logits_scores(model, item)
        assert g.shape == reference.shape
        assert torch.allclose(g, reference, atol=1e-4), (g - reference).abs().max()
        assert torch.allclose(a, reference, atol=1e-4)  # batching changes nothing


def saved_model(config, path, dtype=torch.float32):
    """A model of this config with random weights, saved and loaded back through from_pretrained."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()


def small(**extra):
    return dict(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **extra
    )


def random_items(vocab: int, context: int, seed: int = 1) -> list[s.Tokenized]:
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())

    return [s.Tokenized(tokens(context), (tokens(3), tokens(1), tokens(5)), (1, 1, 1)), s.Tokenized(tokens(7), (tokens(2),), (1,))]


@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_logit_scaled_architectures_are_scored_as_the_model_scores(tmp_path, arch):
    """Cohere multiplies the head's output by logit_scale, Granite divides by logits_scaling: every path
    applies it (LogitTransform), so packed is chosen and all paths equal model(input_ids).logits."""
    from transformers import CohereConfig, GraniteConfig

    config = CohereConfig(**small(logit_scale=0.25)) if arch == "cohere" else GraniteConfig(**small(logits_scaling=4.0))
    model = saved_model(config, tmp_path / arch)
    batch = random_items(259, context=12)
    assert s.select_path(model) == "packed"
    with torch.inference_mode():
        for path in s.PATHS:
            for got, item in zip(s.score(model, batch, path), batch):
                assert torch.allclose(got, own_logits_scores(model, item), atol=1e-4), path


def test_a_sliding_window_model_is_scored_past_its_window(tmp_path):
    """The packed path's 4D mask sees the whole context; a Mistral-style model attends to its last
    `sliding_window` positions only. The path check's probe crosses the window, so packed is refused,
    and the chosen path equals the model's own logits on contexts three windows long."""
    from transformers import MistralConfig

    model = saved_model(MistralConfig(**small(sliding_window=16, max_position_embeddings=256)), tmp_path / "mistral")
    batch = random_items(259, context=48)
    with torch.inference_mode():
        packed = s.score_packed(model, batch)
    assert max(float((g - own_logits_scores(model, item)).abs().max()) for g, item in zip(packed, batch)) > 1e-2
    path = s.select_path(model)
    assert path != "packed"
    with torch.inference_mode():
        for got, item in zip(s.score(model, batch, path), batch):
            assert torch.allclose(got, own_logits_scores(model, item), atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_packed_is_chosen_in_bfloat16_with_realistic_logits(tiny_models, arch):
    """A random tiny model's logits are below 1; a trained model's reach tens. Scaled up so, in
    bfloat16, the packed path must still pass the check (the old absolute 1e-3 bar refused it)."""
    model, tok = load(tiny_models[arch], dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(60.0)
    with torch.inference_mode():
        largest = float(model(input_ids=torch.tensor([items(tok)[0].context])).logits.abs().max())
    assert largest > 10
    assert s.select_path(model) == "packed"
    assert next(model.parameters()).dtype == torch.bfloat16  # the check's float32 upcast is undone
    batch = items(tok)
    with torch.inference_mode():
        for got, item in zip(s.score_packed(model, batch), batch):
            assert torch.isfinite(got).all()
            assert float((got - own_logits_scores(model, item)).abs().max()) < 0.1 * largest


def test_the_lm_head_runs_in_float32_at_scored_positions(tiny_models):
    """In bfloat16 the head's output is not rounded to 16 bits before the log-softmax."""
    model, _ = load(tiny_models["llama"], dtype=torch.bfloat16)
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(60.0)
    hidden = torch.randn(6, head.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    targets = torch.tensor([3, 7, 11, 100, 200, 250])
    with torch.inference_mode():
        got = s.token_logprobs(head, s.LogitTransform(), hidden, targets)
        exact = torch.log_softmax(hidden.float() @ head.weight.float().T, -1).gather(-1, targets[:, None]).squeeze(-1)
        rounded = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(got, exact, atol=1e-4)
    assert float((rounded - exact).abs().max()) > 1e-3  # what rounding the logits first would cost


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


def test_a_16_bit_heads_float32_copy_is_made_once_per_version_of_its_weight_and_refreshed_in_place() -> None:
    from models.scoring.lm_head import _float32_weight, head_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    want = hidden.float() @ head.weight.float().T
    with torch.inference_mode():  # as the actor calls it; the copy must still serve a forward with a graph
        assert torch.equal(head_logits(head, hidden), want)
    first = _float32_weight(head.weight)
    assert _float32_weight(head.weight) is first  # kept: no copy per call
    with torch.no_grad():
        head.weight.mul_(2)  # new weights copied in place (an actor's swap, an optimizer step)
    with torch.inference_mode():  # the actor's way: refreshed in place, so a captured step reading it reads the new weights
        assert torch.equal(head_logits(head, hidden), 2 * want)
    assert _float32_weight(head.weight) is first and torch.equal(first, head.weight.float())
    with torch.no_grad():
        head.weight.mul_(2)
    assert _float32_weight(head.weight) is not first  # where a gradient is recorded: a new copy, the saved one left be
    assert torch.equal(head_logits(head, hidden), 4 * want)
    head.weight.data = torch.zeros_like(head.weight)  # a new tensor put in its place
    assert not head_logits(head, hidden).any()
    grad_in = hidden.float().requires_grad_(True).to(torch.bfloat16)  # a frozen head under a graph (the reference's)
    head_logits(head, grad_in).sum().backward()
    trained = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)  # a head being trained: upcast per call, gradient flows
    head_logits(trained, hidden).sum().backward()
    assert trained.weight.grad is not None and trained.weight.grad.abs().sum() > 0


def test_a_16_bit_head_on_a_gpu_multiplies_into_float32_with_no_float32_copy_of_its_weight() -> None:
    """On a GPU (traced here on the meta device, which takes the same path) the head's 16-bit inputs go to
    `torch.mm(..., out_dtype=torch.float32)`: float32 logits, gradients for the hidden states and a trained weight in
    their own dtypes, and no float32 copy of the weight kept or made (a 151,936 x 1,536 head: 0.9 GB)."""
    from models.scoring.lm_head import FLOAT32_COPY, Float32Product, head_logits, refresh_float32_head

    head = torch.nn.Linear(64, 1000, bias=False, device="meta", dtype=torch.bfloat16)
    hidden = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    calls: list[int] = []
    original = Float32Product.forward
    try:
        Float32Product.forward = staticmethod(lambda ctx, h, w: calls.append(1) or original(ctx, h, w))  # type: ignore[method-assign]
        logits = head_logits(head, hidden)
        assert calls == [1]
    finally:
        Float32Product.forward = staticmethod(original)  # type: ignore[method-assign]
    assert logits.shape == (2, 3, 1000) and logits.dtype == torch.float32
    logits.sum().backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16 and hidden.grad.shape == hidden.shape
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.bfloat16
    head.requires_grad_(False)
    with torch.inference_mode():
        head_logits(head, hidden.detach())
    refresh_float32_head(head)
    assert not hasattr(head.weight, FLOAT32_COPY)


def test_the_float32_product_of_16_bit_inputs_is_within_the_bound_of_exact_products() -> None:
    """Each product of two bfloat16 values is exact in float32 (8 + 8 significant bits < 24); only the float32 sums
    round: |logit - exact| <= width * 2^-24 * sum |h_k w_k| (Higham's bound for a sum of n terms). Checked against
    float64 on the CPU's path (the GPU's, torch.mm with out_dtype, is checked by `ppoz bench gpu`)."""
    from models.scoring.lm_head import head_logits

    torch.manual_seed(0)
    width = 1536
    head = torch.nn.Linear(width, 4096, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = (3 * torch.randn(5, width)).to(torch.bfloat16)
    got = head_logits(head, hidden).double()
    exact = hidden.double() @ head.weight.double().T
    bound = width * 2.0**-24 * (hidden.double().abs() @ head.weight.double().abs().T)
    assert bool(((got - exact).abs() <= bound).all())
    rounded_to_16_bits = (hidden @ head.weight.T).double()  # what a 16-bit head would give: outside the bound
    assert not bool(((rounded_to_16_bits - exact).abs() <= bound).all())


def test_the_start_up_checks_of_a_16_bit_model_hold_no_float32_copy_of_it(tiny_model) -> None:
    """A bf16 model of Qwen2.5's 151,936-token vocabulary: the scoring path's and the generation layout's float32
    checks run on a small probe of its architecture (scoring.float32_probe), not on the model upcast (which held a
    float32 copy of every weight: 2x the model's bytes beside it at start-up); the checks still choose as before."""
    from transformers import AutoModelForCausalLM

    from learner_node.packed_forward import check_layout
    from tools.bench.memory_peak import peak_memory

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2", vocab_size=151_936), dtype=torch.bfloat16).eval().requires_grad_(False)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    s.refresh_float32_head(model.get_output_embeddings())  # a frozen head's float32 copy on the CPU (lm_head.py), as an actor keeps it
    chosen: list[str] = []
    path = peak_memory(lambda: chosen.append(s.select_path(model)), [model])
    layout = peak_memory(lambda: chosen.append(check_layout(model)), [model])
    assert chosen == ["packed", "packed"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for what, peak in (("select_path", path), ("check_layout", layout)):
        # an upcast model is 2x its bf16 bytes; what the checks hold is a few positions' logits
        assert peak.work < model_bytes, f"{what}: {peak.work / 1e6:.1f} MB beside a {model_bytes / 1e6:.1f} MB model"


def test_the_packed_masks_are_built_on_the_host_and_copied_to_the_device_once() -> None:
    """On a GPU every device write is a kernel launch: the masks of a batch of Kea observations, padded by hundreds
    of positions, were thousands of tiny writes. On the meta device (a GPU's ops, no data) the device ops of scoring
    a batch do not grow with its padding: the masks are built on the host and copied once per pass."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from models.tiny_models import tiny_config
    from tools.bench.meta_trace import traced

    class DeviceOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.count += any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(out))
            return out

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa").eval()
    counts = []
    for pad in (4, 200):  # the second item's context and candidates shorter than the first's by `pad` tokens
        items = [
            s.Tokenized(tuple(range(3, 3 + 20 + pad)), ((5, 6, 7), (8,), (9, 10)), (1, 1, 1)),
            s.Tokenized(tuple(range(3, 23)), ((5,), (8, 9)), (1, 1)),
        ]
        items[0] = s.Tokenized(items[0].context, (*items[0].actions, tuple(range(3, 3 + pad))), (1, 1, 1, 1))
        ops = DeviceOps()
        with traced(), ops, torch.inference_mode():  # traced: what transformers reads back of a mask is answered
            s.score_packed(model, items)
        counts.append(ops.count)
    assert counts[0] == counts[1], f"device ops at 4 and 200 padding positions: {counts}"
