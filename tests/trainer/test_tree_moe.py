"""The tree forward on MoE models (tiny Qwen3-MoE and GPT-OSS, built locally): logps, entropies and the load-balancing loss
equal the row-wise forward's (TRL's `_get_per_token_logps_and_entropies` body) within 1e-5 in float32, in one
trie, in several tries (a token budget) and over TRL's chunks (`batch_size`), and so do the gradients of the loss;
each packed token's weight is the number of rows through it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from appo_trl.tree.attention import install_tree_attention
from appo_trl.tree.forward import pack_rows, tree_logps_and_entropies
from tests.trainer.test_tree_archs import tiny_gpt_oss
from tests.trainer.test_tree_forward import CASES, TOL, batch

ROWS = CASES["mixed"] + CASES["first"]


def tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=128, output_router_logits=True,
                            router_aux_loss_coef=0.01)  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def rowwise(model, ids, mask, c, chunk):
    """TRL's body: per chunk, the fused forward with router logits; the aux losses' mean."""
    logps, ents, aux = [], [], []
    for s in range(0, ids.size(0), chunk):
        i, m = ids[s : s + chunk], mask[s : s + chunk]
        labels = i.masked_fill(m == 0, -100)
        labels[:, :-c] = -100
        out = model(input_ids=i, attention_mask=m, labels=labels, fused_lm_head=True, output_router_logits=True)
        logps.append(out.log_probs[:, -c:])
        ents.append(out.entropy[:, -c:])
        aux.append(out.aux_loss)
    return torch.cat(logps), torch.cat(ents), torch.stack(aux).mean()


def router_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ("gate" in n or "router" in n)
    }


@pytest.mark.parametrize("arch,budget,chunk", [("qwen3_moe", 10_000, 100), ("qwen3_moe", 14, 100),
                                               ("qwen3_moe", 10_000, 4), ("gpt_oss", 14, 4)])  # fmt: skip
def test_moe_aux_loss_equals_rowwise(arch, budget, chunk):
    model = tiny_moe() if arch == "qwen3_moe" else tiny_gpt_oss()
    ids, mask, c = batch(ROWS)
    mask_c = mask[:, -c:].float()
    lr, er, ar = rowwise(model, ids, mask, c, chunk)
    g_row = router_grads(model, ar)
    install_tree_attention(model)
    lt, et, counts = tree_logps_and_entropies(model, ids, mask, c, compute_entropy=True, token_budget=budget,
                                              autocast=contextlib.nullcontext, batch_size=chunk,
                                              compute_aux_loss=True)  # fmt: skip
    at = counts["aux_loss"]
    g_tree = router_grads(model, at)
    assert counts["tree_tokens"] < int(mask.sum())  # rows really share tokens
    torch.testing.assert_close(lt, lr * mask_c, atol=TOL, rtol=0)
    torch.testing.assert_close(et, er * mask_c, atol=TOL, rtol=0)
    torch.testing.assert_close(at, ar, atol=TOL, rtol=0)
    assert g_row and set(g_tree) == set(g_row)
    for name in g_row:
        torch.testing.assert_close(g_tree[name], g_row[name], atol=TOL, rtol=0, msg=name)


def test_row_weights_count_the_rows_through_each_token():
    ids, mask, c = batch(CASES["identical"] + CASES["first"][1:2])
    (pack,) = pack_rows(ids, mask, c, token_budget=10_000)
    assert pack.weights.sum() == mask.sum()  # every real token of every row, once
    assert pack.weights.max() == 4 and pack.weights.min() == 1
