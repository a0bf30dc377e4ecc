"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

# The exit status of a process that stopped because of what it was given, not because it failed: restarting it
# would only meet the same input again (`ppoz learner` after max_discarded_updates non-finite updates in a row).
# A supervisor does not restart it.
EXIT_STOPPED_ON_INPUT = 3


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM the child when its parent dies (a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_now(code: int) -> NoReturn:
    """End the process with `code` once its work is done and written, without the interpreter's finalization: the
    C++ objects torch leaves to it can abort the process there (a learner rank's gloo threads: "terminate called
    without an active exception", SIGABRT, seen in 2 of 3 suite runs) or take seconds. Logs and streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads any more
            pass
    os._exit(code)
