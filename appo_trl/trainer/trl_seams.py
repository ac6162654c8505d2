"""Every write appo-trl makes into TRL's private attributes or module globals: one function per seam.

Each function names its seam and the TRL version it was read from (trl 1.16.0); when TRL moves, this is the file
to read again. Not here: subclassing TRL's `VLLMGeneration` (`appo_trl.vllm.weight_sync`, `appo_trl.vllm.nccl`:
`_init_vllm` overridden, `_iter_named_params` read) and the one module global it swaps while TRL builds the
colocated engine (`trl.generation.vllm_generation.LLM`, `appo_trl.vllm.weight_sync._trl_llm_takes`: floor 2
cannot import this module).
"""

from __future__ import annotations

import contextlib

from appo_trl.trl_rules import (  # the TRL these seams (and TRL's copied rules) were read from
    TRL_VERSION,
    generate_every,
)


@contextlib.contextmanager
def vllm_generation_replaced(build):
    """Seam `trl.trainer.grpo_trainer.VLLMGeneration` (trl 1.16.0): `GRPOTrainer.__init__` builds its vLLM engine /
    weight sync as `VLLMGeneration(**kwargs)` by this module-global name. Within, the name is `build(original)`
    (`original`: the class there on entry); restored on exit. Wrap `super().__init__` with it."""
    import trl.trainer.grpo_trainer as grpo_trainer

    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = build(original)
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


def weights_synced_at(trainer) -> int:
    """Seam `GRPOTrainer._last_loaded_step` (trl 1.16.0): the global step whose weights vLLM holds (-1: none yet);
    TRL's `_generate` syncs when it differs from `state.global_step`."""
    return trainer._last_loaded_step


def mark_weights_synced(trainer) -> None:
    """Seam `GRPOTrainer._last_loaded_step` (trl 1.16.0): vLLM now holds the weights of `state.global_step`."""
    trainer._last_loaded_step = trainer.state.global_step


def weights_sleeping(generation) -> bool:
    """Seam `VLLMGeneration._llm_weights_sleeping` (trl 1.16.0): the colocated engine's weights were dropped by a
    level-2 sleep (its `sync_weights` wakes them first). False where the attribute does not exist (server mode)."""
    return getattr(generation, "_llm_weights_sleeping", False)


def mark_weights_sleeping(generation) -> None:
    """Seam `VLLMGeneration._llm_weights_sleeping` (trl 1.16.0): set after a level-2 sleep, as TRL's colocate
    `generate` does after its own round."""
    generation._llm_weights_sleeping = True


def step_metrics(trainer, mode: str):
    """Seam `GRPOTrainer._metrics` (trl 1.16.0): the step's metric lists of `mode` ("train" | "eval"), a
    `defaultdict(list)` that `GRPOTrainer.log` averages per key and clears. Append to a key to log a value."""
    return trainer._metrics[mode]


def log_metric(trainer, mode: str, key: str, value: float) -> None:
    """Seam `GRPOTrainer._metrics` (trl 1.16.0): `{"train" | "eval": defaultdict(list)}`; `GRPOTrainer.log` averages
    each list into the logged value and clears it. `value` joins the step's `key`."""
    step_metrics(trainer, mode)[key].append(value)


@contextlib.contextmanager
def trl_importance_correction(trainer):
    """Seam `GRPOTrainer.use_vllm` (trl 1.16.0): TRL computes the behaviour-policy correction (the proximal old
    logps, the importance weight in any of its modes, its metrics, the loss factor) under `if self.use_vllm and
    self.vllm_importance_sampling_correction`. Within, `use_vllm` is raised for a sampler that is a separate copy
    of the policy (as a server is), and lowered after; with `use_vllm` already set this does nothing."""
    if trainer.use_vllm:
        yield
        return
    trainer.use_vllm = True
    try:
        yield
    finally:
        trainer.use_vllm = False


def prepend_tools(trainer, standalone: list) -> None:
    """Seams `GRPOTrainer.tools` and `GRPOTrainer._env_tools` (trl 1.16.0): the functions whose schemas
    `_tokenize_prompts` renders into every prompt, and with `environment_factory` each environment's own list
    (its methods). `standalone` (the configured tools) goes first in both, as the chat template lists them."""
    env_methods = list(trainer.tools) if trainer.environment_factories is not None else []
    trainer.tools = standalone + env_methods
    for name in getattr(trainer, "_env_tools", None) or {}:
        trainer._env_tools[name] = standalone + trainer._env_tools[name]


def set_card(trainer, name: str, paper: dict, tags: list[str]) -> None:
    """Seams `GRPOTrainer._name`, `_paper`, `_tag_names` (trl 1.16.0): what `create_model_card` writes as the
    method, its paper and the Hub tags."""
    trainer._name, trainer._paper, trainer._tag_names = name, paper, tags


def buffered_generation(trainer, make_batches) -> list:
    """Seam `GRPOTrainer._buffered_inputs` (trl 1.16.0): the micro-batches of the current generation batch, reused
    for `steps_per_generation` micro-steps; `make_batches()` refills it when TRL's own rule says a new generation
    batch starts (every `steps_per_generation * num_iterations` micro-steps, or when it is empty)."""
    if trainer._step % generate_every(trainer.args) == 0 or trainer._buffered_inputs is None:
        trainer._buffered_inputs = make_batches()
    return trainer._buffered_inputs


__all__ = ["TRL_VERSION", "buffered_generation", "prepend_tools", "set_card", "log_metric", "mark_weights_sleeping", "mark_weights_synced", "step_metrics",
           "trl_importance_correction",
           "vllm_generation_replaced", "weights_sleeping", "weights_synced_at"]  # fmt: skip
