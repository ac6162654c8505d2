"""Command-line flags as TRL reads them: dash-style names, and a `--help` that lists every field by group.

- `normalize_flags(argv)`: `--learning-rate 1e-4` -> `--learning_rate 1e-4` (and `--no-foo` -> `--no_foo`),
  as TRL's parser accepts both spellings. Only flag names change, never values.
- `wants_help(argv)`: `-h` / `--help` anywhere on the line (so `appo train --config R -h` prints help).
- `grouped_help(...)`: every field of the stage's dataclasses with its help text and default, grouped
  (model, data, rollout, strategy, loss, vllm, training, evaluation, logging, checkpoints & hub) like
  `trl grpo --help`. With a recipe, the defaults shown are the recipe's values.

appo-trl's own fields name their group in their metadata (`metadata={"help": ..., "group": "strategy"}`,
`appo_trl.config.script._h`). The fields inherited from TRL and transformers carry no group: they
are grouped by name rules and by "anchor" fields (a dataclass's fields are read in declaration order and an
anchor switches the group for the fields that follow it).

What this does not do: parse values (that is TRL's `TrlParser`, called by `appo_trl.configs.recipes`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

GROUPS: dict[str, str] = {
    "model": "Model loading, dtype, LoRA / quantization (TRL ModelConfig) and reference model",
    "data": "Dataset, columns, system prompt and reward functions",
    "rollout": "Sampling and the tool loop: group size, completion budget, temperature, tools",
    "strategy": "Rollout strategy (grpo / arpo / aepo / appo) and its branching rules",
    "loss": "Policy loss, KL, clipping, advantages and reward weighting",
    "vllm": "vLLM generation (server mode) and weight sync",
    "training": "Optimizer, schedule, batch sizes, precision and distributed training",
    "evaluation": "In-training evaluation",
    "logging": "Logging, trackers and completion logging",
    "checkpoints & hub": "Output directory, checkpoints, resume and Hugging Face Hub push",
    "other": "Other settings",
}

# TRL's and transformers' fields (ours are tagged): first group of each dataclass (by class name), before any anchor
_START = {"SFTScriptArguments": "data", "ScriptArguments": "data", "ModelConfig": "model", "GRPOConfig": "model",
          "SFTConfig": "model"}  # fmt: skip
# anchor field -> group of this field and those that follow it in the same class
_ANCHORS = {
    # trl GRPOConfig (declaration order: model, data, generation, vLLM, training, logging)
    "model_init_kwargs": "model", "num_generations": "rollout", "beta": "loss",
    "max_tool_calling_iterations": "rollout", "vllm_importance_sampling_correction": "loss",
    "log_completions": "logging", "use_transformers_continuous_batching": "rollout",
    "vllm_importance_sampling_cap": "loss",
    # trl SFTConfig (model, then data preprocessing, then the loss)
    "dataset_text_field": "data", "completion_only_loss": "loss",
}  # fmt: skip


def _by_name(name: str) -> str | None:
    if name.startswith("vllm_importance_sampling"):
        return "loss"
    if name == "use_vllm" or name.startswith("vllm_") or name == "ds3_gather_for_generation":
        return "vllm"
    if name in ("output_dir", "resume_from_checkpoint", "push_to_hub", "overwrite_output_dir") or name.startswith(
        ("save_", "hub_")
    ):
        return "checkpoints & hub"
    if name.startswith(("eval_", "per_device_eval", "do_eval", "num_generations_eval")) or name in (
        "batch_eval_metrics", "prediction_loss_only", "metric_for_best_model", "greater_is_better",
        "load_best_model_at_end", "include_for_metrics", "bf16_full_eval", "fp16_full_eval",
    ):  # fmt: skip
        return "evaluation"
    if name.startswith(("logging_", "log_", "trackio_")) or name in (
        "report_to", "run_name", "project", "disable_tqdm", "skip_memory_metrics",
        "include_num_input_tokens_seen",
    ):  # fmt: skip
        return "logging"
    if name.startswith("dataset_") or name in ("reward_funcs", "system_prompt"):
        return "data"
    return None


def field_groups(dataclass_types: Sequence[type]) -> dict[str, str]:
    """Field name -> group name for every init field of `dataclass_types` (the first class owning a name wins):
    the field's own `group` tag, else the name rules and anchors above."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    out: dict[str, str] = {}
    for dc in dataclass_types:
        own_first = [c for c in dc.__mro__ if c.__name__ in _START]
        current = _START.get(own_first[0].__name__ if own_first else "", "other")
        for f in dataclasses.fields(dc):
            # only the fields a class (or a non-TrainingArguments parent) declares move the anchor
            current = _ANCHORS.get(f.name, current)
            if not f.init or f.name in out:
                continue
            group = f.metadata.get("group") or _by_name(f.name)
            if group is None:
                group = "training" if f.name in base else current
            out[f.name] = group
    return out


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """`--learning-rate x` -> `--learning_rate x`; `--no-use-peft` -> `--no_use_peft`. Values are untouched."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:  # argparse never takes a `--x` token as a value
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def grouped_help(
    dataclass_types: Sequence[type], usage: str, description: str = "", config: dict | None = None
) -> str:
    """The `--help` text: each field's flag, help and default, in GROUPS order.

    `config` (a recipe mapping) replaces the defaults shown, as TRL does with `--config R -h`.
    """
    from trl import TrlParser

    source = TrlParser(dataclass_types)
    if config:
        source.set_defaults_with_config(**{k: v for k, v in config.items() if k != "env"})
    groups = field_groups(dataclass_types)
    parser = argparse.ArgumentParser(usage=usage, description=description, add_help=False, formatter_class=_Formatter)
    sections = {name: parser.add_argument_group(name, text) for name, text in GROUPS.items()}
    for action in source._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if any(o.startswith("--no_") for o in action.option_strings):
            action.help, action.default = f"Same as `--{action.dest} false`.", argparse.SUPPRESS
        elif not action.help:
            action.help = "(no description)"
        sections[groups.get(action.dest, "other")]._group_actions.append(action)
    for section in sections.values():
        if not section._group_actions:
            parser._action_groups.remove(section)
    parser._action_groups = [g for g in parser._action_groups if g._group_actions]
    return parser.format_help()


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `--name TYPE` once (the dash alias is accepted but not listed) and the default after the help."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=40, width=119)

    def _format_action_invocation(self, action):
        opts = [o for o in action.option_strings if "-" not in o[2:]] or action.option_strings[:1]
        if action.nargs == 0:
            return ", ".join(opts)
        return ", ".join(opts) + " " + self._format_args(action, self._get_default_metavar_for_optional(action))

    def _get_default_metavar_for_optional(self, action):
        name = getattr(action.type, "__name__", "")
        return {"string_to_bool": "BOOL", "str": "STR", "int": "INT", "float": "FLOAT"}.get(name, "VALUE")
