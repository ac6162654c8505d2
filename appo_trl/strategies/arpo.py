"""`arpo`: `initial_rollouts` roots per prompt, entropy-driven branching after tool results inside the tool loop.

The engine calls `BranchHook` after every tool result; forks and refills bring each group to exactly n rows, and
every row reaches the loss. The user's agent runs its own loop: the same hook then decides on the recorded runs,
and forks re-run the agent by replay (`appo_trl.strategies.arpo_replay`). AEPO
(`appo_trl.strategies.aepo`) is this loop with its penalty and budget.
"""

from __future__ import annotations

import math
import random
from typing import Any

from appo_trl.strategies.base import RolloutStrategy, register_strategy
from appo_trl.strategies.record import Round


class BranchHook:
    """ARPO / AEPO in-loop branching rule, called by the engine after every tool result (`hook(ctx) -> copies`).

    P = clip(τ + β·(H_t − H_root)) with H_t the entropy of the tokens sampled right *after* the current result
    (`lookahead` timing; `faithful` uses the segment before the call, as the reference's lagged code) and
    H_root the trajectory's own root entropy (inherited by its branches; no stale per-prompt dictionary).
    `empty_segment_entropy: zero` reads an empty segment as H = 0 (released code) instead of "unknown" (ΔH = 0).
    AEPO uses the reference's penalised form P = clip(1 − τ/f + β·ΔH) with f = max(0, 1 − penalty·l)
    (`appo_trl.algorithms.arpo`); l counts, with `aepo_penalty_scope: lineage` (ours), the consecutive fork points
    of this trajectory's lineage that forked, and with `prompt` (released code) the consecutive rounds in which
    the prompt created trajectories (forks or refills), not reset by rounds in which nothing in the batch was
    created (`PromptRoundCounter`). Up to `beam_size − 1` Bernoulli copies per call; the engine caps groups at n
    and refills them. Draws are seeded per (round, trajectory, position), not by call order.
    """

    def __init__(self, args, seed: int, penalty: bool):
        from appo_trl.algorithms.arpo import PromptRoundCounter

        self.args, self.seed, self.penalty = args, seed, penalty
        self.consecutive: dict[str, int] = {}
        self.rounds = PromptRoundCounter()
        self.base: dict[str, int] = {}  # uid -> round offset (a decision is in round base + num_calls)
        self.last_round: dict[int, int] = {}  # group -> last decision round seen
        self.known: dict[int, int] = {}  # group -> trajectories the hook knows were created
        self.calls = self.copies = 0
        self.prob_sum = 0.0

    def _round(self, ctx) -> int:
        """Round of this decision in the released round-synchronous sampler; records refills as creations."""
        traj, g = ctx.trajectory, ctx.trajectory.group
        if traj.uid not in self.base:
            if traj.parent is not None and traj.parent in self.base:
                self.base[traj.uid] = self.base[traj.parent]
            elif traj.origin == "refill":
                # the group ran dry at the end of round R = last decision + 1; k refills seen at once were
                # created in rounds R .. R + k − 1 (the earlier ones ended without a tool call)
                new = max(ctx.group_size - self.known.get(g, ctx.group_size), 1)
                first = self.last_round.get(g, 0) + 1
                for k in range(new):
                    self.rounds.record(g, first + k)
                self.base[traj.uid] = first + new - 1
            else:
                self.base[traj.uid] = 0
        self.known[g] = ctx.group_size
        r = self.base[traj.uid] + traj.num_calls
        self.last_round[g] = max(self.last_round.get(g, 0), r)
        return r

    def __call__(self, ctx) -> int:
        from appo_trl.algorithms.arpo import aepo_consecutive_penalty, arpo_branch_probability, sample_branch_copies
        from appo_trl.rollout import mix_seed

        a, traj = self.args, ctx.trajectory
        h_now = ctx.lookahead_entropy if ctx.lookahead_entropy is not None else ctx.segment_entropy
        h_root = ctx.root_entropy
        if a.empty_segment_entropy == "zero":  # released code: an empty segment has H = 0
            h_now = 0.0 if math.isnan(h_now) else h_now
            h_root = 0.0 if math.isnan(h_root) else h_root
        by_prompt = a.aepo_penalty_scope == "prompt"
        r = self._round(ctx) if by_prompt else 0
        if by_prompt:
            run = self.rounds.counter(traj.group, r)
        else:
            run = self.consecutive.get(traj.uid, self.consecutive.get(traj.parent, 0))
        factor = aepo_consecutive_penalty(run, rate=a.branch_penalty) if self.penalty else None
        prob = arpo_branch_probability(
            h_now, h_root, base=a.branch_probability, weight=a.entropy_weight, penalty_factor=factor
        )
        rng = random.Random(mix_seed(self.seed, traj.seed, ctx.position))
        slots = max(ctx.target - ctx.group_size, 0)
        copies = int(sample_branch_copies(prob, a.beam_size - 1, rng))
        if by_prompt and min(copies, slots):
            self.rounds.record(traj.group, r)
            self.known[traj.group] = ctx.group_size + min(copies, slots)
        self.consecutive[traj.uid] = run + 1 if copies else 0
        self.calls, self.copies, self.prob_sum = self.calls + 1, self.copies + copies, self.prob_sum + float(prob)
        return copies


