"""How the reliability commands (`ppoz fuzz`, `ppoz soak`) print a report and what they exit with."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any


def print_report(report: Any, as_json: bool, as_text: Callable[[Any], str]) -> int:
    """Print the report (a dataclass with failures()) as text or JSON; 1 if it failed, else 0."""
    failures = report.failures()
    print(json.dumps({**asdict(report), "failures": failures}, indent=2) if as_json else as_text(report))
    return 1 if failures else 0


def ledger_and_steps_failures(ledger_balanced: bool, ledger: str, steps: int) -> list[str]:
    """What a run that served clients fails on whatever else it checks: a ledger that does not balance
    (tools/reliability/ledger.py), and no step answered at all."""
    out = [] if ledger_balanced else [f"ledger not balanced: {ledger}"]
    if not steps:
        out.append("no step was answered")
    return out


def run_as_script(
    prog: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int], level: int
) -> None:
    """`python -m reliability.NAME`: the same options as the ppoz subcommand."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    add_arguments(parser)
    logging.basicConfig(level=level)
    sys.exit(main(parser.parse_args()))
