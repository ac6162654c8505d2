"""Rollout strategies of `APPOTrainer`: how one generation round turns unique prompts into groups of n rows.

A strategy orchestrates the rollout engine (`appo_trl.rollout`) and the pure branching / advantage maths
(`appo_trl.algorithms`); it holds no maths of its own and no trainer state across rounds (checkpoint resume
restarts a round from scratch). Registry `STRATEGIES`: name -> class.

- `grpo`: n independent rollouts per prompt through the tool loop; every row reaches the loss.
- `arpo` / `aepo`: `initial_rollouts` per prompt, entropy-driven branching after tool results inside the tool
  loop (the engine's `hook`), refilled by the engine to exactly n rows; every row reaches the loss.
- `appo`: `initial_rollouts` per prompt, one trainer forward on them, branch points by BS = Z(H)·Z(FV),
  n − N branch rollouts, dual-group advantages credited to the source prefix; branch rows are removed before
  the loss (`RoundBatch.keep`).

What this module does not do: tokenise prompts, gather across ranks, log, or compute losses (the trainer does).
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field
from typing import Any

import torch

from appo_trl.trainer.rows import pad_rows

TRL_STD_EPS = 1e-4  # ε in TRL's (r − mean)/(std + ε) group advantage


@dataclass
class RoundBatch:
    """One generation round on one rank: `groups[g]` holds the n trajectories of unique prompt g, initial first.

    `keep[i]` (row order = groups flattened) says whether row i reaches the loss; `info` carries what the
    strategy needs again after the rewards (branch points, scores); `metrics` are per-round scalars under fixed
    keys (the trainer averages them across ranks).
    """

    groups: list[list[Any]]
    keep: list[bool]
    info: dict = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> list[Any]:
        return [t for g in self.groups for t in g]


class RolloutStrategy:
    """Base strategy: `generate` one round, then optionally replace the advantages once rewards are known."""

    name = "base"
    metric_keys: tuple[str, ...] = ()

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args

    @property
    def engine(self):
        return self.trainer.rollout_engine

    def generate(self, prompt_ids: list[list[int]], n: int, seed: int) -> RoundBatch:
        raise NotImplementedError

    def advantages(self, batch: RoundBatch, rewards: torch.Tensor, default: torch.Tensor, length: int) -> torch.Tensor:
        """Advantages for the local rows (before any row is dropped); TRL's group advantages by default.

        With `advantage_std_eps` other than TRL's 1e-4 (the released code: 1e-6) the group advantages are
        recomputed as (r − mean_g)/(std_g + ε) with TRL's unbiased group std (`scale_rewards: group` only).
        """
        eps = getattr(self.args, "advantage_std_eps", TRL_STD_EPS)
        if eps == TRL_STD_EPS:
            return default
        from appo_trl.algorithms.advantages import group_advantages

        n = len(batch.groups[0]) if batch.groups else 1
        return group_advantages(rewards, n, std="unbiased", eps=eps).to(default)


class GRPOStrategy(RolloutStrategy):
    """n independent tool-loop rollouts per prompt (the fair baseline: same loop, no branching)."""

    name = "grpo"

    def generate(self, prompt_ids, n, seed):
        groups = self.engine.run(self.engine.rollout(prompt_ids, n, seed=seed))
        return RoundBatch(groups=groups, keep=[True] * (len(groups) * n))


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
            elif traj.meta.get("origin") == "refill":
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
        if getattr(a, "empty_segment_entropy", "nan") == "zero":  # released code: an empty segment has H = 0
            h_now = 0.0 if math.isnan(h_now) else h_now
            h_root = 0.0 if math.isnan(h_root) else h_root
        by_prompt = getattr(a, "aepo_penalty_scope", "lineage") == "prompt"
        r = self._round(ctx) if by_prompt else 0
        if by_prompt:
            run = self.rounds.counter(traj.group, r)
        else:
            run = self.consecutive.get(traj.uid, self.consecutive.get(traj.parent, 0))
        factor = aepo_consecutive_penalty(run, rate=a.branch_penalty) if self.penalty else None
        prob = arpo_branch_probability(
            h_now, h_root, base=a.branch_probability, weight=a.entropy_weight, penalty_factor=factor
        )
        rng = random.Random(mix_seed(self.seed, traj.meta.get("seed", 0), ctx.position))
        slots = max(ctx.target - ctx.group_size, 0)
        copies = int(sample_branch_copies(prob, a.beam_size - 1, rng))
        if by_prompt and min(copies, slots):
            self.rounds.record(traj.group, r)
            self.known[traj.group] = ctx.group_size + min(copies, slots)
        self.consecutive[traj.uid] = run + 1 if copies else 0
        self.calls, self.copies, self.prob_sum = self.calls + 1, self.copies + copies, self.prob_sum + float(prob)
        return copies


class ARPOStrategy(RolloutStrategy):
    """ARPO: N roots per prompt, in-loop branching after tool results, groups refilled to exactly n."""

    name = "arpo"
    penalty = False
    metric_keys = (
        "branch/points_per_prompt",
        "branch/initial_per_prompt",
        "branch/depth_mean",
        "branch/probability_mean",
        "branch/refill_per_prompt",
    )

    def initial_counts(self, prompt_ids, n, seed) -> tuple[list[int], list[list[Any]]]:
        """Roots per prompt and trajectories already sampled for each group (none for ARPO)."""
        return [self.args.initial_rollouts] * len(prompt_ids), [[] for _ in prompt_ids]

    def generate(self, prompt_ids, n, seed):
        counts, kept = self.initial_counts(prompt_ids, n, seed)
        hook = BranchHook(self.args, seed, self.penalty)
        sizes = [n - len(k) for k in kept]
        groups = self.engine.run(self.engine.rollout(prompt_ids, counts, seed=seed, hook=hook, group_size=sizes))
        groups = [list(k) + list(g) for k, g in zip(kept, groups)]
        rows = [t for g in groups for t in g]
        origin = [t.meta.get("origin", "root") for t in rows]
        metrics = {
            "branch/points_per_prompt": origin.count("fork") / len(groups),
            "branch/initial_per_prompt": sum(counts) / len(groups) + sum(len(k) for k in kept) / len(groups),
            "branch/depth_mean": sum(_depth(t, rows) for t in rows) / len(rows),
            "branch/probability_mean": hook.prob_sum / hook.calls if hook.calls else math.nan,
            "branch/refill_per_prompt": origin.count("refill") / len(groups),
        }
        return RoundBatch(groups=groups, keep=[True] * len(rows), metrics=metrics)


class AEPOStrategy(ARPOStrategy):
    """AEPO: ARPO's loop with the consecutive-branch penalty and an optional dynamic initial budget.

    `dynamic_rollouts_source="probe"` (reference): one extra full rollout per prompt measures H_root and the
    mean segment entropy H_tool, then is discarded. `"reuse"`: the same first rollout is kept as a group member
    (no extra sampling) and the remaining roots and branches fill the other n − 1 slots.
    """

    name = "aepo"
    penalty = True

    def initial_counts(self, prompt_ids, n, seed):
        a = self.args
        if not a.dynamic_rollouts:
            return super().initial_counts(prompt_ids, n, seed)
        from appo_trl.algorithms.arpo import aepo_initial_rollouts
        from appo_trl.rollout.text import window_entropy

        # other samples than the group's (seed + 7919), on the same replica as the group (tree ids from `seed`)
        probes = self.engine.run(self.engine.rollout(prompt_ids, 1, seed=seed + 7919, tree_seed=seed))
        cfg = self.engine.config
        norm = math.log(len(self.trainer.processing_class_tokenizer)) if cfg.entropy_normalize else 1.0
        counts, kept = [], []
        for (probe,) in probes:
            ents = probe.entropies or []
            starts = [0] + sorted({c.end for c in probe.tool_calls})  # the calls of one chat turn share `end`
            seg = [
                window_entropy(ents[s:], cfg.entropy_window, cfg.entropy_reduce, norm) for s in starts if s < len(ents)
            ]
            h_tool = sum(seg) / len(seg) if seg else math.nan
            h_root = probe.meta.get("root_entropy", math.nan)
            if math.isnan(h_root) or math.isnan(h_tool):  # no entropies recorded: the configured budget
                k = a.initial_rollouts
            else:
                k = int(aepo_initial_rollouts(h_root, h_tool, n))
            if a.dynamic_rollouts_source == "reuse" and n > 1:
                counts.append(min(max(k - 1, 1), n - 1))
                kept.append([probe])
            else:
                counts.append(min(max(k, 1), n))
                kept.append([])
        return counts, kept


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


def excluded_token_mask(tokenizer, mode: str = "whitespace_punct") -> torch.Tensor:
    """Bool (V,): token ids that are never branch points.

    `whitespace_punct` (ours): text only whitespace / punctuation, or a special token. `whitespace` (released
    APPO code): `decode([id]).strip() == ""` only, so punctuation and special tokens (e.g. the final EOS) stay.
    """
    if mode not in ("whitespace_punct", "whitespace"):
        raise ValueError(f"mode must be 'whitespace_punct' or 'whitespace', got {mode!r}")
    strip = string.whitespace + string.punctuation if mode == "whitespace_punct" else None
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids) if mode == "whitespace_punct" else set()
    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(vocab):
        out[i] = i in special or tokenizer.decode([i]).strip(strip) == ""
    return out


class APPOStrategy(RolloutStrategy):
    """APPO (APPO paper; docs/fidelity.md): score initial rollouts, branch at n − N points, credit the source prefix."""

    name = "appo"
    metric_keys = (
        "branch/points_per_prompt",
        "branch/rows_dropped",
        "branch/bs_mean",
        "branch/bs_max",
        "branch/h_mean",
        "branch/fv_mean",
        "branch/fv_std",
        "branch/position_mean",
        "branch/fallback_frac",
        "branch/no_candidates",
    )

    def __init__(self, trainer):
        super().__init__(trainer)
        self._excluded = None

    def _exclusions(self) -> torch.Tensor | None:
        mode = getattr(self.args, "branch_token_filter", "whitespace_punct")
        if not self.args.exclude_whitespace_punct or mode == "none":
            return None
        if self._excluded is None:
            self._excluded = excluded_token_mask(self.trainer.processing_class_tokenizer, mode)
        return self._excluded

    def generate(self, prompt_ids, n, seed):
        from appo_trl.algorithms.branching import appo_branch_points, candidate_mask, future_value

        a, N = self.args, self.args.initial_rollouts
        init = self.engine.run(self.engine.rollout(prompt_ids, N, seed=seed))
        if N == n:  # degenerate: nothing to branch, APPO reduces to its loss on n initial rollouts
            return RoundBatch(groups=init, keep=[True] * (len(init) * n), info={"points": [[] for _ in init]})
        flat = [t for g in init for t in g]
        scored = self.trainer.score_trajectories(flat)  # trainer forward: current logps (+ exact entropies)
        mask = pad_rows([t.loss_mask for t in flat], 0).float()
        ids = pad_rows([t.completion_ids for t in flat], 0)
        sampler_lp = pad_rows([t.logprobs for t in flat], float("nan"))
        sampler_lp = torch.nan_to_num(sampler_lp, nan=0.0) * mask
        if a.branch_entropy_source == "trainer":
            entropy = scored["entropies"]
        elif any(t.entropies is None for t in flat):
            raise RuntimeError(
                "branch_entropy_source=sampler_topk needs sampler entropies: build the rollout engine "
                "with RolloutConfig(record_entropies=True) or set branch_entropy_source=trainer."
            )
        else:
            entropy = torch.nan_to_num(pad_rows([t.entropies for t in flat], float("nan")), nan=0.0)
        fv = future_value(scored["logps"] * mask, sampler_lp, mask, gamma=a.fv_gamma, clip_eps=a.future_kl_clip_ratio)
        excluded = self._exclusions()
        token_excluded = excluded[ids.clamp(max=len(excluded) - 1)] if excluded is not None else None
        valid = candidate_mask(
            mask,
            min_remaining=a.min_remaining_tokens,
            excluded=token_excluded,
            max_length=a.max_completion_length,
            exclude_last=not getattr(a, "branch_allow_last_token", False),
        )
        points, _ = appo_branch_points(
            entropy,
            fv,
            mask,
            valid,
            group_size=N,
            num_branches=n - N,
            zscore_scope=getattr(a, "branch_zscore_scope", "candidates"),
            degeneracy_guard=getattr(a, "fv_degeneracy_guard", True),
            max_per_row=a.max_branches_per_rollout,
        )
        requests = [(init[g][p.row], p.position) for g, pts in enumerate(points) for p in pts]
        branches = self.engine.run(
            self.engine.branch_many(requests, seed=seed + 1, resample=a.resample_selected_token)
        )
        groups, k = [], 0
        for g, pts in enumerate(points):
            groups.append(list(init[g]) + list(branches[k : k + len(pts)]))
            k += len(pts)
        all_pts = [p for pts in points for p in pts]
        valid_any = valid.any(dim=1).view(len(init), N).any(dim=1)
        metrics = {
            "branch/points_per_prompt": len(all_pts) / len(init),
            "branch/rows_dropped": float(len(all_pts)),
            "branch/bs_mean": float(sum(p.score for p in all_pts) / max(len(all_pts), 1)),
            "branch/bs_max": float(max((p.score for p in all_pts), default=0.0)),
            "branch/h_mean": float((entropy * mask).sum() / mask.sum().clamp(min=1)),
            "branch/fv_mean": float((fv * mask).sum() / mask.sum().clamp(min=1)),
            "branch/fv_std": float(fv[mask.bool()].std(correction=0)) if mask.sum() > 1 else 0.0,
            "branch/position_mean": float(sum(p.position for p in all_pts) / max(len(all_pts), 1)),
            "branch/fallback_frac": sum(not p.strict for p in all_pts) / max(len(all_pts), 1),
            "branch/no_candidates": float((~valid_any).float().mean()),
        }
        keep = ([True] * N + [False] * (n - N)) * len(init)
        # step 2's logps are θ_old's: the trainer reuses them as old logps instead of a second forward
        old = [scored["logps"][i, : len(t.completion_ids)] for i, t in enumerate(flat)]
        old_rows = [old[g * N + j] if j < N else None for g in range(len(init)) for j in range(n)]
        return RoundBatch(groups=groups, keep=keep, info={"points": points, "old_logps": old_rows}, metrics=metrics)

    def advantages(self, batch, rewards, default, length):
        """(B_local, T) advantages: initial rows get dual-group credit; branch rows keep TRL's value (dropped later)."""
        if self.args.advantage_mode == "group" or self.args.initial_rollouts == self.args.num_generations:
            return super().advantages(batch, rewards, default, length)
        from appo_trl.algorithms.advantages import appo_dual_group_advantages

        a, n, N = self.args, self.args.num_generations, self.args.initial_rollouts
        G = len(batch.groups)
        r = rewards.view(G, n)
        points = batch.info["points"]
        lengths = torch.tensor([[len(t.completion_ids) for t in g[:N]] for g in batch.groups])
        adv = appo_dual_group_advantages(
            initial_rewards=r[:, :N],
            branch_rewards=r[:, N:],
            branch_rows=torch.tensor([[p.row for p in pts] for pts in points], dtype=torch.long),
            branch_positions=torch.tensor([[p.position for p in pts] for pts in points], dtype=torch.long),
            branch_scores=torch.tensor([[p.score for p in pts] for pts in points], dtype=torch.float),
            lengths=lengths,
            max_length=length,
            discount=a.reward_scale_discount,
            m_scaling=a.m_scaling,
        )  # (G·N, T)
        out = default.view(-1, 1).expand(-1, length).clone().view(G, n, length)
        out[:, :N] = adv.view(G, N, length).to(out)
        return out.view(G * n, length)


STRATEGIES: dict[str, type[RolloutStrategy]] = {
    cls.name: cls for cls in (GRPOStrategy, ARPOStrategy, AEPOStrategy, APPOStrategy)
}
