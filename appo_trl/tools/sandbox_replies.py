"""The python sandbox's reply handling (trainer side): validating zygote messages, turning them into results.

`validate_reply` checks every field of a reply line before it is used (a malformed message fails only the call
it names); `to_result` applies ARPO's semantics (stdout on success, the traceback's tail on error, a message for
timeouts and killed processes); `find_zygote` locates the zygote among bwrap's descendants.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from appo_trl.tools.base import ToolResult, truncate_text

logger = logging.getLogger("appo_trl.tools.python_sandbox")


_REPLY_TYPES = {"exit_code": (int, type(None)), "signal": (int, type(None)), "timed_out": bool,
                "killed": (str, type(None)), "duration_s": (int, float), "stdout": str, "stderr": str,
                "stdout_truncated": bool, "stderr_truncated": bool, "setup_failed": bool}  # fmt: skip


def validate_reply(reply: Any) -> str | None:
    """None when `reply` is a well-formed result message, else what is wrong with it."""
    if not isinstance(reply, dict):
        return "not an object"
    if "error" in reply:
        return None if isinstance(reply["error"], str) else "bad error field"
    for key, types in _REPLY_TYPES.items():
        if key not in reply:
            return f"missing {key}"
        if not isinstance(reply[key], types) or (types is not bool and isinstance(reply[key], bool)):
            return f"bad {key}"
    return None


def find_zygote(root: int) -> int | None:
    """The zygote among `root` and its descendants: the first python process running `_zygote.py`."""
    todo = [root]
    while todo:
        pid = todo.pop(0)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
            if any(a.endswith(b"_zygote.py") for a in args) and not args[0].endswith(b"bwrap"):
                return pid
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                todo += [int(p) for p in fh.read().split()]
        except OSError:
            continue
    return None


def to_result(reply: dict[str, Any], latency: float, timeout: float, config, isolation: str, scrub) -> ToolResult:
    """The `ToolResult` the model sees for one validated zygote reply (ARPO semantics; see python_sandbox)."""
    limit = config.max_output_chars
    if "error" in reply:
        err = reply["error"]
        known = {"sandbox_died": "stopped", "sandbox_unresponsive": "stopped responding",
                 "sandbox_closed": "was closed"}  # fmt: skip
        text = f"Error: the python sandbox {known.get(err, 'failed')}."
        return ToolResult(text, ok=False, latency_s=latency, error=err if err in known else "sandbox_error")
    stdout, stderr = scrub(reply["stdout"]), scrub(reply["stderr"])
    meta = {
        "exit_code": reply["exit_code"], "signal": reply["signal"], "isolation": isolation,
        "sandbox_s": reply["duration_s"], "stderr_chars": len(stderr),
    }  # fmt: skip
    byte_cut = reply["stdout_truncated"] or reply["stderr_truncated"]
    if reply["setup_failed"]:
        logger.error("python sandbox: a call's isolation set-up failed: %s", stderr[-500:])
        return ToolResult("Error: the python sandbox failed.", False, latency, False, "sandbox_setup", meta)
    if reply["timed_out"]:
        text, cut = truncate_text(stdout, limit)
        message = f"Execution timed out after {timeout:g} seconds."
        text = f"{text}\n{message}" if text else message
        return ToolResult(text, False, latency, cut or byte_cut, "timeout", meta)
    if reply["killed"] == "memory_limit":
        message = f"Process killed: memory limit of {config.memory_mb} MB exceeded."
        body = stderr or stdout
        text, cut = truncate_text(f"{body}\n{message}" if body else message, limit, keep="tail")
        return ToolResult(text, False, latency, cut or byte_cut, "memory_limit", meta)
    if reply["exit_code"] == 0:
        if not stdout:
            return ToolResult(config.empty_output_text, True, latency, byte_cut, None, meta)
        text, cut = truncate_text(stdout, limit)
        return ToolResult(text, True, latency, cut or byte_cut, None, meta)
    if reply["signal"] is not None:
        try:
            name = signal.Signals(reply["signal"]).name
        except ValueError:
            name = f"signal {reply['signal']}"
        detail = {"SIGXCPU": "CPU time limit exceeded", "SIGSEGV": "crashed (stack overflow or bad memory)",
                  "SIGKILL": "killed (CPU time or memory limit)"}  # fmt: skip
        message = f"Process killed by {name}: {detail.get(name, 'terminated')}."
        body = stderr or stdout
        text, cut = truncate_text(f"{body}\n{message}" if body else message, limit, keep="tail")
        return ToolResult(text, False, latency, cut or byte_cut, f"signal={name}", meta)
    text, cut = truncate_text(stderr or stdout or f"exit code {reply['exit_code']}", limit, keep="tail")
    return ToolResult(text, False, latency, cut or byte_cut, f"exit_code={reply['exit_code']}", meta)
