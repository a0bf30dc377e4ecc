"""How a transformers model takes and returns its KV cache, whichever release is installed.

transformers 5.24 renamed the KV-cache argument of every model's `forward` from
`past_key_values` to `cache`, and the output's field with it; the old names still
work until 5.40 but warn on every call (and the suite turns warnings into errors).
setup.cfg admits releases on both sides of the rename, so the code that passes a
cache asks the module which name its `forward` declares instead of assuming one:

    out = decoder(input_ids=ids, **cache_kwargs(decoder, cache))
    cache = returned_cache(out)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

NEW_NAME = "cache"  # transformers >= 5.24
OLD_NAME = "past_key_values"  # transformers < 5.24 (accepted with a warning until 5.40)


_argument_by_class: dict[type, str] = {}


def _argument_of(forward_owner: type) -> str:
    """The KV-cache parameter that `forward_owner.forward` declares (looked up once per class)."""
    if forward_owner not in _argument_by_class:
        parameters = inspect.signature(forward_owner.forward).parameters  # type: ignore[attr-defined]  # follows functools.wraps
        if NEW_NAME in parameters:
            name = NEW_NAME
        elif OLD_NAME in parameters:
            name = OLD_NAME
        else:  # a wrapper that takes **kwargs only (a peft model, a custom module): go by the library's release
            name = NEW_NAME if _transformers_renamed() else OLD_NAME
        _argument_by_class[forward_owner] = name
    return _argument_by_class[forward_owner]


@functools.lru_cache(maxsize=1)
def _transformers_renamed() -> bool:
    from transformers import modeling_outputs

    return NEW_NAME in {f.name for f in dataclasses.fields(modeling_outputs.BaseModelOutputWithPast)}


def cache_argument(module: Any) -> str:
    """`cache` or `past_key_values`: the name under which `module`'s forward takes a KV cache."""
    return _argument_of(type(module))


def cache_kwargs(module: Any, cache: Any, use_cache: bool = True) -> dict[str, Any]:
    """Keyword arguments that hand `cache` (a transformers Cache, or None) to `module`'s forward."""
    return {cache_argument(module): cache, "use_cache": use_cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned (`output.cache`, or `output.past_key_values` before 5.24)."""
    names = {f.name for f in dataclasses.fields(output)}
    if NEW_NAME in names:
        return getattr(output, NEW_NAME)
    if OLD_NAME in names:
        return getattr(output, OLD_NAME)
    raise TypeError(f"{type(output).__name__} carries no KV cache (fields: {', '.join(sorted(names))})")
