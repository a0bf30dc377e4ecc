"""The KV-cache argument is found by what a model's forward declares, on either side of transformers 5.24's rename."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, modeling_outputs

from models.kv_cache import cache_argument, cache_kwargs, returned_cache
from models.scoring import model_parts

RENAMED = "cache" in {f.name for f in dataclasses.fields(modeling_outputs.BaseModelOutputWithPast)}


class BeforeTheRename(torch.nn.Module):
    def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> Any:
        return past_key_values


class AfterTheRename(torch.nn.Module):
    def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> Any:
        return cache


class KeywordsOnly(torch.nn.Module):  # a wrapper (peft's models) that passes everything on
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return kwargs


def test_the_argument_is_the_one_the_forward_declares() -> None:
    assert cache_argument(BeforeTheRename()) == "past_key_values"
    assert cache_argument(AfterTheRename()) == "cache"
    assert cache_argument(KeywordsOnly()) == ("cache" if RENAMED else "past_key_values")  # by the installed release
    assert cache_kwargs(BeforeTheRename(), "kv") == {"past_key_values": "kv", "use_cache": True}
    assert cache_kwargs(AfterTheRename(), None, use_cache=False) == {"cache": None, "use_cache": False}


@dataclasses.dataclass
class OldOutput:
    last_hidden_state: Any = None
    past_key_values: Any = None


@dataclasses.dataclass
class NewOutput:
    last_hidden_state: Any = None
    cache: Any = None


def test_the_returned_cache_is_read_under_either_name() -> None:
    assert returned_cache(OldOutput(past_key_values="old")) == "old"
    assert returned_cache(NewOutput(cache="new")) == "new"
    with pytest.raises(TypeError, match="carries no KV cache"):
        returned_cache(modeling_outputs.MaskedLMOutput())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_each_architecture_takes_and_returns_its_cache_without_a_warning(tiny_models: dict[str, str], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch]).eval()
    decoder, _, _ = model_parts(model)
    assert cache_argument(decoder) == ("cache" if RENAMED else "past_key_values")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")  # a deprecated name would warn here
        whole = decoder(input_ids=ids).last_hidden_state
        first = decoder(input_ids=ids[:, :3], **cache_kwargs(decoder, None))
        cache = returned_cache(first)
        rest = decoder(input_ids=ids[:, 3:], position_ids=torch.tensor([[3, 4]]), **cache_kwargs(decoder, cache)).last_hidden_state
    assert cache.get_seq_length() == 5  # the second call appended to the cache the first returned
    torch.testing.assert_close(rest, whole[:, 3:], atol=1e-5, rtol=1e-5)  # and read it: the same states as one pass
