"""Command-line options that several commands and tools declare alike (`ppoz status`, `play`, `demo`, `train`,
`export`, the benchmarks and the fuzzer): each declared once here, its help given where it says something of
its own command."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from common.config import local_path_or_id

BROKER_ENDPOINT = "tcp://127.0.0.1:5555"  # the broker's default client endpoint, as `ppoz up` binds it
JSON_INSTEAD_OF_TABLE = "print one JSON object instead of a table"
DEVICE_AUTO = "cpu, cuda, or auto (default)"


def add_broker_flag(parser: argparse.ArgumentParser) -> None:
    """`--broker`: the client endpoint of the broker to talk to."""
    parser.add_argument("--broker", default=BROKER_ENDPOINT, help=f"the broker's client endpoint (default: {BROKER_ENDPOINT})")


def add_json_flag(parser: argparse.ArgumentParser, help: str = JSON_INSTEAD_OF_TABLE) -> None:
    """`--json`: the command's result as JSON, in place of its lines for people."""
    parser.add_argument("--json", action="store_true", help=help)


def add_repeats_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--repeats`: how many times a benchmark measures (3 by default); `help` says what one time is."""
    parser.add_argument("--repeats", type=int, default=3, help=help)


def add_seed_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--seed`: 0 by default; `help` says what it seeds."""
    parser.add_argument("--seed", type=int, default=0, help=help)


def add_device_flag(
    parser: argparse.ArgumentParser, help: str = DEVICE_AUTO, default: str = "auto", choices: Sequence[str] | None = None
) -> None:
    """`--device`: the torch device, `auto` by default (cuda where there is one)."""
    parser.add_argument("--device", default=default, choices=choices, help=help)


def add_model_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--model`: a local model directory or a Hugging Face id; empty by default (what that means: `help`)."""
    parser.add_argument("--model", default="", type=local_path_or_id, help=help)
