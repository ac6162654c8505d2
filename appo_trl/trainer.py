"""`APPOTrainer`: TRL's `GRPOTrainer` with agentic rollouts (tool loop, branching) and branch-aware losses.

This first version runs TRL's own GRPO path unchanged; the tool loop and the ARPO / AEPO / APPO strategies
plug in through `_generate`, `_generate_and_score_completions` and `_compute_loss`.
"""

from __future__ import annotations

from trl import GRPOTrainer


class APPOTrainer(GRPOTrainer):
    """GRPO, ARPO, AEPO and APPO for tool-using LLMs, as one `GRPOTrainer` subclass."""

    _tag_names = ["trl", "grpo", "appo", "appo-trl"]
    _name = "APPO"