@register_strategy
class ARPOStrategy(RolloutStrategy):
    """ARPO: N roots per prompt, in-loop branching after tool results, groups refilled to exactly n."""

    name = "arpo"
    default_loss_mode = "clip"
    card_title = "ARPO (Agentic Reinforced Policy Optimization, arXiv 2507.19849)"
    paper = {
        "name": "ARPO",
        "title": "Agentic Reinforced Policy Optimization",
        "id": "2507.19849",
        "citation": "@article{arpo2025,\n"
        "    title        = {{Agentic Reinforced Policy Optimization}},\n"
        "    year         = 2025,\n"
        "    eprint       = {arXiv:2507.19849},\n"
        "}",
    }
    penalty = False
    branches_by_replay = True
    streams = True  # one prompt's tree per streamed group; the entropy rule reads the sampler's own entropies
    metric_keys = (
        "branch/points_per_prompt",
        "branch/initial_per_prompt",
        "branch/depth_mean",
        "branch/probability_mean",
        "branch/refill_per_prompt",
    )

    @classmethod
    def needs_agent_entropies(cls, args) -> bool:
        return True  # the rule reads the sampler entropies of the recorded runs (the engine records them with a hook)

    def entropy_window(self, engine):
        """The engine's window entropy over recorded rows (for fork points and budgets measured after the runs)."""
        from appo_trl.strategies.arpo_replay import EntropyWindow

        return EntropyWindow(engine.config, len(self.policy.processing_class_tokenizer))

    def initial_counts(self, prompt_ids, n, seed, engine) -> tuple[list[int], list[list[Any]]]:
        """Roots per prompt and trajectories already sampled for each group (none for ARPO)."""
        return [self.args.initial_rollouts] * len(prompt_ids), [[] for _ in prompt_ids]

    def generate(self, prompt_ids, n, seed, engine):
        counts, kept = self.initial_counts(prompt_ids, n, seed, engine)
        hook = BranchHook(self.args, seed, self.penalty)
        sizes = [n - len(k) for k in kept]
        if engine.replays_branches:  # the user's agent: the rule on its recorded runs
            from appo_trl.strategies.arpo_replay import branch_after_runs

            groups = branch_after_runs(engine, hook, prompt_ids, counts, sizes, seed, self.entropy_window(engine))
        else:
            groups = engine.run(engine.rollout(prompt_ids, counts, seed=seed, hook=hook, group_size=sizes))
        groups = [list(k) + list(g) for k, g in zip(kept, groups)]
        rows = [t for g in groups for t in g]
        origin = [t.origin for t in rows]
        metrics = {
            "branch/points_per_prompt": origin.count("fork") / len(groups),
            "branch/initial_per_prompt": sum(counts) / len(groups) + sum(len(k) for k in kept) / len(groups),
            "branch/depth_mean": sum(_depth(t, rows) for t in rows) / len(rows),
            "branch/probability_mean": hook.prob_sum / hook.calls if hook.calls else math.nan,
            "branch/refill_per_prompt": origin.count("refill") / len(groups),
        }
        return Round(groups=groups, keep=[True] * len(rows), metrics=metrics)


def _depth(traj, rows) -> int:
    """Fork depth: 0 for a root, 1 + the parent's depth for a fork (parents looked up among `rows` by uid)."""
    by_uid = {t.uid: t for t in rows}
    depth, cur = 0, traj
    while cur.parent is not None and depth < 64:
        depth += 1
        if cur.parent not in by_uid:
            break
        cur = by_uid[cur.parent]
    return depth
