"""`reference: arpo | aepo | appo | tree_grpo`: the `APPOConfig` values that reproduce each released implementation.

`REFERENCE_PRESETS[algo]` maps field names to the value that makes appo-trl behave like the authors' released
code (verl forks of ARPO, AEPO, APPO and Tree-GRPO; Tree-GRPO's tree search as far as ARPO's engine expresses it). `APPOConfig.__post_init__` applies it; docs/fidelity.md explains every
entry (reason for our default, magnitude of the difference). This module holds data only; what it does NOT
reproduce (the released code's bugs, round-synchronous sampling, random numbers) is listed there too.
"""

from __future__ import annotations

# `reference: <algo>` -> the switch values that reproduce the released implementation (docs/fidelity.md)
_REFERENCE_COMMON = {
    "vllm_importance_sampling_correction": False,  # no counterpart in any released code
    "use_bias_correction_kl": False,  # verl's k3 KL has no importance-sampling factor
    "kl_clamp": 10.0,  # verl clamps k3 to [-10, 10]
    "loss_type": "bnpo",  # verl token-mean per micro-batch, divided by the accumulation steps
    "advantage_std_eps": 1e-6,
    "empty_segment_entropy": "zero",
}
REFERENCE_PRESETS = {
    "arpo": {
        **_REFERENCE_COMMON,
        "rollout_strategy": "arpo",
        "loss_mode": "dual_clip",  # verl's dual clip, c = 3
        "arpo_entropy_timing": "faithful",
    },
    "aepo": {
        **_REFERENCE_COMMON,
        "rollout_strategy": "aepo",
        "loss_mode": "entropy_balanced",
        "entropy_balanced_advantage": False,  # set in the scripts but skipped (entropy_coeff = 0)
        "entropy_advantage_clamp": False,
        "aepo_penalty_scope": "prompt",
        "arpo_entropy_timing": "faithful",
        "dynamic_rollouts": False,  # ENABLE_DYNAMIC_ROLLOUTS=False in every released script
        "dynamic_rollouts_source": "probe",
    },
    "appo": {
        **_REFERENCE_COMMON,
        "rollout_strategy": "appo",
        "loss_mode": "future_kl",
        "future_kl_normalizer": "kept_tokens",
        "fv_gamma": 1.0,
        "m_scaling": "reward_noop",
        "advantage_mode": "dual_group",
        "branch_entropy_source": "sampler_topk",
        "branch_zscore_scope": "loss_mask",
        "branch_token_filter": "whitespace",
        "branch_allow_last_token": True,
        "max_branches_per_rollout": None,
        "min_remaining_tokens": 1,
        "fv_degeneracy_guard": False,
        "resample_selected_token": False,
    },
    "tree_grpo": {  # AMAP-ML/Tree-GRPO's train_*_tree_search.sh; its sampler mapped in docs/fidelity.md
        **_REFERENCE_COMMON,
        "rollout_strategy": "arpo",  # expansions at tool-call boundaries (its nodes: thought, action, observation)
        "entropy_weight": 0.0,  # expand_mode=random: a node is expanded at random, not by entropy
        "loss_mode": "dual_clip",  # policy_loss=grpo runs verl's compute_policy_loss_dual_clip (c = 3)
        "advantage_estimator": "tree_grpo",
        "tree_grpo_combine": "sum",  # adv_estimator=tree: inter-tree + intra-tree advantages
    },
}

__all__ = ["REFERENCE_PRESETS"]
