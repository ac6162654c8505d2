"""`ReplicatedNCCLSync`: TRL's NCCL weight transfer to several vLLM replicas, one `VLLMClient` and group each.

Each replica that is up gets the weights in turn (its NCCL group on `vllm_group_port + i`), then a prefix-cache
reset; one that is down is skipped and out of the router; one that comes back gets a new client and group (the old
group released first), the weights and the reset, then rejoins. A replica that answers but fails stops the run
with its URL. Several ranks: docs/architecture.md ("vLLM"). It does not choose the route (`weight_sync`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trl.generation.vllm_generation as trl_vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

from appo_trl.vllm.client import VLLMServerError, WeightSyncError
from appo_trl.vllm.ranks import broadcast_from_main, several_processes, share_replica_view
from appo_trl.vllm.replicas import ReplicaSet
from appo_trl.vllm.router import RouterError

logger = logging.getLogger(__name__)


class ReplicatedNCCLSync(VLLMGeneration):
    """TRL's NCCL route to several replicas: one `VLLMClient` (and NCCL group) per replica, synced in turn.

    Replicas that are down are skipped; one that comes back gets a new client and NCCL group, the weights and a
    prefix-cache reset, then rejoins the router (see the module docstring). Every rank walks the parameters once
    per replica synced (ZeRO-3 / FSDP gathers are collectives), so the main process broadcasts that list first.

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
        per replica synced; the replicas' view is shared at the end (docs/architecture.md, "vLLM")."""
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
        ups, backs = broadcast_from_main(plan)
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
        if several_processes():
            share_replica_view(self.replicas, main, error)
        elif error is not None:
            raise error
        self.num_syncs += 1


__all__ = ["ReplicatedNCCLSync"]
