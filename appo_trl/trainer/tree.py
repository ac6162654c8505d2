"""The trainer's side of the tree forward (`appo_trl.tree`): TRL's forward triple through the tries.

`trainer_tree_forward` is `APPOTrainer._get_per_token_logps_and_entropies` with `tree_forward`: it passes the trainer's
own `PackCache` (`trainer.tree_packs`: TRL's reference and old-logp passes, APPO's scoring and the loss over the same
rows share the tries), its token budget and autocast, the forward-count agreement of ZeRO-3 / FSDP
(`appo_trl.trainer.sharded.agree_forward_count`), and logs `tree/tokens_ratio` on the loss pass.
"""

from __future__ import annotations

import torch

from appo_trl.trainer.sharded import agree_forward_count
from appo_trl.trainer.trl_seams import log_metric
from appo_trl.tree.forward import PackCache, tree_logps_and_entropies


def trainer_tree_forward(
    trainer, model, input_ids, attention_mask, logits_to_keep, compute_entropy, batch_size=None,
    compute_aux_loss=False, **kwargs,
):  # fmt: skip
    """TRL's return triple, and on the loss pass (gradients on) the metric `tree/tokens_ratio` = tokens forwarded /
    tokens of the row-wise forward."""
    unsupported = [k for k, v in kwargs.items() if v is not None and v is not False]
    if unsupported:
        raise ValueError(f"tree_forward=True does not support {unsupported} (multimodal inputs).")
    logps, entropies, counts = tree_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        compute_entropy=compute_entropy,
        token_budget=trainer.args.tree_token_budget,
        autocast=trainer.accelerator.autocast,  # a fresh context per trie
        agree_forwards=agree_forward_count(trainer),  # ZeRO-3 / FSDP outside a round: the maximum over ranks
        batch_size=batch_size,
        compute_aux_loss=compute_aux_loss,
        packs=trainer.tree_packs,
    )
    if torch.is_grad_enabled():
        mode = "train" if trainer.model.training else "eval"
        log_metric(trainer, mode, "tree/tokens_ratio", counts["tree_tokens"] / max(counts["row_tokens"], 1))
    return logps, entropies, counts.get("aux_loss")


__all__ = ["PackCache", "trainer_tree_forward", "tree_logps_and_entropies"]
