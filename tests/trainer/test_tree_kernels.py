"""The tree attention's per-forward costs, counted on CPU: one layout per trie per forward (FlexAttention's block mask
and the per-segment masks are built once, not once per decoder layer, and the recomputation under activation
checkpointing reuses them), and FlexAttention compiles at most twice over tries of five sizes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import appo_trl.trainer.tree as tree_mod
import appo_trl.trainer.tree_attention as ta
from appo_trl.trainer.tree import pack_rows, tree_logps_and_entropies
from appo_trl.trainer.tree_attention import install_tree_attention
from appo_trl.trainer.tree_kernels import TreeLayout
from tests.trainer.test_tree_forward import CASES, batch, tiny


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """The CUDA dispatch on CPU with FlexAttention serving (no varlen kernel in this process)."""
    monkeypatch.setattr(ta, "_on_gpu", lambda query: True)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: None)
    monkeypatch.setattr(ta, "_flash_varlen", lambda: None)
    monkeypatch.setattr(ta, "_FAILED", set())
    ta._say_fallback.cache_clear()
    yield
    ta._say_fallback.cache_clear()


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


def test_flex_block_mask_built_once_per_trie_per_forward(flex_on_cpu, layouts, monkeypatch):
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


def test_flex_compiles_at_most_twice_over_five_trie_sizes(flex_on_cpu):
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
