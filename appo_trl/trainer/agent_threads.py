"""Each run of the user's agent on a daemon thread of its own, timed and cancelled from outside.

A sync agent runs on its thread; an `async def` agent runs there on an event loop of its own (`asyncio.run`), so a
blocking call inside it (`time.sleep`, a sync HTTP client) stalls that run only, never the other runs or the
timeout: the runner awaits `AgentRun.future` on its own loop with `agent_timeout_s`. A heartbeat on each async run's
loop measures how long the loop was blocked (`AgentRun.blocked_s`, a block in progress included; `on_blocked` at the
run's end), so the runner can name the agent in a warning.

`AgentRun.cancel()` cancels an async agent's task on its own loop (the agent sees `CancelledError`); nothing can stop a
sync agent or a blocked loop from outside, so `join_within(runs, seconds)` waits for all runs together up to one
deadline (a bound that does not grow with their number) and returns those still running: they are abandoned. An
abandoned run's thread is a daemon: it goes on until its call returns (its later requests to the closed endpoint
fail, its result is dropped) or the process exits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable

HEARTBEAT_S = 0.05  # how often an async run's loop records that it is free


class AgentRun:
    """One agent call `fn()` (a sync function or a coroutine function) on a daemon thread named `appo-agent`.

    `future` (on the loop that started it) gets the return value or the exception; `blocked_s` is the longest
    time the run's own event loop went without running its heartbeat (async agents; 0 for sync ones), including a
    block still in progress.
    """

    def __init__(self, fn: Callable, is_async: bool, loop: asyncio.AbstractEventLoop,
                 on_blocked: Callable[[float], None] | None = None):  # fmt: skip
        self.fn, self.is_async, self.future = fn, is_async, loop.create_future()
        self.on_blocked = on_blocked  # called on the run's thread at its end with `blocked_s`, for an async agent
        self._caller = loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._last_beat = self._max_gap = 0.0
        self.thread = threading.Thread(target=self._main, name="appo-agent", daemon=True)
        self.thread.start()

    @property
    def blocked_s(self) -> float:
        if self._loop is None:
            return 0.0
        return max(self._max_gap, time.monotonic() - self._last_beat if not self.thread_done else 0.0)

    @property
    def thread_done(self) -> bool:
        return not self.thread.is_alive()

    def cancel(self) -> None:
        """Cancel an async agent's task on its own loop (a no-op for a sync agent, or a run that ended)."""
        self._cancelled = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed: the run ended
                pass

    def _settle(self, ok: bool, value) -> None:
        if not self.future.done():
            (self.future.set_result if ok else self.future.set_exception)(value)

    def _main(self) -> None:
        try:
            out = (True, asyncio.run(self._run_async()) if self.is_async else self.fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting runner
            if not isinstance(exc, (Exception, asyncio.CancelledError)):  # sys.exit() in the agent: its run's error,
                what = f"sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else type(exc).__name__  # never a
                exc = RuntimeError(f"the agent raised {what}")  # SystemExit that stops the runner's loop (a hang)
            out = (False, exc)
        if self._loop is not None:  # the block that ended the run counts too
            self._max_gap = max(self._max_gap, time.monotonic() - self._last_beat - HEARTBEAT_S)
            if self.on_blocked is not None:
                self.on_blocked(self._max_gap)
        try:
            self._caller.call_soon_threadsafe(self._settle, *out)
        except RuntimeError:  # the runner's loop is closed: the run was abandoned
            pass

    async def _run_async(self):
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._last_beat = time.monotonic()
        self._beat()
        if self._cancelled:
            raise asyncio.CancelledError("before it started")
        return await self.fn()

    def _beat(self) -> None:
        now = time.monotonic()
        self._max_gap = max(self._max_gap, now - self._last_beat - HEARTBEAT_S)
        self._last_beat = now
        self._loop.call_later(HEARTBEAT_S, self._beat)


def join_within(runs: Iterable[AgentRun], seconds: float) -> list[AgentRun]:
    """Wait up to `seconds` in all for the runs' threads; the runs still running after it (abandoned)."""
    deadline = time.monotonic() + seconds
    left = []
    for run in runs:
        run.thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        if run.thread.is_alive():
            left.append(run)
    return left


__all__ = ["AgentRun", "join_within"]
