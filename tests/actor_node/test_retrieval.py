"""Retrieval for rag_step: chunking, corpus loading, embedders, ranking, the prompt template and its budget."""

from __future__ import annotations

import hashlib
import math
import re

import msgpack
import pytest
import torch

from actor_node.embedders import EncoderEmbedder, PolicyEmbedder
from actor_node.retrieval import (
    CONTEXT_HEADER,
    MIN_SNIPPET_TOKENS,
    Chunk,
    CorpusIndex,
    EmbeddingCache,
    HistoryEntry,
    Snippet,
    augment,
    chunk_text,
    load_corpus,
    retrieve,
)
from common.shared_settings import RetrievalConfig

DOCS = {
    "cart.md": "# Shopping cart\nTap the cart icon to open the shopping cart. The checkout button in the cart "
    "starts checkout and payment of the items in the cart.\n",
    "settings.md": "# Settings\nThe settings screen holds the dark mode switch, notification options and language.\n",
    "search/help.txt": "Search: type a product name in the search box and press enter to list matching products.\n",
    "about.txt": "About: version number, licences and the privacy policy of the application.\n",
}


class BagOfWords:
    """A deterministic stand-in embedder: hashed word counts, L2 normalised. Counts its calls and texts."""

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(list(texts))
        out = torch.zeros((len(texts), self.dim))
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z]+", text.lower()):
                out[i, int(hashlib.sha256(word.encode()).hexdigest(), 16) % self.dim] += 1.0
        return torch.nn.functional.normalize(out, dim=-1)


