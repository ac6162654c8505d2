"""The tool protocol shared by every tool, the rollout engine and the CLI.

A tool is triggered by a tag pair in the model's output (`<python>...</python>`, `<search>...</search>`);
the rollout engine cuts the text between the tags and awaits `tool.call(text)`. A call never raises for
problems of the *model's* making (bad code, empty query, backend down): those come back as a `ToolResult`
with `ok=False` and a message the model can read. Exceptions are reserved for programming errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass
class ToolResult:
    """What one tool call produced.

    Args:
        text: what the model sees inside `<result>...</result>` (already truncated).
        ok: False when the call failed (exception in the code, timeout, backend error, cache miss).
        latency_s: wall time of the call, seconds.
        truncated: True when `text` was cut to the tool's output limit.
        error: a short machine-readable reason when `ok` is False (`"timeout"`, `"exit_code=1"`, ...).
        meta: backend-specific extras (exit code, cache hit, number of results...); JSON-serialisable.
    """

    text: str
    ok: bool = True
    latency_s: float = 0.0
    truncated: bool = False
    error: str | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@runtime_checkable
class Tool(Protocol):
    """A tool: a `name`, the `tag` that triggers it, and an async `call`."""

    name: str
    tag: str

    async def call(self, text: str) -> ToolResult: ...

    async def aclose(self) -> None: ...


_CONTROL = {c: None for c in range(32) if c not in (9, 10, 13)}
_CONTROL[0x7F] = None


def sanitize_text(text: str) -> str:
    """Drop NULs and other C0 control characters (keeps tab/newline/CR): tool output goes into a tokenizer."""
    return text.translate(_CONTROL)


def truncate_text(text: str, limit: int, keep: str = "head") -> tuple[str, bool]:
    """Cut `text` to at most `limit` characters (marker included); `keep="tail"` keeps the end (tracebacks).

    Returns `(text, truncated)`.
    """
    if len(text) <= limit:
        return text, False
    marker = "\n...[truncated]...\n"
    room = max(limit - len(marker), 0)
    if keep == "tail":
        return (marker + text[len(text) - room :])[-limit:], True
    return (text[:room] + marker)[:limit], True
