"""The candidate learner's memory at a real vocabulary (Qwen2.5's 151,936 tokens): its no-gradient passes go a
micro-batch at a time, the LM head's log-probabilities a chunk of positions at a time (recomputed in the backward
pass), and with gradient checkpointing a micro-batch keeps one layer's activations at a time. Peaks are counted
by tools/bench/memory_peak.py (every storage an op returns, while it lives)."""

from __future__ import annotations

import torch

from common.segments import CandidateObservation
from learner_node.policy import LearnerPolicy
from learner_node.rollout import CandidateBatch, Rollout
from models import scoring
from models.policy_model import ModelSpec, load_policy
from models.scoring.lm_head import LOGITS_AT_ONCE
from tools.bench.memory_peak import peak_memory

QWEN_VOCAB = 151_936
FLOAT32 = 4


def kea_rollout(n: int, candidates: int, prompt_chars: int, seed: int = 0) -> Rollout:
    """n observations of a long prompt and candidates of 15-25 characters (one byte-token each), choices spread."""
    g = torch.Generator().manual_seed(seed)

    def text(chars: int) -> str:
        return "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (chars,), generator=g))

    r = Rollout()
    for i in range(n):
        actions = [text(int(k)) for k in torch.randint(15, 26, (candidates,), generator=g)]
        r.obs.append(CandidateObservation.from_wire({"prompt": text(prompt_chars), "question": " pick: ", "action": actions}))
        r.actions.append(i % candidates)
        r.logprobs.append(-2.0)
        r.probs.append([1 / candidates] * candidates)
        r.versions.append(0)
        r.lags.append(0)
        r.advantages.append(float(i % 3 - 1))
        r.returns.append(0.5)
        r.values.append(0.1)
        r.seg_ids.append(f"s{i}")
    return r


