"""Serving a LoRA policy with its adapter folded into the base weights while responses are generated.

peft computes a LoRA layer as x W^T + s (x A^T) B^T: two extra small matrix products, a
scale and an add per adapted layer, each a pass over the activations. Folded, the layer
is x (W + s B A)^T: the base layer's cost only. Measured on the CPU bench model (Llama
hidden 512 x 4, an adapter on every linear layer), the engine wrote about 20% more tokens
per second folded (docs/benchmarks.md, "Generation").

The fold is exact up to rounding: the logits differ from the unfolded model's in their
last bits (about 1e-6 in float32), as a different batch shape's do. In bfloat16, W + sBA
is rounded to 8 bits of mantissa, and an adapter's step smaller than that could seem
lost; measured on a tiny Llama with adapters of every size from 3e-4 to 1e-2 (log-prob
effects 0.0007 to 0.023), the folded model's error on the adapter's effect against
float32 equals the unfolded bf16 model's (0.0007-0.0008 mean, both): unfolded, peft adds
the adapter's product to a bf16 activation, rounded as finely (tests/actor_node/
test_lora_fold.py). So every dtype folds (`applies`); on a GPU that saves about 6 kernel
launches per adapted layer per decode step. It is undone exactly: the base weights are
restored from copies taken before the first fold, never by subtracting (W + sBA - sBA
drifts by a rounding error per update, and a policy served for thousands of updates
would drift from the learner's). The copies cost the adapted layers' memory once more, on
the model's device: about 2.6 GB for Qwen2.5-1.5B in bf16, 13 GB for a 7B model; an actor
that cannot spare it sets `[actor] fold_lora = false`. The engine folds before each step and restores when
the batch drains and before new weights load (GenerationEngine.swap), so set_weights always finds the
plain model. Scoring jobs answered between two steps run on the folded weights: the same function up to
rounding.
"""

from __future__ import annotations

from typing import Any

import torch


def lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def applies(model: Any) -> bool:
    """A peft LoRA model (float32, bfloat16 or float16)."""
    return hasattr(model, "peft_config") and next(model.parameters()).is_floating_point() and bool(lora_layers(model))


class FoldedLoRA:
    """Fold and restore every LoRA layer of a model. Both look at each layer's own `merged` flag: something else
    may unmerge a layer between two steps (peft's `disable_adapter()`, which the rag embedder uses, unmerges a
    merged layer by subtracting), and `fold()`, called before every step, folds it again from its original weight."""

    def __init__(self, model: Any) -> None:
        self.layers = lora_layers(model)
        if any(layer.merged for layer in self.layers):
            raise ValueError("the model's LoRA layers are merged already: their base weights are not the originals")
        self.originals = [layer.get_base_layer().weight.detach().clone() for layer in self.layers]

    @property
    def folded(self) -> bool:
        return any(layer.merged for layer in self.layers)

    def fold(self) -> None:
        """Every layer that is not merged: its original weight, then W + sBA."""
        with torch.inference_mode(False), torch.no_grad():
            for layer, original in zip(self.layers, self.originals):
                if not layer.merged:
                    layer.get_base_layer().weight.copy_(original)
                    layer.merge()

    def restore(self) -> None:
        """Every layer back to its original weight, computing its adapter again (not peft's unmerge: no subtraction)."""
        with torch.inference_mode(False), torch.no_grad():
            for layer, original in zip(self.layers, self.originals):
                layer.get_base_layer().weight.copy_(original)
                layer.merged_adapters.clear()
