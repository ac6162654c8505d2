"""`ServerSpec`: the vLLM servers a run samples from, resolved once at start-up and passed explicitly.

`resolve_servers(args)` reads `vllm_server_base_url` (one URL, several replicas, or a router the user runs; else
`http://host:port`), starts vLLM's router in front of several replicas (the main process only; the other ranks
follow it: `prepare_replicas`), waits for every server's health and reads the served `max_model_len`.
`ServerSpec.backend` builds the sampler on it. It does not sync weights (`appo_trl.vllm.weight_sync`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from appo_trl.vllm.client import ServerClient, ServerNotReadyError, WeightSyncError
from appo_trl.vllm.ranks import broadcast_from_main, is_main_process, several_processes
from appo_trl.vllm.replicas import ReplicaBackend, ReplicaSet, parse_server_urls
from appo_trl.vllm.router import RouterClient, VLLMRouter
from appo_trl.vllm.server import VLLMServerBackend

logger = logging.getLogger(__name__)


def wait_for_server(url: str, timeout_s: float, interval_s: float = 2.0) -> None:
    """Wait at start-up for `GET {url}/health` to answer 200: one line when the first probe fails, then
    `ServerNotReadyError` after `timeout_s` (TRL's `vllm_server_timeout`), or at once when the port answers
    404 (an HTTP server that is not vLLM)."""
    client, deadline, said = ServerClient(url), time.monotonic() + timeout_s, False
    hint = f"vllm_server_timeout={timeout_s:g} s; change it with --vllm_server_timeout SECONDS"
    while (reason := client.probe()) is not None:
        if reason.endswith("HTTP 404"):
            raise ServerNotReadyError(f"{url} is not a vLLM server (GET /health answered HTTP 404); "
                                      f"point --vllm_server_base_url at `vllm serve` (or `trl vllm-serve`)")  # fmt: skip
        if time.monotonic() > deadline:
            raise ServerNotReadyError(f"vLLM server at {url} not healthy after {timeout_s:g} s ({reason}). Is "
                                      f"`vllm serve` running there? The wait is {hint}")  # fmt: skip
        if not said:
            logger.warning("waiting for the vLLM server at %s (%s); giving up after %s", url, reason, hint)
            said = True
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())) or 0.05)


def server_urls(args) -> list[str]:
    """The vLLM servers a config names: `vllm_server_base_url` (one URL or several), else TRL's
    `http://{vllm_server_host}:{vllm_server_port}`."""
    return parse_server_urls(args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}")


@dataclasses.dataclass
class ServerSpec:
    """The vLLM servers of one run.

    Args:
        urls: the vLLM servers: one, or the replicas behind the router.
        replicas: the `ReplicaSet` behind the router (several replicas, or a router the user runs); None for one
            server.
        max_model_len: the length every server serves (or `vllm_max_model_length` when none reports it).
        weight_sync: the weight-sync route, `"disk"`, `"nccl"` or `"adapter"`, once TRL has built the weight sync.
        adapters: with the adapter-only sync, the `AdapterVersions` whose version each request names.
    """

    urls: list[str]
    replicas: ReplicaSet | None = None
    max_model_len: int | None = None
    weight_sync: str | None = None
    adapters: Any = None

    @property
    def router_url(self) -> str | None:
        return None if self.replicas is None else self.replicas.router_url

    @property
    def url(self) -> str:
        """Where the sampler's requests go: the router, or the one server."""
        return self.router_url or self.urls[0]

    def backend(self, **kwargs) -> VLLMServerBackend | ReplicaBackend:
        """The sampler: `VLLMServerBackend(self.url, **kwargs)`, resending through `ReplicaBackend` with replicas."""
        backend = VLLMServerBackend(self.url, adapters=self.adapters, **kwargs)
        return backend if self.replicas is None else ReplicaBackend(backend, self.replicas)

    def close(self) -> None:
        """Stop the replica monitor, and the router when appo started it."""
        if self.replicas is not None:
            self.replicas.close()


def resolve_servers(args) -> ServerSpec:
    """The `ServerSpec` of `args` (on every rank): replicas set up, every server healthy within
    `vllm_server_timeout`, the served `max_model_len` checked against `vllm_max_model_length` (every replica must
    serve the same)."""
    urls = server_urls(args)
    replicas = prepare_replicas(args, urls)
    servers = list(replicas.urls) if replicas is not None else urls
    max_model_len = args.vllm_max_model_length
    for url in servers:
        wait_for_server(url, args.vllm_server_timeout)
        _, max_model_len = ServerClient(url).resolve_max_model_len(max_model_len)
    return ServerSpec(servers, replicas, max_model_len)


def prepare_replicas(args, urls: list[str] | None = None) -> ReplicaSet | None:
    """The `ReplicaSet` for several replicas (appo starts the router) or a router the user runs; else None.

    On the main process: with several URLs, waits for each replica's health, starts `vllm-router` in front of
    them; with one URL that answers the router's `GET /list_workers`, its workers are the replicas. The set owns
    the router's worker list and its monitor thread starts here. The other training processes receive the
    router's URL and the replicas (a broadcast) and build a follower set on that router: no router, no monitor,
    no change to the worker list. `urls`: `server_urls(args)` (default: read here).
    """
    main = is_main_process(args)
    found, error, router = None, None, None  # found: (router URL, replica URLs) or None (one vLLM server)
    if main:
        try:
            urls = urls if urls is not None else server_urls(args)
            for url in urls:
                wait_for_server(url, args.vllm_server_timeout)
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
            if not several_processes():
                raise
            error = exc  # raised after the other ranks have it
    message, found = broadcast_from_main((None if error is None else f"{type(error).__name__}: {error}", found))
    if error is not None:
        raise error
    if message is not None:
        raise WeightSyncError(f"the main process could not set up the vLLM replicas: {message}")
    if found is None:
        return None  # one vLLM server
    router_url, urls = found
    replicas = ReplicaSet(router_url, urls, owner=main)
    replicas.router_process = router  # appo's router (main process): stopped at exit, with the set or its parent
    return replicas.start_monitor() if main else replicas


__all__ = ["ServerSpec", "prepare_replicas", "resolve_servers", "server_urls", "wait_for_server"]
