"""`grpo`: n independent tool-loop rollouts per prompt; every row reaches the loss (the fair baseline)."""

from __future__ import annotations

from appo_trl.strategies.base import RolloutStrategy, register_strategy
from appo_trl.strategies.record import Round


@register_strategy
class GRPOStrategy(RolloutStrategy):
    """n independent tool-loop rollouts per prompt (the fair baseline: same loop, no branching)."""

    name = "grpo"
    default_loss_mode = "clip"
    branches = False
    streams = True
    no_tool_calls_note = ""
    card_title = "GRPO (Group Relative Policy Optimization)"
    paper = {
        "name": "GRPO",
        "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "id": "2402.03300",
        "citation": "@article{shao2024deepseekmath,\n"
        "    title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},\n"
        "    author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and "
        "Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},\n"
        "    year         = 2024,\n"
        "    eprint       = {arXiv:2402.03300},\n"
        "}",
    }

    def generate(self, prompt_ids, n, seed, engine):
        groups = engine.run(engine.rollout(prompt_ids, n, seed=seed))
        return Round(groups=groups, keep=[True] * (len(groups) * n))
