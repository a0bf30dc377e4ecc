"""Generation-mode PPO in the learner: the packed recompute, the batch rules, and updates on on-policy and stale data.

The yardstick for log-probabilities is the model's own `model(input_ids).logits`, one forward per
sequence, written here. Updates run through `Learner.step` on a real Redis stream, with responses the
actor's own generation engine wrote.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from actor_node.generation_engine import GenerationEngine
from common.segments import CandidateObservation, GeneratedResponse, GenerateObservation, Segment, Transition
from common.shared_settings import PolicySpec, PolicyStamp
from learner_node.packed_forward import fill_rows, pack, response_logprobs
from learner_node.token_update import build_generation_batch, split_by_mode
from models.policy_model import ModelSpec, load_policy
from tests.learner_node.test_async_ppo import learner_on, write_to_stream


def own_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + j, t] for j, t in enumerate(response)])


def test_pack_fills_rows_in_order_and_gives_a_long_sequence_a_row_alone() -> None:
    assert pack([3, 4, 2, 9, 1], budget=8) == [[0, 1], [2], [3], [4]]
    assert pack([8, 8], budget=8) == [[0], [1]]


def test_rows_are_filled_longest_first_into_the_first_row_with_room() -> None:
    # capacity 10: 9 opens row 0 (room 1); 6 opens row 1 (room 4); 4 fills row 1; 3 opens row 2 (room 7);
    # 2 and 1: 2 goes to row 2 (room 5), 1 to row 0 (room 0); 12 is longer than a row: a row alone
    assert fill_rows([3, 9, 4, 1, 6, 2], 10) == [[1, 3], [4, 2], [0, 5]]
    assert fill_rows([12, 2], 10) == [[0], [1]]
    assert fill_rows([], 10) == []


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_packed_logprobs_are_the_models_own(tiny_models, arch, layout) -> None:
    model, _ = load_policy(ModelSpec(model=tiny_models[arch], device="cpu", lora_rank=4))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 8, 1, 12, 6)]
    temps = [1.0, 0.7, 1.3, 1.0, 2.0]
    assert fill_rows([len(p) + len(r) - 1 for p, r in zip(prompts, responses)], 41) == [[3], [1, 2, 0], [4]]  # rows shared
    with torch.no_grad():
        got, entropy = response_logprobs(model, prompts, responses, temps, budget=100, layout=layout)  # several rows a forward
    for p, r, t, lp, ent in zip(prompts, responses, temps, got, entropy):
        assert float((own_logprobs(model, p, r, t) - lp).abs().max()) < 1e-5
        assert lp.shape == ent.shape == (len(r),) and bool((ent > 0).all())


def sliding_window_model(kind: str, path: Any, window: int | None = 16) -> Any:
    """A tiny model that attends to its last `window` positions (in every layer: Mistral; in its second: Qwen2's
    layer types), saved and loaded back; `window` None: the same weights attending to everything."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    small = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mistral":
        config = MistralConfig(**small, sliding_window=window, max_position_embeddings=256)
    else:
        config = Qwen2Config(**small, use_sliding_window=window is not None, sliding_window=window, max_window_layers=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_sliding_window_model_is_scored_past_its_window_in_packed_rows(tmp_path, kind) -> None:
    """Packed rows carry no hand-built mask: transformers builds it from the position ids, window included.
    Responses past a 16-token window, one of them starting mid-row after another sequence, equal the model's
    own logits; the window matters on these sequences (full attention gives other numbers), and the
    start-up check keeps the packed layout."""
    from learner_node.packed_forward import check_layout

    model = sliding_window_model(kind, tmp_path / kind)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 5, 20, 3)]
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (21, 25, 1, 30)]
    temps = [1.0, 0.7, 1.3, 1.0]
    assert fill_rows([len(p) + len(r) - 1 for p, r in zip(prompts, responses)], 60) == [[0], [3, 2], [1]]
    assert check_layout(model) == "packed"
    with torch.no_grad():
        got, _ = response_logprobs(model, prompts, responses, temps, budget=200)
    unwindowed = sliding_window_model(kind, tmp_path / "full", window=None)
    for p, r, t, lp in zip(prompts, responses, temps, got):
        assert float((own_logprobs(model, p, r, t) - lp).abs().max()) < 1e-5
    assert max(float((own_logprobs(unwindowed, p, r, t) - lp).abs().max()) for p, r, t, lp in zip(prompts, responses, temps, got)) > 1e-2


