"""The C client (bindings/c): conformance vectors, the retry rule on a scripted broker, and a live stack.

The C sources are built once per module with `make -C bindings/c` (gcc, make,
pkg-config, libzmq3-dev and libmsgpack-dev; bin/test installs them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

from common import protocol as p
from common.segments import Segment
from tests.bindings.conftest import BINDINGS, require_tool
from tests.processes import free_port

C_DIR = Path(BINDINGS) / "c"
VECTORS = Path(BINDINGS).parent / "conformance" / "vectors"
RID = re.compile(r"^[0-9a-f]{16}-[0-9]+$")  # the C client's rids: a random 64-bit prefix and a counter


def pkg_config_finds(*names: str) -> bool:
    return any(subprocess.run(["pkg-config", "--exists", name]).returncode == 0 for name in names)


@pytest.fixture(scope="module")
def c_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build bindings/c with make into this worker's own directory; that directory.

    Each pytest-xdist worker runs a module fixture of its own: two makes in one build/
    raced (one `ar rcs` rewrote libppoz.a while the other linked it: "file format not
    recognized"), so no two workers share a build directory.
    """
    require_tool("gcc", "the C client needs a C compiler (Debian: gcc)")
    require_tool("make", "the C client is built with make (Debian: make)")
    require_tool("pkg-config", "the C client finds libzmq and msgpack-c with pkg-config (Debian: pkg-config)")
    if not pkg_config_finds("libzmq"):
        pytest.fail("pkg-config does not find libzmq: install libzmq3-dev (bin/test does; PPOZ_SKIP_BINDINGS=1 skips)")
    if not pkg_config_finds("msgpack-c", "msgpack") and not Path("/usr/include/msgpack.h").exists():
        pytest.fail("msgpack-c is not installed: install libmsgpack-dev (bin/test does; PPOZ_SKIP_BINDINGS=1 skips)")
    build = tmp_path_factory.mktemp("c-build")
    make = ["make", "-C", str(C_DIR), f"BUILD={build}"]
    result = subprocess.run(make, capture_output=True, text=True, timeout=300)  # a C build: 5-15 s alone; x20
    assert result.returncode == 0, f"{' '.join(make)} failed:\n{result.stdout}\n{result.stderr}"
    return build


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start C programs in the background; any still running at teardown are killed."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # ended or SIGKILLed: its pipes close at once


def run(*args: Any, timeout: float = 60) -> subprocess.CompletedProcess:
    """A C program to its end; the default `timeout` is for one that needs no model (ms alone; x1000)."""
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


# --- Without a broker ------------------------------------------------------------------------
def test_every_conformance_vector_byte_for_byte(c_build):
    n = len(list(VECTORS.glob("*.msgpack")))
    assert n >= 10
    result = run(c_build / "test_vectors", VECTORS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"round trip {n}/{n}, requests 9/9, replies 10/10: ok" in result.stdout, result.stdout


def test_make_test_runs_the_vectors(c_build):
    make = ["make", "-C", str(C_DIR), f"BUILD={c_build}", "test"]  # the fixture's directory: no make here races another worker's
    result = subprocess.run(make, capture_output=True, text=True, timeout=120)  # built: 1 s alone; x100
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": ok" in result.stdout


def test_bad_arguments_are_refused_before_anything_is_sent(c_build):
    result = run(c_build / "test_client", "offline")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"test_client offline: (\d+)/\1 checks ok", result.stdout), result.stdout


def test_example_usage(c_build):
    result = run(c_build / "ppoz_example")
    assert result.returncode == 2 and "usage" in result.stderr
    result = run(c_build / "ppoz_example", "tcp://127.0.0.1:5555", "three")
    assert result.returncode == 2 and "EPISODES must be a positive integer" in result.stderr


def test_example_gives_up_at_its_deadline_when_nothing_listens(c_build):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run(c_build / "ppoz_example", endpoint, 1, 1, 1500, 500, timeout=30)  # its 1.5 s deadline is under test; x20
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert "attach failed: timeout: no reply to attach within 1500 ms" in result.stderr, result.stderr
    assert 1.4 <= elapsed < 6, f"gave up after {elapsed:.1f} s, the deadline was 1.5 s"  # and 4.5 s for a loaded machine


