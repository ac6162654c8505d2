"""`SortedTrie`: TRL's `TreeRow` trie for rows added in lexicographic order, built per row instead of per token.

`appo_trl.tree.forward.pack_rows` adds its rows sorted, so a row shares with the trie exactly what it shares with the
row before it: its longest common prefix `l` less one token (nodes are keyed on a token and the next one, so the trie
forks one token before rows diverge), or all of it for an identical row. Then DFS pre-order is the rows' new
suffixes in row order, and every field of `TreeRow.pack()` that the tree forward reads follows from tensor slices:
no Python loop over tokens (TRL's `add`, `fits` and `pack` walk a dict per token: 45-85 ms per 16 x 2,048 group on
the host, while the GPU waits). `tests/trainer/test_tree_trie.py` checks it against `TreeRow` field by field.
"""

from __future__ import annotations

import itertools

import torch


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    m = min(a.numel(), b.numel())
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0]) if diff.numel() else m


class SortedTrie:
    """One trie of rows added in lexicographic order (`shared`, `fits`, `add`, `pack` as `TreeRow`'s)."""

    def __init__(self):
        self.rows: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []  # ids, trained mask, shared, nodes
        self.num_tokens = 0
        self.trained = 0

    def shared(self, ids: torch.Tensor) -> int:
        """How many of the row's first tokens are nodes of the trie already."""
        if not self.rows:
            return 0
        prev = self.rows[-1][0]
        if prev.numel() == ids.numel() and torch.equal(prev, ids):
            return ids.numel()
        return max(_common_prefix(prev, ids) - 1, 0)

    def fits(self, ids: torch.Tensor, trained: torch.Tensor, budget: int, shared: int) -> bool:
        """`TreeRow.fits`: at most `budget` unique tokens and `budget` trained tokens with this row added."""
        novel = ids.numel() - shared
        return self.num_tokens + novel <= budget and self.trained + int(trained.sum()) <= budget

    def add(self, ids: torch.Tensor, trained: torch.Tensor, shared: int) -> None:
        new = torch.arange(self.num_tokens, self.num_tokens + ids.numel() - shared)
        nodes = torch.cat([self.rows[-1][3][:shared], new]) if shared else new  # packed position of each token
        self.rows.append((ids, trained, shared, nodes))
        self.num_tokens += new.numel()
        self.trained += int(trained.sum())

    def pack(self) -> dict[str, torch.Tensor]:
        """The fields of `TreeRow.pack()` the tree forward reads, equal to its values."""
        n = self.num_tokens
        input_ids = torch.cat([ids[s:] for ids, _, s, _ in self.rows]).long()
        position_ids = torch.cat([torch.arange(s, ids.numel()) for ids, _, s, _ in self.rows])
        starts, owners, bounds = [], [], {0, n}
        for i, (ids, _, s, nodes) in enumerate(self.rows):
            if s == ids.numel():  # an identical row adds no node
                continue
            starts.append(int(nodes[s]))
            owners.append(i)
            bounds.add(starts[-1])
            if s:  # the node it forks from gets a second child: its segment ends there
                bounds.add(int(nodes[s - 1]) + 1)
        offsets = sorted(bounds)
        paths, owner = [], 0
        for a, b in zip(offsets[:-1], offsets[1:]):
            while owner + 1 < len(starts) and starts[owner + 1] <= a:
                owner += 1
            paths.append(self.rows[owners[owner]][3][: int(position_ids[b - 1]) + 1])
        shift_labels = torch.full((n,), -100, dtype=torch.long)
        token_index = []
        for ids, trained, _, nodes in self.rows:
            at = trained[1:].nonzero().flatten()
            token_index.append(nodes[at])
            shift_labels[nodes[at]] = ids[at + 1].long()
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "shift_labels": shift_labels,
            "tree_kv_index": torch.cat(paths).long(),
            "tree_cu_seqlens_q": torch.tensor(offsets, dtype=torch.int32),
            "tree_cu_seqlens_k": torch.tensor([0, *itertools.accumulate(p.numel() for p in paths)], dtype=torch.int32),
            "tree_max_seqlens": torch.tensor([max(lengths), max(p.numel() for p in paths)]),
            "token_index": torch.cat(token_index).long(),
        }

    def row_weights(self) -> torch.Tensor:
        """How many rows pass through each packed token (a row's nodes are its root-to-leaf path)."""
        weights = torch.zeros(self.num_tokens)
        for *_, nodes in self.rows:
            weights[nodes] += 1
        return weights