def test_the_start_up_check_refuses_a_packed_mask_that_ignores_the_window(tmp_path) -> None:
    """What the learner did before: a dense block-causal 4D mask built by hand from the packing, each sequence
    seeing all of itself. On a sliding-window model the check's probe (a sequence past the window, starting
    mid-row) catches it and the learner trains padded rows, whose numbers are the model's."""
    from learner_node.packed_forward import check_layout

    model = sliding_window_model("mistral", tmp_path / "mistral")

    def block_causal(_: Any, args: tuple, kw: dict) -> tuple[tuple, dict]:
        pos = kw.get("position_ids")
        if pos is None or kw.get("attention_mask") is not None:
            return args, kw
        starts = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
        seq = starts.cumsum(-1)
        n = pos.shape[1]
        allowed = (seq[:, :, None] == seq[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        return args, {**kw, "attention_mask": allowed[:, None]}

    assert check_layout(model) == "packed"
    handle = model.get_decoder().register_forward_pre_hook(block_causal, with_kwargs=True)
    try:
        assert check_layout(model) == "padded"
    finally:
        handle.remove()


def test_a_model_that_ignores_packed_position_ids_is_trained_padded(tiny_models) -> None:
    """The start-up check refuses a layout that does not give the model's own numbers: a decoder that drops the
    position ids (as a model with its own position handling might) sees the packed sequences as one; the check
    falls back to one sequence per row, whose numbers are the model's."""
    from learner_node.packed_forward import check_layout

    model, _ = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4))
    assert check_layout(model) == "packed"
    decoder = model.get_decoder()
    handle = decoder.register_forward_pre_hook(
        lambda _, args, kw: (args, {k: v for k, v in kw.items() if k != "position_ids"}), with_kwargs=True
    )
    try:
        assert check_layout(model) == "padded"
    finally:
        handle.remove()


def gen_transition(prompt: list[int], response: list[int], reward: float = 1.0, version: int = 1, **kw: Any) -> Transition:
    settings = dict(done=True, truncated=False, temperature=1.0, policy=None)
    settings.update(kw)
    return Transition(
        obs=GenerateObservation(prompt, {"max_new_tokens": 8}),
        action=0,
        logprob=-1.0,
        probs=[],
        policy_version=version,
        mode="generate",
        reward=reward,
        done=settings["done"],
        truncated=settings["truncated"],
        policy=settings["policy"],
        generation=GeneratedResponse(response, [-0.5] * len(response), "length", settings["temperature"], top_p=1.0),
    )


def segment(seg_id: str, transitions: list[Transition], done: bool = False, truncated: bool = False, next_obs=None) -> Segment:
    return Segment(seg_id, "task", 0, "x", done, truncated, next_obs, transitions)


def test_batch_rules_bootstrap_drops_and_chains() -> None:
    stamp = PolicyStamp(run="run-a", normalisation="token", temperature=1.0, lora_rank=4, greedy=False)
    mine = stamp.to_wire()
    other = {**mine, "run": "run-b"}
    segments = [
        segment("done", [gen_transition([1, 2], [3, 4], done=False, policy=mine), gen_transition([5], [6], policy=mine)], done=True),
        segment("length", [gen_transition([7], [8, 9], done=False)], next_obs=GenerateObservation([10, 11], {})),
        segment("detached", [gen_transition([12], [13], done=False), gen_transition([14], [15], done=False)], truncated=True),
        segment(
            "drops",
            [
                gen_transition([20], [21], done=False, version=0),  # lag 5: stale
                gen_transition([22], [23], done=False, version=9),  # from a version ahead
                gen_transition([24], [25], done=False, temperature=0.0),  # greedy
                gen_transition([26], [27], done=False, policy=other),  # another run
                gen_transition([28], [29], done=False),
            ],
            next_obs=GenerateObservation([30], {}),
        ),
    ]
    batch = build_generation_batch(segments, current_version=5, max_policy_lag=4, expected=stamp)
    # stored every transition; trained: done x2, length x1, detached x1 (its last dropped), drops x1
    assert batch.stored == 2 + 1 + 2 + 5 and len(batch) == 5
    assert batch.dropped_truncated == 1 and batch.dropped_stale == 1 and batch.dropped_mismatched == 3
    assert dict(batch.mismatched) == {"version_ahead": 1, "greedy": 1, "run": 1}
    chains = [(c.samples, c.next_prompt) for c in batch.chains]
    # done: both turns in one chain, nothing after; length: bootstraps from next_obs; detached: from the dropped turn's prompt;
    # drops: the last turn alone, bootstrapping from next_obs
    assert chains == [([0, 1], None), ([2], [10, 11]), ([3], [14]), ([4], [30])]
    assert batch.prompts[4] == [28] and batch.responses[4] == [29] and batch.lags == [4, 4, 4, 4, 4]
    # The base weights (run "", version 0) are the run's version 0: trained within the lag, stale beyond it.
    base = {**mine, "run": ""}
    within = build_generation_batch([segment("b", [gen_transition([1], [2], version=0, policy=base)], done=True)], 3, 4, expected=stamp)
    assert len(within) == 1 and within.lags == [3] and within.dropped_mismatched == 0
    beyond = build_generation_batch([segment("b", [gen_transition([1], [2], version=0, policy=base)], done=True)], 5, 4, expected=stamp)
    assert len(beyond) == 0 and beyond.dropped_stale == 1
    claimed = build_generation_batch([segment("b", [gen_transition([1], [2], version=2, policy=base)], done=True)], 3, 4, expected=stamp)
    assert dict(claimed.mismatched) == {"run": 1}  # run "" is version 0 only


