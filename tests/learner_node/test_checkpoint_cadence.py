"""Checkpoints by cadence, written in the background (learner_node/checkpointer.py), against kill -9: a real learner
process, a real Redis, segments in the broker's own stream format. Every segment is trained exactly once by the
run's end, whatever the moment of the kills; a kill loses at most the updates since the last checkpoint on disk,
and the resumed learner says so; a kill in the middle of a checkpoint's writing resumes from the one before."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common import weights
from learner_node import checkpoint
from tests.learner_node.test_resume import learner, write_segments

SEGMENTS = 80  # 10 updates of 8
EVERY_3 = ["--checkpoint-every", "3"]


def finished_exactly_once(ckpt: Path, all_ids: set[str], redis_client, key_prefix: str) -> dict:
    """The last checkpoint of a run that went to its end: every segment trained once, nothing left in the stream."""
    final = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)
    trained = final["recent_segments"]
    assert len(trained) == len(set(trained)), "a segment was trained twice"
    assert set(trained) == all_ids, f"lost: {sorted(all_ids - set(trained))[:5]}"
    assert final["counters"]["transitions_trained"] == SEGMENTS == final["counters"]["transitions_stored"]
    assert final["counters"].get("duplicate_segments", 0) == 0  # entries waiting for a checkpoint are not read again
    assert redis_client.xlen(f"{key_prefix}:segments") == 0  # everything acknowledged and deleted
    assert not redis_client.xpending(f"{key_prefix}:segments", "learners")["pending"]
    assert not list(ckpt.glob(".ckpt-*"))  # no half-written checkpoint left behind
    return final


def _uncheckpointed(log: str, past_a_checkpoint: bool) -> bool:
    """Whether the learner has begun an update (its first "update N" line), or, `past_a_checkpoint`, has finished an
    update N with N % 3 == 2: no checkpoint (every 3) holds N - 1 either, and N - 1 is in Redis already (an update's
    figures are written before the next rollout is read), so the resumed learner finds updates lost."""
    if not past_a_checkpoint:
        return "update " in log
    return any(int(n) % 3 == 2 for n in re.findall(r"update (\d+): version", log))


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)  # this test started it: killed by its own pid
    proc.wait(10)  # SIGKILL ends it at once (ms); x1000


@pytest.mark.slow
@pytest.mark.timeout(900)  # six learner starts (7-10 s alone each) and ten updates, several redone: 60-90 s alone; x10
def test_killed_at_five_moments_with_a_checkpoint_every_3_updates_each_segment_is_trained_exactly_once(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
):
    all_ids = write_segments(redis_client, key_prefix, SEGMENTS)
    ckpt = tmp_path / "ckpt"
    rng = random.Random(55)
    said_lost = False
    for attempt in range(5):
        log = tmp_path / f"run{attempt}.log"
        with open(log, "w") as out:
            proc = learner(tiny_models["llama"], redis_url, key_prefix, ckpt, resume=attempt > 0, max_updates=10, extra=EVERY_3, log=out)
            # a moment after the learner has started updating (its first "update N" line), random within ~2 updates;
            # the random moments are the claim, not deadlines. The second run is killed right after two updates that
            # no checkpoint holds (see `_uncheckpointed`), so that some kill loses updates however slow the machine
            # makes them (in one CI run on a busy machine, all five random moments fell before the first update since
            # the resume had ended, and no learner had anything lost to say)
            wanted = "two updates past a checkpoint" if attempt == 1 else "an update"
            deadline = time.monotonic() + 120  # a learner's start: 7-10 s alone; x12
            while not _uncheckpointed(log.read_text(), attempt == 1) and proc.poll() is None:
                assert time.monotonic() < deadline, f"run {attempt} never reached {wanted}:\n{log.read_text()[-2000:]}"
                time.sleep(0.02)
            if attempt != 1:
                time.sleep(rng.uniform(0.0, 2.0))
            kill(proc)
        said_lost |= "updates since are lost" in log.read_text()
    final_log = tmp_path / "final.log"
    with open(final_log, "w") as out:
        proc = learner(tiny_models["llama"], redis_url, key_prefix, ckpt, resume=True, max_updates=10, extra=EVERY_3, log=out)
        assert proc.wait(300) == 0, final_log.read_text()[-3000:]  # a start and up to ten updates: 20 s alone; x15
    final = finished_exactly_once(ckpt, all_ids, redis_client, key_prefix)
    assert final["updates"] == 10
    # a kill between checkpoints lost the updates since the last one, and the resumed learner said so (the second
    # run's kill comes after such an update: the third run's start says it)
    assert said_lost, "no resumed learner said which updates were lost"
    # the versions never went back: the last published one is the final checkpoint's
    assert weights.latest(redis_client, key_prefix).version == final["version"] >= 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_learner_killed_while_a_checkpoint_is_being_written_resumes_from_the_one_before(
    tiny_model, redis_url, redis_client, key_prefix, tmp_path
):
    """Killed while the writer thread has a checkpoint's staging folder open (all weights trained, so each checkpoint
    holds the model and Adam's moments: tens of ms to write): the resumed learner takes the complete one before, the
    half-written one is removed, and every segment is still trained once."""
    model = tiny_model("llama", hidden=256, layers=2)
    all_ids = write_segments(redis_client, key_prefix, SEGMENTS)
    ckpt = tmp_path / "ckpt"
    caught: tuple[int, list[Path]] | None = None
    for attempt in range(8):  # each run polls for a staging folder and kills the learner inside one; rarely missed
        log = tmp_path / f"run{attempt}.log"
        with open(log, "w") as out:
            proc = learner(model, redis_url, key_prefix, ckpt, resume=attempt > 0, max_updates=10, extra=["--lora-rank", "0"], log=out)
            deadline = time.monotonic() + 120  # a start and the first updates: 10-15 s alone; x8
            while proc.poll() is None and time.monotonic() < deadline:
                if list(ckpt.glob(".ckpt-*.tmp")):
                    kill(proc)
                    break
                time.sleep(0.001)  # a tight poll: the window is a write's tens of ms
            kill(proc)
        staged = list(ckpt.glob(".ckpt-*.tmp"))
        if staged:
            complete = sorted(ckpt.glob("ckpt-*"))
            caught = (attempt, complete)
            break
    assert caught is not None, "no run was killed while a checkpoint was being written"
    _, complete = caught
    before = checkpoint.read_state(complete[-1]) if complete else None
    log = tmp_path / "resumed.log"
    with open(log, "w") as out:
        proc = learner(model, redis_url, key_prefix, ckpt, resume=True, max_updates=10, extra=["--lora-rank", "0"], log=out)
        assert proc.wait(300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    if before is not None:
        assert f"policy version {before['version']} after {before['updates']} updates" in text, text[-2000:]
    else:
        assert "no checkpoint" in text
    finished_exactly_once(ckpt, all_ids, redis_client, key_prefix)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_idle_learner_checkpoints_what_it_trained_once_due_and_acknowledges_it(
    tiny_models, redis_url, redis_client, key_prefix, tmp_path
):
    """One update, then no more data (no rollout timeout): the checkpoint due by time comes while the learner waits,
    and the entries it holds leave the stream then, not when the learner stops. Before, an idle learner sat on them:
    the broker counted them as backlog and held clients back for good (`ppoz bench stability` never finished)."""
    all_ids = write_segments(redis_client, key_prefix, 8)  # one rollout of 8
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    stream = f"{key_prefix}:segments"
    by_time = ["--checkpoint-every", "0", "--checkpoint-every-s", "20"]  # not due at the update (seconds after the start)
    with open(log, "w") as out:
        proc = learner(tiny_models["llama"], redis_url, key_prefix, ckpt, resume=False, max_updates=0, extra=by_time, log=out)
        try:
            deadline = time.monotonic() + 180  # a start, one update and the 20 s: 30 s alone; x6
            while redis_client.xlen(stream) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()[-3000:]  # still running, waiting for data
            assert redis_client.xlen(stream) == 0, log.read_text()[-3000:]
            state = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)
            assert set(state["recent_segments"]) == all_ids and state["updates"] == 1
        finally:
            proc.terminate()  # this test started it: stopped by its own pid
            proc.wait(60)
