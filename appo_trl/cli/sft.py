"""`appo sft --config recipes/<model>/sft.yaml [--key value ...] [--accelerate_config NAME] [--num_processes N]`."""

from __future__ import annotations

USAGE = """appo sft --config RECIPE.yaml [--key value ...]
                [--accelerate_config ddp|zero2|zero3|fsdp|PATH] [--num_processes N] [--mixed_precision no|bf16]"""
DESCRIPTION = """Keys are fields of SFTScriptArguments (dataset_name, messages_column, system_prompt), APPOSFTConfig (TRL's
SFTConfig + assistant_only_loss=True, mask_tool_results=True) and TRL's ModelConfig (use_peft, lora_*);
command-line values override the recipe. Data: chat `messages` or LLaMA-Factory sharegpt (ARPO-SFT).
With --accelerate_config or --num_processes the run is relaunched through `accelerate launch`."""


def main(argv: list[str]) -> int:
    from appo_trl.configs.arguments import wants_help

    if not argv or wants_help(argv):
        from appo_trl.cli.train import print_help
        from appo_trl.stages.sft import dataclass_types

        return print_help(argv, dataclass_types, USAGE, DESCRIPTION)
    from appo_trl.stages.sft import cli

    return cli(argv)
