"""Agent endpoint benchmark: the latency the OpenAI-compatible endpoint adds to each call over the sampler's own.

Workload: `--trajectories` agent runs at once (default 64), each `--turns` chat requests long (a user message, then
the assistant answer sent back with a `tool` message, as an `openai` SDK loop does), through `httpx.AsyncClient`
(the client the `openai` SDK uses) against `AgentEndpoint` on 127.0.0.1. The sampler is an in-process fake that
waits `--decode-ms` and answers 16 tokens, so the sampler's own time per call is known exactly. For each call,
added latency = the client's round trip − the sampler call's own duration (paired per trajectory, in order): HTTP,
JSON, chat-template rendering of the new messages, the hop to the sampler's loop and back, and the queueing of all
of that behind the other trajectories' calls. `--client thread` (default): clients and endpoint share one
interpreter, as `APPOTrainer(agent=fn)` runs agents; `--client process`: the clients run in their own process, as
agents in sandboxes do. Reported: p50 and p99 (ms; the goal is p50 <= 5 ms on this CPU), overall and per turn (turn 1
opens the connections), the handler's own time per call (`agent_handler_ms_p50`: parsing, rendering, answering,
without HTTP and without waiting) and this process's CPU per call. With the default 20 ms sampler the calls come
faster than one interpreter serves them: the numbers are then queueing (docs/benchmarks.md, "Agent endpoint").

    python bench/agent_endpoint.py            # 64 trajectories x 4 turns
    python bench/agent_endpoint.py --quick    # 16 x 3
    python bench/agent_endpoint.py --client process --decode-ms 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appo_trl.rollout import SamplingParams, Segment  # noqa: E402
from appo_trl.rollout.agent_endpoint import AgentEndpoint  # noqa: E402
from appo_trl.rollout.agent_session import ChatRenderer  # noqa: E402
from appo_trl.rollout.chat_format import ChatToolFormat  # noqa: E402
from appo_trl.tiny import build_tiny_model  # noqa: E402


class FakeSampler:
    """Waits `decode_s`, answers 16 tokens; notes each call's own duration per session (the trajectory)."""

    def __init__(self, tokenizer, decode_s: float):
        self.ids = tokenizer.encode(" the answer is 42", add_special_tokens=False) * 4
        self.ids = self.ids[:15] + [tokenizer.eos_token_id]
        self.decode_s = decode_s
        self.spent: dict[str, list[float]] = defaultdict(list)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        start = time.perf_counter()
        await asyncio.sleep(self.decode_s)
        ids = self.ids[: params.max_tokens]
        seg = Segment(list(ids), [-0.5] * len(ids), None, "eos")
        self.spent[params.session_id].append(time.perf_counter() - start)
        return seg


async def run_trajectory(client, base_url: str, turns: int) -> list[float]:
    messages = [{"role": "user", "content": "What is six times seven?"}]
    out = []
    for turn in range(turns):
        start = time.perf_counter()
        reply = await client.post(f"{base_url}/chat/completions", json={"model": "m", "messages": messages})
        out.append(time.perf_counter() - start)
        reply.raise_for_status()
        messages.append(reply.json()["choices"][0]["message"])
        messages.append({"role": "user", "content": f"Check it again ({turn})."})
    return out


async def run_clients(warm_url: str, urls: list[str], turns: int) -> list[list[float]]:
    import httpx

    limits = httpx.Limits(max_connections=len(urls), max_keepalive_connections=len(urls))
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await run_trajectory(client, warm_url, 1)  # imports, first render, one connection
        return await asyncio.gather(*(run_trajectory(client, u, turns) for u in urls))


def client_process(warm_url: str, urls: list[str], turns: int) -> list[list[float]]:
    """The clients in their own interpreter (agents in sandboxes or subprocesses)."""
    return asyncio.run(run_clients(warm_url, urls, turns))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--decode-ms", type=float, default=20.0)
    ap.add_argument(
        "--client",
        choices=["thread", "process"],
        default="thread",
        help="thread: clients share the trainer's interpreter (how `agent=` functions run); "
        "process: clients in their own process (agents in sandboxes or subprocesses)",
    )
    ap.add_argument("--quick", action="store_true", help="16 trajectories x 3 turns")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.trajectories, args.turns = 16, 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), chat_template="tools"))
    sampler = FakeSampler(tok, args.decode_ms / 1000)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    endpoint = AgentEndpoint(lambda c: asyncio.run_coroutine_threadsafe(c, loop), sampler.generate,
                             ChatRenderer(tok, tool_format=ChatToolFormat(tok)), SamplingParams(max_tokens=4096),
                             2048, concurrency=args.trajectories).start()  # fmt: skip

    warm_url = endpoint.open_session(session_id="warm-up")[0]
    urls = [endpoint.open_session(session_id=f"t{j}")[0] for j in range(args.trajectories)]
    try:
        start, cpu = time.perf_counter(), time.process_time()
        if args.client == "thread":
            rounds = asyncio.run(run_clients(warm_url, urls, args.turns))
        else:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh interpreter
                rounds = pool.apply(client_process, (warm_url, urls, args.turns))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        handler = sorted(1000 * x for x in endpoint.overheads_s[1:])  # the handler's own time (warm-up left out)
    finally:
        endpoint.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    per_turn = [
        [1000 * (trips[t] - sampler.spent[f"t{j}"][t]) for j, trips in enumerate(rounds)] for t in range(args.turns)
    ]
    added = sorted(x for turn in per_turn for x in turn)
    p = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    figures = {
        "agent_calls": len(added),
        "agent_trajectories": args.trajectories,
        "agent_client": args.client,
        "agent_added_latency_ms_p50": round(p(added, 0.50), 3),
        "agent_added_latency_ms_p99": round(p(added, 0.99), 3),
        "agent_added_latency_ms_p50_per_turn": [round(p(turn, 0.50), 3) for turn in per_turn],
        "agent_added_latency_ms_p99_per_turn": [round(p(turn, 0.99), 3) for turn in per_turn],
        "agent_added_latency_ms_mean": round(statistics.fmean(added), 3),
        "agent_handler_ms_p50": round(handler[len(handler) // 2], 3),
        "agent_sampler_ms": args.decode_ms,
        "agent_wall_s": round(wall, 3),
        # this process's CPU per call: the endpoint and the fake sampler (with --client thread, the clients too)
        "agent_process_cpu_ms_per_call": round(1000 * cpu / len(added), 3),
    }
    print(f"{len(added)} calls, {args.trajectories} trajectories at once: added latency p50 "
          f"{figures['agent_added_latency_ms_p50']} ms, p99 {figures['agent_added_latency_ms_p99']} ms "
          f"(sampler {args.decode_ms} ms per call)")  # fmt: skip
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