# --- The retry rule, against a scripted broker ----------------------------------------------------
# The waits below: the C client's process starts and sends, or answers and exits, in ms alone (10 s: x1000); a
# `not router.poll(300)` looks for a resend that must not come, where load can only make it pass wrongly.
@pytest.fixture
def scripted(zmq_context: zmq.Context, c_build: Path, processes) -> Callable[..., tuple[zmq.Socket, subprocess.Popen]]:
    """A bare ROUTER standing in for the broker, and `test_client attach` (or another command) pointed at it."""

    def start(deadline_ms: int, attempt_ms: int, command: str = "attach", *extra: str) -> tuple[zmq.Socket, subprocess.Popen]:
        router = zmq_context.socket(zmq.ROUTER)
        router.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        proc = processes(str(c_build / "test_client"), command, f"tcp://127.0.0.1:{port}", str(deadline_ms), str(attempt_ms), *extra)
        return router, proc

    return start


def receive(router: zmq.Socket) -> tuple[bytes, bytes]:
    """One request: (routing id, body); checks the framing of docs/protocol.md section 1."""
    assert router.poll(10_000), "no request from the C client"  # as the comment above says
    frames = router.recv_multipart()
    assert len(frames) == 3 and frames[1] == b"", f"expected [routing id, empty delimiter, body], got {frames!r}"
    return frames[0], frames[2]


def answer(router: zmq.Socket, peer: bytes, body: dict[str, Any]) -> None:
    router.send_multipart([peer, b"", p.encode(body)])


def attached(rid: Any, task_id: str = "emu-7") -> dict[str, Any]:
    body = p.header(p.OP_ATTACH, rid)
    body.update(status="attached", task_id=task_id, resumed=False)
    return body


def test_retry_rule_new_socket_same_rid_late_replies_ignored_and_retry_after(scripted):
    router, proc = scripted(20_000, 1000)
    # attempt 1: no answer, so the client must give up on this socket after 1 s...
    peer1, first = receive(router)
    request = p.decode(first)
    assert list(request) == ["proto", "v", "op", "rid"] and request["op"] == "attach"
    assert RID.match(request["rid"]), request["rid"]
    # ...and send the very same bytes (same rid) on a new socket (a new routing id).
    peer2, second = receive(router)
    assert second == first and peer2 != peer1
    # A late answer to some other request is ignored; `overloaded` is retried after its retry_after_ms.
    answer(router, peer2, attached("someone-else", task_id="wrong"))
    answer(router, peer2, p.error_body(request["rid"], p.OP_ATTACH, p.E_OVERLOADED, "queue full", retry_after_ms=300))
    sent_at = time.monotonic()
    peer3, third = receive(router)
    assert third == first and peer3 == peer2  # an answered attempt keeps its socket
    assert time.monotonic() - sent_at >= 0.25, "the client must wait retry_after_ms before resending"  # load only lengthens it
    answer(router, peer3, attached(request["rid"]))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 0, out + err
    assert out.strip() == "attached emu-7 attempts 3"


def test_an_error_that_is_not_retried_returns_at_once(scripted):
    router, proc = scripted(20_000, 5000)
    peer, body = receive(router)
    rid = p.decode(body)["rid"]
    answer(router, peer, p.error_body(rid, p.OP_ATTACH, p.E_BAD_REQUEST, "`task_id` must be a str"))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 1
    assert out.strip() == "error bad_request attempts 1: `task_id` must be a str", out + err
    assert not router.poll(300), "a bad_request must not be resent"


@pytest.mark.parametrize("code", [p.E_BAD_REQUEST, p.E_INTERNAL])
def test_an_error_with_rid_nil_answers_the_request_and_is_final(scripted, code):
    """protocol section 4: the broker could not read the rid; one request per socket, so it is this one's, never resent."""
    router, proc = scripted(20_000, 5000)
    peer, _ = receive(router)
    answer(router, peer, p.error_body(None, None, code, "no readable rid"))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 1
    assert out.strip() == f"error {code} attempts 1: no readable rid", out + err
    assert not router.poll(300), "a request the broker could not read must not be resent"


def test_a_retried_error_whose_wait_ends_past_the_deadline_is_reported(scripted):
    router, proc = scripted(1500, 1000)
    peer, body = receive(router)
    rid = p.decode(body)["rid"]
    answer(router, peer, p.error_body(rid, p.OP_ATTACH, p.E_OVERLOADED, "storage (Redis) unavailable", retry_after_ms=5000))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 1
    assert out.strip() == "error overloaded attempts 1: storage (Redis) unavailable", out + err


