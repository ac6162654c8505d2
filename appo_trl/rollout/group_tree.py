"""Every group is a tree: `GroupTree`, each row's parent row and the completion position where it leaves it.

One structure for every kind of group: ARPO / AEPO forks and refills, APPO branches, an agent's runs branched by
replay and environment groups. It is read off the trajectories' typed lineage (`Trajectory.parent`, `.branch_pos`)
and kept only where the tokens really are shared: a row whose parent is not in the group, or whose prompt and first
`branch_pos` completion tokens differ from its parent's (an agent branch's row is the chain of its branch call, which
need not be its parent's row), shares only the prompt (parent -1). Tree credit (`appo_trl.algorithms.tree_credit`,
through `appo_trl.strategies.credit`) and the rollout dump (`appo_trl.reporting.rollout_dump`) both read this, so what
the dump shows is what the credit used.

`lineage_roots` gives each row's tree in Tree-GRPO's sense (`tree_index`): the first row of its `Trajectory.parent`
chain inside the group, so an APPO branch and an agent run branched by replay join the tree of the rollout they
were branched from, even where the row shares only the prompt with it.

`turn_ends` gives the per-turn reward positions: the last token of each run of sampled tokens (an assistant turn of
the chat format, a segment between tool calls of the tag format, one model call of an agent's chain).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupTree:
    """One group's rows as a tree: `parents[i]` (row index in the group, -1 = only the prompt is shared),
    `branch_pos[i]` (completion tokens row i shares with its parent; 0 for a root) and `lengths[i]`."""

    parents: tuple[int, ...]
    branch_pos: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, rows) -> GroupTree:
        """The tree of a group of `Trajectory` rows (any order)."""
        index = {t.uid: i for i, t in enumerate(rows)}
        parents, positions = [], []
        for t in rows:
            p, bp = index.get(t.parent, -1) if t.parent is not None else -1, int(t.branch_pos or 0)
            if p >= 0 and not shares_prefix(t, rows[p], bp):
                p = -1
            parents.append(p)
            positions.append(bp if p >= 0 else 0)
        return cls(tuple(parents), tuple(positions), tuple(len(t.completion_ids) for t in rows))


def shares_prefix(row, parent, position: int) -> bool:
    """Whether `row` holds `parent`'s prompt and its first `position` completion tokens."""
    if position > min(len(row.completion_ids), len(parent.completion_ids)):
        return False
    return row.prompt_ids == parent.prompt_ids and row.completion_ids[:position] == parent.completion_ids[:position]


def lineage_roots(rows) -> tuple[int, ...]:
    """Each row's tree: the index of the first row of its `parent` chain within the group (itself for a root)."""
    index = {t.uid: i for i, t in enumerate(rows)}
    roots = []
    for i in range(len(rows)):
        seen, j = {i}, i
        while rows[j].parent is not None and index.get(rows[j].parent, -1) >= 0:
            j = index[rows[j].parent]
            if j in seen:
                raise ValueError(f"group lineage: row {i}'s parent chain loops (rows {sorted(seen)})")
            seen.add(j)
        roots.append(j)
    return tuple(roots)


def turn_ends(loss_mask) -> list[int]:
    """Index of the last sampled token of each turn (each maximal run of mask-1 tokens), in order."""
    ends = []
    for t, m in enumerate(loss_mask):
        if m and (t + 1 == len(loss_mask) or not loss_mask[t + 1]):
            ends.append(t)
    return ends


__all__ = ["GroupTree", "lineage_roots", "shares_prefix", "turn_ends"]
