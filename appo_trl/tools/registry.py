"""Build tools from recipe config: `tools: [python, search]` + `tool_config: {python: {...}, search: {...}}`.

Every problem is reported at start-up as a `ValueError` naming the bad key and the valid ones (with a close
match when there is one): an unknown tool, an unknown or ill-typed parameter, a parameter block for a tool that
is not enabled, a backend that cannot be constructed (e.g. `web` search without its API key). ARPO dropped tools
that failed to construct and trained on without them; here a configured tool either works or the run stops.

`tool_format="tags"` (ARPO) keys the built-in tools by their trigger tag; `tool_format="chat"` also takes Python
callables and dotted import paths (`appo_trl.tools.callables`) and wraps every tool, built-ins included, as a
`FunctionTool` keyed by its function name, with the JSON schema the chat template renders. A function tool's
`tool_config` block takes one key, `timeout` (seconds per call, enforced by the `ToolExecutor`):
`tool_config: {lookup: {timeout: 5}}`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from appo_trl.tools.base import Tool
from appo_trl.tools.callables import FunctionTool, ToolSpecError, builtin_function, resolve_callables, tool_label
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


TOOL_FORMATS = ("tags", "chat")


def default_tool_format(specs) -> str:
    """`chat` when any tool is a Python callable or dotted path (TRL's `tools=`), else ARPO's `tags`."""
    return "tags" if all(isinstance(s, str) and s in TOOL_REGISTRY for s in specs or []) else "chat"


def build_tools(names: list, config: dict[str, dict[str, Any]] | None = None, tool_format: str = "tags",
                base_dirs=()) -> dict[str, Tool]:  # fmt: skip
    """Construct the tools, keyed by trigger tag (tags) or function name (chat); ValueError on any problem.

    Args:
        names: built-in names, and in chat format also callables or dotted import paths.
        config: per-built-in parameters (`tool_config`).
        tool_format: `"tags"` or `"chat"`.
        base_dirs: folders searched first for dotted paths (the recipe's directory).
    """
    if isinstance(names, str) or callable(names):  # `tools: python` in YAML: a one-element list
        names = [names]
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format={tool_format!r}; choose one of {TOOL_FORMATS}")
    specs = resolve_callables(list(names), base_dirs)
    if tool_format == "tags":
        custom = [tool_label(s) for s in specs if not isinstance(s, str)]
        if custom:
            raise ToolSpecError(
                f"tool_format=tags runs the built-in tag tools only ({', '.join(TOOL_REGISTRY)}); "
                f"{', '.join(custom)} need tool_format=chat (the model's chat template)"
            )
    builtin = [s for s in specs if isinstance(s, str)]
    config = dict(config or {})
    functions = [FunctionTool(s) for s in specs if not isinstance(s, str)]  # chat format only (checked above)
    timeouts = {t.name: function_timeout(t.name, config.pop(t.name)) for t in functions if t.name in config}
    tools = _build_builtin(builtin, config, extra_names=[t.name for t in functions])
    if tool_format == "tags":
        return tools
    out: dict[str, Tool] = {}
    by_name = {t.name: t for t in tools.values()}
    custom = iter(functions)
    for spec in specs:
        tool = FunctionTool(builtin_function(spec, by_name[spec])) if isinstance(spec, str) else next(custom)
        tool.call_timeout_s = timeouts.get(tool.name)
        out[tool.name] = tool
    return out


FUNCTION_TOOL_KEYS = ("timeout",)


def function_timeout(name: str, params: Any) -> float | None:
    """The `timeout` of a function tool's `tool_config` block (its only key), checked."""
    if not isinstance(params, dict):
        raise ValueError(f"tool_config[{name!r}] must be a mapping such as {{timeout: 30}}, got {params!r}")
    for key in params:
        if key not in FUNCTION_TOOL_KEYS:
            raise _unknown(f"parameter for function tool {name!r}:", key, FUNCTION_TOOL_KEYS)
    timeout = params.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"tool_config[{name!r}].timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _build_builtin(names: list[str], config: dict[str, dict[str, Any]] | None = None,
                   extra_names=()) -> dict[str, Tool]:  # fmt: skip
    config = dict(config or {})
    for name in config:
        if name not in TOOL_REGISTRY:
            raise _unknown("tool in tool_config", name, [*TOOL_REGISTRY, *extra_names])
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
