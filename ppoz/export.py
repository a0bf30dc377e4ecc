"""`ppoz export CHECKPOINT --out DIR`: a learner's checkpoint as a Hugging Face model folder (learner_node/export.py).

Progress goes to stderr, one line a stage; the exported folder, alone, to stdout (for a script). Exit codes: 0
done, 2 an input to mend (the message names it: not a checkpoint, a base model that is not there, a destination
in use), 1 anything else. Paths are made absolute against the working directory before anything is read.

This module imports no torch until the command runs: `ppoz`'s parser reads every command's options, and
`ppoz broker` starts without torch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from common.config import local_path
from ppoz.flags import add_model_flag

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # learner_node.export.DTYPE_CHOICES, without its torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        type=local_path,
        help="a checkpoint folder (ckpt-NNNNNNNN: LoRA adapter, all weights or sharded), or a folder of them: its newest is taken",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", type=local_path, help="the model folder to write (must not exist, or be empty)"
    )
    add_model_flag(
        parser, "the base model to merge into, in place of the one the checkpoint records (which moved, or is on another machine)"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="dtype of the exported weights (default: auto, the base model's)"
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")


def export_command(checkpoint: str | Path, out: str | Path) -> str:
    """The shell command that exports `checkpoint` (a ckpt-* folder or a folder of them) to `out`, for a summary to print."""
    return shlex.join(["ppoz", "export", os.path.abspath(checkpoint), "--out", os.path.abspath(out)])


def main(args: argparse.Namespace) -> int:
    from learner_node.export import ExportError, export_checkpoint

    def say(line: str) -> None:
        print(f"ppoz export: {line}", file=sys.stderr, flush=True)

    try:
        result = export_checkpoint(args.checkpoint, args.out, model=args.model, dtype=args.dtype, force=args.force, progress=say)
    except ExportError as e:
        print(f"ppoz export: {e}", file=sys.stderr)
        return 2
    print(result.out)
    return 0
