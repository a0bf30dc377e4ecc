"""The trl leg's Python: a virtual environment of its own with trl, over this environment's torch and transformers.

`ppoz bench train` makes it on first use: a `.pth` file there puts this environment's packages on its path, so
torch and transformers are the very versions the ppoz leg runs, and trl and what it needs besides (datasets,
...) are installed beside them, pinned so that pip changes none of this environment's packages. trl is never a
dependency of PPOZ. On a machine without a package index (a lent GPU machine), `--trl-python` names a Python
that imports trl already, and nothing is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

TRL_VERSION = "1.16.0"
DEFAULT_TRL_VENV = Path.home() / ".cache" / "ppoz" / "bench-trl-venv"


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")


def this_environment_dirs() -> list[str]:
    """This environment's package directories (pure and platform), in order, once each."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def pins() -> str:
    """Every distribution installed here as `name==version`: pip's constraints for the trl environment, so that
    installing trl changes none of the packages it shares with this one (it installs only what is missing)."""
    from importlib import metadata

    lines = set()
    for dist in metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        if name and version and name.lower() != "ppoz":
            lines.add(f"{name}=={version}")
    return "\n".join(sorted(lines, key=str.lower)) + "\n"


def probe(python: Path) -> dict[str, Any] | None:
    """trl's, torch's and transformers' versions as the trl environment's Python sees them; None without trl."""
    code = (
        "import json, torch, transformers\n"
        "try:\n    import trl; v = trl.__version__\nexcept ImportError:\n    v = None\n"
        "print(json.dumps({'trl': v, 'torch': torch.__version__, 'transformers': transformers.__version__}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None


def _run_shown(command: list[str], what: str) -> None:
    """Run an install step with its output shown as it comes; a failure names the command."""
    print(f"ppoz bench train: {what}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    except OSError as e:
        raise SystemExit(f"ppoz bench train: {what} failed to start ({e}): {' '.join(command)}") from e
    if done.returncode != 0:
        raise SystemExit(f"ppoz bench train: {what} failed (exit {done.returncode}): {' '.join(command)}")


def ensure_trl(venv: Path) -> Path:
    """The trl environment's Python, with trl TRL_VERSION and this environment's torch and transformers."""
    import torch
    import transformers

    python = venv_python(venv)
    if not python.exists():
        _run_shown([sys.executable, "-m", "venv", str(venv)], f"creating the trl leg's environment in {venv}")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # site.addsitedir, not a plain path line: it also reads the .pth files there (PPOZ's editable install)
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in this_environment_dirs())
    pth = Path(purelib) / "ppoz_environment.pth"
    if not pth.exists() or pth.read_text() != lines:
        pth.write_text(lines)
    found = probe(python)
    if found is None or found["trl"] != TRL_VERSION:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="ppoz-pins-", delete=False) as f:
            f.write(pins())
        try:
            command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", f"trl=={TRL_VERSION}", "-c", f.name]
            _run_shown(command, f"installing trl {TRL_VERSION} into {venv} (once)")
        finally:
            os.unlink(f.name)
        found = probe(python)
    expected = {"trl": TRL_VERSION, "torch": torch.__version__, "transformers": transformers.__version__}
    if found != expected:
        raise SystemExit(f"ppoz bench train: the trl environment {venv} has {found}, expected {expected}; remove it to build it anew")
    return python
