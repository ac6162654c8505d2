"""A port of TreeRL's released estimator, for the fidelity tests only (never imported by the package).

Follows THUDM/TreeRL at commit f0edbea6f2f6392c46d297f83fb4929a9524266e, function by function:
- `openrlhf/trainer/ppo_utils/tree_node.py`: `MCTSNode` (the fields used), `build_into_tree_format` (its
  `build_tree_node` / `add_segments_and_children`), `leaf_normalize`, `leaf_backpropagate`, `normalize_all_steps`
  (`overall_norm_style="none"`: no-op), `select_terminal` (`balance_ratio=0`), `selected_backpropagate`,
  `compute_weighted_update`;
- `openrlhf/trainer/ppo_utils/parallel_mcts.py`: `path_from_root_to_node`, `gather_paths` (`use_state_value_reward`)
  and `fill_in_paths`;
- the options of `scripts/treerl-qw14b.sh`: `use_weighted_value`, `weighted_value_style sqrt`,
  `use_state_value_reward`, `overall_norm_style` none (the CLI default), `average_one_generation`,
  `advantage_mix_allancestor` and `use_all_terminals` off, `balance_ratio` 0.
The per-token values are what `experience_maker._generate_vllm_mcts` writes: `path[i]["value"]` on each of the
node's `token_answer` tokens. Printing, the debugger hooks and the text fields are left out; `row` (the row a leaf
ends) is added to read the result back.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(eq=False)
class MCTSNode:
    answer_token: list
    parent: MCTSNode | None = None
    children: list = field(default_factory=list)
    R: float = 0.0
    main_chain: bool = False
    terminal: bool = False
    terminal_in_subtree: int = 0
    correct_terminal_in_subtree: int = 0
    selected_terminal_in_subtree: int = 0
    accumulated_value: float = 0.0
    row: int = -1


@dataclass(eq=False)
class TreeNode:
    """The fields of TreeRL's `TreeNode` that `build_into_tree_format` reads."""

    token_id_list: list
    score: float
    binary_score: float
    parent_node_split_idx: int | None = None
    child_nodes: list = field(default_factory=list)
    row: int = -1


def build(tree_lists) -> tuple[MCTSNode, list[MCTSNode]]:
    """`build_into_tree_format`'s tree: the root, and every leaf (`all_leaves`)."""
    all_leaves = []

    def build_tree_node(tree_node: TreeNode, parent_mcts_node):
        tree_node.child_nodes.sort(key=lambda x: x.parent_node_split_idx)
        child_split_indices = [child.parent_node_split_idx for child in tree_node.child_nodes]
        is_terminal, R, main_chain = False, 0, False
        if not child_split_indices:
            first_child_split_idx = len(tree_node.token_id_list)
            is_terminal, R = True, tree_node.score
            main_chain = tree_node.binary_score == 1
        else:
            first_child_split_idx = child_split_indices[0]
        root_node = MCTSNode(answer_token=tree_node.token_id_list[:first_child_split_idx], parent=parent_mcts_node,
                             terminal=is_terminal, R=R, main_chain=main_chain, row=tree_node.row)  # fmt: skip
        if root_node.terminal:
            all_leaves.append(root_node)

        def add_segments_and_children(current_mcts_node, start_idx):
            i = 0
            while i < len(tree_node.child_nodes):
                child_nodes_group = []
                current_split_idx = child_split_indices[i]
                while i < len(tree_node.child_nodes) and child_split_indices[i] == current_split_idx:
                    child_nodes_group.append(tree_node.child_nodes[i])
                    i += 1
                is_terminal, R, main_chain = False, 0, False
                if i < len(tree_node.child_nodes):
                    next_split_idx = child_split_indices[i]
                else:
                    next_split_idx = len(tree_node.token_id_list)
                    is_terminal, R = True, tree_node.score
                    main_chain = tree_node.binary_score == 1
                segment_node = MCTSNode(answer_token=tree_node.token_id_list[start_idx:next_split_idx],
                                        parent=current_mcts_node, terminal=is_terminal, R=R, main_chain=main_chain,
                                        row=tree_node.row)  # fmt: skip
                current_mcts_node.children.append(segment_node)
                if segment_node.terminal:
                    all_leaves.append(segment_node)
                for child_node in child_nodes_group:
                    current_mcts_node.children.append(build_tree_node(child_node, current_mcts_node))
                start_idx = next_split_idx
                current_mcts_node = segment_node

        add_segments_and_children(root_node, first_child_split_idx)
        return root_node

    root = MCTSNode(answer_token=[])
    for tree_list in tree_lists:
        if len(tree_list) > 0:
            root.children.append(build_tree_node(tree_list[0], root))
    return root, all_leaves


