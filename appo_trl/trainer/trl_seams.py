"""Every write appo-trl makes into TRL's private attributes or module globals, and every read of one: one function
per seam.

Each function names its seam and the TRL version it was read from (trl 1.16.0); when TRL moves, this is the file
to read again. `tests/trainer/test_trl_seams.py` fails when another module reads one of `GRPOTrainer`'s private
members itself (overriding TRL's hooks and calling `super()`'s is the subclass's own business, not a seam; the
copied rules in `appo_trl.trl_rules`, which floor 1 keeps from importing this module, read two, listed there).
Not here: subclassing TRL's `VLLMGeneration` (`appo_trl.vllm.weight_sync`, `appo_trl.vllm.nccl`:
`_init_vllm` overridden, `_iter_named_params` read) and the one module global it swaps while TRL builds the
colocated engine (`trl.generation.vllm_generation.LLM`, `appo_trl.vllm.weight_sync._trl_llm_takes`: floor 2
cannot import this module).
"""

from __future__ import annotations

import contextlib
import copy

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
    """Seams `GRPOTrainer.tools`, `_standalone_tools` and `_env_tools` (trl 1.16.0): the functions whose schemas
    `_tokenize_prompts` renders into every prompt, the ones bound to no environment, and with `environment_factory`
    each environment's own list (its methods). `standalone` (the configured tools) goes first in both lists, as the
    chat template lists them."""
    trainer._standalone_tools = standalone
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


# ---- reads ---------------------------------------------------------------------------------------------------------
def tokenizer(trainer):
    """Seam `GRPOTrainer._tokenizer` (trl 1.16.0): the processing class's tokenizer (a processor's `.tokenizer`)."""
    return trainer._tokenizer


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """Seam `GRPOTrainer._tokenize_prompts` (trl 1.16.0): the prompt ids TRL samples from (its chat template, the
    tools' schemas, multimodal inputs), for a deep copy of `prompts` (TRL's renderer edits the messages in place)."""
    prompt_ids, _, _ = trainer._tokenize_prompts(copy.deepcopy(prompts))
    return prompt_ids


def per_token_logps_and_entropies(trainer, model, *args, **kwargs):
    """Seam `GRPOTrainer._get_per_token_logps_and_entropies` (trl 1.16.0): the forward TRL's loss and old-logp pass
    run, `(logps, entropies, aux_loss)`; on `APPOTrainer` its override (the tree forward, the cached old logps)."""
    return trainer._get_per_token_logps_and_entropies(model, *args, **kwargs)


def micro_step(trainer) -> int:
    """Seam `GRPOTrainer._step` (trl 1.16.0): the training micro-steps so far, as `_prepare_inputs` counts them."""
    return trainer._step


def num_items_in_batch(trainer, batch_samples, device):
    """Seam `Trainer._get_num_items_in_batch` (transformers, under trl 1.16.0): the loss normaliser of a batch."""
    return trainer._get_num_items_in_batch(batch_samples, device)


def entropy_bonus_enabled(trainer) -> bool:
    """Seam `GRPOTrainer._entropy_bonus_enabled` (trl 1.16.0): TRL adds its entropy bonus to the loss
    (`entropy_coef != 0` or the adaptive one)."""
    return trainer._entropy_bonus_enabled


def distributed(trainer):
    """Seam `GRPOTrainer._dist` (trl 1.16.0): TRL's `DistributedBackend` (`is_zero3`, `is_fsdp`,
    `summon_full_params`); None before TRL's `__init__` has built it."""
    return getattr(trainer, "_dist", None)


def multi_environment(trainer) -> bool:
    """Seam `GRPOTrainer._multi_environment` (trl 1.16.0): `environment_factory` was a dict of named factories."""
    return trainer._multi_environment


def environment_pool(trainer) -> dict:
    """Seam `GRPOTrainer._environment_pool` (trl 1.16.0): environment name -> its reusable instances (TRL's probe
    instance first)."""
    return trainer._environment_pool


def batch_environment_names(trainer) -> list:
    """Seam `GRPOTrainer._batch_environments` (trl 1.16.0): the environment name of each row of the current
    generation batch, beside `trainer.environments` (its instances)."""
    return trainer._batch_environments


def environment_tools(trainer, name) -> list:
    """Seam `GRPOTrainer._env_tools` (trl 1.16.0): the tools exposed while environment `name` is selected."""
    return trainer._env_tools[name]


__all__ = ["TRL_VERSION", "batch_environment_names", "buffered_generation", "distributed", "entropy_bonus_enabled",
           "environment_pool", "environment_tools", "log_metric", "mark_weights_sleeping", "mark_weights_synced",
           "micro_step", "multi_environment", "num_items_in_batch", "per_token_logps_and_entropies", "prepend_tools",
           "set_card", "step_metrics", "tokenize_prompts", "tokenizer", "trl_importance_correction",
           "vllm_generation_replaced", "weights_sleeping", "weights_synced_at"]  # fmt: skip
