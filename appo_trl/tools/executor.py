"""Concurrent tool executor: bounded concurrency, a deadline per call, per-tool metrics.

`await executor.execute(tag, text)` runs the tool registered under `tag` and always returns a `ToolResult`
(an unknown tag, a tool exception and a missed deadline become `ok=False` results), so one bad call never
breaks a rollout. At most `max_workers` calls run at once (others wait their turn without blocking the event
loop); every call is cancelled at its deadline: the tool's own `call_timeout_s` (`tool_config: {name:
{timeout: s}}` for a Python function tool) or else `timeout_s`. Unlike ARPO there is no per-round barrier: each
trajectory awaits only its own calls.

Synchronous function tools run in the executor's own `ToolThreadPool` (`tool_threads` daemon threads), apart
from the event loop's default executor that the in-process sampler uses: a tool that never returns cannot
starve sampling, its call is abandoned at the deadline (a warning names the tool and the call, the model reads
a timeout error) and its thread never blocks interpreter exit.

`metrics()` returns means since the last `reset_metrics()`, ready for `trainer.log`: per tag
`tools/<tag>/calls`, `failures`, `timeouts`, `truncated`, `latency_mean_s`, `latency_max_s`, plus totals
`tools/calls`, `tools/failure_frequency` and `tools/timeouts`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from appo_trl.tools.base import Tool, ToolResult
from appo_trl.tools.pool import ToolThreadPool

logger = logging.getLogger(__name__)


class ToolExecutor:
    """Runs tool calls concurrently for the rollout engine.

    Args:
        tools: tools keyed by trigger tag (what `build_tools` returns).
        max_workers: calls in flight at once, over all tools.
        timeout_s: default deadline of one call, queueing excluded (None: only the tools' own limits); a tool's
            `call_timeout_s` attribute overrides it.
        tool_threads: threads of the pool running synchronous function tools (None: `min(max_workers, 16)`).
    """

    def __init__(self, tools: dict[str, Tool], max_workers: int = 64, timeout_s: float | None = 120.0,
                 tool_threads: int | None = None):  # fmt: skip
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.tools = dict(tools)
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.pool = ToolThreadPool(tool_threads or min(max_workers, 16), name="appo-tool")
        for tool in self.tools.values():
            if hasattr(tool, "pool") and getattr(tool, "pool", None) is None:
                tool.pool = self.pool
        self._semaphores: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = {}
        self.reset_metrics()

    def _semaphore(self) -> asyncio.Semaphore:
        """The bound for the running loop (callers may use successive `asyncio.run` loops)."""
        loop = asyncio.get_running_loop()
        entry = self._semaphores.get(id(loop))
        if entry is None or entry[0] is not loop:  # a new loop (ids of closed loops get reused)
            self._semaphores = {k: v for k, v in self._semaphores.items() if not v[0].is_closed()}
            entry = self._semaphores[id(loop)] = (loop, asyncio.Semaphore(self.max_workers))
        return entry[1]

    async def execute(self, tag: str, text: str, tool: Tool | None = None) -> ToolResult:
        """Run `tool` (default: the tool registered under `tag`) on `text`, with this executor's bound,
        deadline and metrics (under `tag`)."""
        tool = tool if tool is not None else self.tools.get(tag)
        if tool is None:
            result = ToolResult(f"Error: unknown tool {tag!r}.", ok=False, error="unknown_tool")  # no `<`: escaped
            self._record(tag, result)
            return result
        timeout = getattr(tool, "call_timeout_s", None) or self.timeout_s
        async with self._semaphore():
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(tool.call(text), timeout)
            except asyncio.TimeoutError:
                self._warn_timeout(tag, text, timeout)
                result = ToolResult(
                    f"Error: Tool({tag}) timed out after {timeout:g} seconds.", ok=False, error="timeout"
                )
            except Exception as exc:  # noqa: BLE001 - a tool bug must not kill the rollout
                logger.exception("tool %s raised", tag)
                result = ToolResult(f"Error: Tool({tag}) failed: {type(exc).__name__}", ok=False, error="exception")
            result.latency_s = result.latency_s or time.perf_counter() - start
        self._record(tag, result)
        return result

    def _warn_timeout(self, tag: str, text: str, timeout: float) -> None:
        call = text if len(text) <= 200 else text[:200] + "..."
        stuck = f"; {self.pool.stuck} call(s) of synchronous tools still hold a thread" if self.pool.stuck else ""
        exhausted = " (the tool pool is exhausted: new calls wait and time out)" if self.pool.exhausted else ""
        logger.warning("tool %r timed out after %gs and was abandoned, call: %r%s%s", tag, timeout, call, stuck,
                       exhausted)  # fmt: skip

    def _record(self, tag: str, result: ToolResult) -> None:
        s = self._stats[tag]
        s["calls"] += 1
        s["failures"] += not result.ok
        s["timeouts"] += result.error == "timeout"
        s["truncated"] += bool(result.truncated)
        s["latency_sum"] += result.latency_s
        s["latency_max"] = max(s["latency_max"], result.latency_s)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        calls = failures = timeouts = 0
        for tag, s in sorted(self._stats.items()):
            n = s["calls"]
            out[f"tools/{tag}/calls"] = float(n)
            out[f"tools/{tag}/failures"] = float(s["failures"])
            out[f"tools/{tag}/timeouts"] = float(s["timeouts"])
            out[f"tools/{tag}/truncated"] = float(s["truncated"])
            out[f"tools/{tag}/latency_mean_s"] = s["latency_sum"] / n if n else 0.0
            out[f"tools/{tag}/latency_max_s"] = s["latency_max"]
            calls, failures, timeouts = calls + n, failures + s["failures"], timeouts + s["timeouts"]
        out["tools/calls"] = float(calls)
        out["tools/failure_frequency"] = failures / calls if calls else 0.0
        out["tools/timeouts"] = float(timeouts)
        return out

    def reset_metrics(self) -> None:
        self._stats: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "failures": 0, "timeouts": 0, "truncated": 0, "latency_sum": 0.0, "latency_max": 0.0}
        )

    async def aclose(self) -> None:
        for tool in self.tools.values():
            await tool.aclose()
        self.pool.shutdown()  # idle threads end; stuck ones are daemons and never block exit
