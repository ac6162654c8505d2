"""`appo train --config recipes/<model>/<stage>.yaml [--key value ...] [--accelerate_config NAME] [--num_processes N]`."""

from __future__ import annotations

import sys

USAGE = """appo train --config RECIPE.yaml [--key value ...]
                  [--accelerate_config ddp|zero2|zero3|fsdp|PATH] [--num_processes N] [--mixed_precision no|bf16]"""
DESCRIPTION = """Keys are fields of APPOScriptArguments, APPOConfig (GRPOConfig + agentic RL) and TRL's ModelConfig;
command-line values override the recipe (`--key value`, `--key=value` or `--dash-style-key value`). With
--accelerate_config or --num_processes the run is relaunched through `accelerate launch`; otherwise it runs in
this process. With --config, the defaults shown are the recipe's values."""


def print_help(argv: list[str], dataclass_types, usage: str, description: str) -> int:
    """Grouped help (every field, its help and default); with `--config R` the recipe's values are the defaults."""
    from appo_trl.configs.arguments import grouped_help, normalize_flags
    from appo_trl.configs.recipes import RecipeError, load_recipe

    argv, config = normalize_flags(argv), None
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        try:
            config = load_recipe(argv[argv.index("--config") + 1])
        except (RecipeError, OSError, ValueError) as exc:
            print(f"note: recipe not read ({exc}); showing the built-in defaults.", file=sys.stderr)
    try:
        print(grouped_help(dataclass_types(), usage, description, config))
    except (TypeError, ValueError) as exc:  # a recipe value argparse cannot show: fall back to built-in defaults
        print(f"note: recipe values not shown ({exc}).", file=sys.stderr)
        print(grouped_help(dataclass_types(), usage, description))
    return 0


def main(argv: list[str]) -> int:
    from appo_trl.configs.arguments import wants_help

    if not argv or wants_help(argv):
        from appo_trl.stages.train import dataclass_types

        return print_help(argv, dataclass_types, USAGE, DESCRIPTION)
    from appo_trl.stages.train import cli

    return cli(argv)
