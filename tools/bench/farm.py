"""`ppoz bench farm`: the multi-host scenario of tools/reliability/farm.py, its throughput per host and recovery times."""

from __future__ import annotations

import argparse

from tools.bench import load_at_start
from tools.reliability import farm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    farm.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    load_at_start("farm")
    return farm.main(args)
