"""Benchmarks run by `ppoz bench NAME`."""

from __future__ import annotations

import logging
import os
import sys

QUIET_LOAD = 0.5  # a load average above this at the start: other work shares the cores and skews the legs


def load_at_start(bench: str) -> float:
    """The machine's one-minute load average, printed, with a warning when other work is running."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"ppoz bench {bench}: load average {load:.2f} on {cores} cores at the start", file=sys.stderr, flush=True)
    if load > QUIET_LOAD:
        logging.getLogger(f"tools.bench.{bench}").warning(
            "load average %.2f on %d cores before the bench: other work is running and will skew the legs", load, cores
        )
    return load


def status_kb(field: str) -> int:
    """A field of this process's /proc/self/status in kB (VmRSS, VmHWM, ...); 0 where there is none."""
    from tools.reliability.fuzz import rss_kb

    return rss_kb("self", field) or 0
