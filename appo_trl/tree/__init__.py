"""Floor 2: the tree forward. A batch's rows folded into prefix tries, each shared token sent through the model once.

Needs only torch and transformers; never imports the trainer, rollout, algorithms or anything above floor 2.

- `trie`: `SortedTrie`, TRL's `TreeRow` trie built per row from the sorted rows;
- `kernels`: `TreeLayout`, one trie's attention layout on a device (varlen FlashAttention / FlexAttention / SDPA);
- `attention`: `install_tree_attention`, the tree attention registered in transformers' `AttentionInterface`;
- `forward`: `pack_rows`, `PackCache` (rows packed once per batch; its owner keeps it), `tree_logps_and_entropies`
  (TRL's `(B, C)` log-probs and entropies through the tries).

The trainer's side is `appo_trl.trainer.tree` (its cache, the sharded-forward agreement and the `tree/tokens_ratio`
metric). The tree credit of a group's branch tree is pure maths in `appo_trl.algorithms.tree_credit`.
"""
