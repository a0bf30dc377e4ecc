"""The tests' tiny models, each built once and kept on disk by its spec (models/tiny_models.py builds them).

Every test that needs a tiny model asks the session fixtures `tiny_model` and `tiny_reward_model`
(tests/conftest.py), which come here. A model lives in a folder named by a hash of its spec, of the
builder's source and of the transformers release, so a change to any of them builds it anew and
nothing stale is loaded. pytest-xdist workers share the folders: the first to need a model builds it
under a file lock while the others wait, and later runs of the suite on the same checkout find it
built (under .pytest_cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

import models.tiny_models

_BUILDER_SOURCE = Path(models.tiny_models.__file__).read_bytes()
# How long a worker waits for another one's build of the same model: a tiny model and its tokenizer take 5-20 s alone
# on the 2-core VM; x30. (The wait had no deadline but pytest's 300 s per test.)
BUILD_WAIT_S = 600.0


def cached_build(root: Path, build: Callable[..., Path], name: str, **spec: Any) -> str:
    """The folder of the model `build(folder, **spec)` makes, built now only if no earlier test or worker did."""
    digest = hashlib.sha256(_BUILDER_SOURCE)
    digest.update(json.dumps({"builder": build.__name__, "spec": spec, "transformers": transformers.__version__}, sort_keys=True).encode())
    folder = root / f"{name}-{digest.hexdigest()[:16]}"
    done = folder / ".built"
    if done.exists():
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{folder.name}.lock", "w") as lock:
        end = time.monotonic() + BUILD_WAIT_S
        while True:  # another worker building the same model: wait for it, up to BUILD_WAIT_S
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise TimeoutError(f"{folder.name}: another worker held its build lock for {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.1)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that was killed half-way left
            build(folder, **spec)
            done.touch()
    return str(folder)
