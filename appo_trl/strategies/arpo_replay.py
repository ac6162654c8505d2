"""ARPO / AEPO branching on recorded runs: the in-loop rule of `BranchHook`, applied after the user's agent ran.

An agent's own loop exposes no hook, so `branch_after_runs` runs the roots first, then asks the same `BranchHook`
at each recorded fork point (`fork_points`: the first sampled token after a tool or user result, a 0 → 1 step of
the loss mask) with the entropies the engine would have measured there. Decisions go in waves, one fork point per
row per wave in the group's creation order (the round-synchronous order of the in-loop sampler); each copy re-runs
the agent by replay up to that point (`engine.branch_many`), and its own later fork points join the next waves. A
group still short of its size when no decision is left gets one fresh run (`refill`), as the engine refills.
"""

from __future__ import annotations

import dataclasses
import math

from appo_trl.rollout import mix_seed
from appo_trl.rollout.text import window_entropy
from appo_trl.rollout.types import BranchContext, Origin


@dataclasses.dataclass(frozen=True)
class ForkPoint:
    """Where a recorded row could fork, and what the in-loop hook would have seen there.

    position: the first sampled token after a result (`completion_ids[:position]` is shared).
    segment_entropy: window entropy of the sampled segment that ended before the result (`faithful` timing).
    lookahead_entropy: window entropy of the tokens sampled from `position` (`lookahead` timing; None otherwise).
    turns: tool/user turns up to this one (the row's call count at the decision, one per turn).
    """

    position: int
    segment_entropy: float
    lookahead_entropy: float | None
    turns: int


def sampled_segments(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of sampled tokens (mask 1)."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


class EntropyWindow:
    """The engine's window entropy (`RolloutConfig.entropy_window`, `entropy_reduce`, normalised or not)."""

    def __init__(self, config, vocab_size: int):
        self.window, self.reduce = config.entropy_window, config.entropy_reduce
        self.norm = math.log(vocab_size) if config.entropy_normalize else 1.0
        self.timing = config.hook_mode

    def __call__(self, traj, start: int, end: int) -> float:
        if traj.entropies is None:
            return math.nan
        return window_entropy(traj.entropies[start:end], self.window, self.reduce, self.norm)

    def root(self, traj) -> float:
        """The row's root entropy: its own first segment's (as the engine records it), or the one it inherited."""
        if traj.root_entropy is not None:
            return traj.root_entropy
        segs = sampled_segments(traj.loss_mask)
        return self(traj, *segs[0]) if segs else math.nan

    def fork_points(self, traj) -> list[ForkPoint]:
        """Every fork point of `traj` after its `branch_pos` (a branch's earlier ones are its parent's)."""
        segs, after = sampled_segments(traj.loss_mask), traj.branch_pos if traj.branch_pos is not None else -1
        out = []
        for k in range(1, len(segs)):
            start, end = segs[k]
            if start > after:
                look = self(traj, start, end) if self.timing == "lookahead" else None
                out.append(ForkPoint(start, self(traj, *segs[k - 1]), look, k))
        return out


def decide(hook, traj, point: ForkPoint, root_entropy: float, created: int, target: int, active: int) -> int:
    """`hook`'s copies at `point` of the recorded `traj`, as the engine would ask it (capped at the group's slots)."""
    view = dataclasses.replace(traj, num_calls=point.turns)  # the call count at the decision
    ctx = BranchContext(view, point.position, point.segment_entropy, root_entropy, point.lookahead_entropy,
                        created, target, active)  # fmt: skip
    return max(0, min(int(hook(ctx)), target - created))


def branch_after_runs(engine, hook, prompt_ids: list[list[int]], counts: list[int], sizes: list[int], seed: int,
                      window: EntropyWindow) -> list[list]:  # fmt: skip
    """`counts[g]` runs of prompt g, then branches and refills by `hook` until group g holds `sizes[g]` rows."""
    groups = [list(g) for g in engine.run(engine.rollout(prompt_ids, counts, seed=seed))]
    queues: dict[str, list[ForkPoint]] = {}

    def enter(t, g: int, origin: Origin, row_seed: int, root: float | None = None) -> None:
        t.group = g
        t.origin, t.seed, t.root_entropy = origin, row_seed, (window.root(t) if root is None else root)
        queues[t.uid] = window.fork_points(t)

    for g, rows in enumerate(groups):
        for j, t in enumerate(rows):
            enter(t, g, Origin.ROOT, mix_seed(seed, g, j))
    wave = refills = 0
    while True:
        requests, forks, decided = [], [], False
        for g, rows in enumerate(groups):
            created, active = len(rows), sum(bool(queues[t.uid]) for t in rows)
            for t in list(rows):
                if not queues[t.uid]:
                    continue
                point, decided = queues[t.uid].pop(0), True
                copies = decide(hook, t, point, t.root_entropy, created, sizes[g], active)
                for k in range(copies):
                    requests.append((t, point.position))
                    forks.append((g, t, point.position, k))
                created += copies
                active -= not queues[t.uid]
        if requests:
            children = engine.run(engine.branch_many(requests, seed=mix_seed(seed, "wave", wave), resample=True))
            for (g, parent, position, k), child in zip(forks, children):
                fork_seed = mix_seed(parent.seed, "fork", position, k)  # keyed on the lineage, as in the loop
                enter(child, g, Origin.FORK, fork_seed, parent.root_entropy)
                groups[g].append(child)
        elif not decided:
            short = [int(len(rows) < size) for rows, size in zip(groups, sizes)]
            if not any(short):
                return groups
            fresh = engine.run(engine.rollout(prompt_ids, short, seed=mix_seed(seed, "refill", refills)))
            refills += 1
            for g, rows in enumerate(fresh):
                for t in rows:
                    enter(t, g, Origin.REFILL, mix_seed(seed, "refill", g, len(groups[g])))
                    groups[g].append(t)
        wave += 1


__all__ = ["EntropyWindow", "ForkPoint", "branch_after_runs", "decide", "sampled_segments"]
