"""Floor 9: the RL and SFT stages as functions, what `appo train` / `appo sft`, `sft/train.py` and the
study call.

- `train`: `appo train`: recipe -> preflight -> `APPOTrainer` -> train -> save -> push;
- `sft`: `appo sft`: recipe -> `APPOSFTConfig` -> TRL's `SFTTrainer` -> save -> push;
- `interrupts`: Ctrl-C and SIGTERM stop either stage the same way: cleanup, one line, exit code 130 / 143; a
  launched rank stops that way too when the `appo` process that launched it is gone;
- `logs`: the stages' logging (INFO; HTTP request loggers at WARNING; agent endpoint secrets redacted).

Imports every floor below (`trainer`, `reporting`, `configs`, `data`, ...); never `synthetic` or `cli`.
"""
