"""The reward service's contract: its messages, its error codes, and the checks both ends hold them to.

docs/train.md, "A shared reward service", gives it for clients in any language. Every message is one msgpack
map; a client's DEALER socket sends [empty frame, request] and gets [empty frame, reply]:

    request                                                   reply
    {op: "ping", rid}                                         {op, rid, components, max_items}
    {op: "rm_score", rid, pairs: [[prompt, response], ...]}   {op, rid, scores: [float or nil, ...], errors: [str, ...]}  (in order)
    {op: "judge", rid, items: [[prompt, response, ground_truth], ...]}
                                                              {op, rid, verdicts: [{reward, raw_score, reply, error, cached}, ...]}
    any refused request                                       {op, rid, error: {code, message}}

`rid` is the client's request id (1 to 64 bytes), echoed in the reply. A request sent again, byte for
byte, while the first is still being scored joins it rather than being scored twice (a client that timed
out and retried, from a new socket). Only a byte-identical request joins: another client that happens to
use the same rid with other pairs or items gets its own scores, never the first one's. `components` names
what the service hosts, as CompositeReward names them (rm_score, judge_score). A verdict's `reward` is in
[0, 1], or nil with `error` saying why (the judge's reply was unreadable, its request failed): that
response gets no reward, never a 0. `ground_truth` is any msgpack value; the clients here send its text,
which is what the judge's template makes of it.

No number that cannot be a reward leaves the service: a reward model's score that is not finite or is
past `max_abs_reward` goes out as nil, its `errors` entry saying why ("" beside a score), and a verdict's
reward outside [0, 1] as nil with its `error`. The clients hold a reply to the same rules (a service of
another version may not): such a pair or item gets no reward, the others of its request do.

Error codes (`ERROR_CODES`): bad_request, unknown_op, not_hosted, too_large, overloaded (retry after
`retry_after_ms`), timeout (the request waited past `queue_timeout_s`), scoring_failed, internal.

A request is checked against the limits before any of it is scored, tokenized or even decoded: its size
(`max_request_bytes`) and the length of its `pairs` or `items` (`max_items`, read from the array's header:
decoding 20 million empty pairs took the loop 11 s, every other request waiting, only to refuse them).

The server is rewards/service/server.py, the clients rewards/service/client.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from common import protocol as p
from common.protocol import reward_problem
from rewards.functions import RewardError
from rewards.judge import Verdict

OP_PING = "ping"
OP_RM_SCORE = "rm_score"
OP_JUDGE = "judge"
OPS = (OP_PING, OP_RM_SCORE, OP_JUDGE)
COMPONENT_OF_OP = {OP_RM_SCORE: "rm_score", OP_JUDGE: "judge_score"}  # CompositeReward's names
E_NOT_HOSTED = "not_hosted"
E_SCORING_FAILED = "scoring_failed"
ERROR_CODES: dict[str, str] = {
    p.E_BAD_REQUEST: "not a msgpack map, a missing field, or a field of the wrong type; the message names it",
    p.E_UNKNOWN_OP: "`op` is none of ping, rm_score, judge",
    E_NOT_HOSTED: "the service hosts no reward model (rm_score) or no judge (judge); `ping` says what it hosts",
    p.E_TOO_LARGE: "the request is over `max_request_bytes`, or has more than `max_items` pairs or items",
    p.E_OVERLOADED: "too many requests in progress, or the service is stopping; send it again after `retry_after_ms`",
    p.E_TIMEOUT: "the request waited longer than the service's `queue_timeout_s` to be scored",
    E_SCORING_FAILED: "the reward model or the judge failed on this request; the message says why",
    p.E_INTERNAL: "the service failed while handling the request; see its log",
}
RETRIED_CODES = frozenset({p.E_OVERLOADED, p.E_TIMEOUT})  # sent again by the clients; the others are final
VERDICT_FIELDS = ("reward", "raw_score", "reply", "error", "cached")
ROWS_FIELDS = {OP_RM_SCORE: "pairs", OP_JUDGE: "items"}


def verdict_to_wire(verdict: Verdict) -> dict[str, Any]:
    return {name: getattr(verdict, name) for name in VERDICT_FIELDS}


def checked_verdict(verdict: Verdict, where: str) -> Verdict:
    """The verdict, or one without a reward when its reward is not a number in [0, 1] (judge_score's range)."""
    raw = verdict.raw_score if verdict.raw_score is None or math.isfinite(verdict.raw_score) else None
    reward = verdict.reward
    if reward is None or (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        return verdict if raw == verdict.raw_score else Verdict(reward, raw, verdict.reply, verdict.error, verdict.cached)
    return Verdict(None, raw, verdict.reply, f"{where}: the judge's reward {reward} is not a number in [0, 1]", verdict.cached)


def checked_scores(values: Sequence[Any], max_abs: float) -> tuple[list[float | None], list[str]]:
    """Reward-model scores as they may go out: one that is not finite or is past `max_abs` becomes None, with
    its error (the others: "")."""
    scores: list[float | None] = []
    errors: list[str] = []
    for value in values:
        problem = reward_problem(float(value), max_abs)
        scores.append(None if problem else float(value))
        errors.append(f"the reward model's score {problem}" if problem else "")
    return scores, errors


def verdict_from_wire(body: Any, where: str) -> Verdict:
    """A verdict as the service sent it; one that is not a map of the contract's fields is the service's fault, named."""
    if not isinstance(body, dict) or any(name not in body for name in VERDICT_FIELDS):
        raise RewardServiceError(f"{where}: a verdict must be a map of {', '.join(VERDICT_FIELDS)}, got {body!r:.120}")
    number = (int, float, type(None))
    if any(isinstance(body[name], bool) or not isinstance(body[name], number) for name in ("reward", "raw_score")):
        raise RewardServiceError(f"{where}: a verdict's reward and raw_score must be numbers or nil, got {body!r:.120}")
    reward, raw = body["reward"], body["raw_score"]
    verdict = Verdict(
        None if reward is None else float(reward),
        None if raw is None else float(raw),
        str(body["reply"]),
        str(body["error"]),
        bool(body["cached"]),
    )
    return checked_verdict(verdict, where)


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int
    max_items: int


def check_rows(body: dict[str, Any], name: str, columns: tuple[str, ...], limits: Limits) -> list[tuple[Any, ...]]:
    """`body[name]`: an array of rows [prompt, response(, ground_truth)]; prompt and response are str.
    Raises bad_request or too_large naming the field (`pairs[3][1]`, the response)."""
    shape = "[" + ", ".join(columns) + "]"
    rows = p.require(body, name, list, f"an array of {shape} arrays")
    if len(rows) > limits.max_items:
        raise p.ProtocolError(p.E_TOO_LARGE, f"`{name}` has {len(rows)} entries, the limit is {limits.max_items}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            got = f"an array of {len(row)}" if isinstance(row, list) else type(row).__name__
            raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}[{i}]` must be an array {shape}, got {got}")
        for j, column in enumerate(columns[:2]):  # prompt and response; a ground truth may be any value
            if not isinstance(row[j], str):
                raise p.ProtocolError(p.E_BAD_REQUEST, f"`{name}[{i}][{j}]` ({column}) must be a str, got {type(row[j]).__name__}")
    return [tuple(row) for row in rows]


def rows_over(body: bytes, limit: int) -> tuple[str, int] | None:
    """The name and length of an array under `pairs` or `items` in a request's top-level map that is longer than
    `limit`, read from its header before anything is decoded (the other values are skipped unbuilt); None when
    there is none, or where the body cannot be read so far (decode() then says why)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(body)))
    try:
        unpacker.feed(body)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key not in ROWS_FIELDS.values():
                unpacker.skip()
                continue
            rows = unpacker.read_array_header()
            if rows > limit:
                return key, rows
            for _ in range(rows):
                unpacker.skip()
    except Exception:  # noqa: BLE001 - msgpack raises several types for hostile input; decode() names the problem
        pass
    return None


def error_reply(op: Any, rid: Any, e: p.ProtocolError) -> dict[str, Any]:
    """`{op, rid, error: {code, message}}`; an rid or op that cannot be read goes back as nil."""
    return {
        "op": op if isinstance(op, str) else None,
        "rid": rid if p.readable_rid(rid) else None,
        "error": {"code": e.code, "message": e.message},
        **e.extra,
    }


class RewardServiceError(RewardError):
    """The reward service did not answer in time, or refused a request: the responses concerned get no reward."""
