"""The PPOZ wire protocol: names, codes, encoding and validation of messages.

Every message is a ZeroMQ multipart message whose last frame is one msgpack map
(docs/protocol.md is the reference for people writing clients in other
languages; this module is the reference for the Python side). Nothing here
touches a socket: the broker, the actors and the clients all frame and check
messages through these functions, so they cannot drift apart.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL_ID = "ppoz"
PROTOCOL_VERSION = 1

# --- Client operations (front end) ----------------------------------------------------
OP_ATTACH = "attach"
OP_DETACH = "detach"
OP_ASK = "ask"
OP_STEP = "step"
OP_RAG_STEP = "rag_step"
OP_GENERATE = "generate"  # write a response to a prompt, token by token (generation-mode PPO)
OP_FEEDBACK = "feedback"
OP_STATUS = "status"
OP_PING = "ping"
CLIENT_OPS = frozenset({OP_ATTACH, OP_DETACH, OP_ASK, OP_STEP, OP_RAG_STEP, OP_GENERATE, OP_FEEDBACK, OP_STATUS, OP_PING})
STEP_OPS = frozenset({OP_STEP, OP_RAG_STEP, OP_GENERATE})  # the ops whose answer waits for a reward (a `feedback`)

# --- Actor operations (back end) --------------------------------------------------------
OP_READY = "ready"  # actor -> broker: I am here and can hold `credits` jobs
OP_HEARTBEAT = "heartbeat"  # both ways, when nothing else was sent for a heartbeat interval
OP_SCORE = "score"  # broker -> actor: score these jobs (one observation each)
OP_RESULT = "result"  # actor -> broker: the chosen action (or an error) of each of some jobs
OP_DISCONNECT = "disconnect"  # both ways: forget me / you are forgotten, announce again
ACTOR_OPS = frozenset({OP_READY, OP_HEARTBEAT, OP_RESULT, OP_DISCONNECT})

# --- Error codes: a closed list, each documented in docs/protocol.md ----------------------
E_BAD_REQUEST = "bad_request"
E_UNKNOWN_OP = "unknown_op"
E_UNKNOWN_TASK = "unknown_task"
E_FEEDBACK_WITHOUT_STEP = "feedback_without_step"
E_TOO_LARGE = "too_large"
E_UNSUPPORTED_VERSION = "unsupported_version"
E_OVERLOADED = "overloaded"
E_TIMEOUT = "timeout"
E_INTERNAL = "internal"
ERROR_CODES: dict[str, str] = {
    E_BAD_REQUEST: "the message is not a valid request: not a msgpack map, a missing field or a "
    "field of the wrong type or range; the message names it",
    E_UNKNOWN_OP: "`op` names no operation of this protocol version",
    E_UNKNOWN_TASK: "no session has this task_id (never attached, detached, or expired after its TTL); attach again",
    E_FEEDBACK_WITHOUT_STEP: "feedback for a task that has no step waiting for its reward; nothing was recorded",
    E_TOO_LARGE: "the message, the prompt or the candidate list is over a configured limit; the message says which",
    E_UNSUPPORTED_VERSION: '`proto` is not "ppoz" or `v` is not a version this peer speaks; the reply carries the version it speaks',
    E_OVERLOADED: "the broker cannot take the request now; retry the same request after `retry_after_ms`",
    E_TIMEOUT: "the request could not be answered within its deadline (for example no actor was free); retry with the same rid",
    E_INTERNAL: "the broker failed while handling the request (for example storage unavailable); "
    "nothing was applied, retry with the same rid",
}

MAX_RID_BYTES = 64
TASK_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
SAMPLE_ID_PATTERN = TASK_ID_PATTERN  # feedback's `sample`: a client's id for one sample, stored once (check_sample)


class ProtocolError(Exception):
    """A request that must be answered with an error reply of the given code."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.extra = extra


# The largest |reward| accepted anywhere a reward enters (feedback, the gateway, reward functions, reward models,
# judges, the reward service). Far beyond any real reward, yet small enough that no advantage, return or square
# of one overflows float32 (1e6 ** 2 = 1e12 < 3.4e38): a finite 1e300 passes a finiteness check and still makes
# every weight NaN one update later. Configurable where rewards enter ([broker] / [train.reward] max_abs_reward).
DEFAULT_MAX_ABS_REWARD = 1e6


