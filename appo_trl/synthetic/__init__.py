"""Synthetic, seed-determined agentic tasks for the CPU demo and the strategy study (see `task`)."""

from appo_trl.synthetic.task import SYSTEM_PROMPT, SyntheticTask, build_task, write_task

__all__ = ["SYSTEM_PROMPT", "SyntheticTask", "build_task", "write_task"]