def generated(rid: Any, text: str, n_tokens: int = 3, finish_reason: str = "eos") -> dict[str, Any]:
    body = p.header(p.OP_GENERATE, rid)
    body.update(task_id="qa-3", status="ok", text=text, n_tokens=n_tokens, finish_reason=finish_reason, logprob=-2.25, policy_version=12)
    return body


def test_generate_sends_the_documented_fields_retries_as_a_step_and_returns_the_reply(scripted):
    """ppoz_generate with chat messages, stop strings and a seed; the call with a prompt and messages both is refused
    and sends nothing; the broker's `timeout` is retried with the same bytes, as a step's (protocol section 5)."""
    router, proc = scripted(20_000, 5000, "generate", "4096")
    peer, body = receive(router)  # the first request to arrive is the valid call's: the refused one sent nothing
    request = p.decode(body)
    assert list(request) == ["proto", "v", "op", "rid", "task_id", "messages", "sampling", "deadline_ms"], request
    assert request["op"] == "generate" and RID.match(request["rid"]) and request["task_id"] == "qa-3", request
    assert request["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert all(list(m) == ["role", "content"] for m in request["messages"]), request["messages"]
    sampling = request["sampling"]
    assert list(sampling) == ["max_new_tokens", "temperature", "top_p", "stop", "seed"], sampling
    assert sampling == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.95, "stop": ["\n", "User:"], "seed": 42}
    assert [type(sampling[k]) for k in sampling] == [int, float, float, list, int], sampling
    assert type(request["deadline_ms"]) is int and request["deadline_ms"] == 20000, request
    obs = p.check_generate(request, p.Limits())  # what the broker checks, as it would
    assert obs["sampling"]["seed"] == 42 and len(obs["messages"]) == 2, obs

    answer(router, peer, p.error_body(request["rid"], p.OP_GENERATE, p.E_TIMEOUT, "no actor answered in time"))
    peer2, again = receive(router)
    assert again == body and peer2 == peer, "a generate answered `timeout` is sent again, same rid, same socket"
    text = "Blue.\nÉ bleu"  # a newline and a two-byte character
    answer(router, peer2, generated(request["rid"], text))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 0, out + err
    refused, result, rest = out.split("\n", 2)
    assert refused == (
        "refused invalid_argument attempts 0: generate needs exactly one of `prompt` and `messages` (roles and contents), got both"
    ), out
    n_bytes = len(text.encode())
    assert result == f"generated n_tokens 3 finish_reason eos policy_version 12 text_len {n_bytes} logprob -2.25 attempts 2", out
    assert rest == text + "\n", out
    assert not router.poll(300), "nothing more is sent"


@pytest.mark.parametrize("text_cap, kept", [(100, 49), (200_000, 32_767)])
def test_a_long_generated_text_is_cut_at_a_character_boundary(scripted, text_cap, kept):
    """80,000 bytes of "é": a caller's 100-byte buffer gets 49 characters (98 bytes: 99 would split one, then the NUL);
    a buffer larger than the reply's own (PPOZ_TEXT_CAP, 65,536 bytes) gets what the reply keeps, 32,767 characters.
    Either way the call succeeds (the broker recorded the response) and text_len says how long the response was."""
    router, proc = scripted(20_000, 5000, "generate", str(text_cap))
    peer, body = receive(router)
    answer(router, peer, generated(p.decode(body)["rid"], "é" * 40_000, n_tokens=4096, finish_reason="length"))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 0, out + err
    _, result, rest = out.split("\n", 2)
    assert result == "generated n_tokens 4096 finish_reason length policy_version 12 text_len 80000 logprob -2.25 attempts 1"
    assert rest == "é" * kept + "\n"


def test_a_malformed_generate_reply_is_a_protocol_error(scripted):
    router, proc = scripted(20_000, 5000, "generate", "64")
    peer, body = receive(router)
    answer(router, peer, generated(p.decode(body)["rid"], "Blue", finish_reason="tired"))
    out, err = proc.communicate(timeout=10)  # it exits on its answer (see above)
    assert proc.returncode == 1
    assert out.splitlines()[-1] == 'error protocol_error attempts 1: generate reply: `finish_reason` "tired" is not eos, stop or length'
    assert not router.poll(300), "a reply with this request's rid is final"


