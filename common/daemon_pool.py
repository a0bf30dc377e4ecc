"""A fixed set of daemon threads that run calls at once and hand back their results in order.

concurrent.futures' ThreadPoolExecutor joins its threads when the interpreter exits. A call blocked on the network
then holds the whole process up to the call's own deadline after its work is done: `ppoz train` stopped by its time
limit with a group's generate requests in flight printed its summary and exited 300 s later (their deadline). These
threads are daemons: a process that is done exits, and a call still in flight is abandoned with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class DaemonPool:
    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a pool needs a thread at least, got {threads}")
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, Future[Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, arg, future = job
            try:
                future.set_result(call(arg))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(e)

    def map(self, call: Callable[[T], R], args: Iterable[T]) -> list[R]:
        """call(arg) for every arg, at once on the pool's threads; once every call is done (none is left using what
        the caller closes next), the results in order, or the first arg's error."""
        futures: list[Future[R]] = []
        for arg in args:
            futures.append(Future())
            self._jobs.put((call, arg, futures[-1]))
        wait(futures)
        return [future.result() for future in futures]

    def shutdown(self) -> None:
        """The threads end once the calls given before are done; nothing waits for them."""
        for _ in self._threads:
            self._jobs.put(None)
