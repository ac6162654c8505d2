"""Configuration dataclasses: `APPOScriptArguments` (data, rewards, tools) and `APPOConfig(GRPOConfig)`.

- `script`: `APPOScriptArguments`, and `_strategy("help")` and its siblings: the metadata (help, group) of our fields;
- `appo`: `APPOConfig`'s fields, `REMOVED_FIELDS` (refused with one line naming the replacement) and
  `__post_init__`;
- `checks`: the constraints only the config can check, each in one place (a strategy's own are beside it).
"""

from appo_trl.configs.reference import REFERENCE_PRESETS
from appo_trl.trainer.config.appo import REMOVED_FIELDS, APPOConfig
from appo_trl.trainer.config.checks import CUSTOM_LOSS_TYPES
from appo_trl.trainer.config.script import APPOScriptArguments

__all__ = ["APPOConfig", "APPOScriptArguments", "CUSTOM_LOSS_TYPES", "REFERENCE_PRESETS", "REMOVED_FIELDS"]
