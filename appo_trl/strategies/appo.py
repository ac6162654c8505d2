"""`appo`: `initial_rollouts` per prompt, one trainer forward on them, branch points by BS = Z(H)·Z(FV), n − N
branch rollouts from those prefixes, dual-group advantages credited to the source prefix; branch rows leave the
batch before the loss (`Round.keep`). The maths is `appo_trl.algorithms.branching` / `.advantages`.
With `advantage_estimator: tree` the whole group's tree gives token credit instead, and the branch rows reach the
loss (no cached old logps then: TRL's old-logp pass scores every row) unless `tree_credit_branch_rows: false`."""

from __future__ import annotations

import string
import warnings

import torch

from appo_trl.algorithms.rows import pad_rows
from appo_trl.strategies.base import TREE_ESTIMATORS, PolicyForward, RolloutStrategy, register_strategy
from appo_trl.strategies.record import Round


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


@register_strategy
class APPOStrategy(RolloutStrategy):
    """APPO (APPO paper; docs/fidelity.md): score initial rollouts, branch at n − N points, credit the source prefix."""

    name = "appo"
    default_loss_mode = "future_kl"
    drops_branch_rows = True
    env_snapshots = True  # branches start from a prefix after the parent has finished
    branches_by_replay = True  # agent runs: points on the recorded runs, branches replay them
    # the branch-selection forward would run on a background thread, gathering shards beside the trainer's collectives
    async_under_sharding = False
    no_tool_calls_note = " APPO still branches at high-entropy tokens, but no branch follows a tool result."
    card_title = "APPO (Agentic Procedural Policy Optimization, arXiv 2606.12384)"
    paper = {
        "name": "APPO",
        "title": "Agentic Procedural Policy Optimization",
        "id": "2606.12384",
        "citation": "@article{appo2026,\n"
        "    title        = {{Agentic Procedural Policy Optimization}},\n"
        "    year         = 2026,\n"
        "    eprint       = {arXiv:2606.12384},\n"
        "}",
    }
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

    def __init__(self, policy: PolicyForward):
        super().__init__(policy)
        self._excluded = None

    @classmethod
    def needs_sampler_entropies(cls, args) -> bool:
        return args.branch_entropy_source == "sampler_topk"

    @classmethod
    def validate(cls, config) -> None:
        """Also warns (the run goes on) when no token can be a branch point, so every branch is a fallback."""
        super().validate(config)
        n_branch, budget, rest = (
            config.branch_rows_per_prompt,
            config.max_completion_length,
            config.min_remaining_tokens,
        )
        if n_branch > 0 and rest >= budget:
            warnings.warn(
                f"APPOConfig: min_remaining_tokens={rest} >= max_completion_length={budget}: no token can be a "
                f"branch point, so every one of the {n_branch} branches per prompt is a fallback "
                "(`branch/fallback_frac` = 1). Lower min_remaining_tokens (e.g. to max_completion_length // 4).",
                UserWarning,
                stacklevel=5,  # the line that built the config (past validate, _validate_appo, __post_init__, __init__)
            )

    def _exclusions(self) -> torch.Tensor | None:
        mode = self.args.branch_token_filter
        if mode == "none":
            return None
        if self._excluded is None:
            self._excluded = excluded_token_mask(self.policy.processing_class_tokenizer, mode)
        return self._excluded

    def generate(self, prompt_ids, n, seed, engine):
        from appo_trl.algorithms.branching import appo_branch_points, candidate_mask, future_value

        a, N = self.args, self.args.initial_rollouts
        init = engine.run(engine.rollout(prompt_ids, N, seed=seed))
        if N == n:  # degenerate: nothing to branch, APPO reduces to its loss on n initial rollouts
            return Round(groups=init, keep=[True] * (len(init) * n), points=[[] for _ in init])
        flat = [t for g in init for t in g]
        scored = self.policy.score_trajectories(flat)  # the policy's forward: current logps (+ exact entropies)
        mask = pad_rows([t.loss_mask for t in flat], 0).float()
        ids = pad_rows([t.completion_ids for t in flat], 0)
        sampler_lp = pad_rows([t.logprobs for t in flat], float("nan"))
        sampler_lp = torch.nan_to_num(sampler_lp, nan=0.0) * mask
        if a.branch_entropy_source == "trainer":
            entropy = scored.entropies
        elif any(t.entropies is None for t in flat):
            raise RuntimeError(
                "branch_entropy_source=sampler_topk needs sampler entropies: build the rollout engine "
                "with RolloutConfig(record_entropies=True) or set branch_entropy_source=trainer."
            )
        else:
            entropy = torch.nan_to_num(pad_rows([t.entropies for t in flat], float("nan")), nan=0.0)
        fv = future_value(scored.logps * mask, sampler_lp, mask, gamma=a.fv_gamma, clip_eps=a.future_kl_clip_ratio)
        excluded = self._exclusions()
        token_excluded = excluded[ids.clamp(max=len(excluded) - 1)] if excluded is not None else None
        valid = candidate_mask(
            mask,
            min_remaining=a.min_remaining_tokens,
            excluded=token_excluded,
            max_length=a.max_completion_length,
            exclude_last=not a.branch_allow_last_token,
        )
        points, _ = appo_branch_points(
            entropy,
            fv,
            mask,
            valid,
            group_size=N,
            num_branches=n - N,
            zscore_scope=a.branch_zscore_scope,
            degeneracy_guard=a.fv_degeneracy_guard,
            max_per_row=a.max_branches_per_rollout,
        )
        requests = [(init[g][p.row], p.position) for g, pts in enumerate(points) for p in pts]
        branches = engine.run(engine.branch_many(requests, seed=seed + 1, resample=a.resample_selected_token))
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
        if a.tree_credit_branch_rows:  # tree credit: branch rows train; TRL's old-logp pass runs
            return Round(groups=groups, keep=[True] * (len(init) * n), points=points, metrics=metrics)
        keep = ([True] * N + [False] * (n - N)) * len(init)
        # step 2's logps are θ_old's: the trainer reuses them as old logps instead of a second forward
        old = [scored.logps[i, : len(t.completion_ids)] for i, t in enumerate(flat)]
        old_rows = [old[g * N + j] if j < N else None for g in range(len(init)) for j in range(n)]
        return Round(groups=groups, keep=keep, points=points, selection_logps=old_rows, metrics=metrics)

    @classmethod
    def own_advantages(cls, config) -> str | None:
        dual = config.advantage_mode != "group" and config.initial_rollouts != config.num_generations
        return super().own_advantages(config) or (
            "APPO's dual-group advantage (advantage_mode=dual_group)" if dual else None
        )

    def advantages(self, rnd, rewards, default, length):
        """(B_local, T) advantages: initial rows get dual-group credit; branch rows keep TRL's value (dropped later)."""
        a = self.args
        tree = a.advantage_estimator in TREE_ESTIMATORS
        if tree or a.advantage_mode == "group" or a.initial_rollouts == a.num_generations:
            return super().advantages(rnd, rewards, default, length)
        from appo_trl.algorithms.advantages import appo_dual_group_advantages

        a, n, N = self.args, self.args.num_generations, self.args.initial_rollouts
        G = len(rnd.groups)
        r = rewards.view(G, n)
        points = rnd.points
        lengths = torch.tensor([[len(t.completion_ids) for t in g[:N]] for g in rnd.groups])
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
