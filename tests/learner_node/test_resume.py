"""Kill the learner process mid-run (SIGKILL), resume it: no segment lost or trained twice, versions go on."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import pytest

from broker.sessions import SegmentClose, Session
from broker.store import Batch, SessionStore
from common import weights
from common.protocol import encode
from common.segments import RedisKeys
from learner_node import checkpoint
from tests.processes import PPOZ


def write_segments(redis_client, prefix: str, n: int, first: int = 0) -> set[str]:
    """n one-step bandit segments in the broker's stream format, written by the broker's own store code (`first`: the
    number of the first, for segments written after others)."""
    store = SessionStore(redis_client, RedisKeys(prefix), "learners")
    store.ensure_stream()
    ids = set()
    batch = Batch()
    for i in range(first, first + n):
        session = Session(f"emu-{i % 4}", segment_len=8, seq=i // 4)
        t = {
            "obs": {"prompt": "Pick the best colour.", "question": " Answer: ", "action": ["red", "green", "blue"]},
            "action": i % 3,
            "logprob": -1.0986,
            "probs": [1 / 3] * 3,
            "policy_version": 0,
            "reward": float(i % 3 == 1),
            "done": True,
            "truncated": False,
            "mode": "step",
            "step_ms": 0,
            "feedback_ms": 0,
        }
        batch.add("RPUSH", store.keys.open_segment(session.task_id), encode(t))
        close = SegmentClose(session.task_id, session.seq, "done", True, False, None, 1)
        store.stage_close(batch, session, close)
        ids.add(close.seg_id)
    store.apply(batch)
    return ids


def learner(
    model: str,
    redis_url: str,
    prefix: str,
    ckpt: Path,
    resume: bool,
    max_updates: int,
    extra: Sequence[str] = (),
    log: IO[str] | None = None,
) -> subprocess.Popen:
    """`ppoz learner` on the bandit segments, with `extra` flags; with a `log`, at level info into it."""
    args = [
        *PPOZ,
        "--log-level",
        "info" if log is not None else "warning",
        "learner",
        "--model",
        model,
        "--lora-rank",
        "4",
        "--normalisation",
        "token",
        "--device",
        "cpu",
        "--redis-url",
        redis_url,
        "--key-prefix",
        prefix,
        "--rollout-batch",
        "8",
        "--policy-minibatch",
        "4",
        "--micro-batch",
        "4",
        "--max-policy-lag",
        "1000",
        "--checkpoint-dir",
        str(ckpt),
        "--tensorboard-dir",
        "",
        "--weights-bind",
        "tcp://127.0.0.1:0",
        "--max-updates",
        str(max_updates),
        "--read-block-ms",
        "200",
        "--keep-checkpoints",
        "100",
    ]
    return subprocess.Popen(args + [*extra] + (["--resume"] if resume else []), stdout=log, stderr=subprocess.STDOUT if log else None)


@pytest.mark.slow
def test_learner_killed_mid_run_resumes_without_loss_or_double_training(tiny_models, redis_url, redis_client, key_prefix, tmp_path):
    all_ids = write_segments(redis_client, key_prefix, 80)  # 10 updates of 8
    ckpt = tmp_path / "ckpt"
    proc = learner(tiny_models["llama"], redis_url, key_prefix, ckpt, resume=False, max_updates=10)
    # a learner process starts (torch, transformers, peft: 7-10 s alone) and makes 3 updates (about 1 s each): x10
    deadline = time.monotonic() + 120
    while len(list(ckpt.glob("ckpt-*"))) < 3:  # let it finish a few updates, then kill it inside the next one
        assert proc.poll() is None and time.monotonic() < deadline, "the learner stopped or stalled"
        time.sleep(0.05)
    time.sleep(0.15)  # aims the kill inside the next update; any moment is a valid test of the resume (not a deadline)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)  # SIGKILL ends it at once (ms); x1000
    killed_at = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)

    proc = learner(tiny_models["llama"], redis_url, key_prefix, ckpt, resume=True, max_updates=10)
    assert proc.wait(180) == 0  # the start (7-10 s alone) and the 6 or 7 updates left (about 1 s each): x10
    final = checkpoint.read_state(checkpoint.latest(ckpt) or ckpt)
    assert final["updates"] == 10 and final["version"] == 10  # the version sequence went on from the checkpoint
    assert final["version"] > killed_at["version"]
    trained = final["recent_segments"]
    assert len(trained) == len(set(trained)), "a segment was trained twice"
    assert set(trained) == all_ids, "a segment was lost"
    assert final["counters"]["transitions_trained"] == 80 == final["counters"]["transitions_stored"]
    assert redis_client.xlen(f"{key_prefix}:segments") == 0  # everything acknowledged and deleted
    assert not redis_client.xpending(f"{key_prefix}:segments", "learners")["pending"]
    assert weights.latest(redis_client, key_prefix).version == 10
    last = sorted(ckpt.glob("ckpt-*"))[-1]
    assert (last / "adapter" / "adapter_config.json").exists() and (last / "adapter" / "adapter_model.safetensors").exists()
    assert not list(ckpt.glob(".ckpt-*"))  # no half-written checkpoint left behind
