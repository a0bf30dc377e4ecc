"""One reward model and/or LLM judge that every driver of a farm calls over ZeroMQ (`ppoz reward-server`).

- rewards/service/protocol.py: the contract (messages, error codes, limits) and the checks both ends hold it to.
- rewards/service/scheduler.py: how the scorers' work is shared among the requests in progress (round-robin).
- rewards/service/server.py: RewardService, the server.
- rewards/service/client.py: RewardServiceClient, and RemoteRewardModel and RemoteJudge on it, for the drivers.
docs/train.md ("A shared reward service") says how to run one.
"""

from rewards.service.client import RemoteJudge, RemoteRewardModel, RewardServiceClient
from rewards.service.protocol import RewardServiceError
from rewards.service.server import RewardService

__all__ = ["RemoteJudge", "RemoteRewardModel", "RewardService", "RewardServiceClient", "RewardServiceError"]