# --- A real broker ------------------------------------------------------------------------------
def test_error_codes_and_fields_against_a_real_broker(c_build, broker, start_actor):
    start_actor(broker.backend)
    result = run(c_build / "test_client", "live", broker.frontend, timeout=120)  # requests to a broker thread here: 1 s alone; x100
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"test_client live: (\d+)/\1 checks ok", result.stdout), result.stdout


@pytest.mark.slow
def test_example_against_the_live_stack(c_build, live_stack, make_client):
    """The real broker and a real LLM actor (tiny model): 3 episodes of 4 steps."""
    result = run(c_build / "ppoz_example", live_stack.frontend, 3, 4, timeout=240)  # 12 steps of the tiny model: 1-3 s alone; x80
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "episodes 3 steps 12", result.stdout
    assert sum(line.startswith("episode ") for line in lines) == 3, result.stdout
    counters = make_client(live_stack.frontend).status()["counters"]
    assert counters.get("broker/steps", 0) >= 12, counters
    assert counters.get("broker/feedbacks", 0) >= 12, counters
    assert counters.get("broker/attached", 0) >= 1 and counters.get("broker/detached", 0) >= 1, counters
    assert counters.get("broker/segments_closed", 0) >= 3, counters  # one `done` per episode


@pytest.mark.slow
def test_generate_against_the_live_stack(c_build, live_stack, redis_client, key_prefix):
    """ppoz_generate through the real broker to a real LLM actor (tiny model); its feedback closes the segment, whose
    one transition is the response the C client was told about."""
    result = run(c_build / "test_client", "generate-live", live_stack.frontend, timeout=240)  # a few generates: 1-3 s alone; x80
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"test_client generate-live: (\d+)/\1 checks ok", result.stdout), result.stdout
    m = re.search(r"^generated task (\S+) n_tokens (\d+) finish_reason (\w+) policy_version (\d+) text_len (\d+) logprob (\S+)$",
                  result.stdout, re.M)
    assert m, result.stdout
    task, n_tokens, reason, logprob = m[1], int(m[2]), m[3], float(m[6])
    segments = [Segment.from_entry(fields) for _, fields in redis_client.xrange(f"{key_prefix}:segments")]
    mine = [s for s in segments if s.task_id == task]
    assert [s.reason for s in mine] == ["done"], mine
    (transition,) = mine[0].transitions
    assert transition.mode == "generate" and transition.reward == 1.0, transition
    assert len(transition.generation.response_ids) == n_tokens and transition.generation.finish_reason == reason
    assert transition.logprob == logprob  # printed with 17 significant digits: the same double
    assert transition.obs.sampling["seed"] == 7 and transition.obs.sampling["top_p"] == 0.9, transition.obs


@pytest.mark.slow
def test_example_waits_for_a_broker_that_starts_late(c_build, start_broker, start_actor, make_client, processes):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = processes(str(c_build / "ppoz_example"), endpoint, "1", "2", "30000", "500")  # a 30 s deadline, 0.5 s attempts
    time.sleep(2.0)  # not a deadline: still trying after 2 s of its 30
    assert proc.poll() is None, "with nothing listening the example must keep retrying until its deadline"
    broker = start_broker(frontend=endpoint)
    start_actor(broker.backend)
    out, err = proc.communicate(timeout=60)  # its next 0.5 s attempt, then 2 steps of a uniform actor: under 1 s alone; x60
    assert proc.returncode == 0, out + err
    assert out.splitlines()[-1] == "episodes 1 steps 2", out
    counters = make_client(broker.frontend).status()["counters"]
    # The attach was sent several times with one rid: one session, not several.
    assert counters.get("broker/attached") == 1, counters
    assert counters.get("broker/steps") == 2 and counters.get("broker/feedbacks") == 2, counters


@pytest.mark.slow
def test_no_leaks_under_valgrind(c_build, broker, start_actor):
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        pytest.skip("valgrind is not installed")
    start_actor(broker.backend)
    check = [valgrind, "-q", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect,possible", "--error-exitcode=99"]
    for args in (["test_client", "offline"], ["test_client", "live", broker.frontend],
                 ["ppoz_example", broker.frontend, "2", "2"]):
        # under valgrind, 20-50 times slower: 5-10 s alone each; x24
        result = subprocess.run([*check, str(c_build / args[0]), *args[1:]], capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
