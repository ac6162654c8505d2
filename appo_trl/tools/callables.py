"""Python callables as tools, the way TRL's `GRPOTrainer(tools=[...])` takes them.

A tool is a plain function (sync or async) with type hints and a Google-style docstring; its JSON schema comes
from `transformers.utils.get_json_schema`, exactly what `apply_chat_template(tools=[func])` renders for the
model. `FunctionTool` wraps one such function into this package's `Tool` protocol: `call(text)` takes the
*JSON arguments* of a chat-format tool call, runs the function (sync ones in the tools' own daemon-thread
pool, `appo_trl.tools.pool`, never the event loop's default executor that the in-process sampler needs, so a
slow or stuck tool stalls neither the rollout loop nor sampling; one that uses signals, such as a `signal.alarm`
timeout, on the main thread as in TRL: `appo_trl.tools.main_thread`) and returns its result as text, `str(result)`
as TRL does. A function that raises, or arguments that do not fit its signature, give `ok=False` with TRL's
error text `str({"error": str(exc)})`: the model reads it, the run goes on.

`resolve_tools(specs)` turns a `tools=` list into `FunctionTool`s and checks each one *at construction*: an
entry may be a callable, a built-in name (`python`, `search`, wrapped with a one-argument schema around the
sandbox / search tool) or a dotted import path (`tools.lookup`, `my_pkg.tools:lookup`), resolved from the given
folders (the recipe's directory, then the working directory) and then from installed packages. A callable
without a docstring, with an undocumented or untyped argument, with `*args`/`**kwargs`, an unknown name or a
path that does not import fails with one line naming the tool, never mid-training.

What this does not do: probe a tool by calling it (tools may have side effects), sandbox user functions
(they run in the trainer process, like TRL's), or render prompts (the trainer and `rollout.chat_format` do).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from appo_trl.tools.base import Tool, ToolResult, sanitize_text
from appo_trl.tools.main_thread import MAIN_THREAD, uses_signals

BUILTIN_TOOLS = ("python", "search")


class ToolSpecError(ValueError):
    """A `tools=` entry that cannot be used (reported at construction, naming the tool)."""


def trl_error_text(message: str) -> str:
    """The text TRL's tool loop shows the model for a failed call: `str({"error": message})`."""
    return str({"error": message})


def tool_schema(func: Callable, label: str | None = None) -> dict:
    """`get_json_schema(func)` (what the chat template renders), with a one-line error naming the tool."""
    from transformers.utils import get_json_schema

    label = label or getattr(func, "__name__", repr(func))
    if not callable(func):
        raise ToolSpecError(f"tool {label!r} is not callable (got {type(func).__name__})")
    if not inspect.getdoc(func):
        raise ToolSpecError(
            f"tool {label!r} has no docstring: describe it and its arguments (Google style, `Args:`) so the "
            "model knows how to call it"
        )
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError) as exc:
        raise ToolSpecError(f"tool {label!r}: cannot read its signature ({exc})") from None
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSpecError(f"tool {label!r}: *{p.name} / **{p.name} arguments cannot be described to the model")
    try:
        schema = get_json_schema(func)
    except Exception as exc:  # noqa: BLE001 - transformers raises several types; all mean "bad signature/docstring"
        raise ToolSpecError(f"tool {label!r}: {exc}") from None
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ToolSpecError(f"tool {label!r}: its schema is not JSON-serialisable ({exc})") from None
    return schema


logger = logging.getLogger(__name__)
_SAID_MAIN_THREAD: set[str] = set()


class FunctionTool:
    """A Python callable behind the `Tool` protocol; `call(text)` takes a JSON object of arguments.

    Args:
        func: the function (sync or async) the model calls; its `__name__` is the tool name.
        max_chars: results longer than this are cut (the engine also caps result tokens).
        call_timeout_s: deadline of one call, seconds (`tool_config: {name: {timeout: s}}`); the `ToolExecutor`
            enforces it. None: the executor's default.
        pool: the `ToolThreadPool` running a sync `func` (the executor binds its own); None: a process-wide one.
    """

    def __init__(self, func: Callable, max_chars: int = 20_000, call_timeout_s: float | None = None, pool=None):
        self.func = func
        self.call_timeout_s = call_timeout_s
        self.pool = pool
        self.schema = tool_schema(func)
        self.name = self.tag = self.schema["function"]["name"]
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)
        self.max_chars = max_chars
        self.main_thread = not self.is_async and uses_signals(func)
        if self.main_thread and self.name not in _SAID_MAIN_THREAD:
            _SAID_MAIN_THREAD.add(self.name)
            logger.warning("tool %r uses signals (e.g. a signal.alarm timeout): its calls run on the main thread, "
                           "one at a time, as in TRL", self.name)  # fmt: skip
        if callable(getattr(func, "check", None)):  # a built-in's start-up check (search server health, ...)
            self.check = func.check

    async def call(self, text: str) -> ToolResult:
        try:
            arguments = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolResult(trl_error_text(f"arguments are not valid JSON: {exc}"), ok=False, error="bad_arguments")
        if not isinstance(arguments, dict):
            return ToolResult(trl_error_text("arguments must be a JSON object"), ok=False, error="bad_arguments")
        return await self.call_arguments(arguments)

    async def call_arguments(self, arguments: dict) -> ToolResult:
        try:
            if self.is_async:
                result = await self.func(**arguments)
            else:
                result = await self._run_sync(arguments)
            text = result.text if isinstance(result, ToolResult) else str(result)
        except Exception as exc:  # noqa: BLE001 - a failing tool is the model's feedback, as in TRL
            return ToolResult(trl_error_text(str(exc)), ok=False, error=type(exc).__name__)
        ok = result.ok if isinstance(result, ToolResult) else True
        text = sanitize_text(text)
        truncated = len(text) > self.max_chars
        return ToolResult(text[: self.max_chars], ok=ok, truncated=truncated)

    async def _run_sync(self, arguments: dict) -> Any:
        """Run the sync function in the tool pool; when the caller gives up (deadline), abandon the call."""
        from appo_trl.tools.pool import default_pool

        pool = MAIN_THREAD if self.main_thread else self.pool or default_pool()
        future = pool.submit(functools.partial(self.func, **arguments))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            pool.abandon(future)  # a running call keeps its (daemon) thread; the pool replaces it
            raise

    async def aclose(self) -> None:
        closer = getattr(self.func, "aclose", None)
        if closer is not None:
            await closer()


