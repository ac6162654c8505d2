"""Floor 2: pure tensor/list maths of GRPO, ARPO, AEPO and APPO (ARPO, AEPO and APPO papers; docs/fidelity.md).

No trainer or rollout state; this package imports nothing else from `appo_trl` (neither `rollout` nor the trainer). Per-token tensors
are (B, T); masks float or bool.

`entropy` (ARPO paper; released ARPO/APPO entropy estimator)
- `topk_entropy(top_logprobs) -> Tensor (T,)`: −Σ p·log p over top-k ∪ sampled, clamped ≥ 0 (None rows → NaN).
- `segment_entropy(token_entropies, window=20, reduce="sum", vocab_size=None, empty=nan) -> float`: ARPO's segment H
  (÷ ln|V|); `empty=0.0` is the released code's value for an empty segment.

`arpo` (ARPO and AEPO papers)
- `arpo_branch_probability(entropy, root_entropy=0.0, *, base=0.5, weight=0.2, penalty_factor=None) -> float`:
  ARPO clip(τ + βΔH); with `penalty_factor=f` AEPO's effective clip(1 − τ/f + βΔH).
- `aepo_consecutive_penalty(k, rate=0.05) -> float`: f = max(0, 1 − rate·k).
- `aepo_initial_rollouts(h_root, h_tool_avg, n, beta=0.5) -> int`: clamp(int(n·σ(βΔ)) + 1, 1, n).
- `sample_branch_copies(prob, max_copies, rng, slots=None) -> int`: Bernoulli per potential copy.
- `ARPOBranchState`: per-call H_root per trajectory (inherited by branches) and per-prompt consecutive counter
  (`end_round`, `end_batch_round`: the released AEPO update, no reset in rounds where nothing was created).
- `PromptRoundCounter`: that counter fed by decisions that may arrive out of round order (async sampler).

`branching` (APPO paper, branching score)
- `masked_zscore(x, mask, eps=1e-6) -> Tensor`: per-row population z-score, 0 where invalid.
- `future_value(train_logps, sampler_logps, mask, *, gamma, clip_eps=0.2) -> Tensor (B, T)`.
- `candidate_mask(mask, *, min_remaining=0, excluded=None, token_strings=None, exclude_last=True, max_length=None)`.
- `branch_score_components(entropy, fv, valid, *, degeneracy_guard=True, zscore_mask=None) -> (BS, Z(H), Z(FV))`;
  `branch_scores(...) -> BS`; `strict_candidates(...) -> bool (B, T)`; `is_trivial_token(text) -> bool`.
- `select_branch_points(scores, valid, *, num_branches, max_per_row="auto", strict=None, fallback_mask=None)
  -> list[BranchPoint(row, position, score, strict)]` (exactly `num_branches`; position −1 = bare prompt).
- `appo_branch_points(entropy, fv, loss_mask, valid, *, group_size, num_branches, zscore_scope, degeneracy_guard,
  max_per_row) -> (points per group, BS)`: the whole selection the APPO strategy runs.

`advantages` (GRPO, AEPO and APPO papers)
- `group_advantages(rewards, group_size, *, scale="group", std="population", eps=1e-4) -> Tensor (P·G,)`.
- `appo_dual_group_advantages(*, initial_rewards, branch_rewards, branch_rows, branch_positions, branch_scores,
  lengths=None, max_length, discount=0.9, m_scaling="advantage", eps=1e-6) -> Tensor (P·N, T)`.
- `entropy_aware_advantage(advantages, entropies, mask, *, weight=0.2, clamp=(0, 2)) -> Tensor (B, T)`.
- `tree_grpo_advantages(rewards, groups, trees, *, combine="sum", eps=1e-6) -> Tensor (B,)`: Tree-GRPO's advantage
  as released (`sum`: z_group + z_tree, the scripts' estimator; `nested`: z_tree(z_group)).

`tree_credit` (TreeRL, arXiv 2506.11902; THUDM/TreeRL's released code)
- `tree_credit(parents, branch_pos, lengths, rewards=None, *, token_rewards=None, max_length=None, weights=(1, 1),
  scale="sqrt_rows") -> TreeCredit(advantages, node_values, rows_through (R, T), root_value)`: per-token node-value
  advantages on one group's branch tree, outcome or per-turn (return-to-go) rewards.
- `treerl_released_credit(parents, branch_pos, lengths, rewards, *, selected=None, max_length=None) -> TreeCredit`:
  TreeRL's released estimator (leave-one-out leaves, sqrt per node over the selected rows, local terms carried
  forward, the empty node under a token-0 branch); `tree_credit` is the paper's equations.
- `runs(values, length=None) -> [[start, end, value], ...]`: equal-value stretches (the dump's `advantage_runs`).

`losses` (verl dual clip, AEPO paper, APPO paper / FIPO)
- `POLICY_LOSSES[name](logps, old_logps, advantages, mask, **params) -> PolicyLossOutput(per_token_loss,
  keep_mask, metrics)`, names `clip` (eps_low, eps_high), `dual_clip` (+ clip_ratio_c), `entropy_balanced`
  (eps_low, eps_high, clip_ratio_c or None), `future_kl` (eps_low=0.2, eps_high=0.28, clip_ratio_c=3,
  decay_rate=64, future_clip_ratio=0.2 (0 = no clip, f ≤ 10), weight=1, clip_high_only=True, safety_threshold=6,
  chunk_size=128).
  Losses are un-normalised; the trainer multiplies by `keep_mask` and applies TRL's `loss_type` normaliser.
- `discounted_future_sum(x, gamma, chunk_size=128) -> Tensor`: Σ_{k≥t} γ^(k−t)·x_k, chunked matmul.

`rows`
- `pad_rows(rows, value, length=None) -> Tensor (R, T)`: ragged rows right-padded with `value` (float if any is).
"""
