"""The reward service's clients: RemoteRewardModel and RemoteJudge stand for a RewardModel and a Judge, their scoring
answered by a `ppoz reward-server` (rewards/service/server.py) under its contract (rewards/service/protocol.py).

The socket, the bounded send of each attempt and its replacement after an attempt that got no reply are
common/reconnecting.py's, shared with the broker's client (client/sync.py); what is sent again, and how often,
is the service's own rule (RewardServiceClient).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from common.protocol import DEFAULT_MAX_ABS_REWARD, reward_problem
from common.reconnecting import ReconnectingDealer
from common.security import ClientKeys
from rewards.functions import RewardError, bound_reason
from rewards.judge import Verdict
from rewards.service.protocol import COMPONENT_OF_OP, OP_JUDGE, OP_PING, OP_RM_SCORE, RETRIED_CODES, RewardServiceError, verdict_from_wire

log = logging.getLogger(__name__)

CLIENT_CHUNK = 256  # pairs or items per request from the clients here (below the service's default max_items)
# A ping is answered by the service's socket loop at once, never queued behind scoring: a short wait per
# attempt tells a service that is not there within seconds (a scoring request waits `timeout_s`, 60 s for a
# driver: 3 silent minutes at start before this).
PING_TIMEOUT_S = 1.5
PING_PAUSE_S = 1.0


class RewardServiceClient:
    """Requests to a reward service over one DEALER socket, one at a time (a lock; the drivers' scorer is one thread).

    Each attempt waits up to `timeout_s` for its reply; one that gets none replaces the socket (whose queue
    to a dead service would otherwise be delivered to the next one) and the same request, with the same
    rid, is sent again, `retries` times, each retry logged. `overloaded` and `timeout` are sent again after
    `retry_after_ms`. Past the last attempt, or on any other error, RewardServiceError names the service and why.
    A `ping` waits at most PING_TIMEOUT_S per attempt, PING_PAUSE_S between: a service that is not there is
    told within seconds.
    `max_abs_reward`: the bound a score in a reply is held to (RemoteRewardModel)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 60.0,
        retries: int = 2,
        context: zmq.Context | None = None,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
        curve: ClientKeys | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"a reward service client needs timeout_s > 0 and retries >= 0, got {timeout_s} and {retries}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_abs_reward = max_abs_reward
        self.curve = curve  # CURVE keys for every socket it opens (common/security.py); None: plain
        self.ctx = context or zmq.Context.instance()
        self.link = ReconnectingDealer(endpoint, self.ctx, curve, wait_to_send=False)  # the socket, replaced after a silent attempt
        self._lock = threading.Lock()

    @property
    def attempts(self) -> int:
        """Sends, retries included."""
        return self.link.sends

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """The service's reply to one request (without its error: that raises RewardServiceError)."""
        return self._exchange(op, fields, self.timeout_s, self.retries + 1, pause_s=0.0)

    def _exchange(self, op: str, fields: dict[str, Any], timeout_s: float, tries: int, pause_s: float) -> dict[str, Any]:
        """Send one request up to `tries` times, each waiting `timeout_s` for its reply, `pause_s` between unanswered ones."""
        rid = uuid.uuid4().hex
        data = msgpack.packb({"op": op, "rid": rid, **fields}, use_bin_type=True)

        # One request is in flight on the socket, so a reply with rid nil is this one's: the service could not read it.
        def answered(reply: dict[str, Any]) -> bool:
            return reply.get("rid") in (rid, None)

        why = ""
        with self._lock:
            for attempt in range(1, tries + 1):
                reply = self.link.attempt(data, time.monotonic() + timeout_s, answered)
                if reply is None:
                    why = f"no answer within {timeout_s:g} s"
                    if attempt < tries:
                        then = f"retrying in {pause_s:g} s" if pause_s else "sending it again"
                        log.warning(
                            "the reward service at %s: no answer to `%s` within %g s (try %d of %d), %s",
                            self.endpoint,
                            op,
                            timeout_s,
                            attempt,
                            tries,
                            then,
                        )
                        time.sleep(pause_s)
                    continue
                error = reply.get("error")
                if not error:
                    return reply
                code, message = (error.get("code"), error.get("message")) if isinstance(error, dict) else (None, error)
                if code not in RETRIED_CODES:
                    raise RewardServiceError(f"the reward service at {self.endpoint} refused `{op}`: {code}: {message}", reason="refused")
                why = f"{code}: {message}"
                if attempt < tries:
                    log.info(
                        "the reward service at %s answered `%s` with %s (try %d of %d); sending it again",
                        self.endpoint,
                        op,
                        why,
                        attempt,
                        tries,
                    )
                    time.sleep(min(float(reply.get("retry_after_ms") or 0) / 1000, timeout_s))
        raise RewardServiceError(
            f"the reward service at {self.endpoint} did not answer `{op}` after {tries} attempts ({why});"
            " is `ppoz reward-server` running there?",
            reason="no_answer",
        )

    def ping(self) -> dict[str, Any]:
        """The service's ping reply; RewardServiceError naming `endpoint` within (retries + 1) * PING_TIMEOUT_S
        + retries * PING_PAUSE_S seconds (6.5 s for a driver's 2 retries) when nothing answers there, each retry logged."""
        return self._exchange(OP_PING, {}, min(self.timeout_s, PING_TIMEOUT_S), self.retries + 1, PING_PAUSE_S)

    def components(self) -> list[str]:
        """What the service hosts: rm_score, judge_score."""
        reply = self.ping()
        hosted = reply.get("components")
        if not isinstance(hosted, list) or not all(c in COMPONENT_OF_OP.values() for c in hosted):
            raise RewardServiceError(f"the reward service at {self.endpoint} answered ping without its components: {reply!r:.200}")
        return hosted

    def close(self) -> None:
        with self._lock:
            self.link.reset()


def chunks(rows: list[list[Any]]) -> list[list[list[Any]]]:
    """Rows in requests of at most CLIENT_CHUNK (a validation pass scores every record at once)."""
    return [rows[start : start + CLIENT_CHUNK] for start in range(0, len(rows), CLIENT_CHUNK)]


class RemoteRewardModel(RewardServiceClient):
    """A RewardModel's `score(pairs)` answered by the service's reward model."""

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float | RewardError]:
        """Each pair's score, or the RewardServiceError saying why it has none (the service sent nil for it, or a
        number that is not finite or is past `max_abs_reward`): that pair alone goes unrewarded. A request the
        service does not answer raises RewardServiceError for all of them."""
        out: list[float | RewardError] = []
        for chunk in chunks([[prompt, response] for prompt, response in pairs]):
            reply = self.request(OP_RM_SCORE, pairs=chunk)
            scores, errors = reply.get("scores"), reply.get("errors")
            if not isinstance(scores, list) or len(scores) != len(chunk) or not all(_score_or_nil(s) for s in scores):
                raise RewardServiceError(f"the reward service at {self.endpoint} answered rm_score without {len(chunk)} scores")
            if not isinstance(errors, list) or len(errors) != len(scores):
                errors = [""] * len(scores)  # a service from before `errors`
            out += [self._row(score, error) for score, error in zip(scores, errors)]
        return out

    def _row(self, score: Any, error: Any) -> float | RewardError:
        if score is None:
            why = str(error)[:200] if error else "no reason given"
            return RewardServiceError(f"the reward service at {self.endpoint} sent no rm_score: {why}", reason="refused_by_service")
        problem = reward_problem(float(score), self.max_abs_reward)
        if problem:
            return RewardServiceError(f"the reward service at {self.endpoint} sent rm_score {problem}", reason=bound_reason(float(score)))
        return float(score)


def _score_or_nil(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


class RemoteJudge(RewardServiceClient):
    """A Judge's `judge_many(items)` answered by the service's judge. A request the service does not answer
    leaves its items without a verdict's reward (the error says why), as a local judge's failed request does."""

    def judge(self, prompt: str, response: str, ground_truth: Any = None) -> Verdict:
        return self.judge_many([(prompt, response, ground_truth)])[0]

    def judge_many(self, items: Sequence[tuple[str, str, Any]]) -> list[Verdict]:
        out: list[Verdict] = []
        # the ground truth as its text: what the judge's template makes of it, for any type msgpack cannot carry too
        rows = [[prompt, response, None if truth is None else str(truth)] for prompt, response, truth in items]
        for chunk in chunks(rows):
            try:
                verdicts = self.request(OP_JUDGE, items=chunk).get("verdicts")
                if not isinstance(verdicts, list) or len(verdicts) != len(chunk):
                    raise RewardServiceError(f"the reward service at {self.endpoint} answered judge without {len(chunk)} verdicts")
                out += [verdict_from_wire(v, f"the reward service at {self.endpoint}") for v in verdicts]
            except RewardServiceError as e:
                out += [Verdict(None, None, "", error=str(e)) for _ in chunk]
        return out
