"""Policy-loss step of `APPOTrainer` for the loss modes TRL does not have (dual_clip, future_kl, entropy_balanced).

`compute_policy_loss(trainer, model, inputs)` mirrors TRL's `GRPOTrainer._compute_loss`:
the same forward (`_get_per_token_logps_and_entropies`), the same mask (`completion_mask * tool_mask`), the same
old-logp fallback and vLLM importance-sampling multiplication, and exactly the base normaliser of `loss_type`
(`NORMALISERS`), so the returned loss is already scaled for gradient accumulation. Only step 8 (the per-token
policy loss) is replaced, by `appo_trl.algorithms.losses.POLICY_LOSSES[loss_mode]`; with AEPO's
`entropy_balanced_advantage` the advantages are first reweighted by `entropy_aware_advantage` using the
current policy's exact entropies (computed on every step, unlike the reference).

The KL term (`beta != 0`, APPO's 0.001) is TRL's k3 estimator against `ref_per_token_logps`, with TRL's
importance-sampling correction (`use_bias_correction_kl`), added after the policy loss exactly as the base
class does (it is not removed by `keep_mask`: the reference drops sequences from the policy-gradient term
only). Not supported here (rejected by `APPOConfig`): the entropy mask (`top_entropy_quantile < 1`), the
entropy bonus, and sequence-level importance sampling for these modes.
Sequences that a loss drops (`keep_mask`) contribute zero; the denominator stays TRL's global token count, so
the gradient is identical under any split into ranks and micro-batches. `future_kl_normalizer: kept_tokens`
(released APPO code) instead divides the policy term by the kept tokens of the micro-batch (verl's token mean,
with `loss_type: bnpo`); the KL term keeps the full mask there, as verl's. `kl_clamp` clamps k3 to [−c, c] (verl: 10).
"""

from __future__ import annotations

import torch

from appo_trl.trainer.trl_seams import per_token_logps_and_entropies, step_metrics


def _dapo(trainer, per_token, mask, inputs, train):
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if train:
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return (per_token * mask).sum() / normalizer


def _grpo(trainer, per_token, mask, inputs, train):
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return loss / (trainer.current_gradient_accumulation_steps if train else 1.0)


def _bnpo(trainer, per_token, mask, inputs, train):
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return loss / (trainer.current_gradient_accumulation_steps if train else 1.0)


def _dr_grpo(trainer, per_token, mask, inputs, train):
    loss = (per_token * mask).sum() / (per_token.size(0) * trainer.max_completion_length)
    return loss / (trainer.current_gradient_accumulation_steps if train else 1.0)


# loss_type -> normaliser, identical to GRPOTrainer._compute_loss step 10 for that loss_type
NORMALISERS = {"dapo": _dapo, "grpo": _grpo, "bnpo": _bnpo, "dr_grpo": _dr_grpo}


def per_token_kl(logps, ref_logps, old_logps=None, clamp: float | None = None):
    """k3 estimate of KL(pi_theta || pi_ref) per token: exp(r - l) - (r - l) - 1, clamped to [-clamp, clamp] when
    `clamp` is set (verl's low_var_kl uses 10), then times exp(l - old) when `old_logps` is given (TRL's
    `use_bias_correction_kl`). Example: r - l = 3 -> e^3 - 4 = 16.09; clamp 10 -> 10."""
    diff = ref_logps - logps
    kl = torch.exp(diff) - diff - 1
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl * torch.exp(logps - old_logps) if old_logps is not None else kl


def loss_params(trainer) -> dict:
    """Keyword parameters of `POLICY_LOSSES[loss_mode]`: TRL's resolved ε_low/ε_high plus the config's fields."""
    args = trainer.args
    common = {"eps_low": trainer.epsilon_low, "eps_high": trainer.epsilon_high, "clip_ratio_c": args.clip_ratio_c}
    per_mode = {
        "clip": {"eps_low": trainer.epsilon_low, "eps_high": trainer.epsilon_high},
        "dual_clip": common,
        "entropy_balanced": common,
        "future_kl": {
            **common,
            "decay_rate": args.future_kl_decay_rate,
            "future_clip_ratio": args.future_kl_clip_ratio,
            "weight": args.future_kl_weight,
            "clip_high_only": args.future_kl_clip_high_only,
            "safety_threshold": args.future_kl_safety_threshold,
        },
    }
    return per_mode[args.loss_mode]


def reduce_loss(trainer, per_token, kl, mask, keep_mask, inputs, train: bool) -> torch.Tensor:
    """Scalar loss: policy term (+ beta·KL) through the `loss_type` normaliser.

    With `future_kl_normalizer: kept_tokens` the policy term is a token mean over the kept rows only (the
    released code's denominator) and the KL term a token mean over the full mask, both divided by the
    accumulation steps (`bnpo`). Example: rows of 3 tokens with losses −6 (kept) and 0 (dropped) → −1.0 with the
    full count, −2.0 over the kept tokens.
    """
    args = trainer.args
    norm = NORMALISERS[args.loss_type]
    if args.future_kl_normalizer == "kept_tokens" and keep_mask is not None:
        loss = norm(trainer, per_token, mask * keep_mask, inputs, train)
        if kl is not None:
            loss = loss + trainer.beta * norm(trainer, kl, mask, inputs, train)
        return loss
    if kl is not None:
        per_token = per_token + trainer.beta * kl
    return norm(trainer, per_token, mask, inputs, train)


def compute_policy_loss(trainer, model, inputs) -> torch.Tensor:
    """One micro-batch of the configured policy loss, normalised exactly like TRL's `loss_type`."""
    from appo_trl.algorithms.losses import POLICY_LOSSES

    args = trainer.args
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    logps, entropies, aux_loss = per_token_logps_and_entropies(
        trainer,
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
    )
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    advantages = advantages.expand_as(logps)
    mode = "train" if trainer.model.training else "eval"
    metrics = step_metrics(trainer, mode)
    if args.entropy_balanced_advantage:
        from appo_trl.algorithms.advantages import entropy_aware_advantage

        advantages = entropy_aware_advantage(
            advantages,
            entropies.detach(),
            mask,
            weight=args.entropy_advantage_weight,
            clamp=(0.0, 2.0) if args.entropy_advantage_clamp else None,
        )
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    out = POLICY_LOSSES[args.loss_mode](logps, old, advantages, mask, **loss_params(trainer))
    per_token = out.per_token_loss
    if out.keep_mask is not None:
        per_token = per_token * out.keep_mask
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
        per_token = per_token * inputs["importance_sampling_ratio"]
    kl = None
    if trainer.beta != 0.0:
        kl = per_token_kl(
            logps,
            inputs["ref_per_token_logps"],
            old if args.use_bias_correction_kl else None,
            clamp=args.kl_clamp,
        )
    loss = reduce_loss(trainer, per_token, kl, mask, out.keep_mask, inputs, mode == "train")
    if trainer.aux_loss_enabled and aux_loss is not None:
        ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / ga
    # metrics: same collectives on every rank, in the same order
    msum = mask.sum().clamp(min=1.0)
    if trainer.beta != 0.0:
        totals = trainer.accelerator.reduce(torch.stack([(kl * mask).sum(), mask.sum().float()]), reduction="sum")
        metrics["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    entropy = trainer.accelerator.gather((entropies * mask).sum() / msum).nanmean().item()
    metrics["entropy"].append(entropy)
    for key in sorted(out.metrics):
        value = torch.as_tensor(out.metrics[key], dtype=torch.float32, device=logps.device).reshape(())
        metrics[f"{args.loss_mode}/{key}"].append(trainer.accelerator.gather(value).nanmean().item())
    return loss
