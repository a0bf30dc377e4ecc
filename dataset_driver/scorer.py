"""The drivers' scorer: the workers hand it their responses, and it scores them in batches at the reward sources.

A reward model scores a batch at once and a judge runs a batch's requests concurrently; one thread gathers the
batches and hands them to a few scoring threads, so a slow judge holds back only the drivers that wait for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from rewards.composite import CompositeReward, Item, Scored

log = logging.getLogger(__name__)


BATCHES_IN_FLIGHT = 4  # batches a scorer has at the reward sources at once (see BatchingScorer)


class BatchingScorer:
    """Scores responses in batches of up to `max_batch`, gathered for at most `wait_s`, with up to
    `batches_in_flight` batches being scored at once.

    Why more than one batch: a batch is answered when its slowest response is scored, and a judge
    answers in seconds; with one batch at a time, the responses that arrive meanwhile wait for the
    whole batch before theirs starts, and a judge allowed 32 requests at once ran at half of that
    (docs/benchmarks.md, `ppoz bench drivers`). The judge's own `judge_concurrency` still bounds its
    requests; the reward function, the reward model and the running normalisation take one batch
    at a time (CompositeReward's lock), so a user's function need not be thread-safe. While every
    slot is busy the responses queue up, and the next batch takes as many as `max_batch` allows."""

    def __init__(
        self, reward: CompositeReward, max_batch: int = 16, wait_s: float = 0.02, batches_in_flight: int = BATCHES_IN_FLIGHT
    ) -> None:
        if max_batch < 1 or batches_in_flight < 1:
            raise ValueError(f"max_batch and batches_in_flight must be at least 1, got {max_batch} and {batches_in_flight}")
        self.reward = reward
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: queue.Queue[tuple[Item, Future[Scored]] | None] = queue.Queue()
        self._slots = threading.BoundedSemaphore(batches_in_flight)
        self._pool = ThreadPoolExecutor(max_workers=batches_in_flight, thread_name_prefix="reward-batch")
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> Future[Scored]:
        future: Future[Scored] = Future()
        self._queue.put((item, future))
        return future

    def close(self) -> None:
        """Score what was submitted, then stop."""
        self._queue.put(None)
        self._thread.join(60)

    def abandon(self) -> None:
        """Stop now (the run was interrupted): what is queued is not scored, its futures cancelled; a batch being
        scored ends within moments (the reward function's call is abandoned, CompositeReward.stop)."""
        self.reward.stop()
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            if pending is not None:
                pending[1].cancel()
        self._queue.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            self._slots.acquire()  # a free slot first: meanwhile the responses queue up into the next batch
            first = self._queue.get()
            if first is None:
                self._slots.release()
                break
            batch = [first]
            until = time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get(timeout=max(0.0, until - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                batch.append(more)
            try:
                self._pool.submit(self._score, batch)
            except RuntimeError:  # abandoned meanwhile: the pool takes no more work
                for _, future in batch:
                    future.cancel()
                self._slots.release()
                break
        self._pool.shutdown(wait=True)

    def _score(self, batch: list[tuple[Item, Future[Scored]]]) -> None:
        try:
            try:
                scored = self.reward.score([item for item, _ in batch])
            except BaseException as e:  # noqa: BLE001 - out of memory, even SystemExit: these responses get no reward, and each is answered
                log.exception("scoring %d responses failed", len(batch))
                scored = [Scored(None, {}, error=f"scoring failed: {type(e).__name__}: {e}") for _ in batch]
            for (_, future), result in zip(batch, scored):
                future.set_result(result)
        finally:
            self._slots.release()