def builtin_function(name: str, tool: Tool) -> Callable:
    """A documented one-argument function around built-in tool `name`, for chat-format schemas."""
    if name == "python":

        async def python(code: str) -> str:
            """Run Python code in a sandbox and return what it prints (stdout, or the error).

            Args:
                code: a complete Python program; use print() to show results.
            """
            return await tool.call(code)

        func = python
    elif name == "search":

        async def search(query: str) -> str:
            """Search the web or a document collection and return the top results as text.

            Args:
                query: what to search for.
            """
            return await tool.call(query)

        func = search
    else:
        raise ToolSpecError(f"no chat-format wrapper for built-in tool {name!r}")
    func.aclose = tool.aclose  # closing the wrapper closes the sandbox / search client
    if callable(getattr(tool, "check", None)):
        func.check = tool.check
    return func


def _search_paths(base_dirs: Iterable[str | os.PathLike | None]) -> list[str]:
    out = []
    for d in [*base_dirs, os.getcwd()]:
        if d is not None and os.path.isdir(d) and os.path.abspath(d) not in out:
            out.append(os.path.abspath(d))
    return out


def _import_from_file(module: str, dirs: Sequence[str]):
    """Import `module` (dotted) from the first folder holding `a/b.py` or `a/b/__init__.py`, else None."""
    rel = module.replace(".", os.sep)
    for d in dirs:
        for path in (os.path.join(d, rel + ".py"), os.path.join(d, rel, "__init__.py")):
            if os.path.isfile(path):
                digest = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=6).hexdigest()
                unique = f"appo_user_tools_{digest}.{module}"
                if unique in sys.modules:
                    return sys.modules[unique]
                spec = importlib.util.spec_from_file_location(unique, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[unique] = mod
                try:
                    spec.loader.exec_module(mod)
                except Exception:
                    del sys.modules[unique]
                    raise
                return mod
    return None


def load_callable(path: str, base_dirs: Iterable[str | os.PathLike | None] = ()) -> Callable:
    """The object named by `module.attr` or `module:attr`, from `base_dirs`, the cwd, then `sys.path`."""
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ToolSpecError(
            f"unknown tool {path!r}: not a built-in ({', '.join(BUILTIN_TOOLS)}) and not a dotted path "
            "`module.function`"
        )
    try:
        mod = _import_from_file(module, _search_paths(base_dirs))
        if mod is None:
            mod = importlib.import_module(module)
    except ImportError as exc:
        raise ToolSpecError(f"tool {path!r}: cannot import module {module!r} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise ToolSpecError(f"tool {path!r}: importing {module!r} raised {type(exc).__name__}: {exc}") from None
    if not hasattr(mod, attr):
        names = [n for n in dir(mod) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ToolSpecError(f"tool {path!r}: module {module!r} has no attribute {attr!r}.{hint}")
    return getattr(mod, attr)


def tool_label(spec: Any) -> str:
    """A readable name of a `tools=` entry (for messages and configs)."""
    if isinstance(spec, str):
        return spec
    name = getattr(spec, "__qualname__", None) or getattr(spec, "__name__", None)
    module = getattr(spec, "__module__", None)
    if name and "<locals>" in name:  # a function defined inside another one: its own name reads best
        return getattr(spec, "__name__", name)
    return (
        f"{module}.{name}" if name and module and not module.startswith("appo_user_tools_") else (name or repr(spec))
    )


def is_builtin(spec: Any) -> bool:
    return isinstance(spec, str) and spec in BUILTIN_TOOLS


def resolve_callables(specs: Sequence[Any], base_dirs: Iterable[str | os.PathLike | None] = ()) -> list[Any]:
    """Each `tools=` entry as a built-in name (kept) or a checked callable; raises `ToolSpecError` naming it."""
    out, seen = [], {}
    for spec in specs:
        if isinstance(spec, str):
            if not spec.strip():
                raise ToolSpecError("empty tool name in tools")
            if spec in BUILTIN_TOOLS:
                item, name = spec, spec
            elif "." not in spec and ":" not in spec:
                close = difflib.get_close_matches(spec, BUILTIN_TOOLS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ToolSpecError(
                    f"unknown tool {spec!r}; valid: {', '.join(BUILTIN_TOOLS)}.{hint} A custom tool is a Python "
                    f"function or its dotted import path (`my_tools.{spec}`)."
                )
            else:
                item = load_callable(spec, base_dirs)
                name = tool_schema(item, spec)["function"]["name"]
        elif callable(spec):
            item, name = spec, tool_schema(spec, tool_label(spec))["function"]["name"]
        else:
            raise ToolSpecError(f"tool {spec!r} is neither a name, a dotted path nor a callable")
        if name in seen:
            raise ToolSpecError(f"two tools are named {name!r} ({tool_label(seen[name])} and {tool_label(spec)})")
        seen[name] = spec
        out.append(item)
    return out
