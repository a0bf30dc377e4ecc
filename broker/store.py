"""The broker's Redis layout: sessions, open segments and the segment stream.

Keys (P is `key_prefix`):

    P:tasks             SET     task ids of live sessions
    P:task:{task_id}    HASH    created_ms, seq, pending, last_rid, last_reply, attach_rid
    P:seg:{task_id}     LIST    the open segment: one msgpack transition per element
    P:detached:{tid}    STRING  the reply to a detach, kept an hour for a retried detach
    P:{stream_key}      STREAM  closed segments, read by the learner's consumer group

Writes are staged into one MULTI/EXEC pipeline per broker loop turn (group
commit) and replies are sent only after it succeeds, so an acknowledged
feedback is always in Redis, and a crash leaves Redis at a turn boundary.
A segment is closed by a Lua script that moves the list into one stream entry
and bumps the sequence number atomically, so a segment is never both open and
in the stream, nor in the stream twice.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from broker.sessions import PendingStep, SegmentClose, Session, now_ms
from common.protocol import encode

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 3600

# Builds the msgpack array header for the list's n elements and concatenates the
# already-encoded transitions after it: the stream entry's `transitions` field is
# then one msgpack array, without the transitions ever leaving Redis.
CLOSE_SEGMENT_LUA = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local n = #items
local head
if n < 16 then
  head = string.char(144 + n)
elseif n < 65536 then
  head = string.char(220, math.floor(n / 256), n % 256)
else
  head = string.char(221, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end
local id = redis.call('XADD', KEYS[2], '*',
  'seg_id', ARGV[1], 'task_id', ARGV[2], 'seq', ARGV[3], 'reason', ARGV[4],
  'done', ARGV[5], 'truncated', ARGV[6], 'n', n, 'next_obs', ARGV[7],
  'transitions', head .. table.concat(items), 'closed_ms', ARGV[8])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[3], 'seq', ARGV[9])
return id
"""


class SessionStore:
    """Stages the broker's writes and reads its state back after a restart."""

    def __init__(self, client: redis.Redis, prefix: str, stream_key: str, group: str) -> None:
        self.client = client
        self.prefix = prefix
        self.stream = f"{prefix}:{stream_key}"
        self.group = group
        self.tasks_key = f"{prefix}:tasks"
        self._close_script = client.register_script(CLOSE_SEGMENT_LUA)

    def task_key(self, task_id: str) -> str:
        return f"{self.prefix}:task:{task_id}"

    def seg_key(self, task_id: str) -> str:
        return f"{self.prefix}:seg:{task_id}"

    def tombstone_key(self, task_id: str) -> str:
        return f"{self.prefix}:detached:{task_id}"

    # --- start-up ------------------------------------------------------------------------
    def ensure_stream(self) -> None:
        """Create the stream and the learners' consumer group if they do not exist."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def load_sessions(self, segment_len: int) -> dict[str, Session]:
        """Every live session with its pending step and open-segment length."""
        task_ids = sorted(t.decode() for t in self.client.smembers(self.tasks_key))
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hgetall(self.task_key(task_id))
            pipe.llen(self.seg_key(task_id))
        results = pipe.execute() if task_ids else []
        sessions: dict[str, Session] = {}
        for i, task_id in enumerate(task_ids):
            fields, open_len = results[2 * i], results[2 * i + 1]
            if not fields:
                log.warning("task %s is listed but has no state; dropping it from %s", task_id, self.tasks_key)
                self.client.srem(self.tasks_key, task_id)
                continue
            s = Session(task_id, segment_len, created_ms=int(fields.get(b"created_ms", now_ms())), seq=int(fields[b"seq"]))
            s.open_len = open_len
            if fields.get(b"pending"):
                s.pending = PendingStep.from_wire(_decode(fields[b"pending"]))
            if fields.get(b"last_rid"):
                s.last_rid = _decode(fields[b"last_rid"])
                s.last_reply = fields.get(b"last_reply", b"")
            if fields.get(b"attach_rid"):
                s.attach_rid = _decode(fields[b"attach_rid"])
            sessions[task_id] = s
        return sessions

    # --- staged writes (all into one transaction per loop turn) --------------------------
    def pipeline(self) -> redis.client.Pipeline:
        return self.client.pipeline(transaction=True)

    def stage_create(self, pipe: Any, s: Session) -> None:
        pipe.sadd(self.tasks_key, s.task_id)
        pipe.hset(
            self.task_key(s.task_id),
            mapping={"created_ms": s.created_ms, "seq": s.seq, "pending": b"", "attach_rid": encode(s.attach_rid)},
        )

    def stage_pending(self, pipe: Any, s: Session) -> None:
        pending = encode(s.pending.to_wire()) if s.pending is not None else b""
        pipe.hset(self.task_key(s.task_id), "pending", pending)

    def stage_transition(self, pipe: Any, s: Session, transition: dict[str, Any]) -> None:
        pipe.rpush(self.seg_key(s.task_id), encode(transition))
        pipe.hset(self.task_key(s.task_id), mapping={"pending": b"", "last_rid": encode(s.last_rid), "last_reply": s.last_reply})

    def stage_close(self, pipe: Any, s: Session, close: SegmentClose) -> None:
        self._close_script(
            keys=[self.seg_key(s.task_id), self.stream, self.task_key(s.task_id)],
            args=[
                close.seg_id, close.task_id, close.seq, close.reason, int(close.done), int(close.truncated),
                encode(close.next_obs), now_ms(), close.seq + 1,
            ],  # fmt: skip
            client=pipe,
        )

    def stage_delete(self, pipe: Any, s: Session, detach_reply: bytes | None) -> None:
        pipe.delete(self.task_key(s.task_id), self.seg_key(s.task_id))
        pipe.srem(self.tasks_key, s.task_id)
        if detach_reply is not None:
            pipe.set(self.tombstone_key(s.task_id), detach_reply, ex=TOMBSTONE_TTL_S)

    # --- reads -----------------------------------------------------------------------------
    def detach_tombstone(self, task_id: str) -> bytes | None:
        return self.client.get(self.tombstone_key(task_id))

    def stream_length(self) -> int:
        return int(self.client.xlen(self.stream))


def decode_segment(fields: dict[bytes, bytes]) -> dict[str, Any]:
    """A stream entry's fields as a segment map (the learner's view; see docs/protocol.md)."""
    return {
        "seg_id": fields[b"seg_id"].decode(),
        "task_id": fields[b"task_id"].decode(),
        "seq": int(fields[b"seq"]),
        "reason": fields[b"reason"].decode(),
        "done": fields[b"done"] == b"1",
        "truncated": fields[b"truncated"] == b"1",
        "next_obs": _decode(fields[b"next_obs"]),
        "transitions": _decode(fields[b"transitions"]),
        "closed_ms": int(fields[b"closed_ms"]),
    }


def _decode(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False)
