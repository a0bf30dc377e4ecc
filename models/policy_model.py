"""Loading the policy: base causal LM + LoRA adapter, the same way in actor and learner."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from common.config import option
from common.shared_settings import PolicySpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What to load, in this process: the shared policy settings plus this process's device."""

    model: str = option("", "a Hugging Face id or a local directory")
    device: str = option("auto", "auto: cuda if available, else cpu")
    dtype: str = option("auto", "auto: bfloat16 on GPU, float32 on CPU")
    lora_rank: int = option(8, "0: no adapter, all weights are the policy's (tiny models)")
    lora_alpha: int = option(16, "LoRA alpha")
    lora_trainable: tuple[str, ...] = option((), "modules trained in full beside the adapter (peft's modules_to_save)")
    attn_implementation: str = option("sdpa", "transformers' attention implementation")

    @classmethod
    def of(cls, policy: PolicySpec, device: str) -> ModelSpec:
        """The model of the shared [policy] settings, on this process's device ("auto" settings resolved)."""
        from common.shared_settings import AUTO
        from models.tiny_models import default_lora_trainable

        trainable = default_lora_trainable(policy.model) if policy.lora_trainable == [AUTO] else tuple(policy.lora_trainable)
        return cls(
            model=policy.model,
            device=device,
            dtype=policy.dtype,
            lora_rank=policy.lora_rank,
            lora_alpha=policy.lora_alpha,
            lora_trainable=trainable,
        )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def load_policy(spec: ModelSpec) -> tuple[Any, Any]:
    """(model, tokenizer): the base model in eval mode with a fresh LoRA adapter (identity at start)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    device = spec.resolved_device()
    # Straight onto its device (accelerate's device_map): built on the host first, eight actors of a 7B model on one
    # machine would hold ~120 GB of host memory at once before moving it.
    placed = {"device_map": str(device)} if device.type != "cpu" else {}
    model: Any = AutoModelForCausalLM.from_pretrained(
        spec.model, dtype=spec.resolved_dtype(), attn_implementation=spec.attn_implementation, **placed
    )
    model = with_adapter(model, spec)
    model.to(device).eval()  # the adapter, made where the model is, and the model where device_map left it
    log.info("loaded %s on %s (%s), LoRA rank %d", spec.model, spec.resolved_device(), spec.resolved_dtype(), spec.lora_rank)
    return model, tokenizer


def with_adapter(model: Any, spec: ModelSpec) -> Any:
    """`model` with a fresh LoRA adapter of `spec`'s rank on every linear layer (identity at start), or as it is
    with `lora_rank` 0."""
    if spec.lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    config = LoraConfig(
        # GPT-2 style models keep their linear weights transposed (Conv1D); peft must know, or it warns and guesses
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        modules_to_save=list(spec.lora_trainable) or None,
        task_type="CAUSAL_LM",
    )
    # peft keeps adapter weights in float32 even over a bf16 base (autocast_adapter_dtype):
    # a 1e-6 update would round away in 16 bits.
    with peft_warnings_silenced():
        return get_peft_model(model, config)


@contextlib.contextmanager
def peft_warnings_silenced() -> Iterator[None]:
    """Around get_peft_model: the warnings it gives that are nobody's to act on."""
    with warnings.catch_warnings():
        # A tied head (GPT-2, Qwen2) in modules_to_save: peft warns that its trained copy unties it from
        # the input embedding. That is what is meant (the embedding stays the base's); PPOZ never merges the head
        # (the actor folds LoRA layers only, actor_node/lora_merge.py).
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*tied layer is part of the adapter")
        # peft (0.21) reads transformers' deprecated `is_gradient_checkpointing`: theirs to change, not the user's.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them.

    transformers checkpoints a layer only in training mode, and the learner computes in eval mode
    (no dropout: its log-probabilities must be the actor's). So every dropout here is set to 0,
    which makes training mode the same function, and the caller switches training mode on only
    around the forwards that should checkpoint (`LearnerPolicy.checkpointing`): those run without
    a KV cache, which checkpointing turns off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.eval()


def policy_state_items(model: Any, tied_once: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainable part of the policy, one tensor at a time on the CPU: the adapter's weights, or all
    weights without an adapter. One at a time, so a publisher never holds a second copy of a GPU model.
    `tied_once`: a tensor that is another's under a second name (tied embeddings) comes once, under its
    first name (a weight snapshot: the actor's model ties them again)."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if tied_once and tensor.numel() and identity in seen:
            continue
        seen.add(identity)
        yield name, tensor.detach().cpu().contiguous()


def policy_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """`policy_state_items` as one dict (a checkpoint, a test)."""
    return dict(policy_state_items(model))


def load_policy_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Put published weights into the policy (adapter weights, or all weights without an adapter)."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(model, state)
        except KeyError as e:  # peft looks up every trainable module's tensors in the snapshot
            raise ValueError(
                f"adapter snapshot lacks {e}: it was made with other [policy] settings (lora_rank, lora_trainable) than this model's"
            ) from None
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter snapshot has keys this model lacks, e.g. {unexpected[:3]}")
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"weight snapshot has keys this model lacks, e.g. {unexpected[:3]}")
