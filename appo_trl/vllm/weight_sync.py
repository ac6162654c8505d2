"""Weight sync to vLLM: TRL's `VLLMGeneration` with a disk route (CPU), replicated NCCL, or colocate on vLLM-CPU.

TRL syncs a vLLM server over NCCL, which needs CUDA on both sides. `weight_sync_factory` is what TRL's
`GRPOTrainer.__init__` builds in its place: `DiskWeightSync` (safetensors + `reload_weights` + prefix-cache reset)
where the trainer or the server runs on CPU, `ReplicatedNCCLSync` for several replicas, else TRL's own class.
`ColocateWeightSync` is TRL's colocate engine, synced in process on vLLM-CPU. The whole story (routes, replicas,
several ranks, server restarts): docs/architecture.md ("vLLM"). It does not sample or pick the round to sync in.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from trl.generation.vllm_generation import VLLMGeneration

from appo_trl.vllm.client import ServerClient, ServerMismatchError, WeightSyncError, raise_if_disk_full
from appo_trl.vllm.lora import AdapterVersions, choose_adapter_sync, is_peft, server_infos
from appo_trl.vllm.nccl import ReplicatedNCCLSync
from appo_trl.vllm.ranks import broadcast_from_main, several_processes, share_replica_view
from appo_trl.vllm.replicas import ReplicaSet, parse_server_urls
from appo_trl.vllm.spec import ServerSpec

ROUTES = ("auto", "nccl", "disk")


def server_device(base_url: str, timeout_s: float = 240.0) -> str | None:
    """`device_config.device` of the server at `base_url` ("cpu", "cuda", ...), waiting for it to be healthy."""
    client = ServerClient(base_url)
    client.wait_healthy(timeout_s)
    return client.device()


def weight_sync_route(setting: str, trainer_device, probe_url: str, timeout_s: float = 240.0) -> str:
    """`"disk"` or `"nccl"` for `vllm_weight_sync=setting`: `auto` is disk when the trainer's device is CPU or the
    server at `probe_url` (a replica, never the router) reports a CPU device (`GET /server_info`), else nccl."""
    if setting not in ROUTES:
        raise ValueError(f"vllm_weight_sync must be one of {ROUTES}, got {setting!r}")
    if setting != "auto":
        return setting
    if str(getattr(trainer_device, "type", trainer_device)) == "cpu":
        return "disk"
    return "disk" if server_device(probe_url, timeout_s) == "cpu" else "nccl"


def weight_sync_factory(spec: ServerSpec, args, trl_generation):
    """What `GRPOTrainer.__init__` builds instead of `VLLMGeneration(**kwargs)` in server mode: the adapter-only
    sync when `vllm_sync_adapter` and the servers allow it (`appo_trl.vllm.lora`; `spec.adapters` then names the
    version each request asks for), else the route chosen from the accelerator's device (recorded as
    `spec.weight_sync`); `trl_generation` (TRL's class) on one server over NCCL."""

    def build(**kwargs):
        spec.weight_sync = weight_sync_route(args.vllm_weight_sync, kwargs["accelerator"].device, spec.urls[0],
                                             args.vllm_server_timeout)  # fmt: skip
        setting, model = args.vllm_sync_adapter, kwargs["model"]
        adapter = setting != "never" and (is_peft(model) or setting == "always")
        adapter = adapter and choose_adapter_sync(setting, model, server_infos(spec.urls))
        if adapter or spec.weight_sync == "disk":
            sync = DiskWeightSync(urls=spec.urls, sync_dir=args.vllm_weight_sync_dir, replicas=spec.replicas,
                                  server_wait_s=args.vllm_server_wait_s, adapter=adapter, **kwargs)  # fmt: skip
            spec.adapters = sync.adapters
            spec.weight_sync = "adapter" if adapter else spec.weight_sync
            return sync
        if spec.replicas is not None:
            return ReplicatedNCCLSync(replicas=spec.replicas, **kwargs)
        return trl_generation(**kwargs)

    return build


def refuse_tied_lm_head(model, who: str, instead: str) -> None:
    """vLLM-CPU's `reload_weights` keeps a stale packed copy of a tied `lm_head`, silently: refuse such a model."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    if getattr(config, "tie_word_embeddings", False):
        raise ServerMismatchError(
            "the model ties lm_head to the input embeddings, and vLLM-CPU's reload_weights keeps a stale "
            f"copy of a tied lm_head ({who} would silently sample from old weights). Use an untied "
            f"model (e.g. `appo tiny-model --tie_word_embeddings false`) or {instead}."
        )


@contextlib.contextmanager
def _trl_llm_takes(llm_kwargs: dict):
    """Seam `trl.generation.vllm_generation.LLM` (trl 1.16.0): TRL's colocate `_init_vllm` builds `LLM(...)` by this
    module-global name with no dtype; within, `llm_kwargs` are added to its call. (The trainer's other TRL seams are
    in `appo_trl.trainer.trl_seams`; this floor cannot import it.)"""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, **llm_kwargs)
    try:
        yield
    finally:
        vllm_generation.LLM = original


class DiskWeightSync(VLLMGeneration):
    """TRL's `VLLMGeneration` for server mode with the disk route instead of NCCL, or the adapter-only sync.

    Built by `GRPOTrainer.__init__` with `VLLMGeneration`'s arguments (in place of TRL's class, through
    `weight_sync_factory`); only `sync_weights` and `vllm_client.get_server_info` are used, as the rollout engine
    does the sampling. Once per round: every rank walks the parameters (TRL's `_iter_named_params`: gathers, merged
    adapters, vLLM names); the main process writes one `model.safetensors` (a temporary name, then renamed), posts
    `reload_weights` and resets the prefix cache (mandatory: cached prefixes hold the old weights' keys); a barrier.
    With `adapter`, every rank saves the PEFT adapter instead (`AdapterVersions`: only the main process writes),
    the main process loads it on every server under the next version's name, and every rank adopts that name.

    Args:
        urls: the servers (default: TRL's `server_base_url`); with `replicas`, theirs.
        sync_dir: folder the server reads (default: a temporary folder, removed at exit).
        replicas: the `ReplicaSet` behind a router: every replica is synced (docs/architecture.md, "vLLM").
        server_wait_s: how long a server found unreachable is waited for (`GET /health`) before the reload.
        reset_prefix_cache: reset it after the reload (default). An in-flight update inside a `keep` pause clears
            it (`appo_trl.trainer.inflight_sync`): the frozen requests hold blocks, so the reset would fail, and the
            sampler's per-version cache salt keeps every later request off the old weights' blocks.
        adapter: sync the LoRA adapter only (`appo_trl.vllm.lora`; the caller checked the servers take it).
        **kwargs: `VLLMGeneration`'s arguments (`mode` must be `"server"`).
    """

    def __init__(self, *args, urls: list[str] | None = None, sync_dir: str | None = None, replicas=None,
                 server_wait_s: float = 0.0, adapter: bool = False, **kwargs):  # fmt: skip
        self.adapter, self.adapters, self._pending_adapter = adapter, None, None
        self._urls = list(replicas.urls) if replicas is not None else list(urls or [])
        self._sync_dir_arg = sync_dir
        self.replicas = replicas
        self.server_wait_s = server_wait_s
        self.num_syncs = 0
        self.reset_prefix_cache = True
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        if self.mode != "server":
            raise ValueError("the disk weight sync is for vllm_mode=server")
        acc = self.accelerator
        urls = self._urls or parse_server_urls(self.server_base_url)[:1]
        if not urls:
            raise ValueError("DiskWeightSync needs the server: `urls`, `replicas` or TRL's `server_base_url`")
        self.clients = {url: ServerClient(url, timeout_s=max(self.server_timeout, 600.0)) for url in urls}
        self.vllm_client = self.clients[urls[0]]
        on_cpu = False
        for client in self.clients.values():
            # every rank asks (read-only), so every rank fails alike instead of waiting at the barrier below
            client.wait_healthy(self.server_timeout)
            info = client.get_server_info()  # 404 here = no dev mode: fail now, not at the first sync
            on_cpu = on_cpu or (info.get("device_config") or {}).get("device") == "cpu"
        if on_cpu:
            refuse_tied_lm_head(self.model, "the server", "a GPU server")
        if self._sync_dir_arg:
            os.makedirs(self._sync_dir_arg, exist_ok=True)
            self.sync_dir = os.path.abspath(self._sync_dir_arg)
        else:
            from appo_trl.tools.scratch import scratch_path

            # removed at exit; a killed run's (a full copy of the weights) at the next start
            self.sync_dir = scratch_path("vllm-weights", directory=True)
        if self.adapter:
            wait_s = self.server_wait_s if self.replicas is None else 0.0  # a replica found down leaves the router
            self.adapters = AdapterVersions(self.clients, self.sync_dir, wait_s=wait_s)
            self.adapters.prefix = broadcast_from_main(self.adapters.prefix)  # one name per version on every rank
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
        share = self.replicas is not None and several_processes()
        if self.adapter:
            return self._sync_adapter(share)
        tensors = dict(self._named_cpu_tensors(acc.is_main_process))
        error = None
        if acc.is_main_process:
            try:
                tmp = os.path.join(self.sync_dir, "model.safetensors.partial")
                try:
                    save_file(tensors, tmp, metadata={"format": "pt"})
                except BaseException as exc:  # a full disk (or Ctrl-C): no partial file stays behind
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
                    raise_if_disk_full(exc, self.sync_dir, "the weights")
                    raise
                os.replace(tmp, os.path.join(self.sync_dir, "model.safetensors"))
                if self.replicas is None:
                    self.vllm_client.reload_weights(self.sync_dir, wait_s=self.server_wait_s)
                    if self.reset_prefix_cache:
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

    def _sync_adapter(self, share: bool) -> None:
        """Save the adapter (every rank), load it everywhere and unload what no round holds (main process), adopt
        the new name (every rank)."""
        acc, adapters = self.accelerator, self.adapters
        name = adapters.name_for(self.num_syncs + 1)
        adapters.save(acc.unwrap_model(self.model), acc, name)
        error = None
        if acc.is_main_process:
            try:
                if self.replicas is None:
                    adapters.publish(name, self._urls or [self.vllm_client.base_url])
                else:
                    self._pending_adapter = name
                    self._sync_replicas()  # loaded on each replica by `_sync_one`
                    adapters.promote(name, self.replicas.up())
            except Exception as exc:
                if not share:
                    raise
                error = exc
        if share:
            share_replica_view(self.replicas, acc.is_main_process, error)
        else:
            acc.wait_for_everyone()
        adapters.adopt(name)
        self.num_syncs += 1

    def _sync_one(self, url: str) -> None:
        try:
            if self.adapter:  # the version being published (a rejoining replica: the current one)
                self.adapters.load_on(url, self._pending_adapter)
                return
            self.clients[url].reload_weights(self.sync_dir)
            if self.reset_prefix_cache:
                self.clients[url].reset_prefix_cache()
        except WeightSyncError as exc:
            raise WeightSyncError(
                f"vLLM replica {url} did not take the new weights ({exc}); the run stops rather than sample "
                "from a replica with old weights."
            ) from exc

    def _sync_replicas(self) -> None:
        """Every replica that is up, then every replica that came back (before it rejoins the router)."""
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
        if self.mode != "colocate":
            raise ValueError("ColocateWeightSync is for vllm_mode=colocate")
        with _trl_llm_takes(self._llm_kwargs):
            super()._init_vllm()
        self.num_syncs = 0
        self.on_cpu = self.llm.llm_engine.vllm_config.device_config.device_type == "cpu"
        if self.on_cpu:
            refuse_tied_lm_head(self.model, "the engine", "a GPU")

    def sync_weights(self):
        if not self.on_cpu:
            super().sync_weights()
        else:
            weights = [(name, p.detach().to("cpu", copy=True).contiguous()) for name, p in self._iter_named_params()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()
        self.num_syncs += 1


__all__ = ["ROUTES", "ColocateWeightSync", "DiskWeightSync", "ReplicatedNCCLSync", "WeightSyncError",
           "refuse_tied_lm_head", "server_device", "weight_sync_factory", "weight_sync_route"]  # fmt: skip
