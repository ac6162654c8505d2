"""TRL constructor parity for `APPOTrainer`: the default config, a plain `GRPOConfig`, and `rollout_func`.

- `resolve_args(model, args)`: no `args` builds `APPOConfig(f"{model_name}-APPO")`, the way `GRPOTrainer` builds
  `GRPOConfig(f"{model_name}-GRPO")`; a plain `GRPOConfig` is converted field by field into an `APPOConfig`
  (every `GRPOConfig` field keeps its value, the APPO fields take their defaults, so `rollout_strategy: grpo`),
  with one log line saying so. Anything else is a `TypeError`. Such a built config also takes TRL's behaviour
  where appo-trl's defaults differ, since the user chose neither:
  - rounds in which every reward is None: TRL warns and trains on, so `max_nan_reward_steps` is 0 there (an
    `APPOConfig` the user wrote keeps its default, 3 rounds, then an error naming the reward functions);
  - the tool-call limit: TRL limits tool-calling *turns* (`max_tool_calling_iterations`, None = no limit) and
    runs every call of a turn, so `tool_call_limit` (calls, default 3) is None there and only TRL's turn limit
    applies (an `APPOConfig` the user wrote keeps `tool_call_limit`, checked alongside the turn limit).
- `row_forward_where_tree_cannot(args, model)`: the one place that decides whether the tree forward serves a model
  exactly (`tree_forward_obstacles`). The tree forward computes sliding windows, soft-capping, attention sinks and
  the MoE load-balancing loss; a model it still cannot serve (a paged attention implementation) trains with TRL's
  row-wise forward instead, with one log line naming why, whatever config asked for `tree_forward`: a default never
  refuses a model that TRL trains.

- `check_rollout_func(rollout_func)`: it must be callable; what it cannot run with (a branching strategy, tools,
  environments, an injected engine, background rounds) is refused by the sampling path
  (`appo_trl.trainer.sampling_paths.REFUSALS`).

What this does not do: build the model, or check anything else of the config (`APPOConfig.__post_init__` does).
"""

from __future__ import annotations

import dataclasses
import logging

from trl import GRPOConfig

from appo_trl.config import APPOConfig

logger = logging.getLogger(__name__)


def _model_name(model) -> str:
    from trl.trainer.utils import get_config_model_id

    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return name.split("/")[-1]


def grpo_to_appo(args: GRPOConfig) -> APPOConfig:
    """An `APPOConfig` holding every init field of `args` (a `GRPOConfig`); the APPO fields keep their defaults.

    `GRPOConfig.__post_init__` fills both `generation_batch_size` and `steps_per_generation` from whichever was
    set; passing both back is refused by TRL, so only `steps_per_generation` (which implies the other) is passed.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    if values.get("steps_per_generation") is not None:
        values.pop("generation_batch_size", None)
    return APPOConfig(**values)


def resolve_args(model, args) -> APPOConfig:
    """The `APPOConfig` for `APPOTrainer(model, args=args)`: `args` itself, a default one, or a converted one."""
    if isinstance(args, APPOConfig):
        return args
    if args is None:
        built = APPOConfig(f"{_model_name(model)}-APPO")
    elif isinstance(args, GRPOConfig):
        logger.info(
            "APPOTrainer: converting the GRPOConfig field by field into an APPOConfig; that means "
            "rollout_strategy: grpo (use an APPOConfig for arpo, aepo or appo)."
        )
        built = grpo_to_appo(args)
    else:
        raise TypeError(f"APPOTrainer: args must be an APPOConfig or a GRPOConfig, got {type(args).__name__}.")
    built.max_nan_reward_steps = 0  # TRL warns on all-None rewards and trains on; it never stops the run
    built.tool_call_limit = None  # TRL has no call limit: only max_tool_calling_iterations (turns) applies
    return built


def tree_forward_obstacles(model) -> list[str]:
    """What of `model` the tree forward cannot compute exactly (`appo_trl.tree.attention` refuses each)."""
    found = []
    if str(getattr(model.config, "_attn_implementation", None) or "").startswith("paged|"):
        found.append("paged attention")  # `install_tree_attention` cannot wrap it
    return found


def row_forward_where_tree_cannot(args: APPOConfig, model) -> None:
    """Turn `tree_forward` off, with one log line, for a model it cannot serve exactly (see module doc)."""
    obstacles = tree_forward_obstacles(model) if args.tree_forward else []
    if obstacles:
        logger.info("APPOTrainer: %s need(s) TRL's row-wise forward, so tree_forward is off.", " and ".join(obstacles))
        args.tree_forward = False


def check_rollout_func(rollout_func) -> None:
    """A `rollout_func` must be callable (before the model loads); None passes. What it cannot run with is refused by
    the sampling path (`appo_trl.trainer.sampling_paths.REFUSALS`, path `trl`)."""
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(f"APPOTrainer: rollout_func must be callable, got {type(rollout_func).__name__}.")
