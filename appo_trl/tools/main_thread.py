"""Synchronous tools that must run on the main thread: those that use signals (a `signal.alarm` timeout).

Python runs signal handlers, and allows `signal.signal`, only on the main thread; TRL calls synchronous tools
there, while this package's rollout loop has its own thread. `uses_signals(func)` finds such a tool (its code, a
nested function or a function of its own module that it calls names the `signal` module); `FunctionTool` queues
its calls on `MAIN_THREAD` instead of the thread pool, and the main thread runs them, one at a time as in TRL,
while it waits for a rollout (`MainThreadCalls.wait`, which `RolloutEngine.run` uses in place of `result()`).
"""

from __future__ import annotations

import concurrent.futures
import inspect
import queue
import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any


def uses_signals(func: Callable, depth: int = 3) -> bool:
    """True when `func` (or what it calls in its own module, `depth` calls deep) refers to the `signal` module."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    glb = getattr(func, "__globals__", None)
    if code is None or glb is None:
        return False
    seen: set[int] = set()

    def visit(code: types.CodeType, level: int) -> bool:
        if id(code) in seen:
            return False
        seen.add(id(code))
        for name in code.co_names:
            value = glb.get(name)
            if value is signal or getattr(value, "__module__", None) in ("signal", "_signal"):
                return True
            value = inspect.unwrap(value) if callable(value) else value
            inner = getattr(value, "__code__", None)
            if (
                level > 0
                and inner is not None
                and getattr(value, "__globals__", None) is glb
                and visit(inner, level - 1)
            ):
                return True
        return any(isinstance(c, types.CodeType) and visit(c, level) for c in code.co_consts)

    return visit(code, depth)


class MainThreadCalls:
    """Calls queued for the main thread; `wait(future)` on the main thread runs them until `future` is done."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def abandon(self, future: concurrent.futures.Future) -> bool:
        """Cancel a queued call (a running one ends by itself: it holds the main thread)."""
        future.cancel()
        return False

    def wait(self, future: concurrent.futures.Future, timeout: float | None = None) -> Any:
        """`future.result(timeout)`, running queued calls meanwhile when called on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return future.result(timeout)
        future.add_done_callback(lambda _: self._queue.put(None))  # wakes the loop below
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if item is not None:
                self._run(*item)
        return future.result(timeout=0 if deadline is not None else None)

    @staticmethod
    def _run(future: concurrent.futures.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the thread pool does
            future.set_exception(exc)
        else:
            future.set_result(result)


MAIN_THREAD = MainThreadCalls()
