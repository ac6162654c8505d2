"""The tree attention's per-forward costs, counted on CPU: one layout per trie per forward (FlexAttention's block mask
and the per-segment masks are built once, not once per decoder layer, and the recomputation under activation
checkpointing reuses them), and FlexAttention compiles at most twice over tries of five sizes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import appo_trl.tree.attention as ta
import appo_trl.tree.forward as tree_mod
from appo_trl.tree.attention import install_tree_attention
from appo_trl.tree.forward import pack_rows, tree_logps_and_entropies
from appo_trl.tree.kernels import TreeLayout
from tests.trainer.test_tree_forward import CASES, batch, tiny


@pytest.fixture
def layouts(monkeypatch):
    """Every `TreeLayout` the tree forward builds, in order."""
    built = []

    class Recorded(TreeLayout):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(tree_mod, "TreeLayout", Recorded)
    return built


def _run(model, rows, budget, grad=False):
    install_tree_attention(model)
    ids, mask, c = batch(rows)
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx:
        logps, ent, counts = tree_logps_and_entropies(model, ids, mask, c, compute_entropy=True, token_budget=budget)
    if grad:
        (logps.sum() + ent.sum()).backward()
    return counts


def test_flex_block_mask_built_once_per_trie_per_forward(cuda_dispatch_on_cpu, layouts, monkeypatch):
    """Four decoder layers, several tries, two forwards: `create_block_mask` runs once per trie per forward (it ran
    once per layer before), and FlexAttention once per layer and trie."""
    create_block_mask, flex_fn = ta._flex()
    builds, calls = [], []
    monkeypatch.setattr(ta, "_flex", lambda: (lambda *a, **k: builds.append(1) or create_block_mask(*a, **k),
                                              lambda *a, **k: calls.append(1) or flex_fn(*a, **k)))  # fmt: skip
    model = tiny("qwen3")
    model.config.num_hidden_layers = 2
    counts = [_run(model, CASES["mixed"], budget=14) for _ in range(2)]
    tries = sum(c["tries"] for c in counts)
    assert counts[0]["tries"] > 1
    assert len(builds) == tries == len(layouts)
    assert len(calls) == tries * len(model.model.layers)
    assert all(layout.builds == {"block_mask": 1} for layout in layouts)


@pytest.mark.parametrize("reentrant", [False, True])
def test_segment_layout_reused_by_every_layer_and_the_recomputation(reentrant, layouts):
    """The per-segment path (CPU) under activation checkpointing: each trie's gathered indices and masks are built
    once per forward, and the backward's recomputation of every layer reuses them."""
    model = tiny("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    counts = _run(model, CASES["mixed"], budget=14, grad=True)
    assert counts["tries"] > 1 and len(layouts) == counts["tries"]
    assert all(layout.builds == {"segments": 1} for layout in layouts)


def test_flex_compiles_at_most_twice_over_five_trie_sizes(cuda_dispatch_on_cpu):
    """Tries of five different sizes through the compiled FlexAttention: at most two compilations in all (the first
    call, and at most one more when the shapes turn dynamic), none after warm-up."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ta._flex.cache_clear()
    counters.clear()
    model = tiny("qwen3")
    rows = CASES["mixed"][1:]  # each prefix of these rows packs to a different number of tokens
    sizes = []
    for k in range(1, 6):
        ids, mask, c = batch(rows[:k])
        sizes.append(sum(p.unique_tokens for p in pack_rows(ids, mask, c, 10_000)))
        _run(model, rows[:k], budget=10_000)
    assert len(set(sizes)) == 5
    compiled = counters["stats"]["unique_graphs"]
    assert 1 <= compiled <= 2, dict(counters["stats"])


def _varlen_stand_in(top_left=False, old_signature=False):
    """A CPU stand-in for `torch.nn.attention.varlen.varlen_attn`: float32 maths per segment, causal aligned
    bottom-right (FlashAttention 2's convention) or top-left; the newer keyword-only signature (`scale`,
    `window_size`, `enable_gqa`) or the older one (`is_causal`, default scale, no GQA)."""
    calls = []

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, enable_gqa=False, causal=True):
        outs = []
        for s in range(len(cu_q) - 1):
            qs, ks, vs = q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]]
            lq, lk = qs.size(0), ks.size(0)
            assert enable_gqa or ks.size(1) == qs.size(1)
            ks, vs = (x.repeat_interleave(qs.size(1) // x.size(1), dim=1) for x in (ks, vs))
            shift = 0 if top_left else lk - lq
            allowed = torch.arange(lk)[None, :] <= shift + torch.arange(lq)[:, None]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed, scale=scale
            ).transpose(0, 1))  # fmt: skip
        calls.append(1)
        return torch.cat(outs)

    if old_signature:

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            assert is_causal
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    else:

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):  # fmt: skip
            assert window_size == (-1, 0)
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa)

    return varlen_attn, calls


@pytest.mark.parametrize("old_signature", [False, True])
def test_torch_varlen_path_is_exact_through_its_adapter(old_signature, cuda_dispatch_on_cpu, monkeypatch):
    """The varlen dispatch (GQA, scale, causal keyword of either torch signature) on CPU with a bottom-right
    stand-in, float32 admitted: it passes its probe, serves every layer, and gives the row-wise logps, entropies and
    gradients within 1e-5 (the same check runs on the real kernel in `test_tree_gpu.py`)."""
    from appo_trl.tree.kernels import torch_varlen_params
    from tests.trainer.test_tree_forward import assert_exact

    fn, calls = _varlen_stand_in(old_signature=old_signature)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: (fn, torch_varlen_params(fn)))
    monkeypatch.setattr(ta, "HALF", (torch.float32,))
    monkeypatch.setattr(ta, "_PROBED", {})
    monkeypatch.setattr(ta, "_segment_attention", lambda *a, **k: pytest.fail("the per-segment path ran"))
    monkeypatch.setattr(ta, "_flex", lambda: pytest.fail("FlexAttention ran"))
    with torch.no_grad():  # the check runs its own backward: under no_grad (TRL's old-logp pass) too
        assert ta.probe_torch_varlen(torch.device("cpu"), torch.float32, 16) and ta._PROBED
    assert_exact(tiny("qwen3"), CASES["mixed"])
    assert len(calls) > 2


def test_torch_varlen_with_a_top_left_convention_is_skipped_with_one_line(cuda_dispatch_on_cpu, monkeypatch, caplog):
    """A varlen kernel that aligns causal top-left (wrong for a segment shorter than its path) fails the probe:
    one log line, and the next kernel serves, exactly."""
    import logging

    from appo_trl.tree.kernels import torch_varlen_params
    from tests.trainer.test_tree_forward import assert_exact

    fn, calls = _varlen_stand_in(top_left=True)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: (fn, torch_varlen_params(fn)))
    monkeypatch.setattr(ta, "HALF", (torch.float32,))
    monkeypatch.setattr(ta, "_PROBED", {})
    monkeypatch.setattr(ta, "_flex", lambda: None)
    ta._say.cache_clear()
    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        assert_exact(tiny("qwen3"), CASES["tool"])
    lines = [r.getMessage() for r in caplog.records if r.name == ta.__name__]
    assert len(calls) == 1 and len(lines) == 2, lines  # the probe only; then FlexAttention missing
    assert "failed its check" in lines[0] and "top-left" in lines[0]


def test_rows_are_packed_once_per_batch_in_any_row_order(monkeypatch):
    """The old-logp, reference, scoring and loss passes over the same rows pack them once (`PackCache`); the same
    rows in another order reuse the packs with the targets mapped to that order (results equal the direct pack's);
    a changed row packs again."""
    from appo_trl.tree.forward import PackCache

    cache = PackCache()  # its owner's (the trainer's `tree_packs`), passed to every call
    model = tiny("qwen3")
    install_tree_attention(model)
    ids, mask, c = batch(CASES["mixed"])
    with torch.no_grad():
        first = [tree_logps_and_entropies(model, ids, mask, c, compute_entropy=True, token_budget=14, packs=cache)[:2]
                 for _ in range(3)]  # fmt: skip
        assert (cache.packs, cache.hits) == (1, 2)
        perm = torch.tensor([3, 0, 5, 1, 4, 2])
        logps, ent, _ = tree_logps_and_entropies(
            model, ids[perm], mask[perm], c, compute_entropy=True, token_budget=14, packs=cache
        )
        assert (cache.packs, cache.hits) == (1, 3)
        torch.testing.assert_close(logps, first[0][0][perm], atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, first[0][1][perm], atol=1e-6, rtol=0)
        changed = ids.clone()
        changed[0, -1] = 33
        tree_logps_and_entropies(model, changed, mask, c, compute_entropy=False, token_budget=14, packs=cache)
        assert cache.packs == 2
        tree_logps_and_entropies(model, ids, mask, c, compute_entropy=False, token_budget=14)  # no cache: packs afresh
        assert (cache.packs, cache.hits) == (2, 3)


def test_a_varlen_kernel_that_raises_in_a_layer_hands_over_with_one_line(cuda_dispatch_on_cpu, monkeypatch, caplog):
    """A varlen kernel that passed its check but raises in a layer (a head size it lacks, say): one log line, the
    next kernel serves that layer and every later one, exactly; it is not tried again."""
    import logging

    from appo_trl.tree.kernels import torch_varlen_params
    from tests.trainer.test_tree_forward import assert_exact

    fn, _ = _varlen_stand_in()
    calls = []

    def raising(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("FlashAttention only supports head dimension at most 256\n(details)")

    monkeypatch.setattr(ta, "_torch_varlen", lambda: (fn, torch_varlen_params(fn)))
    monkeypatch.setattr(ta, "HALF", (torch.float32,))
    monkeypatch.setattr(ta, "_PROBED", {(str(torch.device("cpu")), torch.float32): None})
    monkeypatch.setattr(ta, "torch_varlen_attention", raising)
    monkeypatch.setattr(ta, "_flex", lambda: None)
    ta._say.cache_clear()
    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        assert_exact(tiny("qwen3"), CASES["tool"])
    lines = [r.getMessage() for r in caplog.records if r.name == ta.__name__]
    assert len(calls) == 1 and "torch_varlen failed (RuntimeError: FlashAttention only supports" in lines[0]
    assert len(lines) == 2  # and FlexAttention is missing: the per-segment path serves
