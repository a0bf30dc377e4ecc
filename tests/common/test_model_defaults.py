"""Settings resolved from the model: `lora_trainable = ["auto"]` and `policy_lr = 0`.

A random tiny model (built by `ppoz tiny-model`, its directory holds ppoz_tiny.json) must train its head
beside the adapter and at a rate its random weights notice; any other model keeps the pretrained defaults.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.config import ConfigError, load
from common.shared_settings import PolicySpec, StoreSettings
from learner_node.config import LearnerConfig
from models.policy_model import ModelSpec, load_policy
from models.tiny_models import LORA_TRAINABLE, MARKER
from tests.processes import ppoz


@pytest.fixture(scope="module")
def pretrained_like(tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama's files without the build record: what a downloaded model directory looks like."""
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    shutil.copytree(tiny_models["llama"], path)
    (path / MARKER).unlink()
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_auto_trains_a_tiny_models_head_and_final_norm(tiny_models: dict[str, str], arch: str) -> None:
    spec = ModelSpec.of(PolicySpec(model=tiny_models[arch]), "cpu")
    assert spec.lora_trainable == LORA_TRAINABLE[arch]
    model, _ = load_policy(spec)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name}
    # peft keeps a trainable copy of each module to save, the original frozen beside it
    assert trainable and all(any(f"{m}.modules_to_save" in name for m in LORA_TRAINABLE[arch]) for name in trainable)


def test_auto_trains_nothing_beside_the_adapter_of_another_model(pretrained_like: str) -> None:
    spec = ModelSpec.of(PolicySpec(model=pretrained_like), "cpu")
    assert spec.lora_trainable == ()
    model, _ = load_policy(spec)
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)


def test_an_explicit_list_is_taken_as_it_is(tiny_models: dict[str, str]) -> None:
    assert ModelSpec.of(PolicySpec(model=tiny_models["llama"], lora_trainable=[]), "cpu").lora_trainable == ()
    assert ModelSpec.of(PolicySpec(model=tiny_models["llama"], lora_trainable=["lm_head"]), "cpu").lora_trainable == ("lm_head",)
    with pytest.raises(ValueError, match="lora_trainable"):
        PolicySpec(model="m", lora_trainable=["auto", "lm_head"])


def test_policy_lr_by_the_model(tiny_models: dict[str, str], pretrained_like: str) -> None:
    def lr(model: str, **kw: object) -> float:
        return LearnerConfig(policy=PolicySpec(model=model, **kw), store=StoreSettings(redis_url="redis://x")).resolved_policy_lr()  # type: ignore[arg-type]

    assert lr(tiny_models["llama"]) == 3e-4
    assert lr(tiny_models["llama"], lora_rank=0) == 3e-4
    assert lr(pretrained_like) == 1e-5
    assert lr(pretrained_like, lora_rank=0) == 1e-6
    given = LearnerConfig(policy=PolicySpec(model=tiny_models["llama"]), store=StoreSettings(redis_url="redis://x"), policy_lr=2e-4)
    assert given.resolved_policy_lr() == 2e-4


def test_policy_lr_must_not_be_negative(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[policy]\nmodel = "m"\n[store]\nredis_url = "redis://x"\n[learner]\npolicy_lr = -1e-5\n')
    with pytest.raises(ConfigError, match="policy_lr"):
        load(LearnerConfig, str(cfg))


def test_gradient_checkpointing_is_on_by_default_on_a_gpu_only(tmp_path: Path) -> None:
    def cfg(**kw: str) -> LearnerConfig:
        return LearnerConfig(policy=PolicySpec(model="m"), store=StoreSettings(redis_url="redis://x"), **kw)  # type: ignore[arg-type]

    assert cfg().checkpoints_layers("cuda:1") and not cfg().checkpoints_layers("cpu")
    assert cfg(gradient_checkpointing="on").checkpoints_layers("cpu")
    assert not cfg(gradient_checkpointing="off").checkpoints_layers("cuda:0")
    bad = tmp_path / "c.toml"
    bad.write_text('[policy]\nmodel = "m"\n[store]\nredis_url = "redis://x"\n[learner]\ngradient_checkpointing = "yes"\n')
    with pytest.raises(ConfigError, match="`gradient_checkpointing` must be auto, on or off, got 'yes'"):
        load(LearnerConfig, str(bad))


def test_a_broken_build_record_is_named(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(ValueError, match=MARKER):
        ModelSpec.of(PolicySpec(model=str(tmp_path)), "cpu")


@pytest.mark.slow
def test_ppoz_tiny_model_builds_a_loadable_model(tmp_path: Path) -> None:
    # torch and transformers imported, a tokenizer trained and a model written: 10-20 s alone on the 2-core VM; x15
    out = ppoz("tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--hidden", "32", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "model =" in out.stdout
    spec = ModelSpec.of(PolicySpec(model=str(tmp_path / "m")), "cpu")
    model, tokenizer = load_policy(spec)
    assert model.config.hidden_size == 32 and spec.lora_trainable == LORA_TRAINABLE["qwen2"]
    bad = ppoz("tiny-model", str(tmp_path / "b"), "--hidden", "30", timeout=300)  # a refusal: less than the build above
    assert bad.returncode == 2 and "--hidden" in bad.stderr


def test_a_model_is_loaded_straight_onto_its_device(tiny_model, monkeypatch) -> None:
    """The weights go from the checkpoint to the model's device (accelerate's device_map), not through the host:
    here the meta device stands in for a GPU, and the model peft wraps is already there."""
    import models.policy_model as policy_model
    from models.policy_model import ModelSpec, load_policy

    seen: list[str] = []
    wrap = policy_model.with_adapter
    monkeypatch.setattr(
        policy_model, "with_adapter", lambda model, spec: seen.append(next(model.parameters()).device.type) or wrap(model, spec)
    )
    model, _ = load_policy(ModelSpec(model=tiny_model("qwen2"), device="meta", lora_rank=4))
    assert seen == ["meta"] and {p.device.type for p in model.parameters()} == {"meta"}
