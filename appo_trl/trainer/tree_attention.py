"""Tree attention for any Hugging Face causal LM, registered through transformers' `AttentionInterface`.

`install_tree_attention(model)` switches the model's `config._attn_implementation` from its base implementation
(`sdpa`, `eager`, `flash_attention_2`, ...) to `appo_tree:<base>`, a wrapper registered in transformers'
`AttentionInterface` and `AttentionMaskInterface`:

- a forward *without* the tree keyword arguments (generation in-process, evaluation, anything that is not the
  trainer's tree forward) is handed to the base implementation and its mask builder unchanged;
- a forward *with* them (`tree_kv_index`, `tree_cu_seqlens_q`, `tree_cu_seqlens_k`, `tree_max_seqlens`,
  `tree_seg_id`, `tree_seg_anc`, laid out by `appo_trl.trainer.tree.pack_rows`) attends over the prefix
  tree: the packed token at position `q` sees exactly the tokens on its root-to-`q` path, which are the tokens its
  own row saw before it, at the same positions (position ids are depths in the tree).

The switch is permanent on purpose: activation checkpointing recomputes a layer's forward during the backward, after
any context manager around the loss forward has exited, and it must recompute the same tree attention (the
checkpointing bug of AReaL #889). The tree layout travels in the forward's keyword arguments, which the
recomputation sees again; the mask builder needs no tree state because the mask is built outside the checkpointed
layers. The implementation name is not written to `config.json` (transformers keeps `_attn_implementation` out of it).

Kernels, chosen once per process:
- CPU (and the fallback everywhere): one call of the base `sdpa`/eager maths per tree segment, over the segment's
  root-to-segment path gathered by `tree_kv_index` (TRL's `tree_kv_index` layout), with a bottom-right causal mask
  inside the segment. Memory is the sum over segments of segment x path, not (unique tokens)^2.
- CUDA: FlashAttention's `flash_attn_varlen_func` when the `flash_attn` package is installed (bottom-right causal
  over the same layout, as TRL's `tree_attention`); else PyTorch's FlexAttention with an ancestor block mask
  (`tree_seg_anc`: a token sees the tokens before it in its own segment and in the segments on its root path),
  compiled at its first call, with one log line saying that flash_attn is missing; else the per-segment path, with
  one log line. If FlexAttention raises (its compilation at the first call, or its kernel), the per-segment path
  serves from then on, with one log line, never an error; an out-of-memory error is not a missing kernel and is
  raised. Attention dropout (FlexAttention has none) also takes the per-segment path. Nothing is downloaded at run
  time (TRL's own `tree_attention` fetches a FlashAttention-3 kernel from the Hub, which is why it is not reused
  here). These CUDA paths have not run on a GPU yet: the FlexAttention forward is tested on CPU (FlexAttention has
  no CPU backward) and the fallbacks with stand-ins (`tests/trainer/test_tree_forward.py`).

Not supported (an error, not a silent difference): sliding-window attention, attention logit soft-capping and
`output_attentions` inside a tree forward.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

logger = logging.getLogger(__name__)

PREFIX = "appo_tree:"


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers' eager attention (the one the Llama family copies): float32 softmax, additive float mask."""
    scaling = scaling if scaling is not None else query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _base_attention(base: str):
    if base in (None, "eager"):
        return eager_attention
    return AttentionInterface._global_mapping[base]


