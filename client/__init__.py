"""Python client of the PPOZ protocol (what an environment such as Kea calls).

- client.sync.Client: blocking; threads may share one (requests go one at a time).
- client.aio.AsyncClient: asyncio; many requests in flight on one socket.
- client.ppoapi.PPOClient: Kea's HTTP PPOClient API over ZeroMQ (a one-import switch).
- client.errors: one exception class per protocol error code.
docs/client.md says how to use them.
"""

from client.aio import AsyncClient
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
from client.ppoapi import PPOClient
from client.sync import Client

__all__ = [
    "AsyncClient",
    "Client",
    "PPOClient",
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
