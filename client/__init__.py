"""Python client of the PPOZ protocol (what an environment such as Kea calls)."""

from client.errors import (
    BadRequest,
    FeedbackWithoutStep,
    InternalError,
    Overloaded,
    PPOZError,
    RequestTimeout,
    TooLarge,
    UnknownOp,
    UnknownTask,
    UnsupportedVersion,
)
from client.sync import Client

__all__ = [
    "Client",
    "PPOZError",
    "BadRequest",
    "FeedbackWithoutStep",
    "InternalError",
    "Overloaded",
    "RequestTimeout",
    "TooLarge",
    "UnknownOp",
    "UnknownTask",
    "UnsupportedVersion",
]
