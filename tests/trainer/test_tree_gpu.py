"""The tree forward on a GPU, kernel by kernel (`-m gpu`; skipped without CUDA): PyTorch's varlen FlashAttention,
flash_attn's varlen, FlexAttention and the per-segment path, each forced in turn and checked to have served.

- float32 (the kernels that take it: FlexAttention, per-segment): logps and entropies within 1e-5 of the row-wise
  forward, every gradient within 1e-5 relative to its largest entry; with and without activation checkpointing;
- bfloat16 (every kernel): the tree's error against a float32 row-wise reference (logps, entropies, and the
  gradients' relative norm) is at most 1.25x the row-wise bfloat16 error against the same reference.
"""

from __future__ import annotations

import random

import pytest
import torch

import appo_trl.tree.attention as ta
from appo_trl.tree.attention import install_tree_attention
from appo_trl.tree.forward import tree_logps_and_entropies
from bench.tree_forward import trl_layout

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
KERNELS = ("torch_varlen", "flash_attn", "flex", "segment")
SERVES = {"torch_varlen": "torch_varlen_attention", "flash_attn": "flash_varlen_attention",
          "flex": "flex_attention", "segment": "_segment_attention"}  # fmt: skip


def model_and_rows(dtype, checkpointing, window=None):
    """A random Qwen3 (head_dim 64, GQA 2:1, 2 layers; with `window`, a sliding first layer) and a group of 8 rows:
    4 roots with two tool-result spans and 4 branches that copy a root up to one of them, then diverge (ARPO's
    shape), one shorter prompt row."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         attn_implementation="sdpa")  # fmt: skip
    if window:
        config = Qwen3Config(
            **{
                **config.to_dict(),
                "use_sliding_window": True,
                "sliding_window": window,
                "max_window_layers": 0,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(DEVICE, dtype)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    rng = random.Random(0)
    tok = lambda k: [rng.randrange(4, 512) for _ in range(k)]  # noqa: E731
    prompt = tok(48)
    roots = [tok(12) + tok(8) + tok(12) + tok(8) + tok(rng.randint(4, 20)) for _ in range(4)]
    branches = [r[: (20 if j % 2 else 40)] + tok(rng.randint(3, 16)) for j, r in enumerate(roots)]
    rows = [(prompt, c) for c in roots + branches] + [(prompt[:20], tok(30))]
    ids, mask, width_c = trl_layout(rows)
    return model, ids.to(DEVICE), mask.to(DEVICE), width_c


def run(model, ids, mask, c, tree: bool):
    """Logps, entropies and the gradients of a fixed weighting of them, float32 on the host."""
    mask_c = mask[:, -c:].float()
    if tree:
        install_tree_attention(model)
        logps, ent, _ = tree_logps_and_entropies(model, ids, mask, c, compute_entropy=True, token_budget=1 << 20)
    else:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-c] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logps, ent = out.log_probs[:, -c:], out.entropy[:, -c:]
    logps, ent = logps.float() * mask_c, ent.float() * mask_c
    weights = torch.linspace(-1.0, 1.0, logps.numel(), device=logps.device).view_as(logps) * mask_c
    model.zero_grad(set_to_none=True)
    ((logps * weights).sum() + 0.3 * (ent * weights.flip(0)).sum()).backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach().cpu(), ent.detach().cpu(), grads


@pytest.fixture
def only(monkeypatch):
    """`only(kernel)`: force that kernel (the others absent), and count the calls that it served."""
    monkeypatch.setattr(ta, "_FAILED", set())
    monkeypatch.setattr(ta, "_PROBED", {})
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32

    def force(kernel):
        if kernel == "torch_varlen" and ta._torch_varlen() is None:
            pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
        if kernel == "flash_attn" and ta._flash_varlen() is None:
            pytest.skip("flash_attn is not installed")
        if kernel == "flex" and ta._flex() is None:
            pytest.skip("this torch has no FlexAttention")
        if kernel != "torch_varlen":
            monkeypatch.setattr(ta, "_torch_varlen", lambda: None)
        if kernel not in ("torch_varlen", "flash_attn"):
            monkeypatch.setattr(ta, "_flash_varlen", lambda: None)
        if kernel == "segment":
            monkeypatch.setattr(ta, "_on_gpu", lambda query: False)
        calls = []
        inner = getattr(ta, SERVES[kernel])
        monkeypatch.setattr(ta, SERVES[kernel], lambda *a, **k: calls.append(1) or inner(*a, **k))
        return calls

    yield force
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _assert_served(calls, kernel):
    assert calls, f"{kernel} did not serve the tree forward (probe: {ta._PROBED})"
    if kernel == "torch_varlen":  # its causal convention was checked, and it passed
        assert ta._PROBED and all(why is None for why in ta._PROBED.values()), ta._PROBED


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kernel", ["flex", "segment"])
def test_float32_exact(kernel, checkpointing, window, only):
    calls = only(kernel)
    model, ids, mask, c = model_and_rows(torch.float32, checkpointing, window)
    lr, er, gr = run(model, ids, mask, c, tree=False)
    lt, et, gt = run(model, ids, mask, c, tree=True)
    _assert_served(calls, kernel)
    torch.testing.assert_close(lt, lr, atol=1e-5, rtol=0)
    torch.testing.assert_close(et, er, atol=1e-5, rtol=0)
    assert set(gt) == set(gr)
    for name, g in gr.items():
        scale = g.abs().max().clamp_min(1e-6)
        assert (gt[name] - g).abs().max() / scale <= 1e-5, name


def _rel(a: dict, b: dict) -> float:
    num = sum(((a[k] - b[k]) ** 2).sum() for k in b) ** 0.5
    return float(num / sum((b[k] ** 2).sum() for k in b) ** 0.5)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bfloat16_error_no_worse_than_rowwise(kernel, checkpointing, window, only):
    calls = only(kernel)
    model, ids, mask, c = model_and_rows(torch.float32, checkpointing, window)
    ref = run(model, ids, mask, c, tree=False)  # float32 row-wise: the reference
    model.to(torch.bfloat16)
    row = run(model, ids, mask, c, tree=False)
    tree = run(model, ids, mask, c, tree=True)
    _assert_served(calls, kernel)
    n = (mask[:, -c:] > 0).sum().item()
    for i, what in ((0, "logps"), (1, "entropies")):
        err_row = (row[i] - ref[i]).abs().sum().item() / n
        err_tree = (tree[i] - ref[i]).abs().sum().item() / n
        assert err_tree <= 1.25 * err_row, f"{what}: tree {err_tree:.3g} vs row-wise {err_row:.3g}"
    err_row, err_tree = _rel(row[2], ref[2]), _rel(tree[2], ref[2])
    assert err_tree <= 1.25 * err_row, f"gradients: tree {err_tree:.3g} vs row-wise {err_row:.3g}"