def test_the_no_gradient_passes_and_the_head_hold_a_micro_batch_and_a_chunk_of_logits_at_a_time(tiny_model) -> None:
    """8 observations of 8 candidates of ~20 tokens: 1,280 scored positions, whose logits at once would be 778 MB
    (and as much again of log-softmax). The proximal and reference passes go 2 observations at a time (320
    positions) and the head a chunk at a time, so the peak stays within a few chunks of logits; a backward too."""
    model, tok = load_policy(ModelSpec(model=tiny_model("qwen2", vocab_size=QWEN_VOCAB), device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tok, "token", 1.0, [16])
    batch = CandidateBatch(lp, kea_rollout(8, 8, 300), micro_batch=2)
    positions = sum(len(a) for item in batch.items for a in item.actions)
    chunk_bytes = LOGITS_AT_ONCE * FLOAT32
    assert positions * QWEN_VOCAB * FLOAT32 > 5 * chunk_bytes  # the whole rollout's logits would be far more
    rows: list[int] = []  # observations per forward of the decoder
    scoring.model_parts(model)[0].register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    targets = peak_memory(lambda: batch.targets({}), [model])
    assert rows and max(rows) == 2, f"observations per no-gradient forward: {rows}"  # a micro-batch, not the rollout
    assert targets.work < 3 * chunk_bytes, f"{targets.work / 1e6:.0f} MB for the no-gradient passes"

    def forward_backward() -> None:
        f = batch.forward([0, 1])
        (f.logp.sum() + f.entropy.sum() + f.kl_ref.sum()).backward()

    trained = peak_memory(forward_backward, [model])
    assert trained.work < 4 * chunk_bytes, f"{trained.work / 1e6:.0f} MB for a micro-batch's forward and backward"


def test_a_chunked_head_gives_the_unchunked_log_probabilities_and_gradients() -> None:
    """`token_logprobs` over positions in chunks (recomputed in the backward) against one log-softmax over all."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50_000, bias=False)
    hidden = torch.randn(3 * scoring.positions_at_once(head) // 2, 16, requires_grad=True)  # a chunk and a half
    targets = torch.randint(0, 50_000, (hidden.shape[0],))
    got = scoring.token_logprobs(head, scoring.LogitTransform(), hidden, targets)
    (got * torch.linspace(-1, 1, len(got))).sum().backward()
    got_grad, hidden.grad = hidden.grad, None
    want = torch.log_softmax(head(hidden), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (want * torch.linspace(-1, 1, len(want))).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_grad, hidden.grad, atol=1e-6, rtol=1e-5)


def test_with_gradient_checkpointing_a_candidate_micro_batch_keeps_a_layer_at_a_time_and_the_same_gradients(tiny_model) -> None:
    """A wider model (hidden 256, 4 layers) and 512-token prompts: with checkpointing the forward and backward of a
    micro-batch peak lower, every layer runs again in the backward pass, and log-probabilities and gradients are
    those of the plain forward (the cache-free one-pass scoring is the same function)."""
    path = tiny_model("qwen2", hidden=256, layers=4, heads=4, kv_heads=2)
    rollout = kea_rollout(2, 6, 512, seed=1)
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, tok = load_policy(ModelSpec(model=path, device="cpu", lora_rank=4))
        lp = LearnerPolicy(model, tok, "token", 1.0, [16], gradient_checkpointing=checkpointing)
        batch = CandidateBatch(lp, rollout, micro_batch=2)
        batch.targets({})  # the reference the forward's KL needs
        calls: list[int] = []
        scoring.model_parts(model)[0].layers[0].self_attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        out: dict[str, torch.Tensor] = {}

        def forward_backward(batch: CandidateBatch = batch, out: dict[str, torch.Tensor] = out) -> None:
            f = batch.forward([0, 1])
            out["logp"] = f.logp.detach()
            f.logp.sum().backward()

        peak = peak_memory(forward_backward, [model])
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[checkpointing] = (out["logp"], grads, len(calls), peak.work, model.training)
    (logp_off, g_off, calls_off, peak_off, training_off), (logp_on, g_on, calls_on, peak_on, training_on) = results[False], results[True]
    torch.testing.assert_close(logp_on, logp_off, atol=1e-5, rtol=0)
    assert g_on.keys() == g_off.keys() and g_on
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], atol=1e-5, rtol=1e-4)
    assert calls_off == 2  # the packed path's two passes (contexts, then candidates over their KV), kept
    assert calls_on == 2  # one pass with no KV cache, and again in the backward pass
    assert peak_on < 0.6 * peak_off, f"checkpointed {peak_on / 1e6:.0f} MB against {peak_off / 1e6:.0f} MB"
    assert not training_on and not training_off


def test_with_gradient_checkpointing_a_sliding_window_model_trains_on_its_checked_path(tmp_path) -> None:
    """A Mistral attending to its last 8 positions fails `packed`'s check (its 4D masks miss the window) and scores by
    `kv_batch`, whose cache a checkpointed forward cannot keep: the learner then scores every pass (proximal,
    reference, the update's) by `per_candidate`, a checked path, so the ratio is 1 at the start of the update and
    the log-probabilities are the model's own."""
    from tests.learner_node.test_generation_update import sliding_window_model

    model = sliding_window_model("mistral", tmp_path / "mistral", window=8)
    path = scoring.select_path(model)
    assert path == "kv_batch"
    from models.policy_model import with_adapter
    from models.tiny_models import build_byte_tokenizer

    tok = build_byte_tokenizer(tmp_path / "tok")
    model = with_adapter(model, ModelSpec(model="mistral", device="cpu", lora_rank=4)).eval()
    lp = LearnerPolicy(model, tok, "token", 1.0, [16], path=path, gradient_checkpointing=True)
    rollout = kea_rollout(2, 3, 24, seed=2)
    batch = CandidateBatch(lp, rollout, micro_batch=2)
    targets = batch.targets({})
    forward = batch.forward([0, 1])
    torch.testing.assert_close(forward.logp.detach(), targets.prox_logp, atol=1e-6, rtol=0)  # ratio 1
    with torch.no_grad(), model.disable_adapter():
        own = [scoring.reference_scores(model, item)[0] for item in batch.items]
    for item, got, want in zip(batch.items, lp.logp_all(batch.items), own, strict=True):
        torch.testing.assert_close(got, scoring.policy_logprobs(scoring.normalise(want, item, "token"), 1.0), atol=1e-4, rtol=0)
