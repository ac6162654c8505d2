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

    python bench/rollout.py            # full workload (about a minute)
    python bench/rollout.py --quick    # 16 prompts x 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appo_trl.rollout import RolloutConfig, RolloutEngine, Trajectory, VLLMServerBackend, mix_seed  # noqa: E402
from appo_trl.tools.base import ToolResult  # noqa: E402
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
            t.meta["seed"] = mix_seed(mix_seed(seed, g), j)  # the engine's seeds: identical token streams
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
    args = ap.parse_args(argv)
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
