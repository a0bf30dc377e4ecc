"""Run a Markdown document's code blocks as a user runs them, in order, in an empty working directory.

sybil parses the document (docs/testing.md, "The docs are tests", says why sybil): every fenced ```bash
and ```python block is run; `<!-- skip: next "why" -->` (sybil's directive) leaves the next block out,
with its reason; `<!-- ctrl-c -->` (ours) says the next block runs until its user presses Ctrl-C, which
this runner does after PPOZ_DOC_BUDGET_S seconds (default 40): SIGINT to the block's process group, as a
terminal sends it to the foreground job, and the block must then end as if it had finished, exit 0.

Each block is a process of its own in the document's working directory (files stay between blocks, as
in one terminal): a bash block runs under `bash -e -o pipefail`, so any failing command fails it; a
python block is fed to the environment's `python -` (the working directory on sys.path, as in a REPL).
The environment's bin/ leads PATH, so `ppoz` and `python3` are the checkout's; `bin` in the working
directory links to the checkout's bin/, so `bin/ppoz` works as it does in a checkout. What a block
starts in the background (`&`) keeps running until the document ends, then its process group is
stopped (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import SkipTest

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

ROOT = Path(__file__).resolve().parent.parent
BUDGET_ENV = "PPOZ_DOC_BUDGET_S"
DEFAULT_BUDGET_S = 40.0  # a `ppoz demo` has shown progress lines by then; a server has long been up
# How long a block interrupted with Ctrl-C may take to finish: the demo's summary plays 3 x 60 episodes
# after the interrupt (about 20 s alone on 2 cores), and on a machine with every core busy twice that.
STOP_DEADLINE_S = 150.0
# How long a block that ends by itself may run: the longest is docs/train.md's quick start, 35-55 s alone
# on the 2-core VM (2026-11-27); beside the other pytest worker and two spinning processes, several times that.
BLOCK_DEADLINE_S = 600.0
INTERRUPT = "ctrl-c"
INSIDE_ENV = "PPOZ_DOC_RUNNING"  # set in every block's environment


Check = Callable[[Path, str], None]
"""A check on what a block left: the working directory and the block's output (stdout and stderr)."""


@dataclass
class BlockRun:
    """One block's run: where it is, what ran, and how it ended."""

    line: int
    language: str
    exit_code: int
    interrupted: bool
    seconds: float
    output: str


