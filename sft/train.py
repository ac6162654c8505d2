"""SFT cold start entry script: `accelerate launch [...] sft/train.py --config recipes/<model>/sft.yaml [--key v]`.

Thin on purpose: the logic (data conversion, `<result>` masking, trainer, Hub push) is `appo_trl.stages.sft`.
`appo sft --config ...` runs the same code, and relaunches itself through `accelerate launch` when given
`--accelerate_config NAME|PATH` / `--num_processes N`.
"""

import sys

from appo_trl.stages.sft import cli

if __name__ == "__main__":
    sys.exit(cli(entry_script=__file__))
