"""`ServerClient`: one vLLM server's endpoints besides sampling (blocking `httpx`), and the package's errors.

Health (`GET /health`), the served model and its `max_model_len` (`GET /v1/models`), the resolved config
(`GET /server_info`), and the development endpoints the disk weight sync needs (`POST /collective_rpc`
`reload_weights`, `POST /reset_prefix_cache`; the server needs `VLLM_SERVER_DEV_MODE=1`), and the runtime LoRA
endpoints of the adapter-only sync (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`). Every other part of
`appo_trl.vllm` asks a server through it. What it does not do: sample (`VLLMServerBackend`), or decide when to
sync (the weight sync does).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class VLLMServerError(RuntimeError):
    """The vLLM server could not serve a request (unreachable, timing out, or answering errors)."""


class VLLMRequestError(VLLMServerError):
    """The server rejected a request with a 4xx answer (not retried); `status` and the server's `message`."""

    def __init__(self, text: str, status: int, message: str):
        super().__init__(text)
        self.status, self.message = status, message


class VLLMServerRestarted(VLLMServerError):
    """The server refused connections and is back: a new process, whose weights must be synced before sampling."""


class VLLMAbortedError(VLLMServerError):
    """The server aborted a request (`finish_reason: "abort"`): paused, shutting down or preempted."""


class WeightSyncError(RuntimeError):
    """The vLLM server did not take the new weights (unreachable, not in dev mode, or answering an error)."""


class SyncDiskFullError(WeightSyncError):
    """The weight sync's folder is full: the weights (or the adapter) could not be written for the server."""


def raise_if_disk_full(exc: BaseException, folder: str, what: str) -> None:
    """`SyncDiskFullError`, one line, when `exc` (or its cause) is a full disk (ENOSPC / EDQUOT, or safetensors'
    `StorageFull`); the caller has removed its unfinished file already. Otherwise nothing."""
    import errno
    import shutil

    seen = exc
    while seen is not None:
        full = isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or "No space left on device" in str(seen) or "StorageFull" in str(seen):
            free = shutil.disk_usage(folder).free // 2**20 if os.path.isdir(folder) else 0
            raise SyncDiskFullError(
                f"writing {what} to {folder} for the vLLM server failed: No space left on device ({free} MiB free "
                "after removing the unfinished save); free some space there (vllm_weight_sync_dir), then resume "
                "with --resume_from_checkpoint true"
            ) from exc
        seen = seen.__cause__ or seen.__context__


class ServerMismatchError(WeightSyncError, ValueError):
    """At start-up: the model or the settings do not fit the vLLM server (a tied `lm_head` on vLLM-CPU, a
    `vllm_max_model_length` other than the server's); a stage prints it as one line."""


class ServerNotReadyError(WeightSyncError):
    """At start-up a vLLM server did not answer `GET /health` within `vllm_server_timeout`, or is not vLLM."""