def is_reward_bound(max_abs: float) -> bool:
    """Whether `max_abs` can be a `max_abs_reward` setting: positive and finite (every config checks it so)."""
    return math.isfinite(max_abs) and max_abs > 0


def reward_problem(value: float, max_abs: float = DEFAULT_MAX_ABS_REWARD) -> str:
    """Why `value` cannot be a reward ("" if it can): not finite, or |value| above `max_abs`."""
    if not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if abs(value) > max_abs:  # repr: 1000001.0 must not print as the bound itself (%g gives 1e+06)
        return f"{value!r} is outside the accepted range [-{max_abs!r}, {max_abs!r}] (max_abs_reward)"
    return ""


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may carry; the broker enforces them on every request."""

    max_message_bytes: int = 4 * 1024 * 1024
    max_actions: int = 256
    max_action_chars: int = 4096
    max_prompt_chars: int = 1_000_000
    max_new_tokens: int = 4096  # generate: the largest response budget a request may ask for
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    max_messages: int = 256
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD  # feedback: |reward| above it is refused (see reward_problem)


# generate's sampling settings: each key, what it must be, and its default (None: required)
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")
FINISH_REASONS = ("eos", "stop", "length")  # why a response ended: the end-of-sequence token, a stop string, its token budget
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-3  # a positive temperature below it divides the logits into infinities


# --- Encoding -------------------------------------------------------------------------
def encode(body: dict[str, Any]) -> bytes:
    """Pack one message body. Strings go out as msgpack str, bytes as bin."""
    return msgpack.packb(body, use_bin_type=True)


def _no_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code}")


def decode(frame: bytes) -> dict[str, Any]:
    """Unpack one message body, refusing anything that is not a well-formed map of the protocol's types.

    Extension types (a timestamp, say) are refused wherever they are, ignored fields included:
    docs/protocol.md allows none. msgpack builds timestamps without calling ext_hook, so
    max_ext_len=0 refuses every extension that carries data and the hook the empty ones."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_extension, max_ext_len=0)
    except Exception as e:  # msgpack raises several types for truncated or hostile input
        if _extension_only(frame):
            raise ProtocolError(
                E_BAD_REQUEST,
                "body holds a msgpack extension type (a timestamp, say); this protocol has none:"
                " send str, int, float, bool, nil, bin, array and map only",
            ) from e
        raise ProtocolError(E_BAD_REQUEST, f"body is not valid msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(body, dict):
        raise ProtocolError(E_BAD_REQUEST, f"body must be a msgpack map, got {type(body).__name__}")
    return body


def _extension_only(frame: bytes) -> bool:
    """Whether a body decode() refused is valid msgpack once extension types are allowed: then they were
    its only fault, and the reply can say so instead of quoting msgpack's max_ext_len. Only refused bodies
    are read twice."""
    try:
        msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception:  # noqa: BLE001 - another fault as well: decode() names msgpack's own words
        return False
    return True


def header(op: str | None, rid: Any = None) -> dict[str, Any]:
    """The fields every message starts with."""
    return {"proto": PROTOCOL_ID, "v": PROTOCOL_VERSION, "op": op, "rid": rid}


def error_body(rid: Any, op: Any, code: str, message: str, **extra: Any) -> dict[str, Any]:
    """An error reply: `{error: {code, message}}` beside the usual header."""
    body = header(op if isinstance(op, str) else None, rid)
    body["error"] = {"code": code, "message": message}
    body.update(extra)
    return body


# --- Validation of requests -----------------------------------------------------------
def check_header(body: dict[str, Any]) -> tuple[str, Any]:
    """Check protocol id, version, op and rid; return (op, rid)."""
    proto, version = body.get("proto"), body.get("v")
    if not isinstance(proto, str) or not isinstance(version, int) or isinstance(version, bool):
        # A header that is missing or of the wrong type is a malformed request, not another version of the protocol.
        raise ProtocolError(
            E_BAD_REQUEST,
            f"the header needs `proto` (a str, {PROTOCOL_ID!r}) and `v` (an int, {PROTOCOL_VERSION}), got proto of type"
            f" {type(proto).__name__} and v of type {type(version).__name__}",
        )
    if proto != PROTOCOL_ID or version != PROTOCOL_VERSION:
        raise ProtocolError(
            E_UNSUPPORTED_VERSION,
            f"this peer speaks proto={PROTOCOL_ID!r} v={PROTOCOL_VERSION}, got proto={proto!r} v={version!r}",
        )
    rid = body.get("rid")
    check_rid(rid)
    op = body.get("op")
    if not isinstance(op, str):
        raise ProtocolError(E_BAD_REQUEST, f"`op` must be a str, got {type(op).__name__}")
    return op, rid


def check_rid(rid: Any) -> Any:
    """A request id: a str or bin of 1 to MAX_RID_BYTES bytes (a str counts its UTF-8 bytes); raise bad_request naming what is wrong."""
    if not isinstance(rid, (str, bytes)) or not rid:
        got = f"an empty {_wire_type(rid)}" if isinstance(rid, (str, bytes)) else _wire_type(rid)
        raise ProtocolError(E_BAD_REQUEST, f"`rid` must be a non-empty str or bin (the client-chosen request id), got {got}")
    try:
        size = len(rid.encode("utf-8")) if isinstance(rid, str) else len(rid)
    except UnicodeEncodeError as e:  # a Python str with lone surrogates: no UTF-8 for it exists
        raise ProtocolError(E_BAD_REQUEST, f"`rid` {rid[:16]!r} is not valid UTF-8 ({e.reason})") from e
    if size > MAX_RID_BYTES:
        raise ProtocolError(E_BAD_REQUEST, f"`rid` is longer than {MAX_RID_BYTES} bytes ({size}): {rid[:16]!r}...")
    return rid


def readable_rid(rid: Any) -> bool:
    """Whether `rid` is one the broker echoes in its reply (see check_rid); else the reply carries nil."""
    try:
        check_rid(rid)
    except ProtocolError:
        return False
    return True


def read_header(frame: bytes) -> dict[str, Any]:
    """The `rid` and `op` of a body that decode() refused or that is over the size limit, as far as they can be read.

    Why: a reply to a body the broker cannot fully read (invalid UTF-8 or an int key somewhere,
    too large) should still carry its rid, so the client can match it and stop waiting
    (docs/protocol.md, section 4). The map is walked at its top level only: each key is read,
    the values of other keys are skipped without being built (so neither their UTF-8 nor their
    size matters), and the walk stops at the first thing it cannot read. Returns a map with
    `rid` (only when readable_rid) and `op` (only when a str) where found; the last of repeated keys wins.
    """
    found: dict[str, Any] = {}
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(frame)))
    try:
        unpacker.feed(frame)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("rid", "op"):
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # noqa: BLE001 - msgpack raises several types for hostile input; what was read so far stands
        pass
    if not readable_rid(found.get("rid")):
        found.pop("rid", None)
    if not isinstance(found.get("op"), str):
        found.pop("op", None)
    return found


