"""PPOAPI's HTTP API in terms of PPOZ requests: routes, bodies and error statuses (no sockets here).

The routes and shapes are PPOAPI's (../shared/FIELD-NOTES.md, section 1), which
unmodified Kea builds call:

    POST /attach                      -> {"status": "attached", "task_id": ...}
    POST /ask?task_id=T               -> {"status": "ok"} or {"status": "wait", "retry_after_ms": ...}
    POST /step     {"task_id", "obs"} -> {"task_id", "status": "ok", "action": int, ...}
    POST /rag_step {"task_id", "obs"} -> as /step
    POST /generate {"task_id", "prompt" or "messages", "sampling", ["deadline_ms"]}
                                      -> {"task_id", "status": "ok", "text", "n_tokens", "finish_reason", "logprob", ...}
    POST /feedback {"task_id", "reward", "done", ["next_obs"]} -> {"status": "ok", ...}
    POST /detach?task_id=T            -> {"status": "detached", ...}
    GET  /health                      -> {"status": "ok"} when the broker answers

An error is `{"error": message, "code": code}` with an HTTP status that says what
kind of error it is (PPOAPI answered some errors with 200; Kea raises on both).

A feedback's `reward` is checked here, before anything is forwarded: one that is not finite or is
larger than `max_abs_reward` (common.protocol.reward_problem, the broker's own rule) gets 400 naming
the field and the bound, and the step keeps waiting for a corrected feedback. Python's json reads
`NaN`, `Infinity` and `-Infinity`, which JSON (RFC 8259) does not have; a body holding one anywhere
gets 400 naming where.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from common import protocol as p
from common.protocol import DEFAULT_MAX_ABS_REWARD, reward_problem

# Protocol error code -> HTTP status.
HTTP_STATUS = {
    p.E_BAD_REQUEST: 400,
    p.E_UNSUPPORTED_VERSION: 400,
    p.E_UNKNOWN_OP: 400,
    p.E_UNKNOWN_TASK: 404,
    p.E_FEEDBACK_WITHOUT_STEP: 409,
    p.E_TOO_LARGE: 413,
    p.E_OVERLOADED: 503,
    p.E_TIMEOUT: 504,
    p.E_INTERNAL: 502,
}
HEADER_FIELDS = ("proto", "v", "op", "rid")
GENERATE_FIELDS = ("task_id", "prompt", "messages", "sampling", "deadline_ms")


class HTTPError(Exception):
    """An error answered to the HTTP client: status, protocol-style code and a message naming the bad input."""

    def __init__(self, status: int, code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.message, "code": self.code}
        if self.retry_after_ms is not None:
            out["retry_after_ms"] = self.retry_after_ms
        return out


@dataclass(frozen=True)
class Forward:
    """One PPOZ request to make for an HTTP request: the op and its fields (a fresh rid is added)."""

    op: str
    fields: dict[str, Any]


ROUTES = {
    ("POST", "/attach"): "attach",
    ("POST", "/ask"): "ask",
    ("POST", "/step"): "step",
    ("POST", "/rag_step"): "rag_step",
    ("POST", "/generate"): "generate",
    ("POST", "/feedback"): "feedback",
    ("POST", "/detach"): "detach",
    ("GET", "/health"): "health",
}


def translate(method: str, path: str, query: str, body: bytes, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD) -> Forward:
    """The PPOZ request for an HTTP request; HTTPError (4xx) when the HTTP request is wrong (a feedback's
    reward that is not finite or past `max_abs_reward` included)."""
    name = ROUTES.get((method, path))
    if name is None:
        if any(route_path == path for _, route_path in ROUTES):
            raise HTTPError(405, p.E_BAD_REQUEST, f"{method} is not allowed on {path}")
        known = ", ".join(f"{m} {route}" for m, route in ROUTES)
        raise HTTPError(404, p.E_UNKNOWN_OP, f"no endpoint {method} {path}; the endpoints are {known}")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    if name == "health":
        return Forward(p.OP_PING, {})
    if name == "attach":
        data = _json(body, required=False)
        task_id = params.get("task_id") or data.get("task_id")
        return Forward(p.OP_ATTACH, {"task_id": task_id} if task_id else {})
    if name in ("ask", "detach"):
        task_id = params.get("task_id") or _json(body, required=False).get("task_id")
        if not task_id:
            raise HTTPError(400, p.E_BAD_REQUEST, f"{path} needs the task_id query parameter ({path}?task_id=...)")
        return Forward(p.OP_ASK if name == "ask" else p.OP_DETACH, {"task_id": task_id})
    data = _json(body, required=True, max_abs_reward=max_abs_reward)
    task_id = data.get("task_id")
    if not isinstance(task_id, str) or not task_id:
        raise HTTPError(400, p.E_BAD_REQUEST, f"{path} needs a JSON body with a string `task_id`, got {task_id!r}")
    if name in ("step", "rag_step"):
        if not isinstance(data.get("obs"), dict):
            raise HTTPError(
                400, p.E_BAD_REQUEST, f"{path} needs `obs`, an object with prompt, question and action; got {data.get('obs')!r}"
            )
        return Forward(p.OP_STEP if name == "step" else p.OP_RAG_STEP, {"task_id": task_id, "obs": data["obs"]})
    if name == "generate":  # the broker checks the prompt and the sampling settings and names what is wrong
        return Forward(p.OP_GENERATE, {k: v for k, v in data.items() if k in GENERATE_FIELDS})
    reward = data.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):  # another type: the broker names it
        problem = _reward_problem(reward, max_abs_reward)
        if problem:
            raise HTTPError(400, p.E_BAD_REQUEST, f"`reward` {problem}; nothing was forwarded, the step still waits for its feedback")
    fields: dict[str, Any] = {
        "task_id": task_id,
        "reward": reward,
        "done": data.get("done", False),
        "truncated": data.get("truncated", False),
    }
    if isinstance(data.get("next_obs"), dict) and data["next_obs"]:  # older Kea clients send {}
        fields["next_obs"] = data["next_obs"]
    return Forward(p.OP_FEEDBACK, fields)


def _reward_problem(reward: int | float, max_abs: float) -> str:
    """reward_problem for a JSON number: an integer too large for a float is out of range too, not an OverflowError."""
    try:
        value = float(reward)
    except OverflowError:
        return (
            f"{str(reward)[:20]}... ({len(str(reward))} digits) is outside the accepted range [-{max_abs!r}, {max_abs!r}] (max_abs_reward)"
        )
    return reward_problem(value, max_abs)


@dataclass(frozen=True)
class NotJSON:
    """Where the body had `NaN`, `Infinity` or `-Infinity` (what json.loads's parse_constant is given)."""

    literal: str


def _json(body: bytes, required: bool, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD) -> dict[str, Any]:
    if not body.strip():
        if required:
            raise HTTPError(400, p.E_BAD_REQUEST, "this endpoint needs a JSON object body")
        return {}
    try:
        data = json.loads(body, parse_constant=NotJSON)
    except RecursionError as e:
        raise HTTPError(400, p.E_BAD_REQUEST, "the body's JSON is nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more digits than int() takes
        raise HTTPError(400, p.E_BAD_REQUEST, f"the body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise HTTPError(400, p.E_BAD_REQUEST, f"the body must be a JSON object, got {type(data).__name__}")
    where = _first_not_json(data)
    if where is not None:
        path, literal = where
        bound = f"[-{max_abs_reward!r}, {max_abs_reward!r}] (max_abs_reward)"
        rule = f"; a reward must be a finite number within {bound}" if path == "reward" else ""
        message = f"`{path}` is {literal}, which JSON does not have (RFC 8259: no NaN or Infinity){rule}; nothing was forwarded"
        raise HTTPError(400, p.E_BAD_REQUEST, message)
    return data


def _first_not_json(data: Any) -> tuple[str, str] | None:
    """The path (`obs.action[2]`) and literal of the first NaN or Infinity in the parsed body; None if there is none.
    A loop rather than recursion: json.loads accepts nesting about as deep as the recursion limit."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, NotJSON):
            return path, value.literal
        if isinstance(value, dict):
            todo += [(f"{path}.{key}" if path else str(key), v) for key, v in reversed(value.items())]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def success(op: str, reply: dict[str, Any]) -> dict[str, Any]:
    """The HTTP body for a PPOZ reply: the reply without its protocol header (PPOAPI's keys are all there)."""
    out = {k: v for k, v in reply.items() if k not in HEADER_FIELDS}
    if op == p.OP_PING:
        return {"status": "ok"}
    return out


def failure(reply: dict[str, Any]) -> HTTPError:
    """The HTTPError for a PPOZ error reply."""
    error = reply.get("error") or {}
    code = str(error.get("code", p.E_INTERNAL))
    return HTTPError(
        HTTP_STATUS.get(code, 502), code, str(error.get("message", "the broker answered an error")), reply.get("retry_after_ms")
    )
