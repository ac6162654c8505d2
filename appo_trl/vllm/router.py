"""vLLM's router (`vllm-router`, the `appo-trl[router]` extra) in front of several vLLM replicas.

`VLLMRouter` starts `vllm-router --worker-urls ... --policy consistent_hash` on a free local port, waits until it
lists every replica, and stops it (`stop()`, at exit, or, on Linux, when the thread that started it dies:
`PR_SET_PDEATHSIG`). `RouterClient` is the admin API appo uses (`list_workers`, `add_worker`, `remove_worker`) and
tells a router from a plain vLLM server (`is_router`). Why `consistent_hash`: docs/architecture.md ("vLLM"). It does
not watch replicas, resend requests or sync weights (`appo_trl.vllm.replicas`, `appo_trl.vllm.weight_sync`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx

POLICIES = ("consistent_hash", "round_robin", "cache_aware", "power_of_two", "random")


class RouterError(RuntimeError):
    """vLLM's router is missing, did not start, or refused an admin call."""


def router_executable() -> str:
    """The `vllm-router` launcher of this environment, or one clear `RouterError` line when it is missing."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    path = here if os.access(here, os.X_OK) else shutil.which("vllm-router")
    if path is None:
        raise RouterError(
            "vllm_server_base_url lists several vLLM replicas, so appo starts vLLM's router in front of them, "
            "but `vllm-router` is not installed: `pip install 'appo-trl[router]'` (or run a router yourself "
            "and give its one URL)."
        )
    return path


def _die_with_parent(parent: int) -> None:
    """In the child, before `exec` (Linux): SIGTERM when the thread that started it exits, e.g. a SIGKILLed trainer."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RouterClient:
    """The admin endpoints of a running `vllm-router` (blocking `httpx`)."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout_s

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            resp = httpx.request(method, f"{self.url}{path}", timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise RouterError(f"vLLM router {self.url}{path} unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise RouterError(f"vLLM router {self.url}{path} answered HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    def list_workers(self) -> list[str]:
        return [u.rstrip("/") for u in self._call("GET", "/list_workers").json().get("urls", [])]

    def add_worker(self, url: str) -> None:
        self._call("POST", "/add_worker", params={"url": url})

    def remove_worker(self, url: str) -> None:
        self._call("POST", "/remove_worker", params={"url": url})

    def is_router(self) -> bool:
        """True when `url` answers `GET /list_workers` with a worker list (a vLLM server answers 404)."""
        try:
            resp = httpx.get(f"{self.url}/list_workers", timeout=self.timeout)
            return resp.status_code == 200 and isinstance(resp.json().get("urls"), list)
        except (httpx.HTTPError, ValueError, AttributeError):
            return False


class VLLMRouter:
    """A `vllm-router` process in front of `replica_urls` (use as a context manager, or `start()`/`stop()`).

    Args:
        replica_urls: the vLLM servers (`http://host:port`), all serving the same model.
        policy: the router's `--policy` (docs/architecture.md, "vLLM", tells why `consistent_hash`).
        host: the address the router listens on.
        port: its port (None: a free one).
        request_timeout_s: the router's `--request-timeout-secs` (a long generation must fit).
        startup_timeout_s: how long the router waits for every replica's `/health` at start.
        log_path: the router's stdout/stderr (default: a temporary file, named in errors).
    """

    def __init__(self, replica_urls: list[str], *, policy: str = "consistent_hash", host: str = "127.0.0.1",
                 port: int | None = None, request_timeout_s: float = 600.0, startup_timeout_s: float = 240.0,
                 log_path: str | None = None):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        if not replica_urls:
            raise ValueError("the router needs at least one replica URL")
        self.replica_urls = [u.rstrip("/") for u in replica_urls]
        self.policy, self.host, self.port = policy, host, port
        self.request_timeout_s, self.startup_timeout_s = request_timeout_s, startup_timeout_s
        self.log_path = log_path
        self._own_log = log_path is None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            router_executable(), "--host", self.host, "--port", str(self.port), "--policy", self.policy,
            "--worker-urls", *self.replica_urls,
            "--request-timeout-secs", str(int(self.request_timeout_s)),
            "--worker-startup-timeout-secs", str(int(self.startup_timeout_s)),
            "--health-check-interval-secs", "2", "--log-level", "warning",
            # its Prometheus exporter has a fixed default port: two routers on one host would collide
            "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
        ]  # fmt: skip

    def start(self) -> VLLMRouter:
        if self.port is None:
            self.port = free_port(self.host)
        cmd = self.command()
        if self.log_path is None:
            from appo_trl.tools.scratch import scratch_path

            self.log_path = scratch_path("vllm-router", suffix=".log")  # a killed run's: removed at the next start
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=functools.partial(_die_with_parent, os.getpid())
                                         if sys.platform.startswith("linux") else None)  # fmt: skip
        atexit.register(self.stop)
        client = RouterClient(self.url, timeout_s=2.0)
        deadline = time.monotonic() + self.startup_timeout_s + 30
        while True:
            if self.proc.poll() is not None:
                raise RouterError(f"vllm-router exited with code {self.proc.returncode} at start ({self._tail()})")
            try:
                if set(client.list_workers()) >= set(self.replica_urls):
                    return self
            except RouterError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RouterError(
                    f"vllm-router on {self.url} did not list the replicas {self.replica_urls} after "
                    f"{self.startup_timeout_s + 30:.0f} s: are they running and healthy? ({self._tail()})"
                )
            time.sleep(0.2)

    def _tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
            return f"log {self.log_path}: " + " | ".join(lines[-3:])
        except OSError:
            return f"log {self.log_path}"

    def stop(self) -> None:
        """Stop the router (terminate, then kill after 10 s); remove the log file appo created for it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc is not None and self._own_log and self.log_path:
            with contextlib.suppress(OSError):
                os.remove(self.log_path)

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["POLICIES", "RouterClient", "RouterError", "VLLMRouter", "free_port", "router_executable"]
