"""appo-trl: agentic RL (GRPO, ARPO, AEPO, APPO) for tool-using LLMs on top of TRL.

Heavy imports (torch, transformers, trl) happen lazily so that `appo --help` and the tools layer stay fast.
"""

__version__ = "0.1.0.dev0"

_LAZY = {
    "APPOConfig": "appo_trl.trainer.config",
    "APPOScriptArguments": "appo_trl.trainer.config",
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
