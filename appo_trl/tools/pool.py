"""`ToolThreadPool`: the bounded pool of daemon threads that runs synchronous tool functions.

A synchronous tool (a plain `def` passed as TRL's `tools=[func]`) must run off the event loop. It does not run
in the loop's default executor (`asyncio.to_thread`): the in-process sampler needs that pool too, and a tool
that never returns would fill it and stop sampling for good. This pool is the tools' own:

- at most `max_workers` calls run at once; further calls wait in its queue (a caller's deadline counts the wait);
- its threads are daemon threads, so a call that never returns never blocks interpreter exit (Python's
  `ThreadPoolExecutor` joins its workers at exit; these are not joined);
- `abandon(future)` (the executor calls it when a call misses its deadline) gives up on a running call: its
  thread is counted as stuck and a fresh thread takes its place, so stuck calls do not shrink the pool. At most
  `max_stuck` threads may be stuck at once; beyond that no replacement starts (calls then queue and time out)
  and `exhausted` is True.

What it does not do: stop a running function (Python cannot kill a thread; a stuck call keeps its thread until
the function returns or the process exits), or isolate tools from the trainer (they share its process, as in TRL).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any


class _Item:
    __slots__ = ("future", "fn", "args", "kwargs", "abandoned")

    def __init__(self, future, fn, args, kwargs):
        self.future, self.fn, self.args, self.kwargs, self.abandoned = future, fn, args, kwargs, False


class ToolThreadPool(concurrent.futures.Executor):
    """A `concurrent.futures.Executor` of daemon threads for synchronous tool calls (see the module docstring).

    Args:
        max_workers: calls running at once.
        max_stuck: abandoned calls whose threads may still run; None: `max_workers`.
        name: thread name prefix.
    """

    _ids = itertools.count()

    def __init__(self, max_workers: int = 8, max_stuck: int | None = None, name: str = "appo-tool"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.max_stuck = max_workers if max_stuck is None else max_stuck
        self.name = f"{name}-{next(self._ids)}"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # alive worker threads
        self._idle = 0  # threads waiting for a call
        self._pending = 0  # calls queued, not yet taken by a thread
        self._stuck = 0
        self._running: dict[concurrent.futures.Future, _Item] = {}

    @property
    def stuck(self) -> int:
        """Threads still running an abandoned call."""
        return self._stuck

    @property
    def exhausted(self) -> bool:
        """True when stuck calls used up the spare threads: fewer than `max_workers` threads serve new calls."""
        return self._threads - self._stuck < self.max_workers and self._threads >= self.max_workers + self.max_stuck

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        with self._lock:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._queue.put(_Item(future, fn, args, kwargs))
            self._pending += 1
            self._grow()
        return future

    def abandon(self, future: concurrent.futures.Future) -> bool:
        """Give up on the call behind `future`: cancel it if queued, else count its thread as stuck.

        Returns True when a running call was abandoned (its thread is replaced while `max_stuck` allows).
        """
        if future.cancel():
            return False
        with self._lock:
            item = self._running.get(future)
            if item is None or item.abandoned:
                return False
            item.abandoned = True
            self._stuck += 1
            self._grow()
        return True

    def _grow(self) -> None:
        # caller holds the lock: start a thread when queued calls outnumber idle threads, fewer than max_workers
        # threads can work (stuck ones excluded) and the cap of max_workers + max_stuck threads leaves room
        working = self._threads - self._stuck
        if (
            self._pending > self._idle
            and working < self.max_workers
            and self._threads < self.max_workers + self.max_stuck
        ):
            self._threads += 1
            thread = threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True)
            thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:  # shutdown sentinel
                    self._threads -= 1
                    self._grow()  # a call submitted after the shutdown still gets a thread
                    return
                self._pending -= 1
                if not item.future.set_running_or_notify_cancel():
                    continue
                self._running[item.future] = item
            try:
                result = item.fn(*item.args, **item.kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                item.future.set_exception(exc)
            else:
                item.future.set_result(result)
            with self._lock:
                del self._running[item.future]
                if item.abandoned:
                    self._stuck -= 1
                    if self._threads - self._stuck > self.max_workers:  # a replacement took this thread's place
                        self._threads -= 1
                        return

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop the idle threads; queued calls are cancelled. Never waits on a stuck call (`wait` is ignored).

        The pool stays usable: a later `submit` starts threads again.
        """
        with self._lock:
            n = self._threads - self._stuck
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.future.cancel()
                    with self._lock:
                        self._pending -= 1
        for _ in range(n):
            self._queue.put(None)


_DEFAULT: ToolThreadPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> ToolThreadPool:
    """The process-wide pool of tools not bound to an executor's own pool (8 threads)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ToolThreadPool(8, name="appo-tool-default")
        return _DEFAULT
