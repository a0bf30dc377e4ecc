"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import signal

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
