"""One exception per protocol error code."""

from __future__ import annotations

from common import protocol as p


class PPOZError(Exception):
    """An error reply from the broker, or no reply within the deadline."""

    code = ""

    def __init__(self, message: str, reply: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reply = reply or {}


class BadRequest(PPOZError):
    """Not a valid request: not a msgpack map, a missing field, or a field of the wrong type; the message names it."""

    code = p.E_BAD_REQUEST


class UnknownOp(PPOZError):
    """`op` names no operation of this protocol version."""

    code = p.E_UNKNOWN_OP


class UnknownTask(PPOZError):
    """No session has this task_id (never attached, detached, or expired): attach again."""

    code = p.E_UNKNOWN_TASK


class FeedbackWithoutStep(PPOZError):
    """Feedback for a task with no step waiting for its reward: nothing was recorded."""

    code = p.E_FEEDBACK_WITHOUT_STEP


class TooLarge(PPOZError):
    """The message, the prompt or the candidate list is over one of the broker's limits; the message says which."""

    code = p.E_TOO_LARGE


class UnsupportedVersion(PPOZError):
    """`proto` or `v` is not one the broker speaks; the reply's `supported` says which it does."""

    code = p.E_UNSUPPORTED_VERSION


class Overloaded(PPOZError):
    """The broker cannot take the request now; the clients send it again after `retry_after_ms`."""

    code = p.E_OVERLOADED


class RequestTimeout(PPOZError):
    """No answer within the deadline: the broker's (no actor was free, say) or the client's own."""

    code = p.E_TIMEOUT


class InternalError(PPOZError):
    """The broker failed on the request (see its log); the clients send it again."""

    code = p.E_INTERNAL


# Every class above, by its code: the direct subclasses of PPOZError when this module is loaded, one per
# code (tests/client/test_retry.py holds them to common/protocol.py's ERROR_CODES).
BY_CODE: dict[str, type[PPOZError]] = {cls.code: cls for cls in PPOZError.__subclasses__()}


def from_reply(reply: dict) -> PPOZError:
    error = reply.get("error") or {}
    cls = BY_CODE.get(str(error.get("code")), PPOZError)
    return cls(f"{error.get('code')}: {error.get('message')}", reply)
