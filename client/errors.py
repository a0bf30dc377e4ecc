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
    code = p.E_BAD_REQUEST


class UnknownOp(PPOZError):
    code = p.E_UNKNOWN_OP


class UnknownTask(PPOZError):
    code = p.E_UNKNOWN_TASK


class FeedbackWithoutStep(PPOZError):
    code = p.E_FEEDBACK_WITHOUT_STEP


class TooLarge(PPOZError):
    code = p.E_TOO_LARGE


class UnsupportedVersion(PPOZError):
    code = p.E_UNSUPPORTED_VERSION


class Overloaded(PPOZError):
    code = p.E_OVERLOADED


class RequestTimeout(PPOZError):
    code = p.E_TIMEOUT


class InternalError(PPOZError):
    code = p.E_INTERNAL


BY_CODE: dict[str, type[PPOZError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownOp,
        UnknownTask,
        FeedbackWithoutStep,
        TooLarge,
        UnsupportedVersion,
        Overloaded,
        RequestTimeout,
        InternalError,
    )
}


def from_reply(reply: dict) -> PPOZError:
    error = reply.get("error") or {}
    cls = BY_CODE.get(str(error.get("code")), PPOZError)
    return cls(f"{error.get('code')}: {error.get('message')}", reply)
