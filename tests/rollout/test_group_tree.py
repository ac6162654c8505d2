"""`GroupTree.of`: a group's rows as a tree, a parent kept only where the tokens really are shared; `turn_ends`."""

from appo_trl.rollout.group_tree import GroupTree, turn_ends
from appo_trl.rollout.types import Trajectory


def row(completion, prompt=(1, 2), **kw):
    n = len(completion)
    return Trajectory(prompt_ids=list(prompt), completion_ids=list(completion), loss_mask=[1] * n,
                      logprobs=[0.0] * n, **kw)  # fmt: skip


def test_lineage_kept_where_the_prefix_is_shared():
    root = row([5, 6, 7, 8])
    fork = root.prefix_copy(2, origin="fork")
    fork.completion_ids += [9, 9]
    refill = row([3], origin="refill")
    stranger = row([5, 6, 0], parent="not-in-this-group", branch_pos=2, origin="branch")
    replayed = row([5, 0, 7], parent=root.uid, branch_pos=2, origin="branch")  # an agent branch's other chain
    other_prompt = row([5, 6, 1], prompt=(1, 3), parent=root.uid, branch_pos=2, origin="branch")
    tree = GroupTree.of([fork, root, refill, stranger, replayed, other_prompt])  # any order
    assert tree.parents == (1, -1, -1, -1, -1, -1)
    assert tree.branch_pos == (2, 0, 0, 0, 0, 0)
    assert tree.lengths == (4, 4, 1, 3, 3, 3)


def test_turn_ends_are_the_last_sampled_token_of_each_run():
    assert turn_ends([1, 1, 0, 0, 1, 1, 1, 0]) == [1, 6]
    assert turn_ends([0, 1]) == [1]
    assert turn_ends([0, 0]) == []
