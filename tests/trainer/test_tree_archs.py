"""The tree forward on sliding-window and soft-capped models (tiny Gemma 2 and Cohere 2, built locally): logps,
entropies and every gradient equal the row-wise forward within 1e-5 in float32, with rows longer than the window,
on the per-segment path (SDPA and eager bases) and through FlexAttention (window in its block mask, soft-capping
in its `score_mod`); and the varlen kernels' left window, counted in packed path positions, is a depth distance."""

from __future__ import annotations

import logging

import pytest
import torch

import appo_trl.tree.attention as ta
from appo_trl.tree.forward import pack_rows
from tests.trainer.test_tree_forward import CASES, TOL, assert_exact, batch, rowwise, tree

WINDOW = 3  # shorter than every row of CASES


def tiny_windowed(arch: str, attn: str = "sdpa", seed: int = 0):
    from transformers import Cohere2Config, Cohere2ForCausalLM, Gemma2Config, Gemma2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn, head_dim=8,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    if arch == "gemma2":  # soft-capping small enough to matter
        config, cls = (
            Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
            Gemma2ForCausalLM,
        )
    else:
        config, cls = Cohere2Config(**common), Cohere2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


@pytest.mark.parametrize("case", ["mixed"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["gemma2", "cohere2"])
def test_sliding_window_models_match_rowwise(arch, attn, case):
    assert_exact(tiny_windowed(arch, attn), CASES[case])


def test_the_window_matters_here(monkeypatch):
    """Guard against a vacuous test: a tree forward that ignores the window disagrees with the row-wise one."""
    model = tiny_windowed("cohere2")
    ids, mask, c = batch(CASES["mixed"])
    monkeypatch.setattr(ta, "layer_window", lambda module, kwargs: None)
    with torch.no_grad():
        lr, _ = rowwise(model, ids, mask, c)
        lt, _ = tree(model, ids, mask, c)
    assert (lt - lr * mask[:, -c:]).abs().max() > 1e-3


def test_varlen_path_positions_are_depths():
    """The gathered root-to-segment path is contiguous in depth: its k-th key has depth k, so a left window of
    `window - 1` path positions (torch varlen, flash_attn) is exactly `depth(q) - depth(kv) < window`."""
    for rows in CASES.values():
        ids, mask, c = batch(rows)
        for pack in pack_rows(ids, mask, c, token_budget=10_000):
            depth = pack.inputs["position_ids"][0]
            cu_k, kv = pack.inputs["tree_cu_seqlens_k"].tolist(), pack.inputs["tree_kv_index"]
            for s in range(len(cu_k) - 1):
                path = kv[cu_k[s] : cu_k[s + 1]]
                assert depth[path].tolist() == list(range(len(path)))


@pytest.mark.parametrize("arch", ["gemma2", "cohere2"])
def test_flex_attention_takes_the_window_and_softcap(arch, monkeypatch, caplog):
    """FlexAttention through the CUDA dispatch on CPU (forward only), no fallback to the segment path. Its eager
    (uncompiled) form runs the same block mask and `score_mod`, without depending on the CPU compiler."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(ta, "_flex", lambda: (create_block_mask, flex_attention))
    monkeypatch.setattr(ta, "_on_gpu", lambda query: True)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: None)
    monkeypatch.setattr(ta, "_flash_varlen", lambda: None)
    monkeypatch.setattr(ta, "_FAILED", set())

    def no_fallback(*args, **kwargs):
        raise AssertionError("the per-segment path ran: FlexAttention did not serve")

    monkeypatch.setattr(ta, "_segment_attention", no_fallback)
    model = tiny_windowed(arch, "eager")
    ids, mask, c = batch(CASES["mixed"])
    mask_c = mask[:, -c:].float()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=ta.__name__):
        lr, er = rowwise(model, ids, mask, c)
        lt, et = tree(model, ids, mask, c)
    torch.testing.assert_close(lt, lr * mask_c, atol=TOL, rtol=0)
    torch.testing.assert_close(et, er * mask_c, atol=TOL, rtol=0)


def tiny_gpt_oss(seed: int = 0):
    from transformers import GptOssConfig, GptOssForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=128, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.01,
                          attn_implementation="eager")  # fmt: skip
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.normal_(0.0, 2.0)  # sinks that matter
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def test_gpt_oss_attention_sinks_and_window_match_rowwise():
    assert_exact(tiny_gpt_oss(), CASES["mixed"])