@pytest.fixture(scope="module")
def byte_tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.fixture(scope="module")
def bpe_tok():
    """A small trained BPE tokenizer: its token counts are not additive over joined strings, unlike the byte one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(DOCS.values()) * 5 + [CONTEXT_HEADER] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


@pytest.fixture
def corpus_dir(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "notes.py").write_text("cart = 1  # not a document\n")
    return tmp_path


def obs_for(prompt: str) -> dict:
    return {
        "prompt": prompt,
        "question": " Which action? ",
        "action": ["0: TouchEvent(Cart)", "1: KeyEvent(BACK)"],
        "extra": {"nested": [1, 2]},
    }


def block_of(obs: dict, augmented: dict) -> str:
    assert augmented["prompt"].startswith(obs["prompt"])
    return augmented["prompt"][len(obs["prompt"]) :]


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("chunk_tokens", 0),
        ("chunk_overlap", -1),
        ("chunk_overlap", 128),
        ("top_k", 0),
        ("max_context_tokens", 0),
        ("history_len", -1),
        ("embed_batch", 0),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        RetrievalConfig(**{field: value})


def test_config_defaults_are_valid():
    cfg = RetrievalConfig()
    assert (cfg.chunk_tokens, cfg.chunk_overlap, cfg.top_k, cfg.max_context_tokens) == (128, 32, 4, 256)


# --- chunking and the corpus --------------------------------------------------------------------


@pytest.mark.parametrize("n_bytes, size, overlap", [(300, 64, 16), (64, 64, 16), (65, 64, 16), (10, 64, 16), (200, 50, 0), (101, 10, 9)])
def test_chunks_overlap_and_cover_every_token(byte_tok, n_bytes, size, overlap):
    text = "".join(chr(ord("a") + (i * 7) % 26) + (" " if i % 5 == 4 else "") for i in range(n_bytes))[:n_bytes]
    ids = byte_tok.encode(text, add_special_tokens=False)
    chunks = [byte_tok.encode(c, add_special_tokens=False) for c in chunk_text(text, byte_tok, size, overlap)]
    assert all(0 < len(c) <= size for c in chunks)
    for prev, nxt in zip(chunks, chunks[1:]):
        assert len(prev) == size and prev[size - overlap :] == nxt[:overlap]
    assert chunks[0] + [t for c in chunks[1:] for t in c[overlap:]] == ids
    # No window is made of tokens the previous one already holds.
    assert all(len(c) > overlap for c in chunks[1:])


def test_chunk_text_of_nothing_is_nothing(byte_tok):
    assert chunk_text("", byte_tok, 16, 4) == []
    with pytest.raises(ValueError, match="overlap"):
        chunk_text("abc", byte_tok, 16, 16)


def test_load_corpus_reads_md_and_txt_in_path_order(corpus_dir, byte_tok):
    chunks = load_corpus(corpus_dir, byte_tok, 32, 8)
    sources = [c.source for c in chunks]
    assert sorted(set(sources)) == sorted(DOCS)  # notes.py is not a document
    assert sources == sorted(sources)
    for source in set(sources):
        assert [c.index for c in chunks if c.source == source] == list(range(sources.count(source)))
    assert chunks[0].text.startswith("About:")


def test_load_corpus_errors_name_the_path(tmp_path, byte_tok):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_corpus(missing, byte_tok, 32, 8)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "empty.md").write_text("  \n")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        load_corpus(tmp_path, byte_tok, 32, 8)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_corpus(tmp_path, byte_tok, 32, 8)


# --- ranking ------------------------------------------------------------------------------------


@pytest.fixture
def index(corpus_dir, byte_tok):
    return CorpusIndex.build(load_corpus(corpus_dir, byte_tok, 512, 0), BagOfWords())


def test_the_relevant_chunk_ranks_first(index):
    cfg = RetrievalConfig(top_k=4, history_len=0)
    snippets = retrieve(
        obs_for("Current page: Shop. Views: <button>cart</button> checkout the shopping cart"), [], index, BagOfWords(), cfg
    )
    assert [s.kind for s in snippets] == ["doc"] * 4
    assert snippets[0].label == "cart.md#0" and "checkout button" in snippets[0].text
    assert [s.score for s in snippets] == sorted((s.score for s in snippets), reverse=True)
    assert snippets[0].score > snippets[1].score


def test_history_competes_with_the_documents(index):
    history = [
        HistoryEntry("Page: Settings. Views: dark mode switch", "TouchEvent(view=dark mode)", 1.0),
        HistoryEntry("Page: Search. Views: search box enter product name", "TouchEvent(view=search box)", 0.5),
        HistoryEntry("Page: Launcher", "IntentEvent(MainActivity)", 0.0),
    ]
    snippets = retrieve(
        obs_for("Page: Search. Views: search box, type product name, press enter"), history, index, BagOfWords(), RetrievalConfig(top_k=3)
    )
    kinds = {(s.kind, s.label) for s in snippets}
    assert ("history", "step -2") in kinds and ("doc", "search/help.txt#0") in kinds
    step = next(s for s in snippets if s.label == "step -2")
    assert step.text == "Page: Search. Views: search box enter product name\nAction: TouchEvent(view=search box)\nReward: 0.5"
    # The history window: only the last history_len entries count.
    later = retrieve(obs_for("search box product name"), history, index, BagOfWords(), RetrievalConfig(top_k=8, history_len=1))
    assert [s.label for s in later if s.kind == "history"] == ["step -1"]


def test_top_k_and_empty_sources(index):
    history = [HistoryEntry(f"page {i}", f"action {i}", float(i)) for i in range(5)]
    for k in (1, 2, 7):
        got = retrieve(obs_for("cart settings search about page"), history, index, BagOfWords(), RetrievalConfig(top_k=k))
        assert len(got) == min(k, len(history) + len(index))
    assert retrieve(obs_for("cart"), [], None, BagOfWords(), RetrievalConfig()) == []
    only_history = retrieve(obs_for("page 3"), history, None, BagOfWords(), RetrievalConfig(top_k=2))
    assert {s.kind for s in only_history} == {"history"}


def test_ties_are_broken_by_source_and_index():
    chunks = [
        Chunk("b.md", 1, "same words"),
        Chunk("a.md", 0, "same words"),
        Chunk("b.md", 0, "same words"),
        Chunk("a.md", 1, "other thing"),
    ]
    embedder = BagOfWords()
    for order in (chunks, chunks[::-1]):
        idx = CorpusIndex.build(order, embedder)
        got = idx.search(embedder(["same words"])[0], 3)
        assert [(c.source, c.index) for _, c in got] == [("a.md", 0), ("b.md", 0), ("b.md", 1)]
        assert [s for s, _ in got] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="dimensions"):
        idx.search(torch.ones(3), 1)
    with pytest.raises(ValueError, match="no chunks"):
        CorpusIndex.build([], embedder)


# --- the prompt ---------------------------------------------------------------------------------


def long_snippets(n: int = 12) -> list[Snippet]:
    return [
        Snippet("doc" if i % 2 else "history", f"item{i}", f"snippet {i}: " + "the cart checkout words " * (5 + 7 * i), 1.0 - i / 100)
        for i in range(n)
    ]


@pytest.mark.parametrize("budget", [40, 64, 80, 100, 150, 256, 1000])
@pytest.mark.parametrize("tok_name", ["byte_tok", "bpe_tok"])
def test_the_block_stays_within_the_token_budget(request, tok_name, budget):
    tok = request.getfixturevalue(tok_name)
    obs = obs_for("Current page: Cart\nActions:\n0: TouchEvent(Cart)\n")
    out = augment(obs, long_snippets(), tok, budget)
    block = block_of(obs, out)
    assert len(tok.encode(block, add_special_tokens=False)) <= budget
    if block:
        assert block.startswith("\n" + CONTEXT_HEADER)
        lines = re.findall(r"^\[(doc|history) item(\d+)\] ", block, re.M)
        assert [int(i) for _, i in lines] == list(range(len(lines)))  # in rank order, none skipped in between


def test_a_snippet_that_does_not_fit_is_cut_then_the_rest_dropped(byte_tok):
    obs = obs_for("prompt without a final newline")
    first, second, third = [Snippet("doc", f"d{i}", f"doc {i} " + "x" * 200, 0.9 - i / 10) for i in range(3)]
    header = len(byte_tok.encode("\n\n" + CONTEXT_HEADER, add_special_tokens=False))
    room = header + len("[doc d0] ") + MIN_SNIPPET_TOKENS + len("\n")
    cut = block_of(obs, augment(obs, [first, second, third], byte_tok, room + 10))
    assert cut == "\n\n" + CONTEXT_HEADER + "[doc d0] " + first.text[: MIN_SNIPPET_TOKENS + 10] + "\n"
    assert augment(obs, [first, second], byte_tok, room - 1) == obs  # less than MIN_SNIPPET_TOKENS left: nothing
    history = Snippet("history", "step -1", "a long earlier prompt " * 20 + "\nAction: TouchEvent(Cart)\nReward: 1", 0.5)
    tail = block_of(obs, augment(obs, [history], byte_tok, header + 60))
    assert tail.endswith("Action: TouchEvent(Cart)\nReward: 1\n")  # a history entry keeps its tail


def test_augment_copies_and_keeps_the_other_keys(byte_tok):
    obs = obs_for("Current page: Cart\n")
    before = {k: (list(v) if isinstance(v, list) else v) for k, v in obs.items()}
    out = augment(obs, [Snippet("doc", "cart.md#0", "  Tap the cart icon.\n", 0.8)], byte_tok, 256)
    assert obs == before
    assert out["prompt"] == ("Current page: Cart\n\nRetrieved context (most relevant first):\n[doc cart.md#0] Tap the cart icon.\n")
    assert {k: v for k, v in out.items() if k != "prompt"} == {k: v for k, v in obs.items() if k != "prompt"}
    out["action"].append("mutated")
    assert obs["action"] == before["action"]
    same = augment(obs, [], byte_tok, 256)
    assert same == obs and same is not obs


def test_the_augmented_prompt_is_deterministic(corpus_dir, byte_tok):
    history = [HistoryEntry(f"Page: Cart step {i}", "TouchEvent(view=checkout)", 0.25 * i) for i in range(6)]
    prompts = []
    for _ in range(2):
        embedder = EmbeddingCache(BagOfWords())
        idx = CorpusIndex.build(load_corpus(corpus_dir, byte_tok, 24, 8), embedder)
        obs = obs_for("Page: Cart. checkout the cart\n")
        snippets = retrieve(obs, history, idx, embedder, RetrievalConfig(top_k=4))
        prompts.append(augment(obs, snippets, byte_tok, 200)["prompt"].encode())
    assert prompts[0] == prompts[1]


# --- history entries on the wire ----------------------------------------------------------------


def test_history_entry_round_trips_through_msgpack():
    entry = HistoryEntry("Page: Cart", "0: TouchEvent(Cart)", 1.5)
    wire = msgpack.unpackb(msgpack.packb(entry.to_dict()))
    assert HistoryEntry.from_dict(wire) == entry
    assert HistoryEntry.from_dict({"prompt": "p", "action": "a", "reward": 2, "later_field": 1}).reward == 2.0


@pytest.mark.parametrize(
    "wire, field",
    [
        ({"action": "a", "reward": 1.0}, "prompt"),
        ({"prompt": "p", "action": 3, "reward": 1.0}, "action"),
        ({"prompt": b"p", "action": "a", "reward": 1.0}, "prompt"),
        ({"prompt": "p", "action": "a", "reward": "1"}, "reward"),
        ({"prompt": "p", "action": "a", "reward": True}, "reward"),
        ({"prompt": "p", "action": "a", "reward": math.nan}, "reward"),
        ({"prompt": "p", "action": "a"}, "reward"),
        (["p", "a", 1.0], "map"),
    ],
)
def test_history_entry_rejects_wrong_types(wire, field):
    with pytest.raises(ValueError, match=field):
        HistoryEntry.from_dict(wire)


# --- embedders ----------------------------------------------------------------------------------


def test_embedding_cache_embeds_only_misses():
    inner = BagOfWords()
    cache = EmbeddingCache(inner, max_entries=3)
    first = cache(["a cart", "a search", "a cart"])
    assert inner.calls == [["a cart", "a search"]]  # one batched call, each new text once
    assert (cache.hits, cache.misses) == (1, 2)
    assert torch.equal(first, inner(["a cart", "a search", "a cart"]))
    inner.calls.clear()
    cache(["a search", "settings", "a cart"])
    assert inner.calls == [["settings"]] and (cache.hits, cache.misses) == (3, 3)
    cache(["about"])  # fourth entry: the least recently used ("a search") goes
    cache(["a search", "about"])
    assert inner.calls[-1] == ["a search"] and (cache.hits, cache.misses) == (4, 5)
    assert len(cache.entries) == 3


@pytest.fixture(scope="module")
def policy_parts(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(arch: str = "llama"):
        model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(tiny_models[arch])

    return load


TEXTS = [
    "Current page: Cart",
    "a much longer text about the settings screen and its dark mode switch " * 3,
    "x",
    "Current page: Cart",
    "",
    "Search: type a product name",
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_policy_embedder_vectors(policy_parts, arch):
    model, tok = policy_parts(arch)
    batched = PolicyEmbedder(model, tok, max_tokens=64, batch=4)(TEXTS)
    assert batched.shape == (len(TEXTS), model.config.hidden_size) and batched.dtype == torch.float32
    assert batched.device.type == "cpu"
    norms = batched.norm(dim=-1)
    assert torch.allclose(norms[[0, 1, 2, 3, 5]], torch.ones(5), atol=1e-5) and norms[4] == 0  # an empty text is zero
    assert torch.equal(batched[0], batched[3])
    one_by_one = torch.cat([PolicyEmbedder(model, tok, max_tokens=64, batch=1)([t]) for t in TEXTS])
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    assert PolicyEmbedder(model, tok)([]).shape == (0, model.config.hidden_size)


def test_policy_embedder_keeps_the_tail_of_long_texts(policy_parts):
    model, tok = policy_parts()
    embed = PolicyEmbedder(model, tok, max_tokens=17)  # BOS + 16 bytes
    same_tail = embed(["AAAA" + "the current page", "BBBBBBBB" + "the current page", "the current pagE"])
    assert torch.allclose(same_tail[0], same_tail[1], atol=1e-6)
    assert not torch.allclose(same_tail[0], same_tail[2], atol=1e-3)


def test_policy_embedder_switches_the_lora_adapter_off(policy_parts):
    from peft import LoraConfig, get_peft_model

    from models.policy_model import peft_warnings_silenced

    model, tok = policy_parts()
    base = PolicyEmbedder(model, tok, batch=2)(TEXTS)
    ids = torch.tensor([tok.encode("Current page: Cart")])
    with torch.inference_mode():
        base_logits = model(input_ids=ids).logits
    with peft_warnings_silenced():
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    with torch.inference_mode():
        assert not torch.allclose(peft_model(input_ids=ids).logits, base_logits, atol=1e-3)  # the adapter matters
    assert torch.allclose(PolicyEmbedder(peft_model, tok, batch=2)(TEXTS), base, atol=1e-5)
    with torch.inference_mode():  # and it is back on afterwards
        assert not torch.allclose(peft_model(input_ids=ids).logits, base_logits, atol=1e-3)


def test_policy_embedder_feeds_retrieval(policy_parts, corpus_dir):
    """Whatever the random tiny model ranks, retrieval over it is deterministic and well formed."""
    model, tok = policy_parts()
    embed = EmbeddingCache(PolicyEmbedder(model, tok, max_tokens=128, batch=4))
    idx = CorpusIndex.build(load_corpus(corpus_dir, tok, 48, 16), embed)
    history = [HistoryEntry("Page: Cart", "TouchEvent(view=checkout)", 1.0)]
    obs = obs_for("Page: Cart\n")
    runs = [augment(obs, retrieve(obs, history, idx, embed, RetrievalConfig(top_k=3)), tok, 128) for _ in range(2)]
    assert runs[0] == runs[1] and embed.hits >= 2
    assert len(tok.encode(block_of(obs, runs[0]), add_special_tokens=False)) <= 128


def test_encoder_embedder(tmp_path):
    from transformers import BertConfig, BertModel

    from models.tiny_models import build_byte_tokenizer

    torch.manual_seed(0)
    BertModel(
        BertConfig(vocab_size=259, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, pad_token_id=0)
    ).save_pretrained(str(tmp_path))
    build_byte_tokenizer(tmp_path)
    embed = EncoderEmbedder(str(tmp_path), max_tokens=32, batch=4)
    vecs = embed(TEXTS)
    assert vecs.shape == (len(TEXTS), 32) and vecs.dtype == torch.float32
    assert torch.allclose(vecs[[0, 1, 2, 3, 5]].norm(dim=-1), torch.ones(5), atol=1e-5) and vecs[4].abs().sum() == 0
    assert torch.equal(vecs[0], vecs[3])
    assert torch.allclose(torch.cat([embed([t]) for t in TEXTS]), vecs, atol=1e-5)