@dataclass
class Session:
    """A document's terminal: its working directory, environment, and the process groups it started."""

    doc: Path
    workdir: Path
    logs: Path
    checks: dict[str, Check]
    budget_s: float = field(default_factory=lambda: float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S)))
    interrupt_next: bool = False
    runs: list[BlockRun] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    checked: set[str] = field(default_factory=set)
    _groups: list[int] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PPOZ_DOC_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PWD"] = str(self.workdir)
        env[INSIDE_ENV] = str(self.doc)  # a document's `bin/test` would run these tests again: they skip themselves
        env["PYTHONFAULTHANDLER"] = "1"  # a block that does not end is sent SIGABRT: its Python processes show their stacks
        return env

    def run(self, example: Example, language: str) -> str | None:
        line, source = example.line, str(example.parsed)
        interrupted, self.interrupt_next = self.interrupt_next, False
        script = self.logs / f"line-{line}.{'sh' if language == 'bash' else 'py'}"
        script.write_text(source)
        log_path = self.logs / f"line-{line}.log"
        if language == "bash":
            command, stdin = ["bash", "-e", "-o", "pipefail", str(script)], subprocess.DEVNULL
        else:
            command, stdin = [sys.executable, "-"], script.open("rb")
        started = time.monotonic()
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                command, cwd=self.workdir, env=self.env(), stdin=stdin, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            self._groups.append(proc.pid)
            try:
                if interrupted:
                    try:
                        proc.wait(self.budget_s)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground job's group
                    code = _wait(proc, STOP_DEADLINE_S)
                else:
                    code = _wait(proc, BLOCK_DEADLINE_S)
            finally:
                if stdin is not subprocess.DEVNULL:
                    stdin.close()  # type: ignore[union-attr]
        output = log_path.read_text(errors="replace")
        self.runs.append(BlockRun(line, language, code, interrupted, time.monotonic() - started, output))
        stopped = f", Ctrl-C after {self.budget_s:g} s" if interrupted else ""
        where = f"{self.doc.name} line {line} ({language}{stopped})"
        if code != 0:
            why = "did not end within its deadline" if code is None else f"exited with {code}"
            return (
                f"{where} {why}; it ran in {self.workdir}:\n{_indented(source)}\n--- its output, last 80 lines ---\n{_tail(output, 80)}"
                + self._logs_left()
            )
        first = source.strip().splitlines()[0]
        for key, check in self.checks.items():
            if first.startswith(key):
                self.checked.add(key)
                try:
                    check(self.workdir, output)
                except AssertionError as e:
                    return f"{where}: {e}\n--- its output, last 80 lines ---\n{_tail(output, 80)}"
        return None

    def _logs_left(self) -> str:
        """The last lines of the log files the blocks wrote in the working directory (a stack started with `&`
        writes its own): what a failing command's background went through, which the temporary folder loses."""
        parts = []
        for log in sorted(self.workdir.glob("*.log")):
            parts.append(f"\n--- {log.name}, last 40 lines ---\n{_tail(log.read_text(errors='replace'), 40)}")
        return "".join(parts)

    def close(self) -> None:
        """Stop what the blocks left running in the background: SIGTERM, then SIGKILL 30 s later."""
        alive = [g for g in self._groups if _group_alive(g)]
        for group in alive:
            _killpg(group, signal.SIGTERM)
        end = time.monotonic() + 30.0  # a stack stops its components one by one, each within seconds
        while any(_group_alive(g) for g in alive) and time.monotonic() < end:
            time.sleep(0.2)
        for group in alive:
            _killpg(group, signal.SIGKILL)


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The block's exit status, or None past `timeout`: then what its processes were doing goes into its log (their
    signal masks on stderr, and each Python's threads' stacks in its log: SIGABRT makes PYTHONFAULTHANDLER dump them), then
    they are killed."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _note_group(proc.pid)
        _killpg(proc.pid, signal.SIGABRT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        return None


def _note_group(group: int) -> None:
    """Each process of the group with the signals it blocks, ignores and catches, on stderr (pytest shows it with the failure)."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.getpgid(int(entry.name)) != group:
                continue
            status = dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines() if ":\t" in line)
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, ValueError):
            continue
        lines.append(
            f"pid {entry.name} {command!r}: SigBlk {status.get('SigBlk')} SigIgn {status.get('SigIgn')} "
            f"SigCgt {status.get('SigCgt')} SigPnd {status.get('SigPnd')} ShdPnd {status.get('ShdPnd')}"
        )
    sys.stderr.write("the group did not end; its processes:\n" + "\n".join(lines) + "\n")


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


class InterruptParser:
    """`<!-- ctrl-c -->`: the next block runs until its user presses Ctrl-C."""

    def __init__(self) -> None:
        self.lexer = DirectiveInHTMLCommentLexer(INTERRUPT, arguments=".*?")

    def __call__(self, document: Document) -> Iterator[Region]:
        for lexed in self.lexer(document):
            yield Region(lexed.start, lexed.end, None, self._evaluate)

    @staticmethod
    def _evaluate(example: Example) -> str | None:
        example.namespace["session"].interrupt_next = True
        return None


def _block_evaluator(language: str) -> Callable[[Example], str | None]:
    def evaluate(example: Example) -> str | None:
        session: Session = example.namespace["session"]
        return session.run(example, language)

    return evaluate


SYBIL = Sybil(
    parsers=[
        CodeBlockParser("bash", evaluator=_block_evaluator("bash")),
        CodeBlockParser("python", evaluator=_block_evaluator("python")),
        SkipParser(),
        InterruptParser(),
    ],
    patterns=["*.md"],
)

FENCE = re.compile(r"^ {0,3}```(\S*)", re.MULTILINE)
SKIP = re.compile(r'^[ \t]*<!--\s*skip:\s*next\s+"([^"]*)"\s*-->', re.MULTILINE)  # at a line's start, as sybil reads it


def run_document(doc: Path, workdir: Path, logs: Path, checks: dict[str, Check]) -> Session:
    """Run `doc`'s blocks in order in `workdir`; raise at the first that fails (sybil's SybilFailure names it)."""
    (workdir / "bin").symlink_to(ROOT / "bin", target_is_directory=True)
    session = Session(doc, workdir, logs, checks)
    document = SYBIL.parse(doc)
    document.namespace["session"] = session
    try:
        for example in document:
            try:
                example.evaluate()
            except SkipTest as e:
                session.skipped.append((example.line, str(e)))
    finally:
        session.close()
    return session


def skip_reasons(doc: Path) -> list[tuple[int, str]]:
    """The document's `<!-- skip: next "why" -->` directives: (line, why)."""
    text = doc.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in SKIP.finditer(text)]


def fenced_languages(doc: Path) -> list[tuple[int, str]]:
    """Every fenced block's opening line and its language ("" for none), closing fences left out."""
    text = doc.read_text()
    found: list[tuple[int, str]] = []
    inside = False
    for m in FENCE.finditer(text):
        if not inside:
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
        inside = not inside
    return found
