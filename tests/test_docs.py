"""The docs are tests: every bash and python block of README.md and docs/*.md runs as written.

Each document's blocks run in order in a fresh empty working directory, with the environment's `ppoz`
on PATH (tests/doc_blocks.py). A block that cannot run here is marked in the document with sybil's
`<!-- skip: next "why" -->`; docs/testing.md lists every one of them, and the test below fails on one
it does not list. The documents bind the ports they show (5555, 5556, 5557), so they run one at a time,
across pytest-xdist workers too (a file lock).

`CHECKS` hold what a document promises of a block beyond its exit status 0, by the block's first line.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sybil.example import SybilFailure

from tests.doc_blocks import INSIDE_ENV, ROOT, Check, fenced_languages, run_document, skip_reasons

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"bash", "python"}
OTHER_LANGUAGES = {"", "toml", "json", "hex", "ini", "text"}  # shown, not run: configs, wire bytes, diagrams, output


def _learned(workdir: Path, output: str) -> None:
    assert "ppoz export" in output, "no export command printed at the end"
    summary = json.loads((workdir / "outputs" / "summary.json").read_text())
    # 0.04 before; 0.32-0.44 after in five runs, quiet and beside two spinners (docs/train.md): 0.20 is 5 of the
    # 25 sums, which a policy that drifted without learning reaches about once in 50 (Poisson, mean 1.5)
    assert summary["val_after"] >= summary["val_before"] + 0.16, f"validation reward {summary['val_before']} -> {summary['val_after']}"


def _demo_summary(workdir: Path, output: str) -> None:
    """The demo's display and files (learning itself: tests/test_end_to_end.py): progress lines every 10 s, and
    after Ctrl-C the summary, the curve drawn, TensorBoard's files and the export command."""
    progress = [line for line in output.splitlines() if "steps" in line and "policy v" in line and "entropy" in line]
    assert len(progress) >= 2, "fewer than 2 progress lines in 40 s"
    assert "stopped by Ctrl-C" in output and "summary" in output, "no summary printed after Ctrl-C"
    summary = output.split("summary", 1)[1]
    assert "random policy" in summary and "trained model" in summary and "untrained model" in summary
    assert "ppoz export" in summary, "no export command printed at the end"
    out = workdir / "runs" / "demo"
    assert str(out / "learning_curve.png") in summary and any((out / "tensorboard").iterdir())
    from PIL import Image

    from ppoz.curve import CURVE_COLOUR

    with Image.open(out / "learning_curve.png") as image:
        assert image.format == "PNG" and image.size == (800, 450)
        counts = {colour: n for n, colour in image.convert("RGB").getcolors(maxcolors=1 << 24)}
        rgb = tuple(int(CURVE_COLOUR[i : i + 2], 16) for i in (1, 3, 5))
        assert counts.get(rgb, 0) > 200, "no learning curve drawn"


CHECKS: dict[str, dict[str, Check]] = {
    "README.md": {"bin/ppoz demo": _demo_summary},
    "train.md": {"ppoz tiny-model tiny --tokenizer numbers": _learned},
}


@pytest.fixture
def one_run_of_the_documents_at_a_time() -> Iterator[None]:
    """The documents bind the same fixed ports: on one machine (another checkout's suite too) they run one at a time."""
    with open(Path(tempfile.gettempdir()) / "ppoz-docs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 6 minutes alone on the 2-core VM, 10 beside the other worker; each block has its deadline
def test_the_documents_blocks_run_as_written(tmp_path: Path, one_run_of_the_documents_at_a_time: None) -> None:
    """Every document, one after another in one test: they share ports, and as tests of their own two pytest-xdist
    workers would wait for each other's. PPOZ_DOCS=docs/train.md,README.md runs those alone."""
    if os.environ.get(INSIDE_ENV):
        pytest.skip(f"run by a block of {os.environ[INSIDE_ENV]}: a document's blocks never run the documents again")
    chosen = [ROOT / name for name in os.environ.get("PPOZ_DOCS", "").split(",") if name] or DOCS
    failures = []
    for n, doc in enumerate(chosen):
        workdir, logs = tmp_path / f"{n}-work", tmp_path / f"{n}-logs"
        workdir.mkdir()
        logs.mkdir()
        checks = CHECKS.get(doc.name, {})
        try:
            session = run_document(doc, workdir, logs, checks)
        except SybilFailure as e:  # the next documents still run: one report names every document that fails
            failures.append(str(e))
            continue
        missing = set(checks) - session.checked
        if missing:
            failures.append(f"{doc.name} has no block that starts with {sorted(missing)} any more; CHECKS names it")
        ran = [f"line {r.line}: {r.seconds:.0f} s{' (Ctrl-C)' if r.interrupted else ''}" for r in session.runs]
        print(f"{doc.name}: {len(session.runs)} blocks ran ({', '.join(ran)}); {len(session.skipped)} skipped")
    assert not failures, "\n\n".join(failures)


def test_every_block_is_run_or_of_a_language_that_is_shown() -> None:
    """A command in a ```sh or ```console block would escape the test above: only bash and python are commands."""
    odd = [
        f"{doc.relative_to(ROOT)} line {line}: ```{language}"
        for doc in DOCS
        for line, language in fenced_languages(doc)
        if language not in RUN_LANGUAGES | OTHER_LANGUAGES
    ]
    assert not odd, f"blocks of a language neither run nor listed as shown (write commands as ```bash): {odd}"


def test_every_skipped_block_is_listed_with_its_reason_in_testing_md() -> None:
    listed = (ROOT / "docs" / "testing.md").read_text()
    unlisted = [
        f'{doc.relative_to(ROOT)} line {line}: "{why}"'
        for doc in DOCS
        for line, why in skip_reasons(doc)
        if f"| {doc.relative_to(ROOT)} | {why} |" not in listed
    ]
    assert not unlisted, f"skipped blocks missing from docs/testing.md's table (| doc | why |): {unlisted}"
