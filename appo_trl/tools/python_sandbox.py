"""The `python` tool: run model-written code in a fresh, resource-limited process, fast.

How it works. One pre-warmed interpreter (the "zygote", `appo_trl/tools/_zygote.py`) is started once with a
scrubbed environment (no inherited variables: API keys, tokens and proxies never reach it) and with common
modules already imported (`numpy`, `sympy`, `math`, ...). Every call forks one *fresh* child from it, so state
never leaks from one `<python>` block to the next, while the interpreter start-up is paid once: a call costs
~8 ms end to end (fork, limits, run, reap) where a cold `python -c` costs ~25 ms, or ~95 ms with a numpy import
(docs/benchmarks.md, "Tools"). Each child:

- runs in its own session / process group, in its own temporary working directory (also its HOME and TMPDIR),
  removed after the call;
- has rlimits: CPU seconds, address space, file size, number of processes, open files, no core dumps;
- has a wall-clock deadline; at the deadline, or as soon as the child exits, its whole process group **and**
  every orphan it left behind (double-fork + `setsid` included) is SIGKILLed and reaped;
- gets stdout and stderr captured and truncated to a configurable size (the `truncated` flag is set);
- when the zygote runs as root and the interpreter is readable by others, drops to uid/gid `nobody` (so the
  kernel's process limit applies); otherwise, in pid-namespace mode, a watchdog polling every 20 ms kills a call
  whose processes exceed `max_processes` (RLIMIT_NPROC is not enforced for root).

Where `unshare` works (checked at start-up; true on this project's machines), the zygote runs in new **network**
and **pid** namespaces (plus a user namespace when not root): the code sees no network interface but a downed
loopback (connections fail with "Network is unreachable"), sees only the sandbox's own processes in `/proc`,
cannot signal the trainer, and cannot kill the zygote (pid 1 of its namespace). `isolation="auto"` falls back to
no namespaces with a warning when `unshare` is unavailable; `isolation="namespace"` makes that an error.

ARPO semantics are kept: a bare final expression is printed; the result is stdout on success and the (trimmed)
traceback on error. Unlike ARPO, code that prints nothing is **not** re-executed.

What this sandbox does NOT protect against (it is not a security boundary for hostile code):
- The filesystem is the host's: the code can read every world-readable file and write wherever its uid may
  (as `nobody` that is little; as a non-root user it is that user's files). There is no mount namespace/chroot.
- Without namespaces (`isolation="none"` or `unshare` unavailable) the network is open, other processes of the
  same uid (the trainer included) can be signalled and their `/proc/<pid>/environ` read.
- Concurrent calls run under the same uid and can see and signal each other's processes.
- Kernel exploits, side channels, CPU contention (one call can saturate its core until its CPU limit), disk
  usage below the file-size limit times the number of files, and memory up to the limit per process.
- The CPU limit counts CPU time, the address-space limit counts virtual memory (the pre-imported modules already
  use some of it: keep `memory_mb` above ~1 GB).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from appo_trl.tools.base import ToolResult, sanitize_text, truncate_text

logger = logging.getLogger(__name__)

ZYGOTE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
DEFAULT_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics",
    "random", "re", "json", "string", "datetime", "heapq", "bisect", "numpy", "sympy",
)  # fmt: skip
_NAMESPACE_FLAGS = ["--net", "--pid", "--fork", "--mount-proc", "--kill-child"]


@dataclasses.dataclass
class PythonToolConfig:
    """Parameters of the `python` tool (`tool_config: {python: {...}}` in a recipe).

    Args:
        timeout_s: wall-clock limit of one call; the process group is SIGKILLed at the deadline.
        cpu_s: CPU-seconds rlimit (defaults to `ceil(timeout_s) + 1`).
        memory_mb: address-space rlimit in MiB.
        file_size_mb: largest file the code may write, MiB.
        max_processes: process/thread rlimit (enforced for non-root uids; root children run as `nobody`).
        max_open_files: open file descriptors rlimit.
        max_output_chars: characters of stdout/traceback the model sees; longer output is cut (`truncated`).
        max_output_bytes: bytes kept per stream inside the sandbox before decoding (the rest is drained and dropped).
        empty_output_text: what the model sees when successful code printed nothing (it is not re-run).
        isolation: `"auto"` (namespaces when available), `"namespace"` (required) or `"none"`.
        drop_privileges: when running as root, run the code as uid/gid 65534 (`nobody`).
        preload: modules imported once in the zygote, so that importing them in a call is free.
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 2048
    file_size_mb: int = 16
    max_processes: int = 256
    max_open_files: int = 256
    max_output_chars: int = 4000
    max_output_bytes: int = 1 << 20
    empty_output_text: str = "(no output: use print() to show values)"
    isolation: str = "auto"
    drop_privileges: bool = True
    preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"python.timeout_s must be > 0, got {self.timeout_s}")
        if self.isolation not in ("auto", "namespace", "none"):
            raise ValueError(f"python.isolation must be one of auto, namespace, none; got {self.isolation!r}")
        for name in ("memory_mb", "file_size_mb", "max_processes", "max_open_files", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"python.{name} must be > 0, got {getattr(self, name)}")
        self.preload = tuple(self.preload)


