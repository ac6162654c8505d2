"""`appo_trl.trainer.rows.group_permutation`: the shuffle that keeps a group's rows together for the tree forward."""

from __future__ import annotations

import itertools

import torch

from appo_trl.trainer.rows import group_permutation


def left_padded(prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


# four groups of sizes 3, 2, 4 and 1, their rows interleaved; group "b"'s rows carry a different pad token id under
# the mask (a group is its prompt *tokens*, padding aside)
GROUPS = {"a": [5, 6, 7], "b": [8, 9], "c": [5, 6], "d": [1, 2, 3, 4]}
LABELS = ["a", "b", "c", "a", "c", "b", "c", "a", "c", "d"]


def permutation(seed: int) -> torch.Tensor:
    ids, mask = left_padded([GROUPS[g] for g in LABELS], width=5)
    ids[LABELS.index("b"), 0] = 63  # under the mask: not part of the prompt
    torch.manual_seed(seed)
    return group_permutation(ids, mask)


def test_groups_stay_whole_contiguous_and_in_order():
    for seed in range(5):
        perm = permutation(seed).tolist()
        assert sorted(perm) == list(range(len(LABELS)))  # a permutation of the rows
        runs = [label for label, _ in itertools.groupby(LABELS[i] for i in perm)]
        assert sorted(runs) == sorted(GROUPS), runs  # one contiguous run per group, holding all of its rows
        for label in GROUPS:  # rows of a group keep their order
            rows = [i for i in perm if LABELS[i] == label]
            assert rows == sorted(rows)


def test_seeded_and_shuffles_groups():
    assert torch.equal(permutation(0), permutation(0))  # the trainer's seed fixes the order
    orders = {tuple(dict.fromkeys(LABELS[i] for i in permutation(seed).tolist())) for seed in range(20)}
    assert len(orders) > 1  # groups are shuffled, not kept in input order
