"""Adapter-only weight sync: the policy's LoRA adapter, not the merged weights, goes to vLLM once per round.

A server started with `--enable-lora --max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` loads an
adapter folder at run time (`POST /v1/load_lora_adapter`) and serves it as a model name. `AdapterVersions` saves
the adapter (safetensors + `adapter_config.json`, TRL's `save_lora_adapter`), loads it on every server under a new
name per policy version, names the version a round started with in that round's requests (`request_model`) and
unloads a version once it is superseded and no round holds it; under streaming (`in_place`) every version is loaded
in place under one name, which the running requests keep (docs/streaming.md). `choose_adapter_sync` decides, from each server's
`/server_info` (`lora_config` is None without `--enable-lora`) and the adapter, whether the run syncs adapters or
falls back to the merged weights (`vllm_sync_adapter`: `auto` says so in one line, `always` stops). It does not
sample or pick the round to sync in (`appo_trl.vllm.weight_sync`, `appo_trl.trainer.weight_sync`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import uuid
import warnings
from collections import Counter

from appo_trl.vllm.client import WeightSyncError, raise_if_disk_full

ADAPTER_SYNC = ("auto", "always", "never")
logger = logging.getLogger(__name__)


class AdapterSyncError(WeightSyncError):
    """At start-up: `vllm_sync_adapter` cannot be honoured (`always` and no adapter route, or a server whose
    `--max-lora-rank` is below the adapter's rank). `appo train` prints it as one line."""


def _trl_lora_tools():
    """TRL 1.16's adapter checks and saver (`trl.experimental.async_grpo`: unstable API, pinned here only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning at import
        from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter, validate_lora_for_vllm_sync
    return save_lora_adapter, validate_lora_for_vllm_sync


def is_peft(model) -> bool:
    from accelerate.utils import is_peft_model

    return is_peft_model(model)


def adapter_problem(model, server_infos: dict[str, dict]) -> str | None:
    """Why the adapter of `model` cannot be served by the servers (`url -> /server_info`'s `vllm_config`), or None.

    Raises `AdapterSyncError` (one line) for a server that has LoRA on but a `--max-lora-rank` below the adapter's
    rank: a misconfigured launch, never silently worked around."""
    if not is_peft(model):
        return "the model has no PEFT adapter (use_peft: false)"
    _, validate = _trl_lora_tools()
    try:
        config = validate(model)
    except ValueError as exc:
        return str(exc).splitlines()[0]
    rank = max([config.r, *config.rank_pattern.values()])
    for url, info in server_infos.items():
        if info.get("error"):
            return f"the vLLM server at {url} did not report its config ({info['error']})"
        lora = info.get("lora_config")
        if lora is None:
            return (f"the vLLM server at {url} was started without LoRA (add `--enable-lora --max-lora-rank "
                    f"{rank}` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True to its environment)")  # fmt: skip
        if int(lora.get("max_lora_rank") or 0) < rank:
            raise AdapterSyncError(
                f"the adapter has rank {rank} but the vLLM server at {url} was started with --max-lora-rank "
                f"{lora.get('max_lora_rank')}: restart it with --max-lora-rank {rank} or more (vLLM accepts 8, 16, "
                "32, 64, ...)"
            )
        if int((info.get("parallel_config") or {}).get("data_parallel_size") or 1) > 1:
            return f"the vLLM server at {url} runs --data-parallel-size > 1, where a loaded adapter reaches one rank"
    return None


def server_infos(urls) -> dict[str, dict]:
    """`url -> /server_info` of each server, or `{"error": ...}` where it does not answer (no dev mode)."""
    from appo_trl.vllm.client import ServerClient

    infos = {}
    for url in urls:
        try:
            infos[url] = ServerClient(url).get_server_info()
        except WeightSyncError as exc:
            infos[url] = {"error": str(exc).splitlines()[0]}
    return infos


def choose_adapter_sync(setting: str, model, server_infos: dict[str, dict]) -> bool:
    """True when each sync sends the adapter only. `never`: False. `auto`: True when `adapter_problem` finds
    none, else one warning line and False (merged weights). `always`: True, or `AdapterSyncError` naming the
    problem."""
    if setting not in ADAPTER_SYNC:
        raise ValueError(f"vllm_sync_adapter must be one of {ADAPTER_SYNC}, got {setting!r}")
    if setting == "never":
        return False
    problem = adapter_problem(model, server_infos)
    if problem is None:
        return True
    if setting == "always":
        raise AdapterSyncError(f"vllm_sync_adapter=always cannot send the adapter only: {problem}.")
    if is_peft(model):
        logger.warning("vllm_sync_adapter=auto: syncing the merged full weights, as %s.", problem)
    return False


class AdapterVersions:
    """The policy's adapter on the vLLM servers: one name per version, held by rounds, unloaded when unused.

    `publish` (main process) saves the adapter to `sync_dir/<name>` and loads it on every server in `clients`; the
    new name becomes `current`. A round holds the name it starts with (`hold`); its requests name it
    (`request_model`), whatever is published meanwhile. A version that is neither current nor held is unloaded
    (`/v1/unload_lora_adapter`) on every server; its files are removed one publish later (vLLM reads the folder
    lazily). Names carry a run token, so a server that outlived an earlier run never serves its adapters.

    `in_place` (streaming's in-flight updates; set before the first publish under it): each version is still saved
    to a folder of its own, but loaded under one name, `live_name`, with `load_inplace` (vLLM replaces the weights
    of a loaded name and keeps its LoRA id; a name not loaded yet is loaded), so a request running across an update
    keeps naming a loaded adapter and continues under the new weights. Once a version is published every request
    names `live_name`; versions loaded under their own names before are unloaded at the next publish, and a
    superseded version's folder is removed one publish later.

    Args:
        clients: `url -> ServerClient` of every server (each replica behind a router).
        sync_dir: folder the servers read the adapters from (the same filesystem).
        prefix: the adapter names' prefix; the names are `{prefix}-{run token}-v{version}`.
        wait_s: how long a server found unreachable at a load is waited for (`GET /health`) before it fails.
    """

    def __init__(self, clients: dict, sync_dir: str, prefix: str = "appo-lora", wait_s: float = 0.0):
        self.clients, self.sync_dir, self.wait_s = dict(clients), sync_dir, wait_s
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.version = 0
        self.current: str | None = None
        self.loaded: list[str] = []  # on the servers, oldest first
        self._held: Counter[str] = Counter()
        self._serving: str | None = None  # the name the round in flight holds
        self._stale_dirs: list[str] = []
        self._lock = threading.Lock()
        self.bytes_last = 0
        self.in_place = False
        self._retired: list[str] = []  # in_place: superseded versions, whose folders go at the publish after next

    @property
    def live_name(self) -> str:
        """The one name every version is loaded under when `in_place`."""
        return f"{self.prefix}-live"

    def name_for(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    # ---- main process: save, load, unload
    def save(self, model, accelerator, name: str) -> str:
        """Save the active adapter to `sync_dir/name` (every rank: gathers are collectives); its folder."""
        save_lora_adapter, _ = _trl_lora_tools()
        folder = os.path.join(self.sync_dir, name)
        try:
            save_lora_adapter(model, accelerator, model.active_adapters[0], folder)
        except BaseException as exc:  # Ctrl-C too: TRL's staging folder (`.<name>.tmp`) never stays behind
            if accelerator.is_main_process:
                shutil.rmtree(os.path.join(self.sync_dir, f".{name}.tmp"), ignore_errors=True)
                raise_if_disk_full(exc, self.sync_dir, f"the LoRA adapter {name}")
            raise
        if accelerator.is_main_process:
            self.bytes_last = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        return folder

    def load_on(self, url: str, name: str | None = None) -> None:
        """Load `name` (default: the current version) on the server at `url`."""
        name = name or self.current
        path = os.path.join(self.sync_dir, name)
        if self.in_place:
            self.clients[url].load_lora_adapter(self.live_name, path, wait_s=self.wait_s, inplace=True)
        else:
            self.clients[url].load_lora_adapter(name, path, wait_s=self.wait_s)

    def publish(self, name: str, urls) -> None:
        """Load `name` (saved by `save`) on the servers at `urls`, then `promote` it."""
        for url in urls:
            self.load_on(url, name)
        self.promote(name, urls)

    def promote(self, name: str, urls) -> None:
        """`name`, loaded on the servers at `urls`, is current; unload there what no round holds (`collect`)."""
        with self._lock:
            previous, self.current = self.current, name
            if not self.in_place:
                self.loaded.append(name)
            elif previous is not None and previous not in self.loaded:
                self._retired.append(previous)
        self.collect(urls)

    def collect(self, urls) -> None:
        """Unload every loaded version that is neither current nor held; remove the folders of the ones unloaded
        at the previous call."""
        with self._lock:
            drop = [n for n in self.loaded if n != self.current and not self._held[n]]
            self.loaded = [n for n in self.loaded if n not in drop]
            old, self._stale_dirs, self._retired = self._stale_dirs, drop + self._retired, []
        for name in drop:
            for url in urls:
                self.clients[url].unload_lora_adapter(name)
        for name in old:
            shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)

    def adopt(self, name: str) -> None:
        """Another rank's `publish`: `name` is current (this rank's requests name it)."""
        with self._lock:
            self.current = name

    # ---- every rank: which adapter a request names
    @contextlib.contextmanager
    def hold(self):
        """Within: the round in flight holds the current version; its requests name it (`request_model`)."""
        with self._lock:
            name = self.current
            if name is not None:
                self._held[name] += 1
            previous, self._serving = self._serving, name
        try:
            yield name
        finally:
            with self._lock:
                if name is not None:
                    self._held[name] -= 1
                self._serving = previous

    def request_model(self) -> str | None:
        """The adapter a request names now: the one the round in flight holds, else the current one (None: none
        published yet, the base model)."""
        with self._lock:
            if self.in_place:
                return self.live_name if self.current is not None else None
            return self._serving or self.current


__all__ = [
    "ADAPTER_SYNC",
    "AdapterSyncError",
    "AdapterVersions",
    "adapter_problem",
    "choose_adapter_sync",
    "is_peft",
    "server_infos",
]
