"""`Round`: the one typed record of a generation round, from the strategy's sampling to the loss.

A strategy's `generate` builds it (groups, keep, metrics and its own selection), the sampling path adds what it
hands over (a background round's environments, an agent round's runs), the round runner fills the rest on the
trainer's thread as the round passes TRL's hooks (ids, policy version, rewards, per-turn rewards, tree credit), and
`RolloutStrategy.advantages(round, ...)` reads it. The walk: docs/architecture.md, "One training step".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class HandedEnvironments(NamedTuple):
    """A background round's own environment instances (one per row) and the prompts its rows were sampled on."""

    instances: list[Any]
    prompts: list[Any]


class AgentReport(NamedTuple):
    """An agent round's runs (`AgentEngine`: counts and errors) and its `agent/*` and endpoint metrics."""

    runs: Any
    metrics: dict[str, float]


@dataclass
class Round:
    """One generation round on one rank: `groups[g]` holds the n rows of unique prompt g, initial first.

    From the strategy (on the round's thread):
        groups, keep: `keep[i]` (row order = groups flattened) says whether row i reaches the loss.
        metrics: per-round scalars under the strategy's fixed `metric_keys` (averaged across ranks).
        points: APPO's selected branch points per group (`BranchPoint`), for its dual-group advantages.
        selection_logps: per row, the logps of APPO's selection forward (None for a row it did not score), served
            once as TRL's old logps (`old_logps`).
    From the sampling path: `environments` (a background round's own instances, until its hand-over) and `agent`
    (an agent round's runs and metrics, until its report).
    On the trainer's thread: `inputs` (TRL's generation batch) and `mode` ("train" | "eval"); at the hand-over to
    TRL `prompt_ids` / `completion_ids` (the exact ids per row), `policy_version` (the optimizer step of the
    weights that sampled it; per-token policy versions of a round sampled across weight updates go beside it) and
    `old_logps`; at scoring `rewards` (TRL's gathered (N_global, F)), `turn_rewards` ((reward function, local
    row) -> one reward per turn), `token_rewards` ((B, T), each turn's reward on its last token) and
    `tree_credit` (each group's `TreeCredit`, for the dump).
    """

    groups: list[list[Any]]
    keep: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)
    points: list[list[Any]] | None = None
    selection_logps: list[torch.Tensor | None] | None = None
    environments: HandedEnvironments | None = None
    agent: AgentReport | None = None
    inputs: list[dict] | None = None
    mode: str = "train"
    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    policy_version: int | None = None
    old_logps: list[torch.Tensor] | None = None
    rewards: torch.Tensor | None = None
    turn_rewards: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    token_rewards: torch.Tensor | None = None
    tree_credit: list[Any] | None = None

    @property
    def rows(self) -> list[Any]:
        return [t for g in self.groups for t in g]

    def holds_ids(self, input_ids: torch.Tensor, logits_to_keep: int) -> bool:
        """Whether `input_ids` (TRL's left-padded prompts + right-padded completions) are exactly this round's rows."""
        if input_ids.size(0) != len(self.prompt_ids):
            return False
        width, ids = input_ids.size(1) - logits_to_keep, input_ids.detach().cpu()
        for i, (p, c) in enumerate(zip(self.prompt_ids, self.completion_ids)):
            if len(p) > width or len(c) > logits_to_keep:
                return False
            if ids[i, width - len(p) : width].tolist() != p or ids[i, width : width + len(c)].tolist() != c:
                return False
        return True

    def take_old_logps(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """The cached old logps as TRL's (B, logits_to_keep) tensor, once, if `input_ids` are this round's rows."""
        cache = self.old_logps
        if cache is None or not self.holds_ids(input_ids, logits_to_keep):
            return None
        self.old_logps = None
        out = torch.zeros(len(cache), logits_to_keep)
        for i, row in enumerate(cache):
            width = min(len(row), logits_to_keep)
            out[i, :width] = row[:width]
        return out.to(input_ids.device)


__all__ = ["AgentReport", "HandedEnvironments", "Round"]
