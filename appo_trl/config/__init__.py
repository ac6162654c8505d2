"""Floor 7: the configuration dataclasses, `APPOScriptArguments` (data, rewards, tools) and `APPOConfig(GRPOConfig)`.

- `script`: `APPOScriptArguments`, and `_strategy("help")` and its siblings: the metadata (help, group) of our fields;
- `appo`: `APPOConfig`'s fields, `REMOVED_FIELDS` (refused with one line naming the replacement) and
  `__post_init__`;
- `checks`: the constraints only the config can check, each in one place (a strategy's own are beside it).

Imports the floors below it (`strategies`: each strategy validates its part; `configs`, `tools`, `vllm`, `trl_rules`);
never `trainer`, `stages`, `synthetic` or `cli`, so the config loads without the trainer.
"""

from appo_trl.config.appo import REMOVED_FIELDS, APPOConfig
from appo_trl.config.checks import CUSTOM_LOSS_TYPES
from appo_trl.config.script import APPOScriptArguments
from appo_trl.configs.reference import REFERENCE_PRESETS

__all__ = ["APPOConfig", "APPOScriptArguments", "CUSTOM_LOSS_TYPES", "REFERENCE_PRESETS", "REMOVED_FIELDS"]