def test_token_ids_outside_the_vocabulary_are_dropped_not_trained() -> None:
    # An actor serving another model sends ids the learner's embedding table does not have: the update would fail.
    segments = [
        segment(
            "ok", [gen_transition([1, 2], [3], done=False), gen_transition([4], [99], done=False)], next_obs=GenerateObservation([5], {})
        ),
        segment("bad-prompt", [gen_transition([70], [3], done=False)], next_obs=GenerateObservation([7], {})),
        segment("bad-next", [gen_transition([1], [3], done=False)], next_obs=GenerateObservation([64], {})),
    ]
    batch = build_generation_batch(segments, current_version=5, max_policy_lag=4, vocab_size=64)
    assert dict(batch.mismatched) == {"token_ids": 2} and batch.dropped_mismatched == 2
    # ok: its first turn, bootstrapping from the dropped turn's prompt; bad-next: truncated, its last turn dropped
    assert [(c.samples, c.next_prompt) for c in batch.chains] == [([0], [4])] and batch.dropped_truncated == 1
    assert max(max(ids) for ids in batch.prompts + batch.responses) < 64
    assert len(build_generation_batch(segments, current_version=5, max_policy_lag=4)) == 4  # no bound given: all kept


def test_a_segment_holding_both_kinds_is_split_where_the_kind_changes() -> None:
    step = Transition(CandidateObservation("p", "", ["a", "b"]), 0, -0.7, [0.5, 0.5], 0, "step", 1.0, False, False)
    seg = segment("mixed", [step, step, gen_transition([1], [2], done=False), step], done=True)
    scoring_parts, generate_parts = split_by_mode([seg])
    assert [len(s.transitions) for s in scoring_parts] == [2, 1] and [len(s.transitions) for s in generate_parts] == [1]
    assert scoring_parts[0].truncated and scoring_parts[0].next_obs is None and not scoring_parts[0].done  # cut: no successor
    assert scoring_parts[1].done and scoring_parts[1].seg_id == "mixed/2"
    # Steps closed by length when the task's next request was a generate: its prompt cannot bootstrap a step
    # (the candidate critic would read a `prompt` it does not have); the steps end truncated, the last dropped.
    steps_then_generate = segment("length", [step, step], next_obs=GenerateObservation([5, 6], {"max_new_tokens": 2}))
    (part,), () = split_by_mode([steps_then_generate])
    assert part.truncated and part.next_obs is None and part.reason == "mode_change"
    from learner_node.rollout import build_rollout

    rollout = build_rollout([part], lambda observations: [0.0] * len(observations), 0.99, 0.95, 0, 8)
    assert len(rollout) == 1 and rollout.dropped_truncated == 1
    same_kind = segment("length", [step], next_obs=step.obs)
    (kept,), () = split_by_mode([same_kind])
    assert kept.next_obs is step.obs and not kept.truncated