def server_message(resp: httpx.Response) -> str:
    """The error message of a vLLM answer (`{"error": {"message": ...}}`, `{"message": ...}` or `{"detail": ...}`)."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:1000]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])
    return resp.text[:1000]


class ServerClient:
    """One vLLM server, blocking: health, served model and length, server info, weight reload, prefix-cache reset.

    Args:
        base_url: the server's root, e.g. `"http://127.0.0.1:8000"`.
        timeout_s: read timeout of every call (a `reload_weights` of a large model must fit).
        connect_timeout_s: connection timeout.
        max_retries: retries of `GET /v1/models` after the first attempt (`resolve_max_model_len`).
        backoff_s: first retry delay, doubled each retry.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, *, connect_timeout_s: float = 10.0,
                 max_retries: int = 3, backoff_s: float = 0.5):  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.max_retries, self.backoff_s = max_retries, backoff_s

    # ---- health
    def probe(self, timeout_s: float = 5.0) -> str | None:
        """None when `GET /health` answers 200, else the reason (no retries)."""
        try:
            resp = httpx.get(f"{self.base_url}/health", timeout=timeout_s)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if resp.status_code == 200 else f"/health answered HTTP {resp.status_code}"

    def wait_healthy(self, timeout_s: float, interval_s: float = 2.0) -> None:
        """Poll `GET /health` until it answers 200, or raise `WeightSyncError` after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.probe() is not None:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f} s")
            time.sleep(interval_s)

    # ---- the served model
    def resolve_max_model_len(self, configured: int | None, model: str | None = None) -> tuple[str, int]:
        """`(model, max_model_len)` served (`GET /v1/models`; `model` None: the first listed), checked against
        `configured` when given.

        Raises `ValueError` naming both numbers when they differ, and `VLLMServerError` when the server is
        unreachable, does not report the length or serves another model.
        """
        url = f"{self.base_url}/v1/models"
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = httpx.get(url, timeout=self.timeout)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code != 200:
                raise VLLMServerError(f"vLLM server {url} answered HTTP {resp.status_code}: {server_message(resp)}")
            break
        else:
            raise VLLMServerError(f"vLLM server at {url} is unreachable ({last}). Is `vllm serve` running there?")
        models = resp.json().get("data") or []
        if not models:
            raise VLLMServerError(f"vLLM server {url} serves no model")
        model = models[0]["id"] if model is None else model
        entry = next((m for m in models if m.get("id") == model), None)
        if entry is None:
            served = ", ".join(str(m.get("id")) for m in models)
            raise VLLMServerError(f"vLLM server {self.base_url} does not serve model {model!r} (it serves {served})")
        served_len = entry.get("max_model_len")
        if served_len is None:
            if configured is None:
                raise VLLMServerError(f"vLLM server {url} does not report max_model_len; set vllm_max_model_length")
            return model, int(configured)
        if configured is not None and int(configured) != int(served_len):
            raise ServerMismatchError(
                f"vllm_max_model_length={configured} but the vLLM server at {self.base_url} serves "
                f"max_model_len={served_len}: set them equal (or leave vllm_max_model_length unset to use the server's)."
            )
        return model, int(served_len)

    # ---- the development endpoints (the disk weight sync)
    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            resp = httpx.request(method, url, timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"vLLM server {url} unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404:
            raise WeightSyncError(
                f"vLLM server {url} answered 404: the development endpoints are off. "
                "Start the server with VLLM_SERVER_DEV_MODE=1 in its environment."
            )
        if resp.status_code != 200:
            raise WeightSyncError(f"vLLM server {url} answered HTTP {resp.status_code}: {resp.text[:500]}")
        return resp

    def call_waiting(self, wait_s: float, method: str, path: str, **kwargs) -> httpx.Response:
        """`_call`; a server that is unreachable is waited for (`GET /health`, up to `wait_s`), then called again."""
        try:
            return self._call(method, path, **kwargs)
        except WeightSyncError as exc:
            if wait_s <= 0 or not isinstance(exc.__cause__, httpx.TransportError):
                raise
            logger.warning("vLLM server %s unreachable during the weight sync; waiting up to %g s for it to come "
                           "back (vllm_server_wait_s)", self.base_url, wait_s)  # fmt: skip
            self.wait_healthy(wait_s, interval_s=min(2.0, wait_s / 10))
            return self._call(method, path, **kwargs)

    def get_server_info(self) -> dict[str, Any]:
        """The server's resolved `VllmConfig` as JSON (as TRL's `VLLMClient.get_server_info`, which TRL calls)."""
        return self._call("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]

    def device(self) -> str | None:
        """`device_config.device` of the server ("cpu", "cuda", ...)."""
        return (self.get_server_info().get("device_config") or {}).get("device")

    def reload_weights(self, weights_path: str, wait_s: float = 0.0) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        self.call_waiting(wait_s, "POST", "/collective_rpc", json=body)

    def load_lora_adapter(self, name: str, path: str, wait_s: float = 0.0, *, inplace: bool = False) -> None:
        """`POST /v1/load_lora_adapter`: serve the adapter folder `path` as model `name` (the server needs
        `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); an unreachable server is waited for `wait_s`.
        `inplace`: `name` is loaded already and its weights are replaced (`load_inplace`), also under the requests
        that name it and run now (an in-flight update)."""
        body = {"lora_name": name, "lora_path": path, **({"load_inplace": True} if inplace else {})}
        try:
            self.call_waiting(wait_s, "POST", "/v1/load_lora_adapter", json=body)
        except WeightSyncError as exc:
            if "answered 404" in str(exc):
                raise WeightSyncError(
                    f"vLLM server {self.base_url} has no /v1/load_lora_adapter: start it with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (and --enable-lora)"
                ) from exc
            raise

    def unload_lora_adapter(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter` (an adapter the server no longer holds, e.g. after a restart, is fine)."""
        try:
            self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        except WeightSyncError as exc:
            if "answered 404" not in str(exc):  # 404: not loaded there (or the endpoint is off: nothing to unload)
                raise

    def reset_prefix_cache(self, attempts: int = 20, interval_s: float = 0.25) -> None:
        """`POST /reset_prefix_cache` until it reports success (it fails while blocks are still held)."""
        for _ in range(attempts):
            if self._call("POST", "/reset_prefix_cache").json().get("success", True):
                return
            time.sleep(interval_s)
        raise WeightSyncError(f"vLLM server {self.base_url} did not reset its prefix cache after {attempts} tries")


__all__ = ["ServerClient", "VLLMAbortedError", "VLLMRequestError", "VLLMServerError", "VLLMServerRestarted",
           "WeightSyncError", "server_message"]  # fmt: skip
