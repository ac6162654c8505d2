"""Long-tail benchmark of streaming rollouts: the trainer's group producer and in-flight sync, on a scripted server.

Tool-loop groups whose tool calls and completion lengths are heavy-tailed flow through the trainer's own producer
(`appo_trl.trainer.streaming.GroupStream`, the staleness bound and whole-group admission of `rollout_stream`) and
its in-flight sync (`appo_trl.trainer.inflight_sync.InFlightSync`: every server paused, the weights reloaded,
resumed), against the today's rounds. The sampler is `VLLMServerBackend` over real HTTP on the scripted vLLM server
of `bench/pausable_vllm.py` (one token per `--step-s`, vLLM 0.31's `/pause` and `/resume`); "training" is a sleep
of `--train-s` per step (the policy is not what is measured). A row makes a Pareto number of tool calls
(`--calls-alpha`, at most `--max-calls`), each answered after `--tool-s` (the same in every mode: only decoding
pauses at an update), and samples a Pareto number of tokens per turn (`--alpha`, `--min-tokens`, capped at
`--max-tokens`); the same rows, in the same order, in every mode. A step trains `--groups` groups of
`--group-size` rows. Modes, one after the other in one run:

- `sync`: sample a round, train, sync;
- `overlap` (today's `max_staleness: 1`): the next round samples while this one trains; the sync waits for both;
- `keep`, `abort`: `rollout_stream` with `inflight_update` keep / abort: one step's groups held at once, a step
  trains the oldest complete groups within `--max-staleness` (per token), then the weights update in flight;
- `keep_over`: `keep` with `stream_overprovision` `--overprovision` (the unfinished groups carry over).

Figures per mode: step time, trainer idle fraction (waiting for groups), server idle fraction (no request
decoding), per-token staleness (trained step minus the token's version: mean and max), rows dropped (too stale,
sampled again) and carried over, pause seconds per sync. Figures: docs/benchmarks.md, "Streaming rollouts".

    python bench/inflight.py                  # 8 steps
    python bench/inflight.py --even           # the even workload: nothing got slower there
    python bench/inflight.py --quick --json   # 3 steps (figures not meaningful)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appo_trl.rollout.types import Trajectory  # noqa: E402
from appo_trl.sampling import SamplingParams  # noqa: E402
from appo_trl.trainer.inflight_sync import InFlightSync  # noqa: E402
from appo_trl.trainer.streaming import GroupStream  # noqa: E402
from appo_trl.vllm.client import ServerClient  # noqa: E402
from appo_trl.vllm.inflight import PolicyClock  # noqa: E402
from appo_trl.vllm.server import VLLMServerBackend  # noqa: E402
from bench.pausable_vllm import PausableVLLM, ServerProcess  # noqa: E402

RESULT = [7, 8, 9, 10]  # a tool result's injected tokens (mask 0)


def pareto(rng: random.Random, alpha: float, low: float) -> float:
    return low * (1.0 - rng.random()) ** (-1.0 / alpha)


@dataclass
class Script:
    """One row: the tokens it samples in each turn (a tool call between two turns)."""

    turns: list[int]

    def cost_s(self, step_s: float, tool_s: float) -> float:
        return sum(self.turns) * step_s + (len(self.turns) - 1) * tool_s


def scripts(n: int, args) -> list[Script]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(n):
        if args.even:  # the overlap benchmark's even shape: two tool calls, three turns of 30-70 tokens
            out.append(Script([rng.randint(30, 70) for _ in range(3)]))
            continue
        calls = min(args.max_calls, int(pareto(rng, args.calls_alpha, 1.0)) - 1)
        turns = [min(args.max_tokens, math.ceil(pareto(rng, args.alpha, args.min_tokens))) for _ in range(calls + 1)]
        out.append(Script(turns))
    return out


class ReloadOnly:
    """`DiskWeightSync`'s surface for `InFlightSync`: the reload the server counts (no weights are written)."""

    def __init__(self, url: str):
        self.url, self.reset_prefix_cache = url, True

    def sync_weights(self):
        ServerClient(self.url).reload_weights("/bench")