_probe_cache: dict[tuple[str, ...], bool] = {}


def _namespace_prefix() -> list[str] | None:
    """The `unshare` command prefix that works on this machine, or None (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    candidates = [[exe, *_NAMESPACE_FLAGS]] if os.geteuid() == 0 else []
    candidates.append([exe, "--user", "--map-current-user", *_NAMESPACE_FLAGS])
    for prefix in candidates:
        key = tuple(prefix)
        if key not in _probe_cache:
            try:
                done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, env={})
                _probe_cache[key] = done.returncode == 0
            except (OSError, subprocess.SubprocessError):
                _probe_cache[key] = False
        if _probe_cache[key]:
            return prefix
    return None


def scrubbed_env() -> dict[str, str]:
    """The zygote's whole environment: nothing is inherited from the caller."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


class PythonSandbox:
    """Owns one zygote process; `await run(code)` executes code in a fresh child and returns a ToolResult.

    Thread- and event-loop-safe: a reader thread resolves each call's future on the loop that awaited it, so
    many calls can be in flight at once without blocking the loop. A dead zygote is restarted on the next call.
    """

    def __init__(self, config: PythonToolConfig | None = None):
        self.config = config or PythonToolConfig()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, subprocess.Popen]] = {}
        self._next_id = 0
        self.isolation: str = "none"
        self.zygote_pid: int | None = None  # pid of `unshare`/the zygote as seen from this process
        self.drop_privileges = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote (idempotent); raises RuntimeError when it cannot start or isolation is unavailable."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            self._start_locked()

    def _start_locked(self) -> None:
        prefix: list[str] = []
        if self.config.isolation != "none":
            found = _namespace_prefix()
            if found is None and self.config.isolation == "namespace":
                raise RuntimeError("python.isolation='namespace' but `unshare` cannot create namespaces here")
            if found is None:
                logger.warning("python sandbox: `unshare` unavailable; running WITHOUT network/pid isolation")
            prefix = found or []
        self.isolation = "namespace" if prefix else "none"
        zcfg = json.dumps(
            {
                "preload": list(self.config.preload),
                "drop_privileges": self.config.drop_privileges,
                "max_processes": self.config.max_processes,
            }
        )
        cmd = [*prefix, sys.executable, "-I", ZYGOTE_PATH, zcfg]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=scrubbed_env(), cwd="/", start_new_session=True, bufsize=0,
        )  # fmt: skip
        line = proc.stdout.readline()
        try:
            hello = json.loads(line)
        except ValueError:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"python sandbox zygote failed to start (said {line[:200]!r})") from None
        self._proc = proc
        self.zygote_pid = proc.pid
        self.drop_privileges = bool(hello.get("drop_privileges"))
        threading.Thread(target=self._reader, args=(proc,), name="appo-sandbox-reader", daemon=True).start()

    def _reader(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                entry = self._pending.pop(reply.get("id"), None)
            if entry is not None:
                loop, fut, _ = entry
                loop.call_soon_threadsafe(_set_result, fut, reply)
        with self._lock:  # this zygote died: fail the calls that were waiting on it
            if self._proc is proc:
                self._proc = None
            orphans = [k for k, (_, _, owner) in self._pending.items() if owner is proc]
            entries = [self._pending.pop(k) for k in orphans]
        for loop, fut, _ in entries:
            loop.call_soon_threadsafe(_set_result, fut, None)

    def close(self) -> None:
        """Stop the zygote (its namespace dies with it, killing anything left)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    # ---- calls ----------------------------------------------------------------------------------
    async def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        cfg = self.config
        timeout = float(timeout_s or cfg.timeout_s)
        start = time.perf_counter()
        if self._proc is None or self._proc.poll() is not None:
            await asyncio.to_thread(self.start)  # (re)start the zygote off the event loop
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start_locked()
            self._next_id += 1
            call_id = self._next_id
            self._pending[call_id] = (loop, fut, self._proc)
            request = {
                "id": call_id, "code": code, "timeout_s": timeout,
                "cpu_s": cfg.cpu_s or int(timeout) + 1, "memory_mb": cfg.memory_mb,
                "file_size_mb": cfg.file_size_mb, "max_processes": cfg.max_processes,
                "max_open_files": cfg.max_open_files, "max_output_bytes": cfg.max_output_bytes,
            }  # fmt: skip
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
            except OSError:
                self._pending.pop(call_id, None)
                self._proc = None
                return ToolResult("Error: the python sandbox is not available.", ok=False, error="sandbox_down")
        try:
            reply = await asyncio.wait_for(fut, timeout + 10.0)
        except asyncio.TimeoutError:
            with self._lock:
                self._pending.pop(call_id, None)
                proc, self._proc = self._proc, None
            if proc is not None:  # the zygote is wedged: replace it
                proc.kill()
            reply = {"unresponsive": True}
        return self._to_result(reply, time.perf_counter() - start, timeout)

    def _to_result(self, reply: dict[str, Any] | None, latency: float, timeout: float) -> ToolResult:
        limit = self.config.max_output_chars
        if reply is None or reply.get("unresponsive"):
            return ToolResult(
                "Error: the python sandbox stopped responding.", ok=False, latency_s=latency,
                error="sandbox_unresponsive" if reply else "sandbox_died",
            )  # fmt: skip
        stdout, stderr = sanitize_text(reply["stdout"]).strip(), sanitize_text(reply["stderr"]).strip()
        meta = {
            "exit_code": reply["exit_code"], "signal": reply["signal"], "isolation": self.isolation,
            "sandbox_s": reply["duration_s"], "stderr_chars": len(stderr),
        }  # fmt: skip
        byte_cut = reply["stdout_truncated"] or reply["stderr_truncated"]
        if reply["timed_out"]:
            text, cut = truncate_text(stdout, limit)
            message = f"Execution timed out after {timeout:g} seconds."
            text = f"{text}\n{message}" if text else message
            return ToolResult(text, False, latency, cut or byte_cut, "timeout", meta)
        if reply.get("killed"):
            message = f"Process killed: more than {self.config.max_processes} processes."
            return ToolResult(message, False, latency, byte_cut, reply["killed"], meta)
        if reply["exit_code"] == 0:
            if not stdout:
                return ToolResult(self.config.empty_output_text, True, latency, byte_cut, None, meta)
            text, cut = truncate_text(stdout, limit)
            return ToolResult(text, True, latency, cut or byte_cut, None, meta)
        if reply["signal"] is not None:
            import signal as _signal

            try:
                name = _signal.Signals(reply["signal"]).name
            except ValueError:
                name = f"signal {reply['signal']}"
            detail = {"SIGXCPU": "CPU time limit exceeded", "SIGSEGV": "crashed (stack overflow or bad memory)"}
            message = f"Process killed by {name}: {detail.get(name, 'terminated')}."
            body = stderr or stdout
            text, cut = truncate_text(f"{body}\n{message}" if body else message, limit, keep="tail")
            return ToolResult(text, False, latency, cut or byte_cut, f"signal={name}", meta)
        text, cut = truncate_text(stderr or stdout or f"exit code {reply['exit_code']}", limit, keep="tail")
        return ToolResult(text, False, latency, cut or byte_cut, f"exit_code={reply['exit_code']}", meta)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


class PythonTool:
    """The `python` tool: `<python>code</python>` -> sandboxed execution (see the module docstring)."""

    name = "python"
    tag = "python"

    def __init__(self, config: PythonToolConfig | None = None, **kwargs: Any):
        self.config = config or PythonToolConfig(**kwargs)
        if self.config.isolation == "namespace" and _namespace_prefix() is None:
            raise ValueError("python.isolation='namespace' but `unshare` cannot create namespaces on this machine")
        self.sandbox = PythonSandbox(self.config)

    def start(self) -> None:
        """Start the zygote now (otherwise the first call starts it)."""
        self.sandbox.start()

    async def call(self, text: str) -> ToolResult:
        if not text.strip():
            return ToolResult("Error: empty python code.", ok=False, error="empty_input")
        return await self.sandbox.run(text)

    async def aclose(self) -> None:
        self.sandbox.close()
