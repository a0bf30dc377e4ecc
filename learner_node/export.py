"""A learner's checkpoint as a Hugging Face model folder, loadable with `AutoModelForCausalLM.from_pretrained`.

A checkpoint (learner_node/checkpoint.py) holds what the learner trained, not a model: the adapter in peft's key
names (`policy.safetensors`, with peft's `modules_to_save` copies: a tiny model's head and final norm), or all
weights without an adapter (`lora_rank = 0`), or, from a sharded learner, neither but `sharded/` (a
torch.distributed.checkpoint folder of every trained tensor and the optimizers, learner_node/sharding.py). Its
`state.json` records the learner's whole config, and with it the `[policy]` the weights belong to: the base model,
the adapter's rank and alpha, the modules trained in full.

`export_checkpoint` rebuilds that policy as the learner and the actor build it (models.policy_model.load_policy:
the base, then the same peft LoRA model), puts the checkpoint's weights in, merges the adapter into the base with
peft's `merge_and_unload` (the modules trained in full replace the base's), and writes the plain model with
`save_pretrained` (config, safetensors, generation config) beside the base's tokenizer. So the folder needs
nothing of PPOZ to load, and computes what the actor served with those weights (an actor folds the same adapter
the same way while it generates: actor_node/lora_merge.py).

The folder is written under a temporary name beside the destination and renamed into place at the end, so an
export that fails or is killed never leaves a half-written model where a model is expected.

Errors a user can mend (not a checkpoint, a base model that is not where the checkpoint says, a destination in
use) are `ExportError`s naming the input at fault.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from common.config import is_local_path, local_path_or_id
from common.shared_settings import AUTO, PolicySpec
from learner_node import checkpoint

log = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # auto: the base model's own dtype
PROVENANCE = "ppoz_export.json"  # in the exported folder: which checkpoint and base it was made from


class ExportError(Exception):
    """An input the user can mend; the message names it."""


@dataclass(frozen=True)
class Source:
    """What a checkpoint holds and what it was trained on: everything an export reads, found without loading a model."""

    checkpoint: Path  # the ckpt-* folder
    newest_of: int  # how many checkpoints the folder the user named held (0: the user named this checkpoint)
    policy: PolicySpec  # as the learner recorded it, the base model replaced by the one to load
    recorded_model: str  # the base model the learner recorded
    sharded: bool
    state: dict[str, Any]

    @property
    def kind(self) -> str:
        return "lora" if self.policy.lora_rank > 0 else "full"


@dataclass(frozen=True)
class ExportResult:
    out: Path
    checkpoint: Path
    base_model: str
    kind: str  # lora or full
    sharded: bool
    dtype: str
    parameters: int


def find_checkpoint(path: str | Path) -> tuple[Path, int]:
    """(the checkpoint folder, how many checkpoints the folder named held: 0 when `path` is a checkpoint itself)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist")
    if not path.is_dir():
        raise ExportError(f"{path} is not a checkpoint: a checkpoint is a folder (ckpt-NNNNNNNN, with a state.json)")
    if (path / "state.json").is_file():
        return path, 0
    found = [p for p in sorted(path.glob("ckpt-*")) if (p / "state.json").is_file()]
    if not found:
        raise ExportError(
            f"{path} is not a checkpoint (no state.json) nor a folder of checkpoints (no ckpt-* folder with a state.json in it)"
        )
    return found[-1], len(found)


def describe(path: str | Path, model: str = "") -> Source:
    """Read a checkpoint (or the newest of a folder of them) and check its base model is there; `model` replaces
    the recorded base (a folder that moved). Nothing is loaded but state.json."""
    ckpt, newest_of = find_checkpoint(path)
    try:
        state = checkpoint.read_state(ckpt)
    except (OSError, ValueError) as e:
        raise ExportError(f"{ckpt}/state.json cannot be read: {e}") from e
    recorded = (state.get("config") or {}).get("policy")
    if not isinstance(recorded, dict):
        raise ExportError(f"{ckpt}/state.json records no [policy] settings (config.policy): not a checkpoint of the PPOZ learner")
    known = {f.name for f in fields(PolicySpec)}
    try:
        spec = PolicySpec(**{k: v for k, v in recorded.items() if k in known})
    except (TypeError, ValueError) as e:
        raise ExportError(f"{ckpt}/state.json has [policy] settings this PPOZ cannot read: {e}") from e
    sharded = checkpoint.is_sharded(ckpt)
    if not sharded and not (ckpt / "policy.safetensors").is_file():
        raise ExportError(f"{ckpt} holds no policy weights (neither policy.safetensors nor {checkpoint.SHARDED}/)")
    base = local_path_or_id(model or spec.model)  # a relative recorded folder (a run from before paths were made absolute): from here
    if not base:
        raise ExportError(f"{ckpt}/state.json records no base model; name it with --model")
    if is_local_path(base) and not os.path.isdir(os.path.expanduser(base)):
        if model:
            raise ExportError(f"the base model {base} (--model) is not a folder")
        raise ExportError(f"the base model {base}, recorded in {ckpt}/state.json, is not there; if it moved, name its folder with --model")
    return Source(ckpt, newest_of, replace(spec, model=base), spec.model, sharded, state)


