"""Build tools from recipe config: `tools: [python, search]` + `tool_config: {python: {...}, search: {...}}`.

Every problem is reported at start-up as a `ValueError` naming the bad key and the valid ones (with a close
match when there is one): an unknown tool, an unknown or ill-typed parameter, a parameter block for a tool that
is not enabled, a backend that cannot be constructed (e.g. `web` search without its API key). ARPO dropped tools
that failed to construct and trained on without them; here a configured tool either works or the run stops.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from appo_trl.tools.base import Tool
from appo_trl.tools.python_sandbox import PythonTool, PythonToolConfig
from appo_trl.tools.search import SearchTool, SearchToolConfig

# name -> (tool class, its config dataclass). A new tool is one line here.
TOOL_REGISTRY: dict[str, tuple[Callable[..., Tool], type]] = {
    "python": (PythonTool, PythonToolConfig),
    "search": (SearchTool, SearchToolConfig),
}


def _unknown(kind: str, name: str, valid) -> ValueError:
    valid = sorted(valid)
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)}.{hint}")


def make_config(name: str, params: dict[str, Any] | None) -> Any:
    """The config dataclass of tool `name` from a parameter dict, checking every key."""
    if name not in TOOL_REGISTRY:
        raise _unknown("tool", name, TOOL_REGISTRY)
    config_cls = TOOL_REGISTRY[name][1]
    params = dict(params or {})
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for key in params:
        if key not in fields:
            raise _unknown(f"parameter for tool {name!r}:", key, fields)
    try:
        return config_cls(**params)
    except TypeError as exc:
        raise ValueError(f"tool {name!r}: bad parameters {params}: {exc}") from None


def build_tools(names: list[str], config: dict[str, dict[str, Any]] | None = None) -> dict[str, Tool]:
    """Construct the named tools, keyed by trigger tag; raises ValueError on any configuration problem."""
    config = dict(config or {})
    for name in config:
        if name not in TOOL_REGISTRY:
            raise _unknown("tool in tool_config", name, TOOL_REGISTRY)
        if name not in names:
            raise ValueError(f"tool_config has parameters for {name!r}, which is not in tools: {list(names)}")
    tools: dict[str, Tool] = {}
    for name in names:
        cfg = make_config(name, config.get(name))
        tool = TOOL_REGISTRY[name][0](cfg)
        if tool.tag in tools:
            raise ValueError(f"tool {name!r} listed twice (tag {tool.tag!r})")
        tools[tool.tag] = tool
    return tools
