"""Loading straight into FSDP2 shards (learner_node/sharded_load.py) against loading whole and sharding after
(`load_policy` then `sharding.shard`), on 2 gloo ranks forked from this process (tests/learner_node/test_sharding.py's
`run_ranks`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner_node import sharded_load
from learner_node.packed_forward import response_logprobs
from learner_node.sharding import full_state_chunks, shard
from models.policy_model import ModelSpec, load_policy
from tests.learner_node.test_sharding import run_ranks

KINDS = {  # (tiny model, LoRA rank, modules trained in full, dtype, mixed precision)
    "lora": ("llama", 4, (), "float32", False),
    "lora_head_bf16": ("llama", 4, ("lm_head", "model.norm"), "bfloat16", True),
    "full_tied": ("qwen2", 0, (), "float32", False),
    "full_tied_bf16": ("qwen2", 0, (), "bfloat16", True),
}
PROMPTS, RESPONSES = [[3, 9, 4, 11, 7], [5, 6], [8, 2, 10, 12, 3, 4, 5]], [[4, 5, 6, 7], [9], [3, 3, 8]]


def _job(rank: int, world: int, model_dir: str, kind: str, out: str) -> None:
    arch, lora_rank, trainable, dtype, mixed = KINDS[kind]
    spec = ModelSpec(model=model_dir, device="cpu", lora_rank=lora_rank, lora_trainable=trainable, dtype=dtype)
    torch.manual_seed(0)
    whole, _ = load_policy(spec)
    shard(whole, mixed)
    torch.manual_seed(0)
    direct, _ = sharded_load.load_sharded_policy(spec, mixed)
    with torch.no_grad():
        logprobs = [response_logprobs(m, PROMPTS, RESPONSES, [1.0, 0.8, 1.0], 64)[0] for m in (whole, direct)]
    states = [{k: v.clone() for k, v in full_state_chunks(m)} for m in (whole, direct)]
    kinds = [{n: (type(p).__name__, p.dtype, p.requires_grad) for n, p in m.named_parameters()} for m in (whole, direct)]
    buffers = [{n: b.clone() for n, b in m.named_buffers()} for m in (whole, direct)]
    if rank == 0:
        torch.save({"logprobs": logprobs, "states": states, "kinds": kinds, "buffers": buffers}, out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_sharded_load_is_the_whole_load_sharded_to_the_bit(kind: str, tiny_models: dict[str, str], tmp_path: Path) -> None:
    run_ranks(_job, tiny_models[KINDS[kind][0]], kind, str(tmp_path / "out.pt"))
    got: dict[str, Any] = torch.load(tmp_path / "out.pt")
    whole, direct = got["states"]
    assert list(direct) == list(whole)
    for key, value in whole.items():
        assert direct[key].dtype == value.dtype and torch.equal(direct[key], value), key  # the adapter's random A too
    assert got["kinds"][0] == got["kinds"][1]  # sharded alike, trained alike, masters alike
    for name, value in got["buffers"][0].items():  # rotary frequencies: computed, not left uninitialised
        assert torch.equal(got["buffers"][1][name], value), name
    for a, b in zip(*got["logprobs"]):
        assert torch.equal(a, b)


def test_the_checkpoint_names_of_a_peft_models_keys() -> None:
    name = sharded_load.checkpoint_name
    assert name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert name("model.norm.weight") == "model.norm.weight"


def test_a_folder_without_safetensors_is_named(tmp_path: Path) -> None:
    assert not sharded_load.loads_sharded(ModelSpec(model=str(tmp_path)))
    with pytest.raises(ValueError, match="no model.safetensors .*: a sharded learner loads safetensors checkpoints only"):
        sharded_load.checkpoint_files(tmp_path)


def test_the_probe_model_is_the_architecture_at_two_layers(tiny_models: dict[str, str]) -> None:
    spec = ModelSpec(model=tiny_models["qwen2"], device="cpu", lora_rank=4)
    probe = sharded_load.probe_model(spec)
    whole, _ = load_policy(spec)
    assert probe.config.num_hidden_layers == 2 and type(probe.get_base_model()) is type(whole.get_base_model())
    plain, _ = load_policy(ModelSpec(model=tiny_models["qwen2"], device="cpu", lora_rank=0))
    assert sharded_load.parameter_count(spec) == sum(p.numel() for p in plain.parameters())  # the base's, tied counted once
    for (name, b), (_, want) in zip(probe.named_buffers(), whole.named_buffers()):
        assert torch.equal(b, want), name  # computed by the constructor, as the loaded model's


def test_a_checkpoint_with_names_transformers_renames_is_loaded_whole(tiny_models: dict[str, str], tmp_path: Path) -> None:
    """A GPT-2 checkpoint as the Hub has it, without the `transformer.` prefix: load_policy reads it (transformers
    renames), the sharded loader would not find its names, so the learner loads it whole and then shards it."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hub-gpt2"
    shutil.copytree(tiny_models["gpt2"], folder)
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    spec = ModelSpec(model=str(folder), device="cpu", lora_rank=4)
    assert not sharded_load.loads_sharded(spec)
    assert sharded_load.loads_sharded(ModelSpec(model=tiny_models["gpt2"], device="cpu", lora_rank=4))
    load_policy(spec)  # what the learner falls back to
