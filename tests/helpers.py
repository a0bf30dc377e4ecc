"""Helpers the tests share."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from client import Client

# Deadlines. Every wait in a test has one, and each says why it is long enough on a loaded machine: what the
# event takes alone on the 2-core VM, and the factor it is given for the load. The bar is `bin/test --busy 2`:
# two processes spinning beside the two pytest-xdist workers, so a test's process gets half a core or less, and a
# burst of other work (an install, another test's torch import) can hold it for seconds. A deadline only bounds
# a failure: a long one costs nothing when the event comes. The shared ones:
# An event among this process's threads and Redis on loopback (a broker thread's reply, an in-process actor
# registering on 0.1 s heartbeats): 0.01-0.3 s alone; x30 and more.
IN_PROCESS_S = 10.0
# One request answered by a broker, actor or service thread of this process with nothing else to do: ms alone; x1000.
REPLY_S = 5.0
# The socket timeout of a Redis connection of a learner or broker in a test: a command on loopback takes ms, a blocking
# read its read_block_ms (0.1-0.2 s) at most; x100.
REDIS_S = 30.0
# A `ppoz` process without torch (broker, gateway) bound and ready: about 1 s alone (0.6 s of CPU); x30.
PROCESS_START_S = 30.0
# A `ppoz` process importing torch, transformers and peft (actor, learner), a tiny model loaded: 7-10 s alone; x12.
TORCH_START_S = 120.0
# A `ppoz` process's exit after SIGTERM (a drain, a tiny model's checkpoint): 1-3 s alone; x10.
PROCESS_STOP_S = 30.0


def wait_for(condition: Callable[[], Any], timeout: float = IN_PROCESS_S, what: str = "condition") -> Any:
    """Poll `condition` until it is truthy; fail the test with `what` after `timeout` s (the default: an event of
    this process's threads, IN_PROCESS_S; a caller that waits on anything slower passes its own, with its reason)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def command_help(*words: str) -> str:
    """What `ppoz WORDS --help` prints, from the command line's own parser in this process, 80 columns
    wide as in a pipe. (A process per command cost 2 s of importing torch each; tests/test_cli.py runs
    the top-level help as a real process.)"""
    from ppoz.cli import main

    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse wraps at the terminal's width
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as ended:
            main([*words, "--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    assert ended.value.code == 0, f"ppoz {' '.join(words)} --help exited with {ended.value.code}"
    return out.getvalue()


def actors_ready(client: Client, n: int) -> bool:
    return len(client.status()["actors"]) >= n


OBS = {
    "prompt": "Screen: MainActivity. History: none.",
    "question": "Which action should I choose next? I shall choose No. ",
    "action": ["0: TouchEvent(view=Shop)", "1: TouchEvent(view=Cart)", "2: KeyEvent(BACK)"],
}


def own_logits_scores(model: Any, item: Any) -> Any:
    """The yardstick for scoring, written here and sharing nothing with models.scoring: for each
    candidate of a tokenized observation, one forward of the model over context + candidate and the
    sum of log-softmax(model(input_ids).logits) at the candidate's tokens."""
    import torch

    sums = []
    with torch.inference_mode():
        for action in item.actions:
            logits = model(input_ids=torch.tensor([list(item.context) + list(action)])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            c = len(item.context)
            sums.append(sum(logp[c - 1 + j, token] for j, token in enumerate(action)))
    return torch.stack(sums)


@contextlib.contextmanager
def router_stand_in(context: zmq.Context, answer: Callable[[bytes], bytes]) -> Iterator[str]:
    """A neighbour's stand-in on loopback: a ROUTER that sends `answer(body)` back for every request's body, in a
    thread, until the block ends; yields its endpoint."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                *envelope, body = sock.recv_multipart()
                sock.send_multipart([*envelope, answer(body)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)  # the thread sees `stop` within one 50 ms poll; x100 (a daemon: a late one cannot hang the run)
        sock.close(linger=0)


@contextlib.contextmanager
def spinning(processes: int) -> Iterator[None]:
    """`processes` busy loops on the cores while the block runs (what `bin/test --busy N` does to the whole suite):
    for a test of a race that load makes likely, such as a learner falling behind its clients."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)  # SIGKILL ends it at once (ms); x1000