def leaf_normalize(nodes, root):
    leaf_correctness = [leaf.R for leaf in nodes]
    _sum = sum(leaf_correctness)
    num = len(leaf_correctness) - 1
    assert num != 0, "entropy num_traces == 0"
    mean = [(_sum - leaf_correctness[i]) / num for i in range(len(leaf_correctness))]
    for i, leaf in enumerate(nodes):
        leaf.R = leaf.R - mean[i]
        leaf.accumulated_value = leaf.R
        leaf_backpropagate(leaf)
    # normalize_all_steps(root, "none"): returns without a change


def leaf_backpropagate(node):
    if node.terminal:
        node.terminal_in_subtree += 1
        node.correct_terminal_in_subtree += int(node.main_chain)
        parent = node.parent
        while parent:
            parent.terminal_in_subtree += 1
            parent.correct_terminal_in_subtree += int(node.main_chain)
            parent.accumulated_value += node.accumulated_value
            parent = parent.parent


def select_terminal(nodes, num_traces, rng: random.Random):
    """`balance_ratio == 0`: the first correct leaf of a shuffle, then a random sample of the others."""
    rng.shuffle(nodes)
    selected, remaining = [], []
    for node in nodes:
        if node.main_chain and len(selected) == 0:
            selected.append(node)
        else:
            remaining.append(node)
    need = num_traces - len(selected)
    if need > 0:
        selected.extend(rng.sample(remaining, min(need, len(remaining))))
    rng.shuffle(selected)
    assert len(selected) == num_traces
    return selected


def selected_backpropagate(node):
    node.selected_terminal_in_subtree += 1
    parent = node.parent
    while parent:
        parent.selected_terminal_in_subtree += 1
        parent = parent.parent


def compute_weighted_update(node):
    """`reweighted_value_style="sqrt"`."""
    if node.selected_terminal_in_subtree == 0:
        return
    node.accumulated_value = node.accumulated_value / math.sqrt(node.selected_terminal_in_subtree)
    for child in node.children:
        compute_weighted_update(child)


def path_from_root_to_node(node):
    path = []
    while node.parent is not None:
        parent_value = node.parent.accumulated_value / node.parent.terminal_in_subtree
        child_value = node.accumulated_value / node.terminal_in_subtree
        if node.terminal:
            assert node.terminal_in_subtree == 1
        path.append(
            {"token_answer": node.answer_token, "value": child_value - parent_value, "state_value": child_value}
        )
        node = node.parent
    return path[::-1]


def fill_in_paths(paths):
    for path in paths:
        for i in range(1, len(path)):
            if abs(path[i]["value"]) < 1e-8:
                path[i]["value"] = path[i - 1]["value"]
    return paths


def gather_paths(selected):
    """`use_state_value_reward`: value = (child − parent, filled) + child."""
    paths = fill_in_paths([path_from_root_to_node(t) for t in selected])
    for path in paths:
        for node in path:
            node["value"] = node["value"] + node["state_value"]
    return paths


def released_values(parents, branch_pos, lengths, rewards, num_traces, seed, correct=None, selected_rows=None):
    """{row: per-token values} of the selected rows, and the selected rows, for one group of our rows.

    `select_terminal` draws `num_traces` leaves with `random.Random(seed)`; `selected_rows` names them instead (the
    rows our trainer keeps).

    Each row is a `TreeNode` holding its own tokens [b(i), L(i)); a child hangs at split index b(j) − b(p(j)) of
    its parent (b(j) >= b(p(j)): the branches our engine makes). `correct[i]` is the binary score (reward == 1)."""
    R = len(parents)
    correct = correct or [float(r == 1) for r in rewards]
    start = [0 if parents[i] < 0 else branch_pos[i] for i in range(R)]
    nodes = [TreeNode(token_id_list=[(i, t) for t in range(start[i], lengths[i])], score=rewards[i],
                      binary_score=correct[i], row=i) for i in range(R)]  # fmt: skip
    trees = []
    for i, p in enumerate(parents):
        if p < 0:
            trees.append([nodes[i]])
        else:
            assert branch_pos[i] >= start[p], "TreeRL's children hang inside their parent's own tokens"
            nodes[i].parent_node_split_idx = branch_pos[i] - start[p]
            nodes[p].child_nodes.append(nodes[i])
    root, leaves = build(trees)
    leaf_normalize(leaves, root)
    if selected_rows is None:
        selected = select_terminal(list(leaves), num_traces, random.Random(seed))
    else:
        selected = [leaf for leaf in leaves if leaf.row in selected_rows]
    for leaf in selected:
        selected_backpropagate(leaf)
    compute_weighted_update(root)
    out = {}
    for leaf, path in zip(selected, gather_paths(selected)):
        values = [node["value"] for node in path for _ in node["token_answer"]]
        assert len(values) == lengths[leaf.row]
        out[leaf.row] = values
    return out, sorted(out)
