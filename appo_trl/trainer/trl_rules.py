"""TRL's own rules, copied where appo-trl must apply them to rows TRL did not build: one function per rule.

Each was read from `GRPOTrainer._generate_and_score_completions` of trl `TRL_VERSION`; when TRL moves, this is the
file to read again (its private attributes: `trl_seams`). The rules: whether TRL runs its no-grad old-logp pass
(`runs_old_logp_pass`), the vLLM importance-sampling ratio (`importance_ratio`), the reference forward, or the
adapter-free / "ref" adapter one under PEFT (`reference_logps`), and truncated-completion masking
(`truncated_rows`), and the reward rule of rows every reward function left unscored (`scored_rewards`,
`unscorable_rows`, `zero_unscorable`). Users: the round runner (`rounds.py`: the old-logp cache, the rewards a
strategy's own advantages read) and an agent's forked rows (`chain_rows.py`). What this does not do: decide when a
rule applies beyond TRL's own condition.

`TRL_COPIES` names, for each rule, the TRL function it was read from and the SHA-256 of that function's source in
`TRL_VERSION`; `tests/trainer/test_trl_rules.py` fails naming the copy when TRL's source moves.
"""

from __future__ import annotations

import math

import torch

TRL_VERSION = "1.16.0"  # the TRL these rules (and `trl_seams`' seams) were read from

_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
_SCORE = f"{_GRPO}._generate_and_score_completions"
_SCORE_SHA = "1fa48922792dcd5c72da155cfe99db477771a7c61cde15519fe8c86d0cdc0b65"
# copy -> (the TRL function it was read from, "module:qualname", and the sha256 of its source in TRL_VERSION)
TRL_COPIES: dict[str, tuple[str, str]] = {
    "runs_old_logp_pass": (_SCORE, _SCORE_SHA),
    "importance_ratio": (_SCORE, _SCORE_SHA),
    "reference_logps": (_SCORE, _SCORE_SHA),
    "truncated_rows": (_SCORE, _SCORE_SHA),
    "unscorable_rows": (_SCORE, _SCORE_SHA),
    "scored_rewards": (_SCORE, _SCORE_SHA),
    "zero_unscorable": (_SCORE, _SCORE_SHA),
}


def unscorable_rows(rewards_per_func: torch.Tensor) -> torch.Tensor:
    """TRL's unscorable rows: (N,) bool, True where every reward function returned None (NaN in `rewards_per_func`)."""
    return torch.isnan(rewards_per_func).all(dim=1)


def scored_rewards(trainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """TRL's reward of each row under `multi_objective_aggregation: sum_then_normalize`: the weighted `nansum` over the
    functions, NaN for an unscorable row, so no baseline counts it (a strategy's own advantages skip NaN rows)."""
    weights = trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable_rows(rewards_per_func)] = math.nan
    return rewards


def zero_unscorable(advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """TRL's last step of the advantages: an unscorable row (reward NaN) carries no signal, its advantage is 0 (a
    (B,) or (B, T) tensor; every token of the row)."""
    out = torch.nan_to_num(advantages, nan=0.0)
    out[torch.isnan(rewards).to(out.device)] = 0.0
    return out


def runs_old_logp_pass(trainer) -> bool:
    """Whether TRL computes `old_per_token_logps` with its no-grad forward: when a generation batch is trained over
    gradient-accumulation steps it does not align with, or with vLLM's importance-sampling correction."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    misaligned = trainer.args.gradient_accumulation_steps % generate_every != 0
    return misaligned or bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def importance_ratio(trainer, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (`vllm_importance_sampling_mode`: token or sequence, truncate or mask)
    of rows with old logps `old`, sampler logps `sampling` and loss mask `mask` (completion mask x tool mask)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    mode = trainer.vllm_importance_sampling_mode
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo, hi = -float("inf") if lo is None else lo, float("inf") if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def reference_logps(trainer, logps):
    """TRL's reference per-token logps: `logps(model)` on its `ref_model`, or, under PEFT (no `ref_model`), on the
    policy with its adapter off, or with the "ref" adapter where the model has one. Call it without gradients."""
    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None:
        return logps(trainer.ref_model)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return logps(trainer.model)


def truncated_rows(trainer, completions: list[list[int]]) -> torch.Tensor:
    """TRL's `mask_truncated_completions` rule: a (R, 1) bool column, True for a completion that does not end in an
    EOS or the pad token (its row leaves the loss: multiply its masks by `~column`)."""
    ends = [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id]
    return torch.tensor([c[-1] not in ends for c in completions]).unsqueeze(1)


__all__ = ["TRL_COPIES", "TRL_VERSION", "importance_ratio", "reference_logps", "runs_old_logp_pass", "scored_rewards",
           "truncated_rows", "unscorable_rows", "zero_unscorable"]  # fmt: skip
