"""`appo tiny-model OUT_DIR`: build the tiny offline model (see `appo_trl.tiny`)."""

from __future__ import annotations

import argparse


def _bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appo tiny-model", description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--max_position_embeddings", type=int, default=2048)
    p.add_argument("--chat_template", choices=["tags", "tools", "qwen3"], default="tags",
                   help="tags: ARPO tag format; tools: TRL's bundled Qwen3 template, <tool_call> function calling "
                        "(tool_format: chat), runs under stock GRPOTrainer(tools=...) too; qwen3: alias of tools")  # fmt: skip
    p.add_argument("--head_dim", type=int, default=32, help="attention head size (vLLM-CPU serves 32, 64, ...)")
    p.add_argument(
        "--tie_word_embeddings",
        type=_bool,
        default=False,
        metavar="{true,false}",
        help="share lm_head with the embeddings (default false: vLLM-CPU's weight reload keeps a stale tied lm_head)",
    )
    a = p.parse_args(argv)
    import sys

    from appo_trl.tiny import build_tiny_model

    if not sys.stderr.isatty():  # a log file: no "Writing model shards" bar
        from appo_trl.reporting.console import quiet_progress_bars

        quiet_progress_bars()

    path = build_tiny_model(
        a.out_dir,
        seed=a.seed,
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.max_position_embeddings,
        chat_template=a.chat_template,
        head_dim=a.head_dim,
        tie_word_embeddings=a.tie_word_embeddings,
    )
    print(path)
    return 0
