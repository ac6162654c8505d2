"""Long-tail skeleton at the vLLM layer: between-rounds weight syncs against in-flight updates, on a scripted server.

Not yet the issue's benchmark: the trainer's streaming producer does not exist, so the "trainer" here is a sleep
of `--train-s` per step, and the sampler is `VLLMServerBackend` over real HTTP on the scripted vLLM server of
`bench/pausable_vllm.py` (one token per `--step-s`, vLLM 0.31's `/pause` and `/resume`). Completion lengths are
a Pareto draw (`--alpha`, `--min-tokens`, capped at `--max-tokens`; the slowest is well over 10x the median). A
step trains `--batch` completions. Modes, one after the other in one run, the same lengths in each:

- `sync`: sample a round of `batch` requests, train, sync;
- `overlap` (today's `max_staleness: 1`): the next round samples while this one trains; the sync waits for both;
- `keep`, `abort`: `--slots` requests always in flight (refilled as they finish); a step trains the oldest
  `batch` finished ones while the others go on, then an in-flight update (`ServerPause`) moves the weights;
- `keep_over`: `keep` with twice the slots (over-provisioning; the unfinished carry over).

Figures per mode: step time, trainer idle fraction (waiting for completions), server idle fraction (no request
decoding), per-token staleness (trained version minus the token's version: mean and max), rows carried over,
pause seconds per sync. Figures: docs/benchmarks.md, "In-flight updates (skeleton)".

    python bench/inflight.py                  # 8 steps
    python bench/inflight.py --quick --json   # 3 steps (figures not meaningful)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appo_trl.sampling import SamplingParams  # noqa: E402
from appo_trl.vllm.client import ServerClient  # noqa: E402
from appo_trl.vllm.inflight import PolicyClock, ServerPause  # noqa: E402
from appo_trl.vllm.server import VLLMServerBackend  # noqa: E402
from bench.pausable_vllm import PausableVLLM  # noqa: E402


def pareto_lengths(n: int, alpha: float, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(high, math.ceil(low * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]


class Run:
    """One mode's run: the server, the sampler, the clock and the figures it collects."""

    def __init__(self, server: PausableVLLM, lengths: list[int], args):
        self.server, self.lengths, self.args = server, iter(lengths), args
        self.clock = PolicyClock(0)
        self.backend = VLLMServerBackend(server.url, clock=self.clock, max_concurrency=4 * args.slots)
        self.version = 0  # the trainer's
        self.staleness: list[int] = []
        self.idle_s = self.pauses_s = 0.0
        self.carried = 0
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

    async def sample(self) -> object:
        n = next(self.lengths)
        return await self.backend.generate([1, 2, 3], SamplingParams(max_tokens=n, seed=n))

    async def train(self, batch) -> None:
        for seg in batch:
            self.staleness += [self.version - v for v, k in seg.version_runs for _ in range(k)]
        await asyncio.sleep(self.args.train_s)
        self.version += 1

    def reload(self) -> None:
        ServerClient(self.server.url).reload_weights("/bench")

    async def sync_between_rounds(self) -> None:
        await asyncio.to_thread(self.reload)
        self.clock.advance(self.version)

    async def update_in_flight(self, mode: str) -> None:
        pause = ServerPause([self.server.url], mode=mode, clock=self.clock, settle_s=0.005)

        def go():
            with pause.paused(version=self.version):
                self.reload()

        await asyncio.to_thread(go)
        self.pauses_s += pause.pause_s_last

    async def waited(self, aw):
        start = time.perf_counter()
        out = await aw
        self.idle_s += time.perf_counter() - start
        return out

    async def rounds(self, steps: int, overlap: bool) -> None:
        def round_():
            return asyncio.ensure_future(asyncio.gather(*(self.sample() for _ in range(self.args.batch))))

        pending = round_()
        for step in range(steps):
            batch = await self.waited(pending)
            more = step < steps - 1
            if overlap and more:  # the next round samples on the weights of now while this one trains
                pending = round_()
            await self.train(batch)
            if overlap and more:
                await self.waited(pending)  # the drain: no request may decode through a sync
            await self.sync_between_rounds()
            if more and not overlap:
                pending = round_()

    async def stream(self, steps: int, mode: str, slots: int) -> None:
        done: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        def finished(task):
            running.discard(task)
            if not task.cancelled():
                done.put_nowait(task.result())

        def refill():
            while len(running) < slots:
                task = asyncio.ensure_future(self.sample())
                running.add(task)
                task.add_done_callback(finished)

        refill()
        for _ in range(steps):
            batch = []
            while len(batch) < self.args.batch:
                batch.append(await self.waited(done.get()))
                refill()
            await self.train(batch)
            await self.update_in_flight(mode)
            refill()
        self.carried = done.qsize() + len(running)
        for task in list(running):
            task.cancel()

    async def run(self, mode: str, steps: int) -> dict:
        self._watch.start()
        start = time.perf_counter()
        try:
            if mode in ("sync", "overlap"):
                await self.rounds(steps, overlap=mode == "overlap")
            else:
                slots = self.args.slots * (2 if mode == "keep_over" else 1)
                await self.stream(steps, "keep" if mode == "keep_over" else mode, slots)
        finally:
            wall = time.perf_counter() - start
            self._stop = True
            await self.backend.aclose()
        return {
            f"{mode}_step_s": round(wall / steps, 4),
            f"{mode}_trainer_idle": round(self.idle_s / wall, 3),
            f"{mode}_server_idle": round(1.0 - self._busy / wall, 3),
            f"{mode}_staleness_mean": round(sum(self.staleness) / max(1, len(self.staleness)), 3),
            f"{mode}_staleness_max": max(self.staleness, default=0),
            f"{mode}_carried_over": self.carried,
            f"{mode}_pause_s_per_sync": round(self.pauses_s / steps, 4),
        }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="completions per training step")
    ap.add_argument("--slots", type=int, default=16, help="requests in flight in the streaming modes")
    ap.add_argument("--step-s", type=float, default=0.002, help="seconds per decoded token")
    ap.add_argument("--train-s", type=float, default=0.3, help="seconds per training step")
    ap.add_argument("--alpha", type=float, default=1.1, help="Pareto shape of the completion lengths")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 steps of 4 (figures not meaningful)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.slots, args.train_s, args.max_tokens = 3, 4, 4, 0.05, 120
    lengths = pareto_lengths(args.steps * args.batch * 4 + 8 * args.slots, args.alpha, args.min_tokens,
                             args.max_tokens, args.seed)  # fmt: skip
    ordered = sorted(lengths)
    figures = {"median_tokens": ordered[len(ordered) // 2], "max_tokens": ordered[-1]}
    for mode in ("sync", "overlap", "keep", "abort", "keep_over"):
        with PausableVLLM(step_s=args.step_s) as server:
            figures.update(asyncio.run(Run(server, lengths, args).run(mode, args.steps)))
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:32s} {value}")
    return figures


if __name__ == "__main__":
    main()