def check_out(out: Path, source: Source, force: bool) -> None:
    """Refuse a destination in use (unless `force`), and any that would hold the checkpoint or the base model."""
    out = Path(os.path.abspath(out))
    for name, path in (("checkpoint", source.checkpoint), ("base model", source.policy.model)):
        if is_local_path(str(path)):
            inside = Path(os.path.abspath(os.path.expanduser(str(path))))
            if out == inside or out in inside.parents:
                raise ExportError(f"--out {out} would replace the {name} {inside}: write the export elsewhere")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out} exists and is not empty; choose another folder or add --force to replace it")
        if not (out / PROVENANCE).is_file():  # --force replaces an export, never a folder of the user's (`--out .`, `~`)
            raise ExportError(f"--out {out} holds files and no {PROVENANCE}: --force replaces only an earlier export")


def export_checkpoint(
    path: str | Path,
    out: str | Path,
    model: str = "",
    dtype: str = "auto",
    force: bool = False,
    progress: Callable[[str], None] = log.info,
) -> ExportResult:
    """Write the policy of checkpoint `path` (or of the newest checkpoint in the folder `path`) as a Hugging Face
    model folder `out`: the adapter merged into the base, in the base's dtype (`dtype` auto) or the one named.
    `model`: the base model to load instead of the recorded one. `progress` gets one line per stage."""
    if dtype not in DTYPE_CHOICES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    source = describe(path, model)
    out = Path(os.path.abspath(out))
    check_out(out, source, force)
    if source.newest_of:
        progress(f"{path} holds {source.newest_of} checkpoints: exporting the newest, {source.checkpoint.name}")
    version = source.state.get("version", "?")
    progress(f"checkpoint {source.checkpoint} (policy version {version}, {source.state.get('updates', '?')} updates)")
    moved = f" (recorded: {source.recorded_model})" if source.policy.model != source.recorded_model else ""
    progress(f"base model {source.policy.model}{moved}")
    merged, tokenizer, dtype_name = _merged_model(source, dtype, progress)
    parameters = sum(p.numel() for p in merged.parameters())
    progress(f"writing {parameters:,} parameters in {dtype_name} to {out}")
    provenance = {
        "checkpoint": str(source.checkpoint),
        "base_model": source.policy.model,
        "kind": source.kind,
        "sharded": source.sharded,
        "lora_rank": source.policy.lora_rank,
        "dtype": dtype_name,
        "policy_version": version,
        "updates": source.state.get("updates"),
        "run_id": source.state.get("run_id"),
    }
    with _staged(out) as staging:
        merged.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    progress(f"done: {out} loads with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return ExportResult(out, source.checkpoint, source.policy.model, source.kind, source.sharded, dtype_name, parameters)


def _base_dtype(base: str) -> str:
    """The dtype the base model's config names (float32 when it names none, or one PPOZ does not load)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as e:
        raise ExportError(f"the base model {base} cannot be loaded ({e}); name the base with --model") from e
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in DTYPE_CHOICES[1:] else "float32"


def _merged_model(source: Source, dtype: str, progress: Callable[[str], None]) -> tuple[Any, Any, str]:
    """(the plain causal LM with the checkpoint's weights, merged; the base's tokenizer; the dtype's name)."""
    from models.policy_model import ModelSpec, load_policy

    policy = source.policy
    dtype_name = _base_dtype(policy.model) if dtype == "auto" else dtype
    trainable = _trained_in_full(source)
    spec = ModelSpec(
        model=policy.model,
        device="cpu",
        dtype=dtype_name,
        lora_rank=policy.lora_rank,
        lora_alpha=policy.lora_alpha,
        lora_trainable=trainable,
    )
    what = f"a LoRA adapter of rank {policy.lora_rank}" if policy.lora_rank else "all weights"
    if policy.lora_rank and trainable:
        what += f" and {', '.join(trainable)} trained in full"
    progress(f"loading the base in {dtype_name} and {what}{' from a sharded checkpoint' if source.sharded else ''}")
    try:
        model, tokenizer = load_policy(spec)
    except OSError as e:
        raise ExportError(f"the base model {policy.model} cannot be loaded ({e}); name the base with --model") from e
    _load_weights(model, source)
    if hasattr(model, "peft_config"):
        progress("merging the adapter into the base weights")
        with _merge_warnings_silenced():
            # not peft's safe_merge: it rounds the float32 delta to a 16-bit base's dtype before adding it (two
            # roundings); this adds it in float32 and rounds the sum once. Its finiteness check is done below.
            model = model.merge_and_unload()
    broken = [name for name, p in model.named_parameters() if not bool(p.isfinite().all())]
    if broken:
        raise ExportError(f"{source.checkpoint} holds weights that are not finite once merged, e.g. {broken[:3]}")
    # peft (0.21) unties a head that was trained apart from a tied input embedding and says so in the config; a
    # config still saying "tied" would make from_pretrained share the base's embedding as the head again
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embedding.weight and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    import torch

    return model.to(getattr(torch, dtype_name)).eval(), tokenizer, dtype_name


def _trained_in_full(source: Source) -> tuple[str, ...]:
    """The modules the adapter trained in full (peft's modules_to_save): as recorded, or for `auto` as peft wrote
    them down in the checkpoint's adapter/ (a base that moved to a copy without the tiny model's build record still
    fits), else as the learner resolved them, by the base model."""
    from models.tiny_models import default_lora_trainable

    policy = source.policy
    if policy.lora_trainable != [AUTO]:
        return tuple(policy.lora_trainable)
    adapter = source.checkpoint / "adapter" / "adapter_config.json"
    if policy.lora_rank and adapter.is_file():
        try:
            return tuple(json.loads(adapter.read_text()).get("modules_to_save") or ())
        except (OSError, ValueError) as e:
            raise ExportError(f"{adapter} cannot be read: {e}") from e
    return default_lora_trainable(policy.model)


def _load_weights(model: Any, source: Source) -> None:
    """The checkpoint's trained tensors into the policy as the learner built it. The names it holds must be exactly
    those the policy trains: peft and DCP load leniently, and would leave the base's weights where a checkpoint of
    other settings (lora_trainable, the base) has none."""
    misfit = f"does not fit the policy recorded in {source.checkpoint}/state.json"
    if source.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from learner_node import sharding

        folder = source.checkpoint / checkpoint.SHARDED
        # the keys TrainState writes: the policy's trained tensors under "policy.model."
        stored = {k for k in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata if k.startswith("policy.model.")}
        trained = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        _check_names(stored, {f"policy.model.{k}" for k in trained}, f"{folder} {misfit}")
        try:  # the policy's model state alone: no optimizer (a TrainState of none), nor the value heads
            sharding.load_sharded(folder, {"policy": sharding.TrainState(model, [])})
        except Exception as e:  # noqa: BLE001 - DCP's CheckpointException carries each rank's error
            raise ExportError(f"{folder} {misfit}: {type(e).__name__}: {e}") from e
        return
    from safetensors.torch import load_file

    from models.policy_model import load_policy_state_dict

    path = source.checkpoint / "policy.safetensors"
    state = load_file(str(path))
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        _check_names(set(state), set(get_peft_model_state_dict(model)), f"{path} {misfit}")
    else:  # all weights: every parameter from the checkpoint (a tied one under either of its names)
        names = dict(model.named_parameters(remove_duplicate=False))
        loaded = {id(names[k]) for k in state if k in names}
        missing = [k for k, p in model.named_parameters() if id(p) not in loaded]
        if missing:
            raise ExportError(f"{path} {misfit}: it lacks weights of the model, e.g. {missing[:3]}")
    try:
        load_policy_state_dict(model, state)
    except ValueError as e:
        raise ExportError(f"{path} {misfit}: {e}") from e


def _check_names(stored: set[str], expected: set[str], what: str) -> None:
    if stored != expected:
        extra, lacking = sorted(stored - expected), sorted(expected - stored)
        raise ExportError(f"{what}: it holds {len(extra)} tensors the policy lacks {extra[:2]} and lacks {len(lacking)} {lacking[:2]}")


@contextlib.contextmanager
def _merge_warnings_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        # peft tells of the head it unties, which is what an export of a trained head must do (see above)
        warnings.filterwarnings("ignore", message=".*embeddings are no longer tied after merging.*")
        yield


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` to write in, renamed to `out` when the block ends without an error (an existing
    `out` is moved aside first and removed after); removed when the block raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{os.getpid()}.tmp"
    old = out.parent / f".{out.name}.replaced-{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        for path in staging.rglob("*"):
            if path.is_file():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())  # on disk before the rename makes the folder visible
        if out.exists():
            os.rename(out, old)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)  # the folder it was to replace, back in its place
        raise
    shutil.rmtree(old, ignore_errors=True)
