"""The trainer's side of vLLM: the servers and TRL's weight sync set up around `GRPOTrainer.__init__`, and one
generation round after the once-per-round weight sync.

`prepare_vllm_server(args)` resolves the servers once (`appo_trl.vllm.resolve_servers`) and yields the
`ServerSpec` the trainer keeps (`trainer.vllm_server`); `generate_round(trainer, sample)` syncs, samples and
survives server restarts. The vLLM parts live in `appo_trl.vllm`; TRL's private attributes are written through
`trl_seams` only. The story: docs/architecture.md ("vLLM").
"""

from __future__ import annotations

import contextlib
import functools
import logging

from appo_trl.trainer import trl_seams

MAX_ROUND_RESTARTS = 3  # server restarts survived within one round before the run stops
logger = logging.getLogger(__name__)


@contextlib.contextmanager
def prepare_vllm_server(args):
    """Wrap `GRPOTrainer.__init__`: resolve the servers, then make TRL build the weight sync `args` asks for.

    Server mode (every rank): the `ServerSpec` (replicas and router, every server healthy within
    `vllm_server_timeout`, the served `max_model_len` written into `args.vllm_max_model_length` when unset, an error
    naming both numbers when they differ) is yielded; TRL builds the route `weight_sync_factory` picks from the
    accelerator's device. Colocate mode: TRL builds `ColocateWeightSync` (in-process `reload_weights` on vLLM-CPU)
    and None is yielded. Without `use_vllm` this does nothing and yields None.
    """
    if args.use_vllm and args.vllm_mode == "colocate":
        from appo_trl.vllm.weight_sync import ColocateWeightSync

        llm_kwargs = {} if args.vllm_dtype == "auto" else {"dtype": args.vllm_dtype}
        colocated = functools.partial(ColocateWeightSync, llm_kwargs=llm_kwargs)
        with trl_seams.vllm_generation_replaced(lambda trl_class: colocated):
            yield None
        return
    if not (args.use_vllm and args.vllm_mode == "server"):
        yield None
        return
    from appo_trl.vllm import resolve_servers
    from appo_trl.vllm.weight_sync import weight_sync_factory

    spec = resolve_servers(args)
    args.vllm_max_model_length = spec.max_model_len
    with trl_seams.vllm_generation_replaced(lambda trl_class: weight_sync_factory(spec, args, trl_class)):
        yield spec


def sync_weights(trainer) -> None:
    """Push the policy's weights to vLLM now (on every rank) and record the step they are from."""
    trainer.vllm_generation.sync_weights()
    trl_seams.mark_weights_synced(trainer)


def held_adapter(trainer):
    """Within: the round holds the LoRA version it starts on (adapter-only sync: its requests name it, and it is not
    unloaded until the round ends; `appo_trl.vllm.lora.AdapterVersions`); otherwise nothing."""
    adapters = getattr(getattr(trainer, "vllm_server", None), "adapters", None)
    return adapters.hold() if adapters is not None else contextlib.nullcontext()


def generate_round(trainer, sample):
    """`sample()` (one round of `strategy.generate`), after the once-per-round weight sync (vLLM), surviving server
    restarts: a round in which any rank's sampler raised `VLLMServerRestarted` is synced again and re-run (same
    seed) on every rank, at most `MAX_ROUND_RESTARTS` times. Colocate sleep mode: the weights are pushed again
    when level-2 sleep dropped them after the last round (as TRL's generate does), the round runs inside the
    backend's `awake()` (KV cache awake), and TRL's weights-sleeping flag is set after it."""
    if not trainer.use_vllm:
        return sample()
    import torch

    from appo_trl.vllm import VLLMServerError, VLLMServerRestarted
    from appo_trl.vllm.weight_sync import DiskWeightSync

    backend = getattr(trainer.rollout_engine, "backend", None)
    resync = False
    for _ in range(MAX_ROUND_RESTARTS + 1):
        asleep = trl_seams.weights_sleeping(trainer.vllm_generation)
        if resync or asleep or trainer.state.global_step != trl_seams.weights_synced_at(trainer):
            sync_weights(trainer)  # once per round, on every rank, before any request
        batch, error = None, None
        try:
            with held_adapter(trainer), getattr(backend, "awake", contextlib.nullcontext)():
                batch = sample()
        except VLLMServerRestarted as exc:
            error = exc
        finally:
            if getattr(backend, "sleep_mode", False):  # `awake` slept at level 2: TRL's flag, as its generate sets
                trl_seams.mark_weights_sleeping(trainer.vllm_generation)
        flag = torch.tensor([float(error is not None)], device=trainer.accelerator.device)
        if not trainer.accelerator.gather(flag).any():
            return batch
        if not isinstance(trainer.vllm_generation, DiskWeightSync):
            raise VLLMServerError(
                "the vLLM server restarted during a round, and TRL's NCCL weight sync cannot re-attach to a new "
                "server process: restart the run (resume_from_checkpoint: true)"
            ) from error
        logger.warning("vLLM server restarted during the round at step %d (%s): syncing the weights again and "
                       "re-running the round", trainer.state.global_step, error or "seen by another rank")  # fmt: skip
        resync = True
    raise VLLMServerError(f"the vLLM server restarted {MAX_ROUND_RESTARTS + 1} times during one round") from error


__all__ = ["MAX_ROUND_RESTARTS", "generate_round", "held_adapter", "prepare_vllm_server", "sync_weights"]
