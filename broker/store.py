"""The broker's writes to Redis and its reads after a restart (key layout: common/segments.py).

Writes are staged into one Batch per broker loop turn (group commit), applied
by one atomic Lua script call, and replies are sent only after it succeeds: an
acknowledged feedback is always in Redis, and a crash leaves Redis at a turn
boundary. Closing a segment moves the list into one stream entry and bumps the
sequence number in the same atomic call, so a segment is never both open and
in the stream, nor in the stream twice.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import redis

from broker.sessions import RECENT_FIELD_PREFIX, PendingStep, Replied, SegmentClose, Session, now_ms
from common import segments as seg
from common.segments import RedisKeys, Transition, unpack

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 3600

# One script call per broker turn applies the whole turn's writes: atomic like
# MULTI/EXEC, but one command to pack and one reply to parse, which costs the
# broker about a sixth of the CPU of a redis-py pipeline (docs/benchmarks.md).
# ARGV[1] is a msgpack array of ops; an op is a Redis command as an array, or
# CLOSE, which moves an open segment into one stream entry: it prefixes the
# list's already-encoded transitions with a msgpack array header, so the
# entry's `transitions` field is one msgpack array and the transitions never
# leave Redis; or SAMPLE, a transition that carries a sample id: marked in
# P:samples (id -> reward) and appended to the open segment only if the id is
# not marked yet, so mark and transition never disagree and a sample id is
# stored once (a close finding its segment empty then writes no entry). Not
# for Redis Cluster (the keys are not declared).
APPLY_LUA = """
local function close_segment(seg, stream, task, seg_id, task_id, seq, reason, done, truncated, next_obs, closed_ms, next_seq)
  local items = redis.call('LRANGE', seg, 0, -1)
  local n = #items
  if n == 0 then  -- its only transition was a sample stored before (SAMPLE): nothing goes to the stream
    redis.call('HSET', task, 'seq', next_seq)
    return
  end
  local head
  if n < 16 then
    head = string.char(144 + n)
  elseif n < 65536 then
    head = string.char(220, math.floor(n / 256), n % 256)
  else
    head = string.char(221, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
  end
  redis.call('XADD', stream, '*', ENTRY)
  redis.call('DEL', seg)
  redis.call('HSET', task, 'seq', next_seq)
end

local function store_sample(samples, sample, reward, seg, transition)
  if redis.call('HSETNX', samples, sample, reward) == 1 then
    redis.call('RPUSH', seg, transition)
  else  -- acknowledged, stored nothing: counted, so that the ledger's acknowledged = stored + these
    redis.call('INCR', samples .. ':duplicates')
  end
end

local ops = cmsgpack.unpack(ARGV[1])
for i = 1, #ops do
  local op = ops[i]
  if op[1] == 'CLOSE' then
    close_segment(unpack(op, 2))
  elseif op[1] == 'SAMPLE' then
    store_sample(unpack(op, 2))
  else
    redis.call(unpack(op))
  end
end
return #ops
""".replace(
    # The entry's field names are the ones the learner reads (common/segments.py), each with its Lua value.
    "ENTRY",
    ", ".join(
        f"'{name}', {value}"
        for name, value in zip(
            seg.ENTRY_FIELDS,
            (
                "seg_id",
                "task_id",
                "seq",
                "reason",
                "done",
                "truncated",
                "n",
                "next_obs",
                "head .. table.concat(items)",
                "closed_ms",
            ),
        )
    ),
)


class Batch:
    """The writes of one broker turn, applied by one atomic script call."""

    def __init__(self) -> None:
        self.ops: list[list[Any]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def add(self, *op: Any) -> None:
        self.ops.append(list(op))

    def pack(self) -> bytes:
        # Redis's Lua msgpack decoder predates the bin type: send bytes as raw strings.
        return msgpack.packb(self.ops, use_bin_type=False)


class Committer:
    """Applies one Batch at a time on a dedicated connection, without waiting for it.

    The broker sends a turn's batch and goes on serving while Redis applies it;
    `poll()` tells when Redis answered. Only one batch is in flight, so a
    failed batch never has a successor applied on top of it.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.conn: Any = None
        self.sent_at = 0.0

    def fileno(self) -> int:
        """The connection's socket, for the broker's poller (connects if needed)."""
        if self.conn is None:
            self.conn = self.client.connection_pool.make_connection()
            self.conn.connect()
        return self.conn._sock.fileno()

    def send(self, batch: Batch, now: float) -> None:
        self.fileno()
        self.conn.send_command("EVAL", APPLY_LUA, 0, batch.pack())
        self.sent_at = now

    def poll(self) -> bool:
        """True once Redis has applied the batch; raises redis.RedisError if it failed."""
        if not self.conn.can_read(timeout=0):
            return False
        self.conn.read_response()  # raises on an error reply
        return True

    def reset(self) -> None:
        """Drop the connection (its answer, if any, is lost); the next send reconnects."""
        if self.conn is not None:
            self.conn.disconnect()
            self.conn = None


class SessionStore:
    """Stages the broker's writes and reads its state back after a restart."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, group: str) -> None:
        self.client = client
        self.keys = keys
        self.group = group

    # --- start-up ------------------------------------------------------------------------
    def ensure_stream(self) -> None:
        """Create the stream and the learners' consumer group if they do not exist."""
        seg.ensure_group(self.client, self.keys, self.group)

    def load_sessions(self, segment_len: int, history_len: int | None = None) -> dict[str, Session]:
        """Every live session with its pending step, open-segment length and (the last `history_len`) rag history."""
        task_ids = sorted(t.decode() for t in self.client.smembers(self.keys.tasks))
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hgetall(self.keys.task(task_id))
            pipe.llen(self.keys.open_segment(task_id))
            pipe.lrange(self.keys.history(task_id), 0, -1)
            pipe.lindex(self.keys.open_segment(task_id), 0)
        results = pipe.execute() if task_ids else []
        sessions: dict[str, Session] = {}
        for i, task_id in enumerate(task_ids):
            fields, open_len, history, first = results[4 * i : 4 * i + 4]
            if not fields:
                log.warning("task %s is listed but has no state; dropping it from %s", task_id, self.keys.tasks)
                self.client.srem(self.keys.tasks, task_id)
                self.client.delete(self.keys.history(task_id))
                continue
            s = Session(task_id, segment_len, created_ms=int(fields.get(b"created_ms", now_ms())), seq=int(fields[b"seq"]))
            s.open_len = open_len
            s.open_version = _policy_version(first)
            s.epoch = fields.get(b"epoch", b"").decode()  # sessions from before epochs have none
            entries = [unpack(entry) for entry in history]
            s.history = entries if history_len is None else entries[len(entries) - history_len :] if history_len else []
            if fields.get(b"pending"):
                s.pending = PendingStep.from_wire(unpack(fields[b"pending"]))
            for entry in _recent_replies(fields):
                s.restore(entry)
            if fields.get(b"attach_rid"):
                s.attach_rid = unpack(fields[b"attach_rid"])
                s.attach_sender = fields.get(b"attach_sender", b"").decode()  # "" in a hash from before it was kept
            sessions[task_id] = s
        return sessions

    # --- staged writes (all into one Batch per loop turn) --------------------------------
    def apply(self, batch: Batch) -> None:
        """Apply a batch and wait for it (start-up and tests; the broker loop uses a Committer)."""
        if batch.ops:
            self.client.eval(APPLY_LUA, 0, batch.pack())

    def stage_create(self, batch: Batch, s: Session) -> None:
        batch.add("SADD", self.keys.tasks, s.task_id)
        batch.add(
            "HSET",
            self.keys.task(s.task_id),
            "created_ms",
            str(s.created_ms),
            "seq",
            str(s.seq),
            "pending",
            b"",
            "attach_rid",
            seg.pack(s.attach_rid),
            "attach_sender",
            s.attach_sender,
            "epoch",
            s.epoch,
        )

    def stage_pending(self, batch: Batch, s: Session, replied: Replied) -> None:
        """A step's pending record, with its reply kept for retries (`recent:<slot>`) in the same HSET."""
        pending = seg.pack(s.pending.to_wire()) if s.pending is not None else b""
        batch.add("HSET", self.keys.task(s.task_id), "pending", pending, replied.field, seg.pack(replied.to_wire()))

    def stage_transition(self, batch: Batch, s: Session, transition: Transition, replied: Replied | None = None) -> None:
        """A feedback's transition appended to the open segment (with a sample id: marked, and appended only the first
        time that id comes); the pending step cleared and the reply kept, in one HSET."""
        packed = seg.pack(transition.to_wire())
        if transition.sample is not None:
            batch.add("SAMPLE", self.keys.samples, transition.sample, repr(transition.reward), self.keys.open_segment(s.task_id), packed)
        else:
            batch.add("RPUSH", self.keys.open_segment(s.task_id), packed)
        kept = (replied.field, seg.pack(replied.to_wire())) if replied is not None else ()
        batch.add("HSET", self.keys.task(s.task_id), "pending", b"", *kept)

    def stage_history(self, batch: Batch, s: Session, entry: dict[str, Any], keep: int) -> None:
        batch.add("RPUSH", self.keys.history(s.task_id), seg.pack(entry))
        batch.add("LTRIM", self.keys.history(s.task_id), str(-keep), "-1")

    def stage_close(self, batch: Batch, s: Session, close: SegmentClose) -> None:
        batch.add(
            "CLOSE",
            self.keys.open_segment(s.task_id),
            self.keys.stream,
            self.keys.task(s.task_id),
            close.seg_id,
            close.task_id,
            str(close.seq),
            close.reason,
            "1" if close.done else "0",
            "1" if close.truncated else "0",
            seg.pack(close.next_obs),
            str(now_ms()),
            str(close.seq + 1),
        )

    def stage_delete(self, batch: Batch, s: Session) -> None:
        """Forget a session in Redis (detach, expiry): its hash, open segment (already closed or empty) and history."""
        batch.add("DEL", self.keys.task(s.task_id), self.keys.open_segment(s.task_id), self.keys.history(s.task_id))
        batch.add("SREM", self.keys.tasks, s.task_id)

    def stage_tombstone(self, batch: Batch, task_id: str, rid: Any, reply: bytes) -> None:
        """The reply to a detach, kept TOMBSTONE_TTL_S for a retried detach (the session it names is gone)."""
        batch.add("SET", self.keys.tombstone(task_id), seg.pack({"rid": rid, "reply": reply}), "EX", str(TOMBSTONE_TTL_S))

    # --- reads -----------------------------------------------------------------------------
    def detach_reply(self, task_id: str, rid: Any) -> bytes | None:
        """The reply a detach of `task_id` with this rid got (within TOMBSTONE_TTL_S), else None."""
        tombstone = self.client.get(self.keys.tombstone(task_id))
        if tombstone is None:
            return None
        record = unpack(tombstone)
        same = type(record.get("rid")) is type(rid) and record.get("rid") == rid  # str and bin rids are distinct on the wire
        return record["reply"] if same else None

    def segment_lengths(self, newest: int) -> list[int]:
        """The transitions (`n`) of the stream's newest `newest` entries, oldest first: one script, so that only the
        numbers cross the network, read once at the broker's start (broker/backlog.py)."""
        lengths = self.client.eval(NEWEST_LENGTHS, 1, self.keys.stream, newest, seg.F_N)
        return [int(n) for n in reversed(lengths) if n.isdigit()]  # an entry without a count is left to the mean

    def stream_state(self) -> tuple[int, int, int]:
        """(entries in the segment stream, of them those a learner has read and not yet acknowledged, the backlog
        limit the learner publishes), in one round trip. Read entries stay in the stream until the checkpoint that
        holds them is durable (learner_node/checkpointer.py); they are no backlog: nothing waits behind them. Pending
        is 0 while the learners' group is missing (a reset Redis, before `ensure_stream` runs again); the limit is 0
        while none is published (or it is not a positive number)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.keys.stream)
        pipe.xpending(self.keys.stream, self.group)
        pipe.get(self.keys.learner_backlog)
        length, pending, limit = pipe.execute(raise_on_error=False)
        if isinstance(length, Exception):
            raise length
        read = pending["pending"] if isinstance(pending, dict) else 0
        try:
            return int(length), int(read), max(0, int(limit)) if limit is not None else 0
        except (ValueError, TypeError):
            log.warning("ignoring a malformed learner backlog limit %r", limit)
            return int(length), int(read), 0


# The `n` field of the newest ARGV[1] entries of KEYS[1], newest first ("" for an entry without it).
NEWEST_LENGTHS = """
local out = {}
for i, entry in ipairs(redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[1])) do
    local fields, n = entry[2], ''
    for j = 1, #fields, 2 do
        if fields[j] == ARGV[2] then n = fields[j + 1] end
    end
    out[i] = n
end
return out
"""


def _recent_replies(fields: dict[bytes, bytes]) -> list[Replied]:
    """The kept replies of a task hash, oldest first: its `recent:<slot>` fields, and a broker's older `last_rid`/`last_reply`."""
    prefix = RECENT_FIELD_PREFIX.encode()
    entries = [Replied.from_wire(unpack(value)) for name, value in fields.items() if name.startswith(prefix)]
    if fields.get(b"last_rid") and not entries:  # written before `recent` existed: its one kept reply, as the oldest write
        entries.append(Replied(0, unpack(fields[b"last_rid"]), fields.get(b"last_reply", b"")))
    return sorted(entries, key=lambda e: e.n)


def _policy_version(packed: bytes | None) -> int | None:
    """The policy version of a stored transition (the open segment's first), None when there is none or it cannot be
    read (the segment then closes by length alone)."""
    if packed is None:
        return None
    try:
        record = unpack(packed)
    except Exception:  # noqa: BLE001 - a record the learner will judge; here it only loses the age rule
        return None
    version = record.get("policy_version") if isinstance(record, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None