def require(body: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    """Return body[name], or raise bad_request naming the field and what it must be."""
    if name not in body:
        raise ProtocolError(E_BAD_REQUEST, f"`{name}` is missing; it must be {what}")
    value = body[name]
    # bool is an int in Python but not on the wire: never accept it for a number.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ProtocolError(E_BAD_REQUEST, f"`{name}` must be {what}, got {_wire_type(value)}")
    return value


def optional(body: dict[str, Any], name: str, types: type | tuple[type, ...], what: str, default: Any) -> Any:
    """Like require, but a missing or nil field gives the default."""
    if body.get(name) is None:
        return default
    return require(body, name, types, what)


def check_optional_task_id(body: dict[str, Any]) -> str | None:
    """The task_id of a request where it may be left out (attach): None, else as check_task_id."""
    return None if body.get("task_id") is None else check_task_id(body)


def check_task_id(body: dict[str, Any]) -> str:
    """The task_id of a request: 1 to 128 characters of letters, digits and . _ : @ -."""
    task_id = require(body, "task_id", str, "a str")
    if not TASK_ID_PATTERN.match(task_id):
        raise ProtocolError(E_BAD_REQUEST, f"`task_id` must be 1 to 128 of [A-Za-z0-9._:@-], got {task_id[:40]!r}")
    return task_id


def check_sample(body: dict[str, Any]) -> str | None:
    """A feedback's optional `sample`: the client's id for the sample this reward belongs to, 1 to 128 of
    [A-Za-z0-9._:@-]; the broker marks it stored in the same write as the transition, and stores a sample
    id once (docs/protocol.md, "feedback"). None when left out."""
    sample = optional(body, "sample", str, "a str of 1 to 128 of [A-Za-z0-9._:@-] (the client's sample id)", None)
    if sample is not None and not SAMPLE_ID_PATTERN.match(sample):
        raise ProtocolError(E_BAD_REQUEST, f"`sample` must be 1 to 128 of [A-Za-z0-9._:@-], got {sample[:40]!r}")
    return sample


def check_obs(body: dict[str, Any], limits: Limits, name: str = "obs") -> dict[str, Any]:
    """Validate an observation and return it reduced to its three known keys."""
    obs = require(body, name, dict, "a map {prompt, question, action}")
    prompt = require(obs, "prompt", str, f"a str (in `{name}`)")
    question = optional(obs, "question", str, f"a str (in `{name}`)", "")
    actions = require(obs, "action", list, f"a non-empty array of str (in `{name}`)")
    if not actions:
        raise ProtocolError(E_BAD_REQUEST, f"`{name}.action` is empty; a step needs at least one candidate action")
    if len(actions) > limits.max_actions:
        raise ProtocolError(E_TOO_LARGE, f"`{name}.action` has {len(actions)} candidates, the limit is {limits.max_actions}")
    for i, action in enumerate(actions):
        if not isinstance(action, str):
            raise ProtocolError(E_BAD_REQUEST, f"`{name}.action[{i}]` must be a str, got {_wire_type(action)}")
        if not action:  # nothing to score: the actor refused it, and in a next_obs the learner could not score it either
            raise ProtocolError(E_BAD_REQUEST, f"`{name}.action[{i}]` is empty; a candidate needs at least one character")
        if len(action) > limits.max_action_chars:
            raise ProtocolError(E_TOO_LARGE, f"`{name}.action[{i}]` has {len(action)} characters, the limit is {limits.max_action_chars}")
    if len(prompt) + len(question) > limits.max_prompt_chars:
        raise ProtocolError(
            E_TOO_LARGE,
            f"`{name}.prompt` + `{name}.question` have {len(prompt) + len(question)} characters, the limit is {limits.max_prompt_chars}",
        )
    return {"prompt": prompt, "question": question, "action": actions}


def check_generate(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """Validate a generate request's prompt and sampling settings; return them as the job's observation.

    The prompt is either `prompt` (a str, tokenized as it is) or `messages` (an array of
    {role, content} maps, rendered with the model's chat template), never both. `sampling`
    holds `max_new_tokens` (required), `temperature` (0 means greedy), `top_p`, `top_k` (0: off), `stop`
    (strings that end the response) and `seed`; any other key is refused by name."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError(E_BAD_REQUEST, "a generate request needs exactly one of `prompt` (a str) and `messages` (an array of maps)")
    obs: dict[str, Any] = {}
    if prompt is not None:
        prompt = require(body, "prompt", str, "a non-empty str")
        if not prompt:
            raise ProtocolError(E_BAD_REQUEST, "`prompt` is empty")
        if len(prompt) > limits.max_prompt_chars:
            raise ProtocolError(E_TOO_LARGE, f"`prompt` has {len(prompt)} characters, the limit is {limits.max_prompt_chars}")
        obs["prompt"] = prompt
    else:
        obs["messages"] = _check_messages(require(body, "messages", list, "a non-empty array of {role, content} maps"), limits)
    sampling = require(body, "sampling", dict, "a map with at least `max_new_tokens`")
    unknown = sorted(str(k) for k in sampling if k not in SAMPLING_KEYS)
    if unknown:
        raise ProtocolError(E_BAD_REQUEST, f"unknown `sampling` keys: {', '.join(unknown)}; known: {', '.join(SAMPLING_KEYS)}")
    budget = require(sampling, "max_new_tokens", int, "a positive int (in `sampling`)")
    if budget < 1:
        raise ProtocolError(E_BAD_REQUEST, f"`sampling.max_new_tokens` must be at least 1, got {budget}")
    if budget > limits.max_new_tokens:
        raise ProtocolError(E_TOO_LARGE, f"`sampling.max_new_tokens` is {budget}, the limit is {limits.max_new_tokens}")
    temperature = float(optional(sampling, "temperature", (int, float), "0 (greedy) or a number from 0.001 to 100", 1.0))
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ProtocolError(
            E_BAD_REQUEST,
            f"`sampling.temperature` must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}, got {temperature}",
        )
    top_p = float(optional(sampling, "top_p", (int, float), "a number in (0, 1]", 1.0))
    if not 0 < top_p <= 1:
        raise ProtocolError(E_BAD_REQUEST, f"`sampling.top_p` must be in (0, 1], got {top_p}")
    top_k = optional(sampling, "top_k", int, "an int from 0 (off) to 2^31 - 1", 0)
    if not 0 <= top_k < 2**31:
        raise ProtocolError(E_BAD_REQUEST, f"`sampling.top_k` must be from 0 (off) to 2^31 - 1, got {top_k}")
    stop = optional(sampling, "stop", list, "an array of non-empty str", [])
    if len(stop) > limits.max_stop_strings:
        raise ProtocolError(E_TOO_LARGE, f"`sampling.stop` has {len(stop)} strings, the limit is {limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ProtocolError(E_BAD_REQUEST, f"`sampling.stop[{i}]` must be a non-empty str, got {_wire_type(s)}")
        if len(s) > limits.max_stop_chars:
            raise ProtocolError(E_TOO_LARGE, f"`sampling.stop[{i}]` has {len(s)} characters, the limit is {limits.max_stop_chars}")
    seed = optional(sampling, "seed", int, "an int from 0 to 2^63 - 1", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ProtocolError(E_BAD_REQUEST, f"`sampling.seed` must be from 0 to 2^63 - 1, got {seed}")
    obs["sampling"] = {"max_new_tokens": budget, "temperature": temperature, "top_p": top_p, "top_k": top_k, "stop": stop, "seed": seed}
    return obs


def _check_messages(messages: list[Any], limits: Limits) -> list[dict[str, str]]:
    if not messages:
        raise ProtocolError(E_BAD_REQUEST, "`messages` is empty")
    if len(messages) > limits.max_messages:
        raise ProtocolError(E_TOO_LARGE, f"`messages` has {len(messages)} entries, the limit is {limits.max_messages}")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ProtocolError(E_BAD_REQUEST, f"`messages[{i}]` must be a map {{role, content}}, got {_wire_type(m)}")
        unknown = sorted(str(k) for k in m if k not in ("role", "content"))
        if unknown:
            raise ProtocolError(E_BAD_REQUEST, f"`messages[{i}]` has unknown keys {', '.join(unknown)}; known: role, content")
        role = require(m, "role", str, f"one of {', '.join(MESSAGE_ROLES)} (in `messages[{i}]`)")
        if role not in MESSAGE_ROLES:
            raise ProtocolError(E_BAD_REQUEST, f"`messages[{i}].role` must be one of {', '.join(MESSAGE_ROLES)}, got {role[:40]!r}")
        content = require(m, "content", str, f"a str (in `messages[{i}]`)")
        chars += len(content)
        out.append({"role": role, "content": content})
    if chars > limits.max_prompt_chars:
        raise ProtocolError(E_TOO_LARGE, f"`messages` hold {chars} characters of content, the limit is {limits.max_prompt_chars}")
    return out


def check_reward(body: dict[str, Any], max_abs: float = DEFAULT_MAX_ABS_REWARD) -> float:
    """A finite int or float reward within +-`max_abs`, as a float (what is stored); bool, nan, inf and
    absurd magnitudes (1e300 would overflow the learner's advantages) are refused.

    Both msgpack number types are accepted: a JSON or JavaScript client cannot always tell
    1 from 1.0. The conformance vectors carry float64 (what the bindings send), docs/protocol.md section 3."""
    reward = require(body, "reward", (int, float), "a finite number")
    problem = reward_problem(float(reward), max_abs)
    if problem:
        raise ProtocolError(E_BAD_REQUEST, f"`reward` {problem}; nothing was recorded, the step still waits for its feedback")
    return float(reward)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


_WIRE_TYPES = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin", list: "array", dict: "map", type(None): "nil"}


def _wire_type(value: Any) -> str:
    return _WIRE_TYPES.get(type(value), type(value).__name__)