def _segment_attention(base, module, query, key, value, kv_index, cu_q, cu_k, scaling, dropout):
    """Per segment: its queries attend to its gathered root-to-segment path, causally aligned bottom-right."""
    fn = eager_attention if base in (None, "eager") else _base_attention("sdpa")
    outs = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        lq, lk = q1 - q0, k1 - k0
        idx = kv_index[k0:k1]
        k, v = key.index_select(2, idx), value.index_select(2, idx)
        allowed = (
            torch.arange(lk, device=query.device)[None, :]
            <= (lk - lq) + torch.arange(lq, device=query.device)[:, None]
        )
        if fn is eager_attention:
            mask = torch.zeros(lq, lk, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
        else:
            mask = allowed[None, None]
        out, _ = fn(module, query[:, :, q0:q1], k, v, mask, dropout=dropout, scaling=scaling, is_causal=False)
        outs.append(out)
    return torch.cat(outs, dim=1), None


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch: the next kernel serves
        return None
    return flash_attn_varlen_func


@functools.cache
def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None
    return create_block_mask, torch.compile(flex_attention, dynamic=True)


@functools.cache
def _say_fallback(what: str, using: str = "the per-segment SDPA path") -> None:
    logger.warning("tree attention: %s; using %s.", what, using)


_FAILED: set[str] = set()  # GPU kernels that raised once in this process: not tried again


def _on_gpu(query: torch.Tensor) -> bool:
    """Whether the CUDA kernels are tried (the CPU tests drive the CUDA dispatch by patching this)."""
    return query.is_cuda


def _flex_attention(flex, module, query, key, value, tree, scaling):
    create_block_mask, flex_attention = flex
    seg_id, seg_anc = tree["tree_seg_id"], tree["tree_seg_anc"]

    def ancestor(b, h, q, kv):  # kv precedes q in DFS pre-order and lies on q's root-to-segment path
        return (kv <= q) & seg_anc[seg_id[q], seg_id[kv]]

    n = query.size(2)
    block = create_block_mask(ancestor, None, None, n, n, device=query.device)
    n_rep = getattr(module, "num_key_value_groups", 1)
    out = flex_attention(query, key, value, block_mask=block, scale=scaling, enable_gqa=n_rep > 1)
    return out.transpose(1, 2).contiguous(), None


def _cuda_attention(module, query, key, value, tree, scaling, dropout):
    """FlashAttention varlen, else FlexAttention; `None` when neither serves (the caller runs the segment path)."""
    flash = _flash_varlen()
    if flash is not None:
        q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))
        idx = tree["tree_kv_index"]
        out = flash(
            q,
            k.index_select(0, idx),
            v.index_select(0, idx),
            tree["tree_cu_seqlens_q"],
            tree["tree_cu_seqlens_k"],
            int(tree["tree_max_seqlens"][0]),
            int(tree["tree_max_seqlens"][1]),
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
        )
        return out.unsqueeze(0), None
    if "flex" in _FAILED:
        return None
    flex = _flex()
    if flex is None:
        _say_fallback("neither flash_attn nor FlexAttention is available on this GPU")
        return None
    if dropout:
        _say_fallback("flash_attn is not installed and FlexAttention has no attention dropout")
        return None
    try:
        out = _flex_attention(flex, module, query, key, value, tree, scaling)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # compilation (first call) or the kernel failed: the segment path serves from now on
        _FAILED.add("flex")
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        _say_fallback(f"flash_attn is not installed and FlexAttention failed ({type(exc).__name__}: {first})")
        return None
    _say_fallback("flash_attn is not installed", "FlexAttention with an ancestor block mask")
    return out


def tree_attention(base: str):
    """The `AttentionInterface` function of `appo_tree:<base>`."""
    base_fn = _base_attention(base)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("tree_kv_index") is None:
            return base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
            raise ValueError("tree_forward: sliding-window attention is not supported; set tree_forward=False.")
        if kwargs.get("softcap") or getattr(module, "attn_logit_softcapping", None):
            raise ValueError("tree_forward: attention soft-capping is not supported; set tree_forward=False.")
        if kwargs.get("output_attentions"):
            raise ValueError("tree_forward: output_attentions is not supported in a tree forward.")
        dropout = dropout if module.training else 0.0
        if _on_gpu(query):
            out = _cuda_attention(module, query, key, value, kwargs, scaling, dropout)
            if out is not None:
                return out
        return _segment_attention(
            base,
            module,
            query,
            key,
            value,
            kwargs["tree_kv_index"],
            kwargs["tree_cu_seqlens_q"],
            kwargs["tree_cu_seqlens_k"],
            scaling,
            dropout,
        )

    return attention


def tree_mask(base: str):
    """The `AttentionMaskInterface` function of `appo_tree:<base>`: the base's mask, or none in a tree forward."""
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base or "eager")

    def mask(*args, **kwargs):
        if getattr(_STATE, "active", False) or base_mask is None:
            return None
        return base_mask(*args, **kwargs)

    return mask


_STATE = threading.local()  # per thread: an in-process sampler thread keeps its masks during a tree forward


class tree_forward_active:
    """Context: masks built inside are `None` (the tree attention needs none; masks are built outside the
    checkpointed layers, so the recomputation in the backward does not need this flag)."""

    def __enter__(self):
        self._prev = getattr(_STATE, "active", False)
        _STATE.active = True

    def __exit__(self, *exc):
        _STATE.active = self._prev


def register(base: str) -> str:
    name = PREFIX + (base or "eager")
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, tree_attention(base))
        AttentionMaskInterface.register(name, tree_mask(base))
    return name


def install_tree_attention(model) -> str:
    """Switch `model` (a `PreTrainedModel`, or a PEFT / DDP wrapper of one) to tree attention; idempotent."""
    config = model.config
    current = config._attn_implementation
    if current and current.startswith(PREFIX):
        return current
    if current and current.startswith("paged|"):
        raise ValueError(f"tree_forward: attention {current!r} (paged) cannot run a tree forward.")
    name = register(current)
    config._attn_implementation = name
    return name
