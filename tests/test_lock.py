"""The dependency lock (constraints.txt, written by bin/lock): it fits setup.cfg, and the tests run on what it locks."""

from __future__ import annotations

import configparser
import os
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
NOT_LOCKED = {"ppoz", "pip", "setuptools", "wheel"}  # the project itself and the installers


def locked() -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def declared() -> list[Requirement]:
    """setup.cfg's requirements: install_requires and every extra."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in cfg["options.extras_require"]:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in (line.split("#")[0].strip() for line in lines) if line]


def test_every_pin_is_exact_and_every_requirement_is_locked_within_its_range() -> None:
    pins = locked()
    assert all(len(p.specifier) == 1 and next(iter(p.specifier)).operator == "==" for p in pins), "a lock pins with == only"
    by_name: dict[str, list[Requirement]] = {}
    for pin in pins:
        by_name.setdefault(canonicalize_name(pin.name), []).append(pin)
    stale = []
    for req in declared():
        versions = [next(iter(p.specifier)).version for p in by_name.get(canonicalize_name(req.name), [])]
        if not versions or not all(req.specifier.contains(v, prereleases=True) for v in versions):
            stale.append(f"{req} (locked: {', '.join(versions) or 'nothing'})")
    assert not stale, f"constraints.txt does not fit setup.cfg; run bin/lock: {stale}"
    assert [str(p.specifier) for p in by_name["torch"]] == ["==2.13.0"], (
        "torch is held at the release whose CPU build bin/bootstrap.sh installs"
    )


def test_the_tests_run_on_the_locked_versions() -> None:
    if os.environ.get("PPOZ_UNLOCKED"):
        pytest.skip("bin/test --latest: the newest releases, away from the lock on purpose")
    pins = {canonicalize_name(p.name): next(iter(p.specifier)).version for p in locked() if p.marker is None or p.marker.evaluate()}
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    moved = [
        f"{name} {version} (locked {pins[name]})"
        for name, version in installed.items()
        if name in pins and version.split("+")[0] != pins[name]
    ]
    unlocked = [f"{name} {version}" for name, version in installed.items() if name not in pins and name not in NOT_LOCKED]
    assert not moved and not unlocked, (
        f"this environment is not the locked one: {moved + unlocked}; "
        "install with 'pip install -c constraints.txt -e .[dev]' (bin/test does), or set PPOZ_UNLOCKED=1 to test another on purpose"
    )
