"""Configuration dataclasses: `APPOScriptArguments` (data, rewards, tools) and `APPOConfig(GRPOConfig)`.

Every field is a recipe key (flat YAML) and a CLI flag (`--key value`), parsed by `appo_trl.recipes`.
`APPOConfig` is extended by the trainer work (rollout strategy, branching, losses); this module holds the
fields and the validation only, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, ScriptArguments


@dataclass
class APPOScriptArguments(ScriptArguments):
    """Script arguments of `appo train`: where the data comes from and how completions are scored.

    Args:
        dataset_name: hub id, local parquet/jsonl file, or folder of such files.
        prompt_column: column holding the prompt (a string, or a list of chat messages).
        answer_column: column holding the gold answer(s), passed to reward functions as `answer`.
        reward_funcs: reward function names from `appo_trl.rewards` or dotted import paths.
        system_prompt: system message prepended to string prompts (a name from the prompt registry or text).
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id, local parquet/jsonl file, or a folder of such files."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the prompt (text or messages)."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the gold answer(s)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arpo_deep_research"],
        metadata={"help": "Reward function names (see `appo_trl.rewards.REWARD_FUNCS`) or dotted import paths."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt name (prompt registry) or literal text."}
    )


@dataclass
class APPOConfig(GRPOConfig):
    """`GRPOConfig` plus the agentic-RL settings of appo-trl (see the trainer module for their use).

    Args:
        tools: tools the agent may call (names from `appo_trl.tools`), e.g. `[python, search]`.
        tool_config: per-tool parameters keyed by tool name, e.g. `{python: {timeout_s: 5}, search: {backend: cache}}`.
    """

    tools: list[str] = field(
        default_factory=list, metadata={"help": "Tools the agent may call, e.g. `python search`."}
    )
    tool_config: dict | str | None = field(
        default=None,
        metadata={"help": "Per-tool parameters as a mapping (YAML) or JSON string, keyed by tool name."},
    )
