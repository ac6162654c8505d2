"""appo-trl: agentic RL (GRPO, ARPO, AEPO, APPO) for tool-using LLMs on top of TRL.

Heavy imports (torch, transformers, trl) happen lazily so that `appo --help` and the tools layer stay fast.

`OMP_WAIT_POLICY` defaults to `PASSIVE` (when unset, and only if torch has not loaded yet): idle OpenMP threads
sleep instead of spinning. On a loaded 2-core machine the spinning made a training step 10x slower than on the
quiet machine, and 39x slower than with `PASSIVE` (`bench/threads.py`, docs/benchmarks.md). Set the variable
to `ACTIVE` to get OpenMP's spinning back.
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0.dev0"

_LAZY = {
    "APPOConfig": "appo_trl.config",
    "APPOScriptArguments": "appo_trl.config",
    "APPOTrainer": "appo_trl.trainer.trainer",
    "APPOSFTConfig": "appo_trl.stages.sft",
    "build_tiny_model": "appo_trl.tiny",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'appo_trl' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
