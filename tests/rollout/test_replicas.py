"""Several vLLM replicas behind vLLM's router (`vllm-router`, the `[router]` extra): two fake servers
(bench/fake_vllm.py) and the real router on 127.0.0.1.

Tree routing (every request of a tree on one replica), a replica crashing mid-round (its requests resent, the
round complete, no row lost or doubled, the dead time logged), a replica coming back (it rejoins only after a
sync), all replicas down (one clear error, fast). tests/real_vllm/test_replicas.py runs the same against two
real vLLM-CPU servers.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams, Segment
from appo_trl.vllm.replicas import ReplicaBackend, ReplicasDownError, ReplicaSet, parse_server_urls
from appo_trl.vllm.router import RouterClient, RouterError, VLLMRouter, router_executable
from appo_trl.vllm.server import VLLMServerBackend, VLLMServerError
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy
from tests.rollout.conftest import ScriptedTool, generate_once

pytestmark = pytest.mark.network

try:
    router_executable()
    HAVE_ROUTER = True
except RouterError:
    HAVE_ROUTER = False
needs_router = pytest.mark.skipif(not HAVE_ROUTER, reason="vllm-router is not installed (pip install '.[router]')")


def test_parse_server_urls():
    assert parse_server_urls("http://a:1/") == ["http://a:1"]
    assert parse_server_urls("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert parse_server_urls(["http://a:1", "http://b:2/"]) == ["http://a:1", "http://b:2"]
    assert parse_server_urls(None) == []
    with pytest.raises(ValueError, match="lists a replica twice"):
        parse_server_urls("http://a:1,http://a:1/")
    with pytest.raises(ValueError, match="'a:1' is not an http"):
        parse_server_urls(["a:1"])


def test_router_missing_is_one_clear_line(monkeypatch):
    import appo_trl.vllm.router as router_mod

    monkeypatch.setattr(router_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(router_mod.os, "access", lambda path, mode: False)
    with pytest.raises(RouterError, match=r"`vllm-router` is not installed: `pip install 'appo-trl\[router\]'`"):
        router_executable()


def _tool_script(tiny_tokenizer, enc):
    """Two turns per trajectory: a python call, then an answer after the result (several requests per tree)."""
    eos = tiny_tokenizer.eos_token_id
    rclose = tiny_tokenizer.convert_tokens_to_ids("</result>")

    def script(ctx, rng):
        return enc("<python>x</python>") if ctx.count(rclose) == 0 else enc("<answer> 4 </answer>") + [eos]

    return script


@pytest.fixture
def pair(tiny_tokenizer, enc):
    """Two fake replicas (slow enough that requests are in flight when one dies) behind the real router."""
    policy = ScriptedPolicy(tiny_tokenizer, _tool_script(tiny_tokenizer, enc), delay=lambda ctx: 0.05)
    servers = [FakeVLLMServer(policy, tiny_tokenizer).start() for _ in range(2)]
    routers = []

    def make(policy_name="consistent_hash"):
        router = VLLMRouter([s.url for s in servers], policy=policy_name, startup_timeout_s=30).start()
        routers.append(router)
        replicas = ReplicaSet(router.url, [s.url for s in servers], health_interval_s=0.2).start_monitor()
        backend = ReplicaBackend(VLLMServerBackend(router.url, max_retries=2, backoff_s=0.05, timeout_s=30),
                                 replicas)  # fmt: skip
        tools = {"python": ScriptedTool("python", lambda q: "r")}
        engine = RolloutEngine(backend, tiny_tokenizer, RolloutConfig(max_completion_length=64, max_model_len=256),
                               tools)  # fmt: skip
        routers.append(replicas)
        routers.append(engine)
        return engine, replicas

    yield servers, make
    for obj in reversed(routers):
        obj.close() if hasattr(obj, "close") else obj.stop()
    for s in servers:
        s.stop()


def _wait_down(replicas, url, within_s=10.0):
    deadline = time.monotonic() + within_s
    while url not in replicas.down():
        assert time.monotonic() < deadline, f"the monitor did not take {url} out within {within_s} s"
        time.sleep(0.05)


def _sessions(server) -> set[str]:
    return {s for s in server.sessions if s is not None}


@needs_router
def test_every_request_of_a_tree_lands_on_one_replica(pair, enc):
    servers, make = pair
    engine, _ = make("consistent_hash")
    groups = engine.run(engine.rollout([enc(f"question {i}") for i in range(8)], 2, seed=1))
    # branches of some rows: same tree, more requests
    parents = [g[0] for g in groups]
    branches = engine.run(engine.branch_many([(p, 2) for p in parents], seed=5))
    trees = {t.route_key for g in groups for t in g}
    assert len(trees) == 8 and {b.route_key for b in branches} <= trees
    a, b = _sessions(servers[0]), _sessions(servers[1])
    assert None not in servers[0].sessions + servers[1].sessions  # every request carried its tree id
    assert a | b == trees and not a & b  # each tree on exactly one replica
    assert a and b  # and both replicas served trees
    assert len(servers[0].bodies) + len(servers[1].bodies) == 8 * 2 * 2 + 8 * 2  # 2 turns per row and per branch


@needs_router
def test_round_robin_splits_trees(pair, enc):
    """The baseline the tree routing is measured against: the same workload, trees split across replicas."""
    servers, make = pair
    engine, _ = make("round_robin")
    engine.run(engine.rollout([enc(f"question {i}") for i in range(8)], 2, seed=1))
    assert _sessions(servers[0]) & _sessions(servers[1])


@needs_router
def test_replica_killed_mid_round_resends_and_completes(pair, enc, caplog):
    servers, make = pair
    engine, replicas = make()
    victim, survivor = servers
    killed = {}

    def kill_when_busy():
        while len(victim.bodies) < 3:
            time.sleep(0.005)
        killed["in_flight_sessions"] = set(victim.sessions[-3:])
        victim.kill()

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    with caplog.at_level(logging.WARNING, logger="appo_trl.vllm.replicas"):
        start = time.monotonic()
        groups = engine.run(engine.rollout([enc(f"question {i}") for i in range(8)], 4, seed=2))
        took = time.monotonic() - start
        killer.join()
        _wait_down(replicas, victim.url)  # (the router may have moved its requests before the monitor saw it)
    rows = [t for g in groups for t in g]
    assert [len(g) for g in groups] == [4] * 8 and len({t.uid for t in rows}) == 32  # nothing lost or doubled
    assert all(t.finish_reason == "eos" and len(t.tool_calls) == 1 for t in rows)  # every row whole
    assert killed["in_flight_sessions"] <= _sessions(survivor)  # the dead replica's trees finished elsewhere
    assert replicas.down() == [victim.url] and RouterClient(replicas.router_url).list_workers() == [survivor.url]
    m = engine.metrics()
    assert m["replicas/up"] == 1 and m["replicas/down_events"] == 1 and m["replicas/dead_time_s"] > 0
    assert any(f"vLLM replica {victim.url} is down" in r.getMessage() for r in caplog.records)
    assert took < 30


@needs_router
def test_replica_back_rejoins_only_after_sync(pair, enc, tiny_tokenizer):
    servers, make = pair
    engine, replicas = make()
    victim, survivor = servers
    port = victim.port
    victim.kill()
    _wait_down(replicas, victim.url)
    back = FakeVLLMServer(victim.policy, tiny_tokenizer)
    back.port = port
    back.start()
    servers.append(back)
    time.sleep(1.0)  # the monitor keeps polling: a healthy replica is not let back in by itself
    assert RouterClient(replicas.router_url).list_workers() == [survivor.url]
    order = []
    replicas.rejoin_healthy(sync=lambda url: order.append(("sync", url, sorted(RouterClient(replicas.router_url)
                                                                              .list_workers()))))  # fmt: skip
    assert order == [("sync", victim.url, [survivor.url])]  # synced while still out of the router
    assert sorted(RouterClient(replicas.router_url).list_workers()) == sorted([victim.url, survivor.url])
    assert replicas.down() == [] and replicas.num_rejoins == 1 and replicas.dead_time_s[victim.url] >= 1.0
    engine.run(engine.rollout([enc(f"question {i}") for i in range(8)], 1, seed=3))
    assert back.bodies  # it serves again


@needs_router
def test_all_replicas_down_is_one_clear_error_within_the_timeout(pair, enc):
    servers, make = pair
    engine, replicas = make()
    for s in servers:
        s.kill()
    start = time.monotonic()
    with pytest.raises(ReplicasDownError) as err:
        generate_once(engine.backend, enc("question"), SamplingParams(max_tokens=8, seed=1, session_id="t"))
    assert time.monotonic() - start < 30  # the backend's timeout_s
    msg = str(err.value)
    assert msg.startswith("all 2 vLLM replicas behind the router") and all(s.url in msg for s in servers)


@needs_router
def test_a_server_error_with_every_replica_up_is_raised_not_resent(pair, enc):
    """Resending is for a replica that died; a 5xx from healthy replicas is the backend's error, raised."""
    servers, make = pair
    engine, replicas = make()
    for s in servers:
        s.fail_next = 100
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match="failed after 3 attempts") as err:
        generate_once(engine.backend, enc("question"), SamplingParams(max_tokens=8, seed=1, session_id="t"))
    assert not isinstance(err.value, ReplicasDownError) and replicas.down() == [] and replicas.num_resent == 0
    assert time.monotonic() - start < 15


