"""`appo serve-search` as a child process: started on 127.0.0.1 on a free port, stopped on exit, always.

`search_server(corpus)` runs `python -m appo_trl.cli serve-search --corpus corpus` in a subprocess, waits for its
`/health`, yields where it listens (`SearchServer`) and stops it on exit (also on errors and Ctrl-C; on Linux the
child also gets SIGTERM when this process dies, even by SIGKILL). `appo demo`, `appo study` and `appo train` with
`search_corpus` use it. What it does not do: serve or index (`appo_trl.tools.search_server`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class SearchServer:
    """Where a started `appo serve-search` listens: `url` is its `/retrieve` endpoint (the search tool's `url`)."""

    url: str
    pid: int
    port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def search_server(corpus: str, log_path: str | None = None, timeout_s: float = 120.0) -> Iterator[SearchServer]:
    """`appo serve-search --corpus corpus` on 127.0.0.1:<free port>; yields it, stops it on exit.

    Raises RuntimeError naming the log when the server exits early or does not answer `/health` in `timeout_s`."""
    port = free_port()
    cmd = [sys.executable, "-m", "appo_trl.cli", "serve-search", "--corpus", corpus, "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=_die_with_parent)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"appo serve-search exited with code {proc.returncode} (log: {log_path})")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"appo serve-search did not answer /health within {timeout_s:g} s (log: {log_path})"
                )
            time.sleep(0.2)
        yield SearchServer(base + "/retrieve", proc.pid, port)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _die_with_parent() -> None:
    """In the server child (Linux): get SIGTERM when the parent process dies, even by SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
