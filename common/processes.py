"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM the child when its parent dies (a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
