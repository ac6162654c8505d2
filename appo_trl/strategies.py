"""Rollout strategies of `APPOTrainer`: how one generation round turns unique prompts into groups of n rows.

A strategy orchestrates the rollout engine (`appo_trl.rollout`) and the pure branching / advantage maths
(`appo_trl.algorithms`); it holds no maths of its own and no trainer state across rounds (checkpoint resume
restarts a round from scratch, spec/trl-internals.md §8). Registry `STRATEGIES`: name -> class.

- `grpo`: n independent rollouts per prompt through the tool loop; every row reaches the loss.
- `arpo` / `aepo`: `initial_rollouts` per prompt, entropy-driven branching after tool results inside the tool
  loop (the engine's `hook`), refilled by the engine to exactly n rows; every row reaches the loss.
- `appo`: `initial_rollouts` per prompt, one trainer forward on them, branch points by BS = Z(H)·Z(FV),
  n − N branch rollouts, dual-group advantages credited to the source prefix; branch rows are removed before
  the loss (`RoundBatch.keep`).

What this module does not do: tokenise prompts, gather across ranks, log, or compute losses (the trainer does).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import torch

from appo_trl.trainer_utils import pad_rows


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
        """Advantages for the local rows (before any row is dropped); TRL's group advantages by default."""
        return default


class GRPOStrategy(RolloutStrategy):
    """n independent tool-loop rollouts per prompt (the fair baseline: same loop, no branching)."""

    name = "grpo"

    def generate(self, prompt_ids, n, seed):
        groups = self.engine.run(self.engine.rollout(prompt_ids, n, seed=seed))
        return RoundBatch(groups=groups, keep=[True] * (len(groups) * n))


class ARPOStrategy(RolloutStrategy):
    """ARPO: in-loop branching after tool results with P = clip(τ + β·ΔH); the engine refills groups to n.

    The branching decision is the engine's `hook` contract (rollout layer); this strategy passes the configured
    hook and reports the branch statistics of the returned trajectories.
    """

    name = "arpo"
    metric_keys = ("branch/points_per_prompt", "branch/depth_mean", "branch/initial_per_prompt")

    def make_hook(self):
        from appo_trl.rollout import ARPOBranchHook  # rollout layer: ARPO / AEPO in-loop branching rule

        a = self.args
        return ARPOBranchHook(
            beam_size=a.beam_size, branch_probability=a.branch_probability, entropy_weight=a.entropy_weight,
            entropy_tokens=a.entropy_tokens, entropy_topk=a.entropy_topk, timing=a.arpo_entropy_timing,
            branch_penalty=0.0, initial_rollouts=a.initial_rollouts,
        )

    def generate(self, prompt_ids, n, seed):
        groups = self.engine.run(self.engine.rollout(prompt_ids, n, seed=seed, hook=self.make_hook()))
        rows = [t for g in groups for t in g]
        branched = [t for t in rows if t.parent is not None]
        metrics = {
            "branch/points_per_prompt": len(branched) / max(len(groups), 1),
            "branch/depth_mean": sum(_depth(t) for t in rows) / max(len(rows), 1),
            "branch/initial_per_prompt": (len(rows) - len(branched)) / max(len(groups), 1),
        }
        return RoundBatch(groups=groups, keep=[True] * len(rows), metrics=metrics)


class AEPOStrategy(ARPOStrategy):
    """AEPO: ARPO's loop with the consecutive-branch penalty and (optionally) a dynamic initial budget."""

    name = "aepo"

    def make_hook(self):
        from appo_trl.rollout import ARPOBranchHook

        a = self.args
        return ARPOBranchHook(
            beam_size=a.beam_size, branch_probability=a.branch_probability, entropy_weight=a.entropy_weight,
            entropy_tokens=a.entropy_tokens, entropy_topk=a.entropy_topk, timing=a.arpo_entropy_timing,
            branch_penalty=a.branch_penalty, initial_rollouts=a.initial_rollouts,
            dynamic_rollouts=a.dynamic_rollouts, dynamic_source=a.dynamic_rollouts_source,
            initial_entropy_tokens=a.initial_entropy_tokens,
        )


def _depth(traj) -> int:
    return int((getattr(traj, "meta", None) or {}).get("depth", 0 if traj.parent is None else 1))


def excluded_token_mask(tokenizer) -> torch.Tensor:
    """Bool (V,): token ids whose text is only whitespace / punctuation, or special (never branch points)."""
    strip = string.whitespace + string.punctuation
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(vocab):
        out[i] = i in special or tokenizer.decode([i]).strip(strip) == ""
    return out


class APPOStrategy(RolloutStrategy):
    """APPO (spec/algorithms.md §5.5): score initial rollouts, branch at n − N points, credit the source prefix."""

    name = "appo"
    metric_keys = (
        "branch/points_per_prompt", "branch/rows_dropped", "branch/bs_mean", "branch/bs_max", "branch/h_mean",
        "branch/fv_mean", "branch/fv_std", "branch/position_mean", "branch/fallback_frac", "branch/no_candidates",
    )

    def __init__(self, trainer):
        super().__init__(trainer)
        self._excluded = None

    def _exclusions(self) -> torch.Tensor | None:
        if not self.args.exclude_whitespace_punct:
            return None
        if self._excluded is None:
            self._excluded = excluded_token_mask(self.trainer.processing_class_tokenizer)
        return self._excluded

    def generate(self, prompt_ids, n, seed):
        from appo_trl.algorithms.branching import branch_scores, candidate_mask, future_value, select_branch_points

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
        else:
            entropy = torch.nan_to_num(pad_rows([t.entropies for t in flat], float("nan")), nan=0.0)
        fv = future_value(scored["logps"] * mask, sampler_lp, mask, gamma=a.fv_gamma)
        excluded = self._exclusions()
        token_excluded = excluded[ids.clamp(max=len(excluded) - 1)] if excluded is not None else None
        valid = candidate_mask(mask, min_remaining=a.min_remaining_tokens, excluded=token_excluded)
        bs = branch_scores(entropy, fv, valid)
        points, requests = [], []
        for g in range(len(init)):
            sl = slice(g * N, (g + 1) * N)
            pts = select_branch_points(bs[sl], valid[sl], num_branches=n - N, max_per_row=a.max_branches_per_rollout)
            points.append(pts)
            requests += [(init[g][p.row], p.position) for p in pts]
        branches = self.engine.run(
            self.engine.branch_many(
                [dict(parent=par, position=pos, resample=a.resample_selected_token) for par, pos in requests], seed=seed + 1
            )
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
        return RoundBatch(groups=groups, keep=keep, info={"points": points}, metrics=metrics)

    def advantages(self, batch, rewards, default, length):
        """(B_local, T) advantages: initial rows get dual-group credit; branch rows keep TRL's value (dropped later)."""
        if self.args.advantage_mode == "group" or self.args.initial_rollouts == self.args.num_generations:
            return default
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
