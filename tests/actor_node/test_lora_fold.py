"""The engine folds a float32 LoRA adapter into the base weights while rows run (actor_node/lora_merge.py):
the same text and log-probabilities as the plain model, the base weights bit-identical afterwards, and a new
adapter loaded between batches is the one folded next."""

from __future__ import annotations

import torch

from actor_node.generation_engine import GenerationEngine
from models.policy_model import ModelSpec, load_policy
from tests.actor_node.test_engine_against_generate import byte_prompt, drive, job


def randomise_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_folded_generation_equals_the_plain_model_and_leaves_the_base_weights_exact(tiny_models) -> None:
    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=8))
    randomise_adapter(model, 0)
    before = base_weights(model)
    requests = {0: [job(i, byte_prompt(20 + 40 * i, seed=i), 24, temperature=1.0, seed=i) for i in range(4)]}
    requests[5] = [job(9, byte_prompt(70, seed=9), 30)]

    folded = GenerationEngine(model, tokenizer, max_rows=4)
    assert folded.folded is not None
    answers, _ = drive(folded, {k: list(v) for k, v in requests.items()})
    plain, _ = drive(GenerationEngine(model, tokenizer, max_rows=4, fold_lora=False), {k: list(v) for k, v in requests.items()})
    for i in answers:
        assert answers[i].response_ids == plain[i].response_ids, i
        assert torch.allclose(torch.tensor(answers[i].logprobs), torch.tensor(plain[i].logprobs), atol=1e-5), i
    after = base_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # restored exactly, not by subtracting
    assert not folded.folded.folded

    # While rows run, the adapter is folded: peft computes no LoRA product, the base weight holds W + sBA.
    folded.add([job(20, "hello", 50)])
    folded.step()
    layer = folded.folded.layers[0]
    assert layer.merged and not torch.equal(layer.get_base_layer().weight, folded.folded.originals[0])
    folded.cancel({20})
    assert not layer.merged and torch.equal(layer.get_base_layer().weight, folded.folded.originals[0])

    # New adapter weights, loaded between batches, are what the next batch folds.
    randomise_adapter(model, 1)
    again, _ = drive(folded, {0: [job(30, byte_prompt(50, seed=3), 20)]})
    fresh, _ = drive(GenerationEngine(model, tokenizer, max_rows=1, fold_lora=False), {0: [job(30, byte_prompt(50, seed=3), 20)]})
    assert again[30].response_ids == fresh[30].response_ids
    assert all(torch.equal(before[n], p) for n, p in base_weights(model).items())


def test_a_scoring_job_that_disables_the_adapter_between_steps_changes_nothing(tiny_models) -> None:
    """rag_step's embedder runs under peft's disable_adapter(), which unmerges a merged layer by subtracting:
    the next step folds it again from the original weight, and the batch drains to the exact base weights."""
    import warnings

    model, tokenizer = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=8))
    randomise_adapter(model, 2)
    before = base_weights(model)
    request = job(0, byte_prompt(60, seed=4), 20)
    plain, _ = drive(GenerationEngine(model, tokenizer, max_rows=1, fold_lora=False), {0: [dict(request)]})
    engine = GenerationEngine(model, tokenizer, max_rows=1)
    engine.add([request])
    answers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft warns when asked to unmerge what is not merged
        while engine.active:
            with torch.inference_mode(), model.disable_adapter():
                model(input_ids=torch.tensor([[5, 6, 7]]))
            answers.update((j["job"], a) for j, a in engine.step())
            assert engine.folded is not None and all(layer.merged for layer in engine.folded.layers) == bool(engine.active)
    assert answers[0].response_ids == plain[0].response_ids
    assert all(torch.equal(before[n], p) for n, p in base_weights(model).items())


def test_a_bfloat16_adapter_folds_and_keeps_its_effect_as_the_unfolded_model_does(tiny_models) -> None:
    """Folded in bf16, W + sBA is rounded to 8 bits: the adapter's effect on the log-probabilities (against the
    float32 model's) is off by as much as the unfolded bf16 model's, no more; the base comes back bit for bit."""
    from actor_node.lora_merge import FoldedLoRA, applies
    from learner_node.packed_forward import response_logprobs

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (20, 9, 33, 14)]
    responses = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (12, 30, 5, 40)]

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat(response_logprobs(model, prompts, responses, [1.0] * 4, 256)[0])

    effects = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model, _ = load_policy(ModelSpec(model=tiny_models["llama"], device="cpu", lora_rank=8, dtype=dtype))
        assert applies(model)
        plain = logprobs(model)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # an adapter that has learned something: log-prob effects of about 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        effects[dtype] = logprobs(model) - plain
        if dtype == "bfloat16":
            before = base_weights(model)
            fold = FoldedLoRA(model)
            fold.fold()
            assert all(layer.merged for layer in fold.layers)  # no LoRA product computed: the base weight is W + sBA
            effects["folded"] = logprobs(model) - plain
            fold.restore()
            assert all(torch.equal(before[n], p) for n, p in base_weights(model).items())
    reference = effects["float32"]
    unfolded_error = float((effects["bfloat16"] - reference).abs().mean())
    folded_error = float((effects["folded"] - reference).abs().mean())
    assert float(reference.abs().mean()) > 10 * unfolded_error  # the effect is well above bf16's own noise
    assert folded_error <= 1.5 * unfolded_error, (folded_error, unfolded_error)
