"""Agent endpoint benchmark: the latency `AgentEndpoint` adds to each agent call over the engine's own call, and the
share of replayed calls that match token for token when branches re-run a deterministic agent.

The stack of `agent=` training on a vLLM server: `bench/fake_vllm.py` in its own process (a scripted model answering
each turn with words and a tool call, about 68 tokens, at `--step-ms` per token), `RolloutEngine` over
`VLLMServerBackend`, `AgentEndpoint`. `--trajectories` agents at once, each with its own `httpx.AsyncClient`, run a
tool loop of `--turns` calls; added latency = round trip - `VLLMServerBackend.generate`'s own time for that call.
`--client process`: agents in their own interpreter; `thread`: in the trainer's. One setting per `--step-ms` value (a
saturation curve). Replay: `--branches` per run re-run the agent as `AgentEngine.branch_many` does. Stall: `--stall-trajectories` runs'
round trips alone and while one more run posts `--stall-bytes` bodies (over max_model_len, refused) back to back.
Figures and what they mean: docs/benchmarks.md, "Agent endpoint".

    python bench/agent_endpoint.py                  # 64 trajectories x 4 turns at 20, 10, 5 and 2.5 ms per token
    python bench/agent_endpoint.py --quick          # 16 x 3 at 2 ms per token, 1 branch per run
    python bench/agent_endpoint.py --client thread --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FILLER = 40  # median words before the tool call: answers of about 68 tokens (27 for the call, EOS)
TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "a times b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]  # fmt: skip


def make_script(tok):
    """The scripted model: each turn answers a few words (their number drawn from the request's seed: answers differ
    in length, as a real model's do) then a `multiply` tool call and EOS; a request that continues a partly answered
    turn (a branch) gets the rest of that answer."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    header = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    words = tok(" let me think about this step by step first", add_special_tokens=False)["input_ids"]

    def script(ctx, rng):
        n = ctx.count(start)
        args = json.dumps({"a": n % 10, "b": 7})
        call = f'<tool_call>{{"name": "multiply", "arguments": {args}}}</tool_call>'
        filler = [words[i % len(words)] for i in range(int(FILLER * math.exp(rng.gauss(0.0, 0.5))))]
        call_ids = tok(call, add_special_tokens=False)["input_ids"]
        answer = filler + call_ids + [tok.eos_token_id]
        done = max(1 + ctx[::-1].index(start) - header, 0)
        return answer[done:] if done < len(answer) else answer[-len(call_ids) - 1 :]

    return script


def serve_fake(model_dir: str, conn) -> None:
    """The fake vLLM server's process: answers its port, then takes `decode_step_s` settings until None."""
    from transformers import AutoTokenizer

    from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy

    tok = AutoTokenizer.from_pretrained(model_dir)
    server = FakeVLLMServer(ScriptedPolicy(tok, make_script(tok)), tok).start()
    conn.send(server.port)
    while (step := conn.recv()) is not None:
        server.decode_step_s = step
        conn.send(step)
    server.stop()


async def agent(client, base_url: str, turns: int) -> list[float]:
    """A deterministic tool loop: the question, then each answer with its tool results; its round trips."""
    messages, trips = [{"role": "user", "content": "What is six times seven? Use the tool."}], []
    for _ in range(turns):
        start = time.perf_counter()
        reply = await client.post(f"{base_url}/chat/completions",
                                  json={"model": "policy", "messages": messages, "tools": TOOLS})  # fmt: skip
        trips.append(time.perf_counter() - start)
        reply.raise_for_status()
        message = reply.json()["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] * args["b"])})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": "Go on."})
    return trips