class Run:
    """One mode's run: the server, the sampler, the clock and the figures it collects."""

    def __init__(self, server: PausableVLLM | ServerProcess, rows: list[Script], args):
        self.server, self.rows, self.args = server, iter(rows), args
        self.clock = PolicyClock(0)
        self.backend = VLLMServerBackend(server.url, clock=self.clock, max_concurrency=1024)
        self.staleness: list[int] = []
        self.idle_s = self.pauses_s = 0.0
        self.carried = self.dropped = self.syncs = 0
        self._busy, self._stop = 0.0, False
        self._watch = threading.Thread(target=self._server_busy, daemon=True)

    def _server_busy(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            time.sleep(0.002)
            now = time.perf_counter()
            if self.server.running and self.server.state == "running":
                self._busy += now - last
            last = now

    async def row(self) -> Trajectory:
        script = next(self.rows)
        t = Trajectory(prompt_ids=[1, 2, 3])
        for turn, n in enumerate(script.turns):
            seg = await self.backend.generate(t.prompt_ids + t.completion_ids, SamplingParams(max_tokens=n, seed=n))
            t.append(seg.token_ids, 1, list(seg.logprobs), versions=[v for v, k in seg.version_runs for _ in range(k)])
            if turn < len(script.turns) - 1:
                await asyncio.sleep(self.args.tool_s)  # the tool call: never paused
                t.append(RESULT, 0)
        return t

    async def group(self) -> list[Trajectory]:
        return list(await asyncio.gather(*(self.row() for _ in range(self.args.group_size))))

    def train(self, rows: list[Trajectory], step: int) -> None:
        for t in rows:
            self.staleness += [step - v for v, m in zip(t.versions, t.loss_mask) if m]
        time.sleep(self.args.train_s)

    # ---- today's rounds ---------------------------------------------------------------------------------------
    async def rounds(self, steps: int, overlap: bool) -> None:
        def round_():
            return asyncio.ensure_future(asyncio.gather(*(self.group() for _ in range(self.args.groups))))

        async def waited(aw):
            start = time.perf_counter()
            out = await aw
            self.idle_s += time.perf_counter() - start
            return out

        pending = round_()
        for step in range(steps):
            rows = [r for g in await waited(pending) for r in g]
            more = step < steps - 1
            if overlap and more:  # the next round samples on the weights of now while this one trains
                pending = round_()
            await asyncio.to_thread(self.train, rows, step)
            if overlap and more:
                await waited(pending)  # the drain: no request may decode through a sync
            await asyncio.to_thread(ReloadOnly(self.server.url).sync_weights)
            self.clock.advance(step + 1)
            self.syncs += 1
            if more and not overlap:
                pending = round_()

    # ---- rollout_stream: the trainer's producer ----------------------------------------------------------------
    def stream(self, steps: int, mode: str, overprovision: float) -> None:
        loop = asyncio.new_event_loop()  # the sampler's own thread, as the rollout engine's loop
        thread = threading.Thread(target=loop.run_forever, name="bench-sampler", daemon=True)
        thread.start()
        g = self.args.groups

        def start(group) -> concurrent.futures.Future:
            return asyncio.run_coroutine_threadsafe(self.group(), loop)

        stream = GroupStream(start, lambda: self.clock.version, group_size=self.args.group_size,
                             max_groups=max(g, math.ceil(g * (1 + overprovision))), max_staleness=self.args.max_staleness)  # fmt: skip
        sync = InFlightSync(ReloadOnly(self.server.url), [self.server.url], mode, self.clock)
        fed = 0

        def feed(k: int) -> None:
            nonlocal fed
            stream.feed([{"prompt": fed + i} for i in range(k) for _ in range(self.args.group_size)],
                        [[1, 2, 3]] * k, list(range(fed, fed + k)))  # fmt: skip
            fed += k

        try:
            for step in range(steps):
                if step:
                    sync.sync(step)  # in flight: the groups sampling are paused, not drained
                feed(max(0, 2 * stream.max_groups - stream.queued - stream.held))
                batch = stream.take(g, step)
                self.idle_s += batch.wait_s
                self.train([r for grp in batch.groups for r in grp.rows()], step)
            self.carried = stream.held * self.args.group_size
            self.dropped, self.syncs, self.pauses_s = stream.dropped_rows, len(sync.pause_s), sum(sync.pause_s)
        finally:
            stream.close()
            asyncio.run_coroutine_threadsafe(self.backend.aclose(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)

    def run(self, mode: str, steps: int) -> dict:
        self._watch.start()
        start = time.perf_counter()
        try:
            if mode in ("sync", "overlap"):
                asyncio.run(self._rounds_then_close(steps, mode == "overlap"))
            else:
                over = self.args.overprovision if mode == "keep_over" else 0.0
                self.stream(steps, "keep" if mode == "keep_over" else mode, over)
        finally:
            wall = time.perf_counter() - start
            self._stop = True
        return {
            f"{mode}_step_s": round(wall / steps, 4),
            f"{mode}_trainer_idle": round(self.idle_s / wall, 3),
            f"{mode}_server_idle": round(1.0 - self._busy / wall, 3),
            f"{mode}_staleness_mean": round(sum(self.staleness) / max(1, len(self.staleness)), 3),
            f"{mode}_staleness_max": max(self.staleness, default=0),
            f"{mode}_rows_dropped": self.dropped,
            f"{mode}_rows_carried": self.carried,
            f"{mode}_pause_s_per_sync": round(self.pauses_s / max(1, self.syncs), 4),
        }

    async def _rounds_then_close(self, steps: int, overlap: bool) -> None:
        try:
            await self.rounds(steps, overlap)
        finally:
            await self.backend.aclose()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="groups per training step")
    ap.add_argument("--group-size", type=int, default=4, help="rows per group (num_generations)")
    ap.add_argument("--step-s", type=float, default=0.002, help="seconds per decoded token")
    ap.add_argument("--train-s", type=float, default=0.3, help="seconds per training step")
    ap.add_argument("--tool-s", type=float, default=0.05, help="seconds per tool call (every mode)")
    ap.add_argument("--alpha", type=float, default=1.1, help="Pareto shape of the tokens per turn")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--calls-alpha", type=float, default=1.2, help="Pareto shape of 1 + the tool calls per row")
    ap.add_argument("--max-calls", type=int, default=14)
    ap.add_argument("--max-staleness", type=int, default=2, help="the streaming modes' bound (per token)")
    ap.add_argument("--overprovision", type=float, default=1.0, help="keep_over: stream_overprovision")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--even", action="store_true", help="no long tail: every row 2 tool calls, 3 turns of 30-70 "
                    "tokens (the overlap benchmark's shape)")  # fmt: skip
    ap.add_argument("--modes", default="sync,overlap,keep,abort,keep_over")
    ap.add_argument("--server-process", action="store_true", help="the scripted server in a process of its own, "
                    "as vLLM runs (default: a thread of this one)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="3 steps of 2 groups of 2 (figures not meaningful)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.groups, args.group_size, args.train_s, args.max_tokens, args.max_calls = 3, 2, 2, 0.05, 60, 3
    rows = scripts(args.steps * args.groups * args.group_size * 6 + 64, args)
    costs = sorted(r.cost_s(args.step_s, args.tool_s) for r in rows)
    calls = sorted(len(r.turns) - 1 for r in rows)
    figures = {"server": "process" if args.server_process else "thread",
               "median_row_s": round(costs[len(costs) // 2], 4), "slowest_row_s": round(costs[-1], 4),
               "median_calls": calls[len(calls) // 2], "max_calls": calls[-1]}  # fmt: skip
    for mode in args.modes.split(","):
        with (ServerProcess if args.server_process else PausableVLLM)(step_s=args.step_s) as server:
            figures.update(Run(server, rows, args).run(mode, args.steps))
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:32s} {value}")
    return figures


if __name__ == "__main__":
    main()
