"""Floor 10: synthetic, seed-determined agentic tasks for the CPU demo and the strategy study (see `task`).

`task` builds the data and tools; `pipeline` runs SFT, RL and evaluation on them, so this floor imports the
stages, the trainer and evaluation below it, and never `cli`.
"""

from appo_trl.synthetic.task import SYSTEM_PROMPT, SyntheticTask, build_task, write_task

__all__ = ["SYSTEM_PROMPT", "SyntheticTask", "build_task", "write_task"]
