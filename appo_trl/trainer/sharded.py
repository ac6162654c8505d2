"""Full policy weights for one generation round under sharded engines (DeepSpeed ZeRO-3, FSDP2).

Under ZeRO-3 and FSDP2 a forward of the policy gathers its parameter shards collectively, so every rank must
run the same forwards in the same order or the run hangs (or, under ZeRO-3, corrupts its prefetch trace). The
in-process sampler (`appo_trl.rollout.TransformersBackend`) and APPO's branch-selection forward
(`APPOTrainer.score_trajectories`) run a different number of forwards on each rank: rollouts end at different
lengths, make different tool calls, and branches fail on one rank only. `full_weights_for_round` therefore
gathers the full weights once per round on every rank, at the same point of `_generate`, and lets every forward
of the round run on the plain module without any collective:

- ZeRO-3: TRL's `unwrap_model_for_generation` on the DeepSpeed engine (`trainer.model_wrapped`), as TRL's own
  `GRPOTrainer` samples: `GatheredParameters` over all parameters, and ZeRO-3's module hooks removed for the
  round (re-registered, with the prefetch trace invalidated, on exit), plus the start-of-forward hook TRL
  leaves on (it broadcasts on every forward while the trace is incomplete). Given the bare module instead of
  the engine, TRL cannot find the hooks (they hang off the engine's optimizer) and leaves them in place: the
  sampler's forwards then re-partition parameters and record a trace that the first training forward replays,
  which is how the first backward failed with `The size of tensor a (0) must match the size of tensor b (64)`.
- FSDP2: `unshard()` of every FSDP module (one all-gather each, in module order), resharding after forward
  switched off for the round, then `reshard()` and the previous setting restored.
- DDP, ZeRO-1/2, FSDP1 through TRL's `summon_full_params`, one process: the unwrapped module.

What it does not do: anything for the vLLM server (it holds its own weights; `score_trajectories` then runs
sharded forwards, once per round on every rank); save memory: the full model lives on every rank for the round,
which is the price of sampling in-process (use vLLM at scale).

Outside the round (the loss, TRL's old-logp and reference passes, `score_trajectories` with a vLLM server) the
forwards are sharded, so their count must agree: the tree forward's number of tries depends on the rows, and
`agree_forward_count` gives it the maximum over ranks (one all-reduce per trainer forward, only while parameters
are sharded and not held in full by a round); the ranks with fewer tries run padding forwards
(`appo_trl.trainer.tree`). TRL's row-wise forward runs ceil(rows / batch size) forwards, equal on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from appo_trl.trainer import trl_seams


def _fsdp2_modules(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp2_unsharded(modules: list) -> Iterator[None]:
    """All-gather every FSDP2 module once and keep it unsharded until exit (no collective in between)."""
    saved = []
    for m in modules:  # the reshard-after-forward state of each param group, restored exactly on exit
        state = m._get_fsdp_state()
        groups = list(getattr(state, "_fsdp_param_groups", []))
        saved.append((state, getattr(state, "_auto_reshard_after_forward", None),
                      [g.post_forward_mesh_info for g in groups]))  # fmt: skip
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.reshard()
        for state, auto, infos in saved:
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
            if auto is not None:
                state._auto_reshard_after_forward = auto


@contextlib.contextmanager
def _zero3_start_hook_removed(engine) -> Iterator[None]:
    """Take ZeRO-3's start-of-forward hook off the module for the round (TRL's unwrap leaves it on).

    That hook (`DeepSpeedZeRoOffload.fwd_pre_hook`) calls the parameter coordinator's `reset_step`, which
    broadcasts (`assert_ints_same_as_other_ranks`) on every forward while the prefetch trace is incomplete, and
    TRL's unwrap invalidates the trace at every exit: one collective per sampler forward. Put back first in line.
    """
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    handle = getattr(offload, "fwd_pre_hook", None)
    module = getattr(offload, "module", None)
    hook = module._forward_pre_hooks.get(handle.id) if handle is not None and module is not None else None
    if hook is None:
        yield
        return
    handle.remove()
    try:
        yield
    finally:
        offload.fwd_pre_hook = module.register_forward_pre_hook(hook, prepend=True)


@contextlib.contextmanager
def full_weights_for_round(trainer) -> Iterator[torch.nn.Module]:
    """Gather the policy's full weights on every rank for one generation round; yields the module to sample with.

    Call it on every rank at the same point, around everything that runs forwards of a variable count
    (in-process sampling, APPO's selection forward): inside, no forward issues a collective.
    """
    from trl.models.utils import unwrap_model_for_generation

    accelerator, args = trainer.accelerator, trainer.args
    wrapped = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    fsdp2 = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", None) == 2
    with (
        unwrap_model_for_generation(
            wrapped, accelerator, gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
        ) as model,
        _zero3_start_hook_removed(wrapped) if trl_seams.distributed(trainer).is_zero3 else contextlib.nullcontext(),
        _fsdp2_unsharded(_fsdp2_modules(model)) if fsdp2 else contextlib.nullcontext(),
        trl_seams.distributed(trainer).summon_full_params(wrapped, recurse=False),  # FSDP1 (TRL's path); a no-op otherwise
    ):
        trainer._full_weights_held = True
        try:
            yield model
        finally:
            trainer._full_weights_held = False


def agree_forward_count(trainer) -> Callable[[int], int] | None:
    """The maximum of a per-rank forward count over ranks, when forwards gather sharded parameters; else None.

    Sharded: ZeRO-3 or FSDP, outside `full_weights_for_round` (inside it no forward runs a collective, and the
    round's forward counts differ by design). Every rank must call the returned function at the same point.
    """
    dist = trl_seams.distributed(trainer)
    if dist is None or not (dist.is_zero3 or dist.is_fsdp) or getattr(trainer, "_full_weights_held", False):
        return None
    device = trainer.accelerator.device

    def agree(count: int) -> int:
        agreed = torch.tensor([count], dtype=torch.long, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return int(agreed.item())

    return agree
