"""The `python` tool: run model-written code in a fresh, isolated, resource-limited process, fast.

How it works. One pre-warmed interpreter (the "zygote", `appo_trl/tools/_zygote.py`) is started once inside a
bubblewrap sandbox with a scrubbed environment and common modules already imported (`numpy`, `sympy`, `math`,
...). Every call forks one *fresh* child from it, so state never leaks from one `<python>` block to the next,
while the interpreter start-up is paid once (docs/benchmarks.md, "Tools"). The isolation layers, why they were
chosen and what they do not cover are described in `appo_trl/tools/isolation.py`; in short, each call runs:

- as pid 1 of its own pid namespace (its `/proc` shows its own processes only; when it ends or its deadline
  passes, every process it started dies with it, `setsid` and double forks included);
- in its own user namespace, without any capability, under `no_new_privs` and a seccomp filter, as a uid no
  other call in flight has (when the trainer is root);
- on a read-only, allow-listed view of the filesystem (no home, no project dir, no host `/tmp`), with private
  size-capped tmpfs for its work dir (cwd, HOME), `/tmp` and `/dev/shm`, and its own ipc namespace, all gone
  when the call ends;
- without network (no interface but a downed loopback, which it cannot bring up);
- with per-call cgroup limits (memory of all its processes, pids; a CPU quota on request) where allowed,
  else per-call RLIMIT_NPROC (threads counted) and per-process RLIMIT_AS/RLIMIT_CPU; plus a wall-clock deadline.

Fail closed: when bubblewrap, user namespaces or libseccomp are missing, the tool refuses to start with one line
saying why and what to change (`PythonTool(...)` for a missing bwrap/pyseccomp, `start()` for anything found
while setting the jail up, checked by a probe call); the failure is final, later calls fail without running
code. Call `start()` before loading a model to fail early. `isolation: none` (explicit, logged as a warning on
every start) runs code unisolated.

The trainer side never blocks its event loop on the sandbox: requests go through a writer thread, replies are
read by a buffered reader thread that validates every message (size-capped lines, unguessable 128-bit ids,
typed fields). A zygote that dies or stops answering is replaced; the calls in flight fail cleanly. Output is
capped (`max_output_bytes`) before anything is encoded: stdout in the child itself, stderr's tail in its
worker; host paths are removed from it (tracebacks show `<stdlib>/...`, `<site-packages>/...`).

ARPO semantics are kept: a bare final expression is printed; the result is stdout on success and the (trimmed)
traceback on error. Unlike ARPO, code that prints nothing is **not** re-executed.

What this sandbox does NOT protect against: kernel exploits, side channels and CPU contention, reading
world-readable allow-listed files (`/usr`, `/etc`, the python installation), memory per process only where
cgroups cannot be created (normal user without delegation), and calls in flight *at the same time* meeting
through abstract unix sockets if both try. With `isolation: none`, nothing of the above holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any

from appo_trl.tools import isolation as iso
from appo_trl.tools.base import ToolResult, sanitize_text
from appo_trl.tools.sandbox_replies import find_zygote as _find_zygote
from appo_trl.tools.sandbox_replies import to_result, validate_reply

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = (
    "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics",
    "random", "re", "json", "string", "datetime", "heapq", "bisect", "numpy", "sympy",
)  # fmt: skip
ISOLATION_ALIASES = {"auto": "bwrap", "namespace": "bwrap", "bwrap": "bwrap", "none": "none"}
MAX_CODE_BYTES = 1 << 20
START_TIMEOUT_S = 120.0
REPLY_GRACE_S = 10.0


@dataclasses.dataclass
class PythonToolConfig:
    """Parameters of the `python` tool (`tool_config: {python: {...}}` in a recipe).

    Args:
        timeout_s: wall-clock limit of one call; every process of the call is killed at the deadline.
        cpu_s: CPU-seconds rlimit per process (defaults to `ceil(timeout_s) + 1`).
        memory_mb: memory of one call, MiB: a cgroup limit on all its processes where cgroups can be created,
            and always an address-space rlimit per process (the pre-imported modules use some: keep it >= 1024).
        file_size_mb: largest file the code may write, MiB.
        tmpfs_mb: size of each private tmpfs of a call (work dir, `/tmp`, `/dev/shm`), MiB.
        max_processes: processes + threads of one call (cgroup `pids.max` and RLIMIT_NPROC, both per call).
        max_open_files: open file descriptors rlimit.
        cpus: CPU quota of one call in cores (cgroup `cpu.max`). None (default): no quota, CPU time is bounded by
            `cpu_s` per process and the deadline (the cpu controller halves throughput on a busy machine).
        max_output_chars: characters of stdout/traceback the model sees; longer output is cut (`truncated`).
        max_output_bytes: bytes kept per stream (stdout capped in the child before encoding, stderr keeps the
            tail); this bounds what one call can cost the trainer.
        empty_output_text: what the model sees when successful code printed nothing (it is not re-run).
        isolation: `"bwrap"` (default; `"auto"` and `"namespace"` are accepted aliases), or `"none"`: run the
            code UNISOLATED as the trainer's user (explicit opt-in, logged as a warning).
        preload: modules imported once, so that importing them in a call is free. Standard-library ones are
            imported by the zygote; the others (numpy, sympy) by a template process that forks the workers
            of calls whose code names them (an ordinary call is forked from the small zygote: 1.6x faster).
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 2048
    file_size_mb: int = 16
    tmpfs_mb: int = 64
    max_processes: int = 64
    max_open_files: int = 256
    cpus: float | None = None
    max_output_chars: int = 4000
    max_output_bytes: int = 64 * 1024
    empty_output_text: str = "(no output: use print() to show values)"
    isolation: str = "bwrap"
    preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"python.timeout_s must be > 0, got {self.timeout_s}")
        if self.isolation not in ISOLATION_ALIASES:
            raise ValueError(
                f"python.isolation must be one of bwrap, none (auto/namespace = bwrap); got {self.isolation!r}"
            )
        self.isolation = ISOLATION_ALIASES[self.isolation]
        for name in ("memory_mb", "file_size_mb", "tmpfs_mb", "max_processes", "max_open_files", "max_output_chars",
                     "max_output_bytes", "cpus"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"python.{name} must be > 0, got {getattr(self, name)}")
        self.preload = tuple(self.preload)

    def limits(self) -> dict[str, int]:
        return {
            "cpu_s": int(self.cpu_s or int(self.timeout_s) + 1), "memory_mb": int(self.memory_mb),
            "file_size_mb": int(self.file_size_mb), "tmpfs_mb": int(self.tmpfs_mb),
            "max_processes": int(self.max_processes), "max_open_files": int(self.max_open_files),
            "max_output_bytes": int(self.max_output_bytes),
        }  # fmt: skip