def engine_transitions(model_dir: str, n: int, version: int = 0, max_new_tokens: int = 6) -> list[Transition]:
    """n responses the actor's own engine wrote with its own copy of the model, as the broker stores them."""
    model, tokenizer = load_policy(ModelSpec.of(PolicySpec(model=model_dir, lora_rank=4), "cpu"))
    engine = GenerationEngine(model, tokenizer, max_rows=4)
    prompts = ["say yes", "a longer prompt about the weather today", "count: one two", "the end"]
    jobs = [
        {
            "job": i,
            "task_id": f"t{i}",
            "obs": {"prompt": prompts[i % 4], "sampling": {"max_new_tokens": max_new_tokens, "temperature": [1.0, 0.8][i % 2]}},
        }
        for i in range(n)
    ]
    answers = dict((j["job"], a) for j, a in engine.add(jobs[:4]))
    rest = jobs[4:]
    while engine.active or rest:
        if rest and engine.free:
            joining, rest = rest[: engine.free], rest[engine.free :]
            answers.update((j["job"], a) for j, a in engine.add(joining))
        answers.update((j["job"], a) for j, a in engine.step())
    out = []
    for i in range(n):
        g = answers[i]
        t = gen_transition(g.prompt_ids, g.response_ids, reward=float(len(g.text) % 2), version=version, temperature=g.temperature)
        assert t.generation is not None
        t.generation.logprobs = g.logprobs
        out.append(t)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_on_policy_responses_give_ratio_one_through_the_learners_real_path(
    tiny_models, arch, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    n = 8
    write_to_stream(redis_client, key_prefix, engine_transitions(tiny_models[arch], n))
    learner = learner_on(tiny_models[arch], "float32", redis_url, redis_client, key_prefix, tmp_path, n, policy_minibatch=4)
    metrics = learner.step()
    assert metrics is not None
    assert metrics["generation/on_policy_logprob_dev"] < 1e-4
    assert metrics["generation/first_minibatch_ratio_dev"] < 1e-4
    assert metrics["generation/optimizer_steps"] >= 2 and learner.version == 1
    assert learner.counters["transitions_trained"] == n
    assert math.isfinite(metrics["generation/value_loss"]) and metrics["generation/response_length"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 3])
def test_stale_responses_are_trained_with_ratio_one_against_the_learners_weights(
    tiny_models, lag, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """The learner is `lag` versions ahead of the actor that wrote the responses: they are kept (within
    max_policy_lag), clipped against its own weights (first ratio 1) and weighted by prox / behaviour."""
    n = 8
    learner = learner_on(tiny_models["llama"], "float32", redis_url, redis_client, key_prefix, tmp_path, n, policy_minibatch=4)
    with torch.no_grad():  # the learner's weights moved on: a different adapter than the actor's
        for name, p in learner.lp.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    learner.version = lag
    write_to_stream(redis_client, key_prefix, engine_transitions(tiny_models["llama"], n))
    metrics = learner.step()
    assert metrics is not None and learner.counters["transitions_trained"] == n and learner.counters["dropped_stale"] == 0
    assert metrics["generation/first_minibatch_ratio_dev"] < 1e-5
    assert abs(metrics["generation/behaviour_weight"] - 1) > 1e-3  # the behaviour policy is not the learner's
    assert metrics["generation/optimizer_steps"] >= 2


def test_gradient_checkpointing_recomputes_the_layers_and_changes_nothing_else(tiny_models) -> None:
    """GPT-2 has dropout in its config: the learner's function stays the eval-mode one, and each decoder layer
    runs again in the backward pass."""
    from learner_node.policy import LearnerPolicy
    from models import scoring

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (12, 7)]
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 9)]
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, tokenizer = load_policy(ModelSpec(model=tiny_models["gpt2"], device="cpu", lora_rank=4))
        lp = LearnerPolicy(model, tokenizer, "token", 1.0, [8], gradient_checkpointing=checkpointing)
        # a module inside the first layer: its hooks fire again when the layer is recomputed
        layer = scoring.model_parts(model)[0].h[0].attn
        calls: list[int] = []
        layer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        with lp.checkpointing():
            logp, _ = response_logprobs(model, prompts, responses, [1.0, 1.0], budget=64)
        forward_calls = len(calls)
        torch.cat(logp).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[checkpointing] = (torch.cat(logp).detach(), grads, forward_calls, len(calls), model.training)
    (lp_off, g_off, fwd_off, all_off, training_off), (lp_on, g_on, fwd_on, all_on, training_on) = results[False], results[True]
    torch.testing.assert_close(lp_on, lp_off, atol=1e-6, rtol=0)
    assert g_on.keys() == g_off.keys() and g_on
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], atol=1e-6, rtol=1e-5)
    assert (fwd_off, all_off) == (1, 1)  # one forward of the packed row, kept for the backward
    assert (fwd_on, all_on) == (1, 2)  # and run again in the backward pass
    assert not training_on and not training_off  # back in eval mode after the forward


