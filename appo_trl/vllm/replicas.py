"""Several vLLM replicas behind one router: who is in, who is out, and requests that outlive a replica.

`parse_server_urls` reads `vllm_server_base_url` (one URL or several). `ReplicaSet` watches the replicas behind one
`vllm-router` (a monitor thread polls `/health`); a replica found down leaves the router (checked, or the set fails
with `ReplicaRemovalError`: it must never serve old weights) and rejoins only after a weight sync gave it the current
weights (`rejoin`). Only the *owner* set (the main training process) changes the router's worker list; *followers*
adopt its view at every sync. `ReplicaBackend` resends a request whole when a replica died under it. The rules in
full: docs/architecture.md ("vLLM"). It does not route, start servers or sync weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from appo_trl.sampling import SamplingParams, Segment
from appo_trl.vllm.client import ServerClient, VLLMRequestError, VLLMServerError
from appo_trl.vllm.router import RouterClient, RouterError
from appo_trl.vllm.server import VLLMServerBackend

logger = logging.getLogger(__name__)


class ReplicasDownError(VLLMServerError):
    """Every vLLM replica behind the router is down."""


class ReplicaRemovalError(VLLMServerError):
    """The router kept a dead replica in its worker list: it could serve stale weights when it restarts."""


def parse_server_urls(value: Any) -> list[str]:
    """`vllm_server_base_url` as a list of URLs (one or more), each `http(s)://host:port` without a trailing /."""
    if value is None:
        return []
    parts = value.replace(",", " ").split() if isinstance(value, str) else [str(v).strip() for v in value]
    urls = [p.rstrip("/") for p in parts if p]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_base_url: {url!r} is not an http(s):// URL")
    if len(set(urls)) != len(urls):
        raise ValueError(f"vllm_server_base_url lists a replica twice: {urls}")
    return urls


class ReplicaSet:
    """The replicas behind one router, their health, and membership in the router (see the module docstring).

    Args:
        router_url: the router the backend talks to.
        replica_urls: the vLLM servers behind it.
        health_interval_s: seconds between two `/health` polls of every replica.
        failures_to_down: failed polls in a row that make a replica down.
        auto_rejoin: the monitor adds a replica back as soon as it is healthy, without a weight sync. Only
            right when the weights never change (evaluation, benchmarks); training leaves it False.
        owner: this set changes the router's worker list (removes a dead replica, adds one back). False: a
            follower that shares another process's router (see the module docstring).
    """

    def __init__(self, router_url: str, replica_urls: list[str], *, health_interval_s: float = 1.0,
                 failures_to_down: int = 2, auto_rejoin: bool = False, owner: bool = True):  # fmt: skip
        self.router_url = router_url.rstrip("/")
        self.owner = owner
        self.urls = [u.rstrip("/") for u in replica_urls]
        self.router = RouterClient(self.router_url)
        self.health_interval_s, self.failures_to_down = health_interval_s, failures_to_down
        self.auto_rejoin = auto_rejoin
        self._lock = threading.Lock()
        self._failures = dict.fromkeys(self.urls, 0)
        self._leaving: set[str] = set()  # being removed from the router
        self.down_since: dict[str, float] = {}  # url -> time.monotonic() it was found down
        self.last_error: dict[str, str] = {}
        self.dead_time_s = dict.fromkeys(self.urls, 0.0)
        self.num_down_events = 0
        self.num_rejoins = 0
        self.num_resent = 0
        self.failure: ReplicaRemovalError | None = None  # set once: every later request and sync raises it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.router_process = None  # the `VLLMRouter` appo started, stopped by `close`

    # ---- state
    def up(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u not in self.down_since]

    def down(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u in self.down_since]

    def describe_down(self) -> str:
        now = time.monotonic()
        with self._lock:
            return ", ".join(
                f"{u} (down {now - t:.1f} s: {self.last_error.get(u, '?')})" for u, t in self.down_since.items()
            )

    # ---- health
    @staticmethod
    def probe(url: str, timeout_s: float = 5.0) -> str | None:
        """None when `GET url/health` answers 200, else the reason."""
        return ServerClient(url).probe(timeout_s)

    def check(self) -> None:
        """Poll every replica that is up once; mark down those that failed `failures_to_down` times in a row."""
        for url in self.up():
            error = self.probe(url)
            if error is None:
                self._failures[url] = 0
                continue
            self._failures[url] += 1
            if self._failures[url] >= self.failures_to_down:
                self.mark_down(url, error)

    def mark_down(self, url: str, error: str) -> None:
        """Take `url` out of the router; then it is down, until `rejoin` (after a weight sync).

        The owner removes it from the router first; when the router keeps it, the replica is not marked down,
        the set fails and `ReplicaRemovalError` (naming the URL) is raised, here and on every later request and
        sync. A follower only marks it down in its own view."""
        self.raise_if_failed()
        with self._lock:
            if url in self.down_since or url in self._leaving:
                return
            self._leaving.add(url)
        found = time.monotonic()
        try:
            if self.owner:
                self._remove_from_router(url)
        finally:
            with self._lock:
                self._leaving.discard(url)
        with self._lock:
            self.down_since[url] = found
            self.last_error[url] = error
            self.num_down_events += 1
        left = len(self.up())
        logger.warning(
            "vLLM replica %s is down (%s): out of the router; %d of %d replicas serve the round. It rejoins after "
            "it is healthy and has the current weights.", url, error, left, len(self.urls),
        )  # fmt: skip

    def _remove_from_router(self, url: str, attempts: int = 6) -> None:
        delay = 0.2
        for attempt in range(attempts):  # checked: the router must stop sending it requests
            try:
                self.router.remove_worker(url)
                if url not in self.router.list_workers():
                    return
            except RouterError as exc:
                last = str(exc)
            else:
                last = "it still lists it"
            if attempt < attempts - 1:
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
        # the router would skip it only while its own health check fails: a replica that restarts before the
        # next weight sync would get requests with its old weights. Never let that happen: stop the run
        self.failure = ReplicaRemovalError(
            f"vLLM replica {url} is down, but the router {self.router_url} did not take it out after {attempts} "
            f"tries ({last}); the run stops, as the router would send it requests with old weights once it "
            "restarts."
        )
        logger.error("%s", self.failure)
        raise self.failure

    def raise_if_failed(self) -> None:
        """Raise the set's `ReplicaRemovalError` when a dead replica could not be taken out of the router."""
        if self.failure is not None:
            raise self.failure

    def rejoin(self, url: str) -> float:
        """Add a replica that is healthy again *and holds the current weights* back to the router; its dead time."""
        if not self.owner:
            raise RuntimeError(f"a follower ReplicaSet does not change the router {self.router_url}: adopt() instead")
        self.raise_if_failed()
        self.router.add_worker(url)
        with self._lock:
            since = self.down_since.pop(url, None)
            dead = 0.0 if since is None else time.monotonic() - since
            self.dead_time_s[url] += dead
            self._failures[url] = 0
            self.num_rejoins += 1
        logger.warning("vLLM replica %s rejoined the router after %.1f s down (weights synced)", url, dead)
        return dead

    def rejoin_healthy(self, sync=None) -> list[str]:
        """Rejoin every down replica that answers `/health` again, after `sync(url)` when given; the rejoined."""
        self.raise_if_failed()
        back = []
        for url in self.down():
            if self.probe(url) is None:
                if sync is not None:
                    sync(url)
                self.rejoin(url)
                back.append(url)
        return back

    # ---- the owner's view, shared with the followers
    def snapshot(self) -> dict[str, Any]:
        """The view a follower `adopt`s: who is down (for how long, why) and the counters (picklable)."""
        now = time.monotonic()
        with self._lock:
            return {
                "down": {u: (now - t, self.last_error.get(u, "?")) for u, t in self.down_since.items()},
                "dead_time_s": dict(self.dead_time_s),
                "down_events": self.num_down_events,
                "rejoins": self.num_rejoins,
                "failure": None if self.failure is None else str(self.failure),
            }

    def adopt(self, view: dict[str, Any]) -> None:
        """Take the owner's `snapshot` as this follower's view: its downs, its rejoins, its counters."""
        now = time.monotonic()
        with self._lock:
            self.down_since = {u: now - elapsed for u, (elapsed, _) in view["down"].items()}
            self.last_error.update({u: error for u, (_, error) in view["down"].items()})
            self.dead_time_s = dict(view["dead_time_s"])
            self._failures = dict.fromkeys(self.urls, 0)
            self.num_down_events, self.num_rejoins = view["down_events"], view["rejoins"]
            if view["failure"] is not None and self.failure is None:
                self.failure = ReplicaRemovalError(view["failure"])

    def start_monitor(self) -> ReplicaSet:
        if not self.owner:
            raise RuntimeError("a follower ReplicaSet runs no monitor: the owner's watches the replicas")
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="appo-replica-monitor", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check()
                if self.auto_rejoin:
                    self.rejoin_healthy()
            except ReplicaRemovalError:
                return  # logged; every later request and sync raises it
            except Exception as exc:  # never die silently: log and keep watching
                logger.warning("replica health check failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        """Stop the monitor, and the router when appo started it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.router_process is not None:
            self.router_process.stop()

    def metrics(self) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            dead = sum(self.dead_time_s.values()) + sum(now - t for t in self.down_since.values())
            return {
                "replicas/up": float(len(self.urls) - len(self.down_since)),
                "replicas/dead_time_s": dead,
                "replicas/down_events": float(self.num_down_events),
                "replicas/rejoins": float(self.num_rejoins),
                "replicas/resent": float(self.num_resent),
            }


class ReplicaBackend:
    """A `Backend` over the router: `VLLMServerBackend` plus resending when a replica dies under a request.

    Args:
        backend: the `VLLMServerBackend` whose `base_url` is the router.
        replicas: the set behind that router.
        timeout_s: a request is resent until this long after its first attempt (default: the backend's
            read timeout); then the last error is raised.
    """

    def __init__(self, backend: VLLMServerBackend, replicas: ReplicaSet, *, timeout_s: float | None = None):
        self.backend, self.replicas = backend, replicas
        self.timeout_s = timeout_s if timeout_s is not None else backend.timeout.read

    def __getattr__(self, name):  # model, resolve_max_model_len, num_requests, ... of the wrapped backend
        return getattr(self.backend, name)

    def _all_down(self) -> ReplicasDownError:
        return ReplicasDownError(
            f"all {len(self.replicas.urls)} vLLM replicas behind the router {self.replicas.router_url} are down: "
            f"{self.replicas.describe_down()}"
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.replicas.raise_if_failed()
            if not self.replicas.up():
                raise self._all_down()
            downs = self.replicas.num_down_events
            try:
                return await self.backend.generate(prompt_ids, params)
            except VLLMRequestError:
                raise
            except VLLMServerError as exc:
                # did a replica die under the request? poll until it is found down (or every replica answers)
                for _ in range(self.replicas.failures_to_down):
                    await asyncio.to_thread(self.replicas.check)
                    if self.replicas.num_down_events > downs:
                        break
                    await asyncio.sleep(self.replicas.health_interval_s)
                if not self.replicas.up():
                    raise self._all_down() from exc
                if self.replicas.num_down_events == downs or time.monotonic() > deadline:
                    raise  # every replica still answers: the server's own error, already retried
                self.replicas.num_resent += 1
                logger.info("resending a request after %s (replicas up: %s)", exc, self.replicas.up())

    async def health(self) -> bool:
        return await self.backend.health()

    async def aclose(self) -> None:
        await self.backend.aclose()

    def metrics(self) -> dict[str, float]:
        return self.replicas.metrics()


__all__ = ["ReplicaBackend", "ReplicaRemovalError", "ReplicaSet", "ReplicasDownError", "parse_server_urls"]