def scrubbed_env() -> dict[str, str]:
    """The zygote's whole environment: nothing is inherited from the caller."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip


class _Zygote:
    """One running zygote: its process, writer thread and the calls waiting on it."""

    def __init__(self, proc: subprocess.Popen, launch: iso.Launch, stderr_file):
        self.proc, self.launch, self.stderr_file = proc, launch, stderr_file
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.dead = False
        self.bytes_read = 0
        self.reads = 0
        self.bad_messages = 0
        self.host_pid: int | None = None
        self.lock = threading.Lock()  # guards `pending` (the sandbox's own lock may be held while probing)
        self.kill_lock = threading.Lock()  # one `_kill` at a time: close() and the reader thread may both kill


class PythonSandbox:
    """Owns one zygote; `await run(code)` executes code in a fresh isolated child and returns a ToolResult.

    Thread- and event-loop-safe: requests are queued to a writer thread (the loop never blocks on a pipe),
    a reader thread resolves each call's future on the loop that awaited it. A dead zygote is restarted on the
    next call; one that does not answer a call within its deadline plus a grace period is killed and replaced.
    """

    def __init__(self, config: PythonToolConfig | None = None):
        self.config = config or PythonToolConfig()
        self._lock = threading.Lock()
        self._z: _Zygote | None = None
        self.isolation = self.config.isolation
        self.info: dict[str, Any] = {}
        self.hide_paths: list[tuple[str, str]] = iso.hidden_path_map()
        self.start_error: iso.IsolationError | None = None
        self._skip_layers: tuple[str, ...] = ()  # benchmarks only (bench/tools.py): isolation layers left out

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def zygote_pid(self) -> int | None:
        """Host pid of the zygote process (init of the sandbox's pid namespace); None when not running."""
        z = self._z
        if z is None or z.proc.poll() is not None:
            return None
        if z.host_pid is None:
            z.host_pid = _find_zygote(z.proc.pid)
        return z.host_pid

    def start(self) -> None:
        """Start the zygote (idempotent). Raises `IsolationError` when the configured isolation cannot be had;
        that failure is final (isolation does not appear mid-run): later starts and calls fail at once."""
        with self._lock:
            if self.start_error is not None:
                raise self.start_error
            if self._z is not None and not self._z.dead and self._z.proc.poll() is None:
                return
            try:
                self._start_locked()
            except iso.IsolationError as exc:
                self.start_error = exc
                logger.error("%s", exc)
                raise

    def _start_locked(self) -> None:
        cfg = self.config
        zcfg = {"preload": list(cfg.preload), "limits": cfg.limits(), "max_request_bytes": 8 * MAX_CODE_BYTES,
                "skip": list(self._skip_layers)}  # fmt: skip
        if cfg.isolation == "none":
            launch = iso.build_unisolated(zcfg)
        else:
            cgroups = "cgroups" not in self._skip_layers
            launch = iso.build_launch(zcfg, cfg.memory_mb, cfg.max_processes, cfg.cpus, cgroups=cgroups)
        self.hide_paths = launch.hide_paths
        stderr_file = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(
                launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file,
                env=scrubbed_env(), cwd="/", start_new_session=True, pass_fds=launch.pass_fds,
            )  # fmt: skip
        except OSError as exc:
            launch.cleanup()
            raise iso.IsolationError(f"python sandbox: cannot start bwrap ({exc}); {iso.HINT}") from None
        launch.release_fds()
        z = _Zygote(proc, launch, stderr_file)
        hello = self._read_hello(z)
        if hello is None:
            z.proc.kill()
            z.proc.wait()
            stderr_file.seek(0)
            said = stderr_file.read().decode(errors="replace").strip().splitlines()
            self._kill(z)
            reason = said[-1] if said else f"exit code {proc.poll()}"
            raise iso.IsolationError(
                f"python sandbox: the sandboxed interpreter failed to start ({reason}); {iso.HINT}"
            )
        self.info = {"isolation": self.isolation, "distinct_ids": bool(hello.get("distinct_ids")),
                     "cgroups": int(hello.get("cgroups", 0))}  # fmt: skip
        z.host_pid = _find_zygote(proc.pid)
        self._z = z
        threading.Thread(target=self._writer, args=(z,), name="appo-sandbox-writer", daemon=True).start()
        threading.Thread(target=self._reader, args=(z,), name="appo-sandbox-reader", daemon=True).start()
        if cfg.isolation != "none":
            self._probe_locked(z)

    def _read_hello(self, z: _Zygote) -> dict | None:
        import select

        fd, buf, deadline = z.proc.stdout.fileno(), b"", time.monotonic() + START_TIMEOUT_S
        while b"\n" not in buf and len(buf) < 4096:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        z.carry = rest  # type: ignore[attr-defined]
        try:
            hello = json.loads(line)
        except ValueError:
            return None
        return hello if isinstance(hello, dict) and hello.get("ready") is True else None

    def _probe_locked(self, z: _Zygote) -> None:
        """Fail closed: one call must get through the whole jail before the sandbox is used."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = secrets.token_hex(16)
        with z.lock:
            z.pending[call_id] = (None, fut)
        z.queue.put(self._request(call_id, "print('ok')", 30.0))
        try:
            reply = fut.result(timeout=60.0)
        except concurrent.futures.TimeoutError:
            reply = None
        if not reply or reply.get("exit_code") != 0 or reply.get("stdout") != "ok\n":
            why = (reply or {}).get("stderr") or (reply or {}).get("error") or "no answer"
            self._z = None
            self._kill(z)
            raise iso.IsolationError(
                f"python sandbox: isolation could not be set up ({why.strip().splitlines()[-1]}); {iso.HINT}"
            )

    def _request(self, call_id: str, code: str, timeout: float) -> bytes:
        return (json.dumps({"id": call_id, "code": code, "timeout_s": timeout}) + "\n").encode()

    def _writer(self, z: _Zygote) -> None:
        fd = z.proc.stdin.fileno()
        while True:
            data = z.queue.get()
            if data is None:
                break
            try:
                while data:
                    data = data[os.write(fd, data) :]
            except OSError:
                break
        try:
            z.proc.stdin.close()
        except OSError:
            pass

    def _reader(self, z: _Zygote) -> None:
        """Buffered, validating reader: a bad message never fails a call it does not name."""
        fd = z.proc.stdout.fileno()
        max_line = 16 * self.config.max_output_bytes + (1 << 16)
        buf, discarding = bytearray(getattr(z, "carry", b"")), False
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            z.reads += 1
            z.bytes_read += len(chunk)
            buf += chunk
            while True:
                end = buf.find(b"\n")
                if end < 0:
                    if len(buf) > max_line:
                        buf.clear()
                        discarding = True
                    break
                line = bytes(buf[:end])
                del buf[: end + 1]
                if discarding:
                    discarding = False
                    z.bad_messages += 1
                    continue
                self._on_line(z, line)
        self._zygote_gone(z, "sandbox_died")

    def _on_line(self, z: _Zygote, line: bytes) -> None:
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        call_id = reply.get("id") if isinstance(reply, dict) else None
        with z.lock:
            entry = z.pending.pop(call_id, None) if isinstance(call_id, str) else None
        if entry is None:
            z.bad_messages += 1
            return
        problem = validate_reply(reply)
        if problem is not None:
            logger.warning("python sandbox: malformed reply (%s); the call fails", problem)
            reply = {"error": f"malformed reply ({problem})"}
        loop, fut = entry
        _resolve(loop, fut, reply)

    def _zygote_gone(self, z: _Zygote, reason: str) -> None:
        """Fail every call still waiting on `z` and clean its resources up (idempotent)."""
        with z.lock:
            z.dead = True
            entries, z.pending = list(z.pending.values()), {}
        if self._z is z:
            self._z = None
        for loop, fut in entries:
            _resolve(loop, fut, {"error": reason})
        self._kill(z)

    def _kill(self, z: _Zygote) -> None:
        with z.kill_lock:  # a second caller waits, then finds every step already done
            z.dead = True
            z.queue.put(None)
            zygote = z.host_pid or (_find_zygote(z.proc.pid) if z.proc.poll() is None else None)
            if zygote is not None:  # init of the sandbox's pid namespace: every process inside dies with it
                try:
                    os.kill(zygote, signal.SIGKILL)
                except OSError:
                    pass
            if z.proc.poll() is None:
                try:
                    os.killpg(z.proc.pid, signal.SIGKILL)
                except OSError:
                    z.proc.kill()
            try:
                z.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            z.launch.cleanup()
            z.stderr_file.close()

    def close(self) -> None:
        """Stop the zygote: every process of every call dies with its namespaces."""
        with self._lock:
            z, self._z = self._z, None
        if z is not None:
            z.queue.put(None)
            try:
                z.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._zygote_gone(z, "sandbox_closed")

    # ---- calls ----------------------------------------------------------------------------------
    async def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        timeout = float(timeout_s or self.config.timeout_s)
        start = time.perf_counter()
        if len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
            return ToolResult(f"Error: code longer than {MAX_CODE_BYTES} bytes.", ok=False, error="code_too_large")
        z = self._z
        if z is None or z.dead or z.proc.poll() is not None:
            try:
                await asyncio.to_thread(self.start)  # (re)start the zygote off the event loop
            except iso.IsolationError:  # logged once by start(); the code never runs unisolated
                return _sandbox_down()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        call_id = secrets.token_hex(16)
        z = self._z
        if z is None:
            return _sandbox_down()
        with z.lock:
            if z.dead:
                return _sandbox_down()
            z.pending[call_id] = (loop, fut)
        z.queue.put(self._request(call_id, code, timeout))  # never blocks: the writer thread does the I/O
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout + REPLY_GRACE_S)
        except asyncio.TimeoutError:  # the zygote is wedged: replace it, failing every call in flight on it
            await asyncio.to_thread(self._zygote_gone, z, "sandbox_unresponsive")
            reply = {"error": "sandbox_unresponsive"}
        return self._to_result(reply, time.perf_counter() - start, timeout)

    def scrub(self, text: str) -> str:
        """Tool output without control characters or host paths."""
        text = sanitize_text(text)
        for path, repl in self.hide_paths:
            if path in text:
                text = text.replace(path, repl)
        return text.strip()

    def _to_result(self, reply: dict[str, Any], latency: float, timeout: float) -> ToolResult:
        return to_result(reply, latency, timeout, self.config, self.isolation, self.scrub)


def _sandbox_down() -> ToolResult:
    return ToolResult("Error: the python sandbox is not available.", ok=False, error="sandbox_down")


def _set_result(fut: Any, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _resolve(loop: asyncio.AbstractEventLoop | None, fut: Any, value: Any) -> None:
    """Resolve an asyncio future on its loop, or a concurrent future (loop None) directly."""
    if loop is None:
        _set_result(fut, value)
    else:
        loop.call_soon_threadsafe(_set_result, fut, value)


class PythonTool:
    """The `python` tool: `<python>code</python>` -> sandboxed execution (see the module docstring)."""

    name = "python"
    tag = "python"

    def __init__(self, config: PythonToolConfig | None = None, **kwargs: Any):
        self.config = config or PythonToolConfig(**kwargs)
        if self.config.isolation != "none":
            iso.check_available()  # fail closed before anything else starts
        self.sandbox = PythonSandbox(self.config)

    def start(self) -> None:
        """Start the zygote now (otherwise the first call starts it)."""
        self.sandbox.start()

    def check(self) -> None:
        """Pre-model check: the sandbox starts and a probe call gets through the whole jail (raises
        `IsolationError`, a ValueError, with one line saying why and what to change)."""
        self.sandbox.start()

    async def call(self, text: str) -> ToolResult:
        if not text.strip():
            return ToolResult("Error: empty python code.", ok=False, error="empty_input")
        return await self.sandbox.run(text)

    async def aclose(self) -> None:
        self.sandbox.close()
