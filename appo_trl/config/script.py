"""`APPOScriptArguments` (data, rewards), and the metadata helpers every appo-trl field uses.

`metadata=_strategy("help")` (`_data`, `_rollout`, `_loss`, `_vllm` likewise) gives a field its `--help` text and
its `--help` group (`appo_trl.configs.arguments.GROUPS`): the grouping of our fields is written once, per field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ScriptArguments


class FieldMeta(dict):
    """A field's metadata: `help` and `group`. transformers' `HfArgumentParser` passes `field.metadata.copy()` to
    `argparse.add_argument`, which takes no `group`: `copy()` (the metadata proxy calls this one) leaves it out."""

    def copy(self) -> dict:
        return {k: v for k, v in self.items() if k != "group"}


def _tag(group: str):
    """`metadata=_strategy("help text")`: the field's help, and its `--help` group (`configs.arguments.GROUPS`)."""
    return lambda text: FieldMeta(help=text, group=group)


_data, _rollout, _strategy, _loss, _vllm = (_tag(g) for g in ("data", "rollout", "strategy", "loss", "vllm"))


@dataclass
class APPOScriptArguments(ScriptArguments):
    """Script arguments of `appo train`: where the data comes from and how completions are scored.

    Args:
        dataset_name: hub id, local parquet/jsonl file, or folder of such files.
        prompt_column: column holding the prompt (a string, or a list of chat messages).
        answer_column: column holding the gold answer(s), passed to reward functions as `answer`.
        reward_funcs: reward function names from `appo_trl.rewards` or dotted import paths.
        system_prompt: system message prepended to string prompts (a name from the prompt registry or text).
        search_corpus: a JSONL corpus for the `search` tool: `appo train` starts `appo serve-search` on it
            (127.0.0.1, a free port) for the run, points `tool_config.search.url` there and stops it at the end.
        skip_bad_rows: drop bad rows (malformed or non-UTF-8 JSON lines, null or empty prompts, prompts too long
            for the model), counted and logged per file, instead of stopping at the first one.
    """

    dataset_name: str | None = field(
        default=None, metadata=_data("Hub id, local parquet/jsonl file, or a folder of such files.")
    )
    prompt_column: str = field(default="prompt", metadata=_data("Column with the prompt (text or messages)."))
    answer_column: str = field(default="answer", metadata=_data("Column with the gold answer(s)."))
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arpo_deep_research"],
        metadata=_data("Reward function names (see `appo_trl.rewards.REWARD_FUNCS`) or dotted import paths."),
    )
    system_prompt: str | None = field(
        default=None, metadata=_data("System prompt name (prompt registry) or literal text.")
    )
    search_corpus: str | None = field(
        default=None,
        metadata=_data(
            "JSONL corpus for the `search` tool: `appo train` starts `appo serve-search` on it (127.0.0.1, a free "
            "port), points `tool_config.search.url` there, and stops it at the end. None: no server is started.",
        ),
    )
    skip_bad_rows: bool = field(
        default=False,
        metadata=_data(
            "Drop bad rows (malformed or non-UTF-8 JSON lines, null or empty prompts, prompts too long for "
            "the model), counted and logged per file; false (default): stop at the first one, naming file and row.",
        ),
    )