async def run_agents(urls: list[str], turns: int) -> list[list[float]]:
    import ssl

    import httpx

    # one client per run, as each agent has its `openai` client; made before the clock starts, with one SSL context:
    # an httpx client builds its own (about 20 ms of CPU), the agent's cost, which 64 runs starting together would
    # otherwise add to each other's first calls
    context = ssl.create_default_context()
    clients = [httpx.AsyncClient(timeout=120, verify=context) for _ in urls]
    try:
        return list(await asyncio.gather(*(agent(c, u, turns) for c, u in zip(clients, urls))))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def agents_process(urls: list[str], turns: int) -> list[list[float]]:
    try:
        return asyncio.run(run_agents(urls, turns))
    except Exception as exc:  # as a plain error: the pool cannot hand back one that does not unpickle (httpx's)
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Bench:
    """The engine over the fake server, the endpoint in front, and the engine's own call time per request."""

    def __init__(self, model_dir: str, port: int, client: str, pool):
        from transformers import AutoTokenizer

        from appo_trl.rollout import RolloutEngine, SamplingParams
        from appo_trl.rollout.agent_endpoint import AgentEndpoint
        from appo_trl.rollout.agent_session import ChatRenderer
        from appo_trl.rollout.chat_format import ChatToolFormat
        from appo_trl.vllm import VLLMServerBackend

        tok = AutoTokenizer.from_pretrained(model_dir)
        self.engine = RolloutEngine(VLLMServerBackend(f"http://127.0.0.1:{port}", model="fake-model"), tok)
        self.own: dict[str, list[float]] = defaultdict(list)  # session id -> the engine's call durations
        self.client, self.pool = client, pool
        renderer = ChatRenderer(tok, tool_format=ChatToolFormat(tok))
        self.endpoint = AgentEndpoint(self.engine.submit, self._generate, renderer, SamplingParams(max_tokens=1024),
                                      2048, concurrency=256).start()  # fmt: skip

    async def _generate(self, ids, params):
        start = time.perf_counter()
        seg = await self.engine.backend.generate(ids, params)
        self.own[params.session_id].append(time.perf_counter() - start)
        return seg

    def run(self, urls: list[str], turns: int) -> list[list[float]]:
        if self.client == "process":
            return self.pool.apply_async(agents_process, (urls, turns)).get(timeout=600)
        out = []  # on their own thread and loop, as `AgentRounds` runs async agents

        def target():
            try:
                out.append(asyncio.run(run_agents(urls, turns)))
            except Exception as exc:  # noqa: BLE001 - raised below, on the caller's thread
                out.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def latency(self, tag: str, trajectories: int, turns: int) -> tuple[dict, list]:
        self.run([self.endpoint.open_session(session_id=f"{tag}-warm")[0]], 1)  # first render, imports, connections
        opened = [self.endpoint.open_session(seed=j, group=j, session_id=f"{tag}-{j}") for j in range(trajectories)]
        self.endpoint.reset_metrics()
        load, cpu, start = os.getloadavg()[0], time.process_time(), time.perf_counter()
        trips = self.run([url for url, _ in opened], turns)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        own = [self.own[f"{tag}-{j}"] for j in range(trajectories)]
        added = [1000 * (t - o) for ts, os_ in zip(trips, own) for t, o in zip(ts, os_)]
        later = [1000 * (t - o) for ts, os_ in zip(trips, own) for t, o in list(zip(ts, os_))[1:]]
        calls = len(added)
        # the hop to the engine's loop and back, per call (a run's mean): the endpoint's wait minus the engine's call
        hops = [(s.row.generation_s - sum(o)) / len(o) for (_, s), o in zip(opened, own)]
        figures = {
            "added_ms_p50": round(pct(added, 0.5), 2), "added_ms_p99": round(pct(added, 0.99), 2),
            "added_ms_p50_after_turn1": round(pct(later, 0.5), 2),
            "added_ms_p99_after_turn1": round(pct(later, 0.99), 2),
            "engine_call_ms_p50": round(1000 * pct([o for os_ in own for o in os_], 0.5), 1),
            "handler_ms_p50": round(1000 * pct(self.endpoint.overheads_s, 0.5), 3),
            "hop_ms_p50": round(1000 * pct(hops, 0.5), 3), "hop_ms_p99": round(1000 * pct(hops, 0.99), 3),
            "calls": calls, "calls_per_s": round(calls / wall, 1),
            "trainer_cpu_ms_per_call": round(1000 * cpu / calls, 3), "load_avg_1m": round(load, 2),
        }  # fmt: skip
        return figures, [session for _, session in opened]

    def replay(self, parents: list, turns: int, branches: int) -> dict:
        """Branch every parent run `branches` times at the middle of one of its answers (calls rotate), re-run the
        agent by replay: replayed calls that matched / calls up to the branch call (as `AgentEngine.branch_many`)."""
        jobs = []
        for j, parent in enumerate(parents):
            for b in range(branches):
                call = parent.calls[(j + b) % len(parent.calls)]
                position = call["start"] + len(call["ids"]) // 2
                url, session = self.endpoint.open_session(seed=1000 + j, group=j, session_id=f"branch-{j}-{b}")
                session.replay = parent.branch_call(position)
                jobs.append((url, session, session.replay.branch_call + 1, parent.row, position))
        self.run([job[0] for job in jobs], turns)
        expected = sum(job[2] for job in jobs)
        matched = sum(job[1].replayed for job in jobs)
        # the branch's row holds its parent's row up to the branch point, token for token
        exact = sum(s.row.prompt_ids == p.prompt_ids and s.row.completion_ids[:pos] == p.completion_ids[:pos]
                    for _, s, _, p, pos in jobs)  # fmt: skip
        return {"agent_replay_branches": len(jobs), "agent_replayed_calls": expected,
                "agent_replay_matched": matched, "agent_replay_match_rate": round(matched / expected, 4),
                "agent_replay_diverged_branches": sum(bool(job[1].diverged) for job in jobs),
                "agent_replay_exact_prefix_branches": exact}  # fmt: skip

    def stall(self, trajectories: int, turns: int, body_bytes: int) -> dict:
        """Other runs' round trips while one run posts ~`body_bytes` bodies (a conversation far over max_model_len,
        refused as too long once tokenised) back to back, against the same runs alone."""
        import random

        import httpx

        rng = random.Random(0)  # words the tokenizer cannot merge much: about one token per 1.1 characters
        text = " ".join("".join(rng.choice("abcdefghij") for _ in range(7)) for _ in range(body_bytes // 8))
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": text[: body_bytes - 100]}]})
        figures = {"stall_body_bytes": len(body)}
        for mode in ("alone", "with_big_bodies"):
            opened = [self.endpoint.open_session(seed=j, group=j, session_id=f"stall-{mode}-{j}")[0]
                      for j in range(trajectories)]  # fmt: skip
            stop, big = threading.Event(), []

            def big_run(url=self.endpoint.open_session(session_id=f"stall-{mode}-big")[0], stop=stop, big=big):
                with httpx.Client(timeout=600) as client:
                    while not stop.is_set():
                        start = time.perf_counter()
                        reply = client.post(f"{url}/chat/completions", content=body,
                                            headers={"content-type": "application/json"})  # fmt: skip
                        big.append((reply.status_code, time.perf_counter() - start))

            thread = threading.Thread(target=big_run)
            if mode != "alone":
                thread.start()
                while not big and thread.is_alive():  # the first big body is in: the runs start under it
                    time.sleep(0.05)
            start = time.perf_counter()
            trips = [1000 * t for ts in self.run(opened, turns) for t in ts]
            wall = time.perf_counter() - start
            stop.set()
            if mode != "alone":
                thread.join()
                figures["stall_big_bodies"] = len(big)
                figures["stall_big_statuses"] = sorted({status for status, _ in big})
                figures["stall_big_body_s_p50"] = round(pct([s for _, s in big], 0.5), 2)
            figures.update({f"stall_{mode}_trip_ms_p50": round(pct(trips, 0.5), 1),
                            f"stall_{mode}_trip_ms_max": round(max(trips), 1),
                            f"stall_{mode}_calls_per_s": round(len(trips) / wall, 1)})  # fmt: skip
        figures["stall_trip_p50_ratio"] = round(figures["stall_with_big_bodies_trip_ms_p50"]
                                                / figures["stall_alone_trip_ms_p50"], 2)  # fmt: skip
        return figures

    def close(self) -> None:
        self.endpoint.close()
        self.engine.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--step-ms", default="20,10,5,2.5", help="fake decode time per token, comma-separated settings")
    ap.add_argument("--client", choices=["process", "thread"], default="process")
    ap.add_argument("--branches", type=int, default=2, help="replay branches per agent run (0: no replay figure)")
    ap.add_argument("--stall-bytes", type=int, default=990_000,
                    help="the stall case: one run posts bodies of this size meanwhile (0: no stall case)")
    ap.add_argument("--stall-trajectories", type=int, default=16, help="the stall case's other runs")
    ap.add_argument("--quick", action="store_true", help="16 trajectories x 3 turns at 2 ms per token, 1 branch")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.trajectories, args.turns, args.step_ms, args.branches, args.stall_trajectories = 16, 3, "2", 1, 4
    with tempfile.TemporaryDirectory(prefix="appo-bench-agent-endpoint-") as tmp:  # removed after an error too
        return _figures(args, tmp)


def _figures(args: argparse.Namespace, tmp: str) -> dict:
    from appo_trl.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(tmp, "tiny"), chat_template="tools")
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=serve_fake, args=(model_dir, child_conn), daemon=True)
    server.start()
    pool = ctx.Pool(1) if args.client == "process" else None
    bench = Bench(model_dir, conn.recv(), args.client, pool)
    figures: dict = {"agent_trajectories": args.trajectories, "agent_turns": args.turns, "agent_client": args.client,
                     "agent_cpus": os.cpu_count()}  # fmt: skip
    try:
        parents = []
        for step in [float(s) for s in args.step_ms.split(",")]:
            conn.send(step / 1000)
            conn.recv()
            result, parents = bench.latency(f"s{step:g}", args.trajectories, args.turns)
            figures.update({f"agent_step{step:g}ms_{k}": v for k, v in result.items()})
            print(f"{step:g} ms/token (engine call p50 {result['engine_call_ms_p50']} ms), {args.trajectories} agents "
                  f"at once, {result['calls_per_s']} calls/s: added p50 {result['added_ms_p50']} ms, p99 "
                  f"{result['added_ms_p99']} ms (after turn 1: {result['added_ms_p50_after_turn1']} / "
                  f"{result['added_ms_p99_after_turn1']}), load {result['load_avg_1m']}", flush=True)  # fmt: skip
        if args.branches:
            figures.update(bench.replay(parents, args.turns, args.branches))
            print(f"replay: {figures['agent_replay_matched']} of {figures['agent_replayed_calls']} replayed calls "
                  f"matched ({100 * figures['agent_replay_match_rate']:.1f} %), "
                  f"{figures['agent_replay_diverged_branches']} of {figures['agent_replay_branches']} branches "
                  f"diverged, {figures['agent_replay_exact_prefix_branches']} hold their parent's tokens up to the "
                  "branch point")  # fmt: skip
        if args.stall_bytes:
            figures.update(stall := bench.stall(args.stall_trajectories, args.turns, args.stall_bytes))
            print(f"stall: {args.stall_trajectories} runs' round trips p50 {stall['stall_alone_trip_ms_p50']} ms "
                  f"(max {stall['stall_alone_trip_ms_max']}) alone, {stall['stall_with_big_bodies_trip_ms_p50']} ms "
                  f"(max {stall['stall_with_big_bodies_trip_ms_max']}) while one run posted "
                  f"{stall['stall_big_bodies']} bodies of {stall['stall_body_bytes']} bytes (HTTP "
                  f"{stall['stall_big_statuses']}, {stall['stall_big_body_s_p50']} s each): "
                  f"x{stall['stall_trip_p50_ratio']}")  # fmt: skip
    finally:
        bench.close()
        conn.send(None)
        server.join(timeout=30)
        if pool is not None:
            pool.close()
            pool.join()
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