@pytest.mark.slow
def test_grpo_trains_each_response_on_its_reported_advantage_with_no_critic(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """[generation] advantage = grpo: every token of response i has advantage A_i = the reward the driver sent
    (its group-relative advantage), not whitened over the batch; no critic is trained. On-policy, at the first
    minibatch the ratio is 1, so the token-mean policy loss is -sum_i A_i L_i / sum_i L_i (L_i: length of i)."""
    from learner_node.config import GenerationConfig

    n = 4
    transitions = engine_transitions(tiny_models["llama"], n)
    advantages = [1.0, 0.5, -0.25, 0.75]  # mean 0.5: whitening over the batch would make the loss about 0
    for t, a in zip(transitions, advantages):
        t.reward = a
    write_to_stream(redis_client, key_prefix, transitions)
    gen = GenerationConfig(advantage="grpo", kl_in_reward=False, kl_estimator="k3")
    learner = learner_on(
        tiny_models["llama"], "float32", redis_url, redis_client, key_prefix, tmp_path, n, policy_minibatch=n, generation=gen
    )
    critic_before = [p.detach().clone() for p in learner.lp.token_value_head.parameters()]
    metrics = learner.step()
    assert metrics is not None and learner.counters["transitions_trained"] == n
    lengths = [len(t.generation.response_ids) for t in transitions]  # type: ignore[union-attr]
    expected = -sum(a * n_tokens for a, n_tokens in zip(advantages, lengths)) / sum(lengths)
    assert metrics["generation/optimizer_steps"] == 1 and metrics["generation/first_minibatch_ratio_dev"] < 1e-4
    assert metrics["generation/policy_loss"] == pytest.approx(expected, abs=1e-4)
    assert metrics["generation/group_relative"] == 1.0 and "generation/value_loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(critic_before, learner.lp.token_value_head.parameters()))


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_group_relative_estimators_take_their_kl_penalty_in_the_loss(advantage) -> None:
    from learner_node.config import GenerationConfig

    with pytest.raises(ValueError, match=f"{advantage} takes the KL to the reference in the loss"):
        GenerationConfig(advantage=advantage)  # kl_in_reward is on by default
    assert GenerationConfig(advantage=advantage, kl_coef=0.0).advantage == advantage
    with pytest.raises(ValueError, match="`advantage` must be one of gae, grpo, rloo, got 'reinforce'"):
        GenerationConfig(advantage="reinforce")


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_responses_of_different_lengths_train_and_micro_batches_add_up_to_the_minibatch(
    tiny_models, advantage, redis_url, redis_client, key_prefix, tmp_path
) -> None:
    """Responses of 1 to 24 tokens after prompts of 2 to 30, in minibatches of 4 (the shapes of a real run: docs/train.md's
    quick start crashed on them at its first update). The update applies, and with a token budget that splits each
    minibatch into several micro-batches it ends at the same weights as with one micro-batch per minibatch: each
    micro-batch's gradient carries its share of the minibatch's loss."""
    from learner_node.config import GenerationConfig

    model_dir = tiny_models["llama"]
    reference, _ = load_policy(ModelSpec(model=model_dir, device="cpu", lora_rank=4))  # LoRA's B starts at 0: the base's own
    g = torch.Generator().manual_seed(1)
    prompt_lengths, response_lengths = (2, 30, 5, 12, 8, 3, 21, 7), (1, 24, 3, 11, 2, 17, 6, 9)
    transitions = []
    for i, (p_len, r_len) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt = torch.randint(3, 250, (p_len,), generator=g).tolist()
        response = torch.randint(3, 250, (r_len,), generator=g).tolist()
        t = gen_transition(prompt, response, reward=(1.0, -0.5, 0.25, 0.0)[i % 4], version=0)
        assert t.generation is not None
        t.generation.logprobs = own_logprobs(reference, prompt, response, 1.0).tolist()  # on-policy
        transitions.append(t)
    n = len(transitions)
    after = {}
    for budget in (4096, 40):  # one micro-batch per minibatch; several (the longest sequence alone in its row)
        prefix = f"{key_prefix}:{budget}"
        write_to_stream(redis_client, prefix, transitions)
        grpo = advantage == "grpo"  # GRPO takes its KL in the loss, GAE in the reward
        gen = GenerationConfig(
            advantage=advantage, kl_in_reward=not grpo, kl_estimator="k3" if grpo else "k1", kl_coef=0.05, micro_batch_tokens=budget
        )
        torch.manual_seed(0)  # the same adapter and critic to start from
        learner = learner_on(
            model_dir, "float32", redis_url, redis_client, prefix, tmp_path / str(budget), n, policy_minibatch=4, generation=gen
        )
        metrics = learner.step()
        assert metrics is not None and learner.version == 1 and learner.counters["transitions_trained"] == n
        assert metrics["generation/optimizer_steps"] == 2 and metrics["generation/first_minibatch_ratio_dev"] < 1e-4
        assert metrics["generation/response_length"] == pytest.approx(sum(response_lengths) / n)
        after[budget] = {name: p.detach().clone() for name, p in learner.lp.model.named_parameters() if p.requires_grad}
    moved = 0
    for name, weight in after[4096].items():
        torch.testing.assert_close(after[40][name], weight, atol=1e-5, rtol=0)
        moved += int("lora_B" in name and bool(weight.abs().max() > 0))
    assert moved > 0  # the adapter trained (its B started at 0)


def test_grpo_trains_nothing_during_the_warm_up(tiny_models, redis_url, redis_client, key_prefix, tmp_path) -> None:
    """`warmup_updates` trains only the critic; GRPO has none, so its warm-up updates leave the policy as it is."""
    from learner_node.config import GenerationConfig

    transitions = [
        gen_transition([5, 6, 7][: 1 + i % 3], [8, 9, 10, 11][: 1 + i % 4], reward=(-1.0, 1.0)[i % 2], version=0) for i in range(4)
    ]
    write_to_stream(redis_client, key_prefix, transitions)
    gen = GenerationConfig(advantage="grpo", kl_in_reward=False, kl_estimator="k3")
    learner = learner_on(
        tiny_models["llama"], "float32", redis_url, redis_client, key_prefix, tmp_path, 4, generation=gen, warmup_updates=1
    )
    before = {name: p.detach().clone() for name, p in learner.lp.model.named_parameters() if p.requires_grad}
    metrics = learner.step()
    assert metrics is not None and "generation/optimizer_steps" not in metrics and learner.version == 0
    for name, p in learner.lp.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name]), name


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_the_reference_and_the_critic_share_one_adapter_off_forward(tiny_models, advantage) -> None:
    """The reference's log-probabilities and the critic's features are the frozen base's states at the same
    positions: one forward of the adapter-off decoder gives both (it gave them in two), and GRPO keeps none."""
    from peft.tuners.lora import LoraLayer

    from learner_node.config import GenerationConfig
    from learner_node.packed_forward import response_hidden
    from learner_node.policy import LearnerPolicy
    from learner_node.token_update import Chain, GenerationBatch, GenerationUpdate
    from models import scoring

    torch.manual_seed(0)
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=4))
    lp = LearnerPolicy(model, tokenizer, "token", 1.0, [8], token_value_hidden=[8])
    g = torch.Generator().manual_seed(1)
    batch = GenerationBatch()
    for i, (n_prompt, n_response) in enumerate([(12, 5), (3, 9), (7, 1)]):  # one chain per response, nothing after
        batch.prompts.append(torch.randint(3, 250, (n_prompt,), generator=g).tolist())
        batch.responses.append(torch.randint(3, 250, (n_response,), generator=g).tolist())
        batch.temperatures.append(1.0)
        batch.rewards.append(float(i))
        batch.dones.append(True)
        batch.lags.append(0)
        batch.behaviour.append([-1.0] * n_response)
        batch.chains.append(Chain([i], None))
    lora = next(m for m in model.modules() if isinstance(m, LoraLayer))
    adapter_off: list[int] = []
    scoring.model_parts(model)[0].register_forward_pre_hook(lambda *_: adapter_off.append(1) if lora.disable_adapters else None)
    settings = {"kl_in_reward": False, "kl_estimator": "k3"} if advantage == "grpo" else {}  # as GRPO takes its KL
    update = GenerationUpdate(lp, batch, GenerationConfig(micro_batch_tokens=64, advantage=advantage, value_hidden=[8], **settings))
    update.targets({})
    assert len(adapter_off) == 1  # all three responses fit one packed forward of 64 tokens
    if advantage == "grpo":
        assert update.features == []
        return
    with torch.no_grad(), lp.base() as base:
        want = response_hidden(base, batch.prompts, batch.responses, 64)
    assert [f.shape for f in update.features] == [(5, 64), (9, 64), (1, 64)]
    for got, expected in zip(update.features, want):
        assert torch.equal(got, expected.float())