class _Router:
    """Stands in for `RouterClient` (the worker list appo's `ReplicaSet` changes); `refuse`: removals fail."""

    def __init__(self, urls, refuse=False):
        self.workers, self.refuse = list(urls), refuse

    def list_workers(self):
        return list(self.workers)

    def remove_worker(self, url):
        if self.refuse:
            raise RouterError(f"vLLM router http://router:30000/remove_worker answered HTTP 500: {url}")
        self.workers.remove(url)

    def add_worker(self, url):
        self.workers.append(url)


class _CutBackend:
    """A router backend whose first request is cut by a replica dying under it (after the router's retries)."""

    def __init__(self, alive, victim):
        self.alive, self.victim, self.prompts = alive, victim, []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        if len(self.prompts) == 1:
            self.alive.discard(self.victim)
            raise VLLMServerError("vLLM server http://router:30000 failed after 3 attempts: RemoteProtocolError")
        return Segment([7, 8], [-0.1, -0.2], None, "eos", None)


def _replica_set(monkeypatch, urls, alive, refuse=False):
    import appo_trl.vllm.replicas as replicas_mod

    monkeypatch.setattr(ReplicaSet, "probe", staticmethod(lambda url, timeout_s=5.0: None if url in alive else
                                                          "ConnectError: connection refused"))  # fmt: skip
    monkeypatch.setattr(replicas_mod.time, "sleep", lambda s: None)  # the removal retries, without the wait
    replicas = ReplicaSet("http://router:30000", urls, health_interval_s=0.01, failures_to_down=1)
    replicas.router = _Router(urls, refuse)
    return replicas


