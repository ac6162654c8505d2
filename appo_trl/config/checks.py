"""The checks of `APPOConfig.__post_init__` that only the config can make (each constraint checked here once).

What a strategy needs of the config lives beside the strategy (`RolloutStrategy.validate`); what needs the
model, the tools or the launched processes is checked where those exist (the trainer, `appo_trl.configs`).
Every failure is one `ValueError` line starting `APPOConfig: `.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import fields

from appo_trl import trl_rules
from appo_trl.config.stream import check_stream
from appo_trl.configs.errors import fail
from appo_trl.configs.reference import REFERENCE_PRESETS

# Loss normalisers the custom (non-TRL) loss modes reproduce exactly (TRL `GRPOTrainer._compute_loss`).
CUSTOM_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")


@functools.cache
def literal_choices(cls: type, owner: type) -> dict[str, tuple]:
    """Field name -> allowed values (None included when the field is optional) of `owner`'s `Literal` fields."""
    hints, out = typing.get_type_hints(cls), {}
    for name in vars(owner).get("__annotations__", {}):
        hint = hints[name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        values = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
        if values:
            out[name] = tuple(values) + ((None,) if type(None) in args else ())
    return out


def check_choices(cfg, owner: type) -> None:
    """Every `Literal` field holds one of its values. argparse checks flags, but recipe values and Python
    arguments reach the config without it."""
    for name, allowed in literal_choices(type(cfg), owner).items():
        value = getattr(cfg, name)
        if value not in allowed:
            fail(f"{name}={value!r}; choose one of {tuple(a for a in allowed if a is not None)}.")


def apply_reference(cfg) -> None:
    """Set every switch of `REFERENCE_PRESETS[reference]`; refuse an explicit conflicting value."""
    if cfg.reference is None:
        return
    defaults = {f.name: f.default for f in fields(cfg)}
    for name, value in REFERENCE_PRESETS[cfg.reference].items():
        current = getattr(cfg, name)
        if current == value:
            continue
        if current != defaults[name]:
            fail(
                f"reference={cfg.reference} sets {name}={value!r} (the released code's behaviour), but the "
                f"config sets {name}={current!r}; remove one of them."
            )
        setattr(cfg, name, value)


def check_ranges(cfg) -> None:
    """Numeric settings inside their domains, and the values only some settings accept."""
    if cfg.tree_forward and cfg.tree_token_budget < 1:
        fail(f"tree_token_budget={cfg.tree_token_budget} must be >= 1 (unique tokens per forward).")
    if cfg.beam_size < 1:
        fail(f"beam_size={cfg.beam_size} must be >= 1.")
    if cfg.vllm_server_wait_s < 0:
        fail(f"vllm_server_wait_s={cfg.vllm_server_wait_s} must be >= 0 (0 = do not wait).")
    if not cfg.vllm_request_timeout_s > 0:
        fail(f"vllm_request_timeout_s={cfg.vllm_request_timeout_s} must be > 0 (seconds per request).")
    if cfg.max_nan_reward_steps < 0:
        fail(f"max_nan_reward_steps={cfg.max_nan_reward_steps} must be >= 0 (0 = never stop).")
    if cfg.max_failed_agent_rounds < 0:
        fail(f"max_failed_agent_rounds={cfg.max_failed_agent_rounds} must be >= 0 (0 = never stop).")
    if not cfg.agent_timeout_s > 0:
        fail(f"agent_timeout_s={cfg.agent_timeout_s} must be > 0 (seconds per agent run).")
    if cfg.dump_rollouts < 0:
        fail(f"dump_rollouts={cfg.dump_rollouts} must be >= 0 (groups written per step).")
    for name in ("branch_probability", "reward_scale_discount", "future_kl_clip_ratio"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            fail(f"{name}={getattr(cfg, name)} must be in [0, 1].")
    if cfg.future_kl_clip_ratio == 0.0 and cfg.reference != "appo":
        fail(
            "future_kl_clip_ratio=0 means 'no clip' (weight clamped to ≤ 10) in the released APPO code; set "
            "reference: appo to use that meaning, or a ratio in (0, 1]."
        )
    if cfg.future_kl_normalizer == "kept_tokens" and (cfg.loss_mode != "future_kl" or cfg.loss_type != "bnpo"):
        fail(
            "future_kl_normalizer=kept_tokens is verl's token mean over the kept rows of a micro-batch: it needs "
            f"loss_mode=future_kl and loss_type=bnpo (got {cfg.loss_mode!r}, {cfg.loss_type!r})."
        )
    if cfg.kl_clamp is not None and cfg.kl_clamp <= 0:
        fail(f"kl_clamp={cfg.kl_clamp} must be > 0 (or null for no clamp).")
    if not cfg.advantage_std_eps > 0:
        fail(f"advantage_std_eps={cfg.advantage_std_eps} must be > 0.")
    if cfg.advantage_std_eps != 1e-4 and cfg.scale_rewards not in ("group", True):
        fail(f"advantage_std_eps needs scale_rewards=group (got {cfg.scale_rewards!r}).")
    if not 0.0 < cfg.fv_gamma <= 1.0:
        fail(f"fv_gamma={cfg.fv_gamma} must be in (0, 1].")
    if cfg.clip_ratio_c <= 1.0:
        fail(f"clip_ratio_c={cfg.clip_ratio_c} must be > 1 (dual-clip bound).")
    if cfg.future_kl_decay_rate <= 0:
        fail(f"future_kl_decay_rate={cfg.future_kl_decay_rate} must be > 0.")
    if (
        (cfg.tool_call_limit is not None and cfg.tool_call_limit < 0)
        or (cfg.max_tool_calling_iterations is not None and cfg.max_tool_calling_iterations < 0)
        or cfg.entropy_tokens < 1
        or cfg.entropy_topk < 1
        or cfg.min_remaining_tokens < 0
    ):
        fail(
            "tool_call_limit, max_tool_calling_iterations, min_remaining_tokens must be >= 0 (the limits: or "
            "null) and entropy_tokens, entropy_topk >= 1."
        )


def check_loss(cfg) -> None:
    """The custom loss modes run with the loss types (and TRL options) they reproduce."""
    if cfg.loss_mode != "clip" or (cfg.kl_clamp is not None and cfg.beta != 0.0):
        if cfg.loss_type not in CUSTOM_LOSS_TYPES:
            fail(f"loss_mode={cfg.loss_mode} supports loss_type in {CUSTOM_LOSS_TYPES} (got {cfg.loss_type!r}).")
        if cfg.top_entropy_quantile < 1.0:
            fail(f"loss_mode={cfg.loss_mode} does not support top_entropy_quantile < 1; use loss_mode=clip.")


def check_vllm(cfg) -> None:
    """vLLM settings that depend on the mode."""
    if cfg.vllm_dtype != "auto" and not (cfg.use_vllm and cfg.vllm_mode == "colocate"):
        fail("vllm_dtype applies to vllm_mode=colocate only (a server takes --dtype at launch).")
    if cfg.use_vllm and cfg.vllm_mode not in ("server", "colocate"):
        fail(f"vllm_mode={cfg.vllm_mode!r}; choose server (vllm serve) or colocate (in-process vLLM).")
    if cfg.use_vllm and cfg.vllm_mode == "colocate" and cfg.vllm_tensor_parallel_size > 1:
        fail(
            f"vllm_mode=colocate with vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} is not supported "
            "(each rank's tool loop sends its own requests, a tensor-parallel group must send the same ones); "
            f"use vllm_mode=server (`vllm serve MODEL --tensor-parallel-size {cfg.vllm_tensor_parallel_size}`)."
        )


def check_async(cfg) -> None:
    """`max_staleness` / `weight_sync_steps`: settings the background rounds can honour (see async_rounds), and the
    streaming fields (`config.stream`)."""
    check_stream(cfg, fail)
    k, w = cfg.max_staleness, cfg.weight_sync_steps
    if k < 0 or w < 1:
        fail(f"max_staleness={k} must be >= 0 and weight_sync_steps={w} >= 1.")
    if k == 0:
        if w != 1:
            fail(f"weight_sync_steps={w} needs max_staleness >= 1 (a synchronous run syncs every round).")
        return
    if w > k:
        fail(f"weight_sync_steps={w} > max_staleness={k}: rows would be older than the bound allows.")
    every, ga = trl_rules.generate_every(cfg), cfg.gradient_accumulation_steps
    if every % ga != 0 or 2 * (every // ga) - 1 > k:
        fail(
            f"max_staleness={k} with steps_per_generation × num_iterations = {every} and "
            f"gradient_accumulation_steps = {ga}: a round must span a whole number m of optimizer steps with "
            "2m − 1 <= max_staleness (its last rows train m − 1 steps after its first)."
        )
    if cfg.use_vllm and cfg.vllm_mode == "colocate":
        fail(
            f"max_staleness={k} with vllm_mode=colocate: the in-process vLLM engine would be synced (and put to "
            "sleep) while a background round generates on it; use vllm_mode=server, or max_staleness: 0."
        )
    if cfg.async_fv_policy == "sampler" and cfg.use_vllm:
        fail("async_fv_policy=sampler scores with the in-process sampler copy; with use_vllm use proximal.")
    if not cfg.vllm_importance_sampling_correction:
        fail(
            "max_staleness >= 1 trains on rows sampled by older weights: it needs the behaviour-policy "
            "correction, vllm_importance_sampling_correction=True (TRL's default)."
        )


def check_replicas(cfg) -> None:
    """`vllm_server_base_url`: one URL or several (a list, or one string split at commas); the router policy."""
    from appo_trl.vllm.replicas import parse_server_urls
    from appo_trl.vllm.router import RouterError, router_executable

    try:
        urls = parse_server_urls(cfg.vllm_server_base_url)
    except ValueError as exc:
        fail(str(exc))
    if urls:
        cfg.vllm_server_base_url = ",".join(urls)  # TRL's field is a str: a list is kept comma-joined
    if cfg.use_vllm and len(urls) > 1:
        try:
            router_executable()
        except RouterError as exc:
            fail(str(exc))


def resolve_branch_cap(cfg) -> None:
    """`auto` → ⌈(n − N)/N⌉ + 1; null / "none" → no cap (None); an integer (or its string) → that cap (≥ 1)."""
    cap = cfg.max_branches_per_rollout
    if isinstance(cap, str) and cap.strip().lower() in ("none", "null"):
        cap = None
    if cap == "auto":
        cap = math.ceil(cfg.branch_rows_per_prompt / cfg.initial_rollouts) + 1
    elif cap is not None:
        try:
            cap = int(cap)
        except (TypeError, ValueError):
            fail(f"max_branches_per_rollout={cap!r}; use auto, a positive integer or null (no cap).")
        if cap < 1:
            fail(f"max_branches_per_rollout={cap} must be >= 1 (null = no cap).")
    cfg.max_branches_per_rollout = cap


def check_batching(cfg) -> None:
    """Groups stay on one rank, and the rows left after dropping branches still split into micro-batches.

    TRL's `_prepare_inputs` shuffles the per-rank generation batch (`per_device_train_batch_size ×
    steps_per_generation` rows) and splits it into `steps_per_generation` equal slices. APPO removes the
    n − N branch rows of each group before that split, so the rank keeps G·N rows (G = groups per rank) and
    each micro-step trains on G·N / steps_per_generation rows: G·N must be a multiple of steps_per_generation.
    """
    n, spg = cfg.num_generations, cfg.steps_per_generation
    rows = cfg.per_device_train_batch_size * spg
    if rows % n != 0:
        fail(
            f"per_device_train_batch_size × steps_per_generation = {rows} must be a multiple of "
            f"num_generations = {n}, so that every group is sampled, branched and scored on one rank."
        )
    if cfg.drops_branch_rows and (rows // n * cfg.initial_rollouts) % spg != 0:
        fail(
            f"after removing branch rows each rank keeps {rows // n} groups × {cfg.initial_rollouts} "
            f"initial rollouts = {rows // n * cfg.initial_rollouts} rows, which must split evenly into "
            f"steps_per_generation = {spg} micro-batches; raise per_device_train_batch_size or change "
            "initial_rollouts."
        )


def follow_hardware(cfg) -> None:
    """The fields whose TRL default assumes an accelerator, on a machine with none (`bf16`, `dataloader_pin_memory`)."""
    bf16_follows_hardware(cfg)
    pin_memory_follows_hardware(cfg)


def bf16_follows_hardware(cfg) -> None:
    """`bf16` left unset: TRL's default (True) where an accelerator runs it, False on a machine with none.

    TRL's `GRPOConfig` turns an unset `bf16` into True and transformers then refuses a CPU-only machine ("Your
    setup doesn't support bf16/gpu") unless `use_cpu=True` is given; an `APPOConfig` trains in fp32 there instead,
    so the README's Python example runs as written on a CPU. An explicit `bf16` is kept (and checked) as in TRL.
    """
    if cfg.bf16 is not None or cfg.fp16 or cfg.use_cpu:
        return
    if not _has_accelerator():
        cfg.bf16 = False


def _has_accelerator() -> bool:
    import torch

    accelerators = (torch.cuda.is_available(), getattr(torch, "xpu", None) and torch.xpu.is_available(),
                    torch.backends.mps.is_available(), hasattr(torch, "npu") and torch.npu.is_available())  # fmt: skip
    return bool(any(accelerators))


def pin_memory_follows_hardware(cfg) -> None:
    """No accelerator: `dataloader_pin_memory` off (as transformers does for `use_cpu=True`), since torch cannot pin
    there and warns "'pin_memory' argument is set as true but no accelerator is found" on every run."""
    if cfg.dataloader_pin_memory and not cfg.use_cpu and not _has_accelerator():
        cfg.dataloader_pin_memory = False
