"""`appo train --config recipes/<model>/<stage>.yaml [--key value ...] [--accelerate_config NAME] [--num_processes N]`."""

from __future__ import annotations

USAGE = """usage: appo train --config RECIPE.yaml [--key value ...]
                  [--accelerate_config ddp|zero2|zero3|fsdp|PATH] [--num_processes N] [--mixed_precision no|bf16]

Keys are fields of APPOScriptArguments, APPOConfig (GRPOConfig + agentic RL) and TRL's ModelConfig;
command-line values override the recipe. With --accelerate_config or --num_processes the run is relaunched
through `accelerate launch`; otherwise it runs in this process."""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    from appo_trl.train import cli

    return cli(argv)