def test_a_request_cut_by_a_dying_replica_is_resent_once_and_yields_one_segment(monkeypatch):
    """appo's own resend (the router's retries exhausted): the request again, whole, one segment back."""
    import asyncio

    urls = ["http://a:1", "http://b:2"]
    alive = set(urls)
    replicas = _replica_set(monkeypatch, urls, alive)
    inner = _CutBackend(alive, "http://b:2")
    backend = ReplicaBackend(inner, replicas, timeout_s=10)
    seg = asyncio.run(backend.generate([1, 2, 3, 4], SamplingParams(max_tokens=8, seed=1, session_id="t")))
    assert isinstance(seg, Segment) and seg.token_ids == [7, 8]  # exactly one segment
    assert inner.prompts == [[1, 2, 3, 4], [1, 2, 3, 4]]  # sent again, whole
    assert replicas.num_resent == 1 and replicas.metrics()["replicas/resent"] == 1
    assert replicas.down() == ["http://b:2"] and replicas.router.workers == ["http://a:1"]


def test_a_dead_replica_the_router_keeps_stops_the_run_with_its_url(monkeypatch):
    """When the router does not let a dead replica go, it would serve stale weights once it restarts: stop."""
    import asyncio

    from appo_trl.vllm.replicas import ReplicaRemovalError

    urls = ["http://a:1", "http://b:2"]
    alive = {"http://a:1"}
    replicas = _replica_set(monkeypatch, urls, alive, refuse=True)
    with pytest.raises(ReplicaRemovalError, match=r"vLLM replica http://b:2 is down, but the router .* did not "
                                                  r"take it out after 6 tries"):  # fmt: skip
        replicas.check()
    assert replicas.down() == []  # not counted as out of the router: it is not
    backend = ReplicaBackend(_CutBackend(set(), "x"), replicas, timeout_s=10)
    with pytest.raises(ReplicaRemovalError, match="http://b:2"):  # every later request
        asyncio.run(backend.generate([1], SamplingParams(max_tokens=8, seed=1, session_id="t")))
    with pytest.raises(ReplicaRemovalError, match="http://b:2"):  # and every later sync
        replicas.rejoin_healthy()


@needs_router
def test_the_router_dies_with_a_sigkilled_parent(pair, tmp_path):
    """SIGKILL runs no exit handler: the router must still go (PR_SET_PDEATHSIG), not outlive the trainer."""
    import os
    import signal
    import subprocess
    import sys

    servers, _ = pair
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from appo_trl.vllm.router import VLLMRouter; "
         "r = VLLMRouter(sys.argv[1:], startup_timeout_s=30).start(); print(r.proc.pid, flush=True); time.sleep(600)",
         *[s.url for s in servers]],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        router_pid = int(child.stdout.readline())
    finally:
        child.kill()
        child.wait(timeout=10)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive(router_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(router_pid):
        os.kill(router_pid, signal.SIGKILL)
        pytest.fail(f"vllm-router (pid {router_pid}) outlived its SIGKILLed parent")
