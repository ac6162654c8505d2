"""Evaluation entry script: `python eval/run.py --config eval/<name>.yaml [--key value ...]`.

The same as `appo eval ...` (and `python eval/run.py compare A.json B.json`); the logic lives in
`appo_trl.evaluation`, the benchmark registry in `appo_trl/evaluation/benchmarks.yaml` and the system and
judge prompts in `appo_trl/evaluation/prompts.yaml` (packaged, so an installed wheel has them too).
"""

import sys

from appo_trl.cli.eval import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
