"""A port of Tree-GRPO's released advantages, for the fidelity tests only (never imported by the package).

Follows AMAP-ML/Tree-GRPO at commit 90b170995d996d772d68117e0c7bd0b8fe00d393:
- `verl/trainer/ppo/core_algos.py`: `compute_grpo_outcome_advantage` and `compute_tree_grpo_outcome_advantage`;
- `verl/trainer/ppo/ray_trainer_ts.py: compute_advantage`, branch `adv_estimator == 'tree'` (what
  `train_multihopqa_tree_search.sh` runs: the two outcome advantages, over `uid` and over `tree_uid`, summed) and
  branch `'tree_2norm'` (`compute_tree_grpo_outcome_advantage`).
Torch float32 as released; the (bs, response_length) tiling by `eos_mask` is left out (one score per row).
"""

from __future__ import annotations

from collections import defaultdict

import torch


def compute_grpo_outcome_advantage(scores: torch.Tensor, index, epsilon: float = 1e-6) -> torch.Tensor:
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
            id2std[idx] = torch.std(torch.tensor([id2score[idx]]))
    for i in range(bsz):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def compute_tree_grpo_outcome_advantage(scores: torch.Tensor, index, tree_index, epsilon: float = 1e-6):
    scores = scores.clone()
    id2score, treeid2score = defaultdict(list), defaultdict(list)
    id2mean, id2std, treeid2mean, treeid2std = {}, {}, {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
            id2std[idx] = torch.std(torch.tensor([id2score[idx]]))
    for i in range(bsz):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        treeid2score[tree_index[i]].append(scores[i])
    for idx in treeid2score:
        if len(treeid2score[idx]) == 1:
            treeid2mean[idx], treeid2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            treeid2mean[idx] = torch.mean(torch.tensor(treeid2score[idx]))
            treeid2std[idx] = torch.std(torch.tensor(treeid2score[idx]))
    for i in range(bsz):
        scores[i] = (scores[i] - treeid2mean[tree_index[i]]) / (treeid2std[tree_index[i]] + epsilon)
    return scores


def released_tree(scores: torch.Tensor, index, tree_index) -> torch.Tensor:
    """`adv_estimator == 'tree'`: inter-tree (over `uid`) + inner-tree (over `tree_uid`) advantages."""
    return compute_grpo_outcome_advantage(scores, index) + compute_grpo_outcome_advantage(scores, tree_index)
