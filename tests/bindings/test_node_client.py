"""The Node.js client (bindings/node): its own tests, and its example against a real broker and LLM actor."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from typing import Callable

import pytest
import redis as redis_py

from client import Client
from common import protocol as p
from common.segments import Segment
from tests.processes import free_port
from tests.bindings.conftest import BINDINGS, LiveStack, require_tool

NODE_DIR = os.path.join(BINDINGS, "node")

# Attach, one step, feedback with the integral reward 1 (done), detach; print the task id and the bytes
# the client builds for that feedback, for Python to decode. (deadlineMs: a step of the tiny model on an actor thread
# of the test's process, 0.05-0.5 s alone; x100 and more. The generate below gets twice as long.)
REWARD_SCRIPT = r"""
const ppoz = require("./ppoz.js");
(async () => {
  const client = new ppoz.PPOZClient(process.argv[1], { deadlineMs: 60000 });
  try {
    const taskId = await client.attach();
    const obs = { prompt: "Screen: MainActivity", question: "Which action should I choose next? I shall choose No. ",
                  action: ["0: TouchEvent(view=Cart)", "1: TouchEvent(view=Search)"] };
    const pings = await Promise.all([0, 1, 2, 3].map(() => client.ping()));
    await client.step(taskId, obs);
    const fb = await client.feedback(taskId, 1, { done: true });
    await client.detach(taskId);
    const built = ppoz.encode(ppoz.buildRequest("feedback", ppoz.feedbackFields(taskId, 1, { done: true }), "f1"));
    console.log(JSON.stringify({ taskId, segmentClosed: fb.segment_closed, pings: pings.length, built: built.toString("hex") }));
  } finally {
    client.close();
  }
})().catch((e) => { console.error(`${e.code}: ${e.message}`); process.exitCode = 1; });
"""

# Attach, one generate (a plain prompt, top-p, a seed), its feedback (reward 1, done), detach; print the task id and the reply.
GENERATE_SCRIPT = r"""
const ppoz = require("./ppoz.js");
(async () => {
  const client = new ppoz.PPOZClient(process.argv[1], { deadlineMs: 120000, attemptTimeoutMs: 60000 });
  try {
    const taskId = await client.attach();
    const reply = await client.generate(taskId, { prompt: "Q: 2 + 3 = ? Answer with a number.\nA:", maxNewTokens: 8, topP: 0.9, seed: 7,
                                                  deadlineMs: 60000 });
    const fb = await client.feedback(taskId, 1, { done: true });
    await client.detach(taskId);
    console.log(JSON.stringify({ taskId, reply, segmentClosed: fb.segment_closed }));
  } finally {
    client.close();
  }
})().catch((e) => { console.error(`${e.code}: ${e.message}`); process.exitCode = 1; });
"""


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:  # each caller's timeout says why
    return subprocess.run(args, cwd=NODE_DIR, capture_output=True, text=True, timeout=timeout)


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's packages installed (npm ci, as bin/bootstrap.sh does)."""
    node = require_tool("node", "install Node.js 18 or later")
    npm = require_tool("npm", "install npm (it comes with Node.js)")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules")):
        proc = run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], timeout=300)  # from npm's cache: 5-20 s alone; x15
        assert proc.returncode == 0, f"npm ci failed in {NODE_DIR}: {explain(proc)}"
    return node


def test_npm_test_passes(node: str) -> None:
    proc = run([require_tool("npm", "install npm"), "test"], timeout=180)  # node's own tests: 2-5 s alone; x36
    assert proc.returncode == 0, explain(proc)


@pytest.mark.slow
def test_example_runs_episodes_against_the_live_stack(node: str, live_stack: LiveStack, make_client: Callable[..., Client]) -> None:
    proc = run([node, "example.js", live_stack.frontend, "3", "4"], timeout=240)  # 12 steps of the tiny model: 1-3 s alone; x80
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "episodes 3 steps 12", explain(proc)
    assert sum(line.startswith("episode ") for line in lines) == 3, explain(proc)
    counters = make_client(live_stack.frontend).status()["counters"]
    assert counters.get("broker/steps", 0) >= 12, counters
    assert counters.get("broker/feedbacks", 0) >= 12, counters
    assert counters.get("broker/detached", 0) >= 1, counters


def test_example_against_nothing_times_out(node: str) -> None:
    start = time.monotonic()
    proc = run([node, "example.js", f"tcp://127.0.0.1:{free_port()}", "1", "1", "1500"], timeout=30)  # its 1.5 s is under test
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, explain(proc)
    assert elapsed < 10, f"took {elapsed:.1f} s\n{explain(proc)}"  # node's start and the 1.5 s deadline, 2 s alone; x5
    assert "timeout" in proc.stderr, explain(proc)
    assert "attach" in proc.stderr, explain(proc)


@pytest.mark.slow
def test_integral_reward_goes_out_as_a_float(
    node: str, live_stack: LiveStack, redis_client: redis_py.Redis, key_prefix: str
) -> None:
    proc = run([node, "-e", REWARD_SCRIPT, live_stack.frontend], timeout=120)  # a step of the tiny model: under 1 s alone; x100
    assert proc.returncode == 0, explain(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["segmentClosed"] is True and out["pings"] == 4, out
    # On the wire: Python's decoder sees a float, as for a Python client's reward=1.0.
    built = p.decode(bytes.fromhex(out["built"]))
    assert type(built["reward"]) is float and built["reward"] == 1.0, built
    assert type(built["v"]) is int, built
    # In Redis: the episode's segment closed at done, its one transition rewarded 1.0.
    segments = [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{key_prefix}:segments")]
    mine = [s for s in segments if s.task_id == out["taskId"]]
    assert [s.reason for s in mine] == ["done"], mine
    (transition,) = mine[0].transitions
    assert type(transition.reward) is float and transition.reward == 1.0, transition
    assert transition.done is True, transition


@pytest.mark.slow
def test_generate_against_the_live_stack(node: str, live_stack: LiveStack, redis_client: redis_py.Redis, key_prefix: str) -> None:
    """client.generate through the real broker to a real LLM actor (tiny model); its feedback closes the segment, whose one
    transition is the response the client was told about."""
    proc = run([node, "-e", GENERATE_SCRIPT, live_stack.frontend], timeout=240)  # 8 tokens of the tiny model: under 1 s alone; x200
    assert proc.returncode == 0, explain(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    reply = out["reply"]
    assert out["segmentClosed"] is True, out
    assert reply["status"] == "ok" and reply["task_id"] == out["taskId"], reply
    assert isinstance(reply["text"], str) and 1 <= reply["n_tokens"] <= 8 and reply["finish_reason"] in p.FINISH_REASONS, reply
    assert reply["logprob"] <= 0 and reply["policy_version"] >= 0, reply
    segments = [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{key_prefix}:segments")]
    mine = [s for s in segments if s.task_id == out["taskId"]]
    assert [s.reason for s in mine] == ["done"], mine
    (transition,) = mine[0].transitions
    assert transition.mode == "generate" and transition.reward == 1.0, transition
    assert len(transition.generation.response_ids) == reply["n_tokens"], transition.generation
    assert transition.generation.finish_reason == reply["finish_reason"] and transition.logprob == reply["logprob"]
    # the sampling settings the broker recorded: the client's top_p and seed, its default temperature (1)
    assert transition.obs.sampling["temperature"] == 1.0 and transition.obs.sampling["top_p"] == 0.9, transition.obs
    assert transition.obs.sampling["seed"] == 7, transition.obs
