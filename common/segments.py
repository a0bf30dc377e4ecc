"""The segment stream's entry format, shared by the broker (writer) and the learner (reader).

docs/protocol.md, section 7, describes the fields.
"""

from __future__ import annotations

from typing import Any

import msgpack


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
    return msgpack.unpackb(data, raw=False)
