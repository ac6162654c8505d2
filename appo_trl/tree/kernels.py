"""The tree attention's layout and kernel bodies; `appo_trl.tree.attention` dispatches between them.

`TreeLayout` is built once per trie per forward (`appo_trl.tree.forward.tree_logps_and_entropies`) and travels in
the forward's keyword arguments (`tree_layout`), so every decoder layer and the recomputation under activation
checkpointing reuse what a kernel needs: the varlen `cu_seqlens` and maxima (host integers, no device sync per
layer), the per-segment gathered indices and masks, and FlexAttention's block mask. A kernel's piece is made at
its first use (the first layer that runs that kernel) and kept on the layout; `builds` counts them.
"""

from __future__ import annotations

import inspect

import torch


class TreeLayout:
    """One trie's attention layout on one device (see the module doc). `pack` holds `appo_trl.tree.forward`'s tree
    tensors; the CPU copies give the host integers, the device copies the kernels' operands."""

    def __init__(self, pack: dict[str, torch.Tensor], device):
        self.device = torch.device(device)
        self.cu_q_list = pack["tree_cu_seqlens_q"].tolist()
        self.cu_k_list = pack["tree_cu_seqlens_k"].tolist()
        self.max_q, self.max_k = (int(x) for x in pack["tree_max_seqlens"].tolist())
        self.n = self.cu_q_list[-1]
        to = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        self.kv_index = to(pack["tree_kv_index"])
        self.cu_q = to(pack["tree_cu_seqlens_q"].int())
        self.cu_k = to(pack["tree_cu_seqlens_k"].int())
        self.seg_id = to(pack["tree_seg_id"])
        self.seg_anc = to(pack["tree_seg_anc"])
        depth = pack.get("position_ids")  # depths in the tree: a sliding window counts them
        self.depth = to(depth.reshape(-1)) if depth is not None else None
        self._pieces: dict = {}
        self.builds: dict[str, int] = {}

    def piece(self, key, make):
        """`make()` once per layout and `key` (the kernel and, for masks, the window and dtype)."""
        if key not in self._pieces:
            self._pieces[key] = make()
            name = key[0] if isinstance(key, tuple) else key
            self.builds[name] = self.builds.get(name, 0) + 1
        return self._pieces[key]

    def segments(self, window: int | None = None):
        """Per segment: query span, gathered key indices, bottom-right causal `allowed` (lq, lk) mask; with a
        sliding `window`, also depth(q) - depth(kv) < window (the gathered path is contiguous in depth, so path
        positions are depths)."""

        def make():
            out = []
            for s in range(len(self.cu_q_list) - 1):
                q0, q1, k0, k1 = self.cu_q_list[s], self.cu_q_list[s + 1], self.cu_k_list[s], self.cu_k_list[s + 1]
                lq, lk = q1 - q0, k1 - k0
                cols = torch.arange(lk, device=self.device)[None, :]
                rows = (lk - lq) + torch.arange(lq, device=self.device)[:, None]
                allowed = cols <= rows
                if window:
                    allowed = allowed & (cols > rows - window)
                out.append((q0, q1, self.kv_index[k0:k1], allowed[None, None]))
            return out

        return self.piece(("segments", window), make)

    def block_mask(self, create_block_mask, window: int | None = None):
        """FlexAttention's block mask: a token sees the tokens before it in its own segment and in the segments on
        its root path (DFS pre-order keeps every ancestor before its descendants); with a sliding `window`, only
        those fewer than `window` deep above it. One per trie and window (Gemma 2 alternates two)."""
        seg_id, seg_anc, depth = self.seg_id, self.seg_anc, self.depth

        def ancestor(b, h, q, kv):
            return (kv <= q) & seg_anc[seg_id[q], seg_id[kv]]

        def windowed(b, h, q, kv):
            return (kv <= q) & seg_anc[seg_id[q], seg_id[kv]] & (depth[q] - depth[kv] < window)

        mask_mod = windowed if window else ancestor
        return self.piece(("block_mask", window), lambda: create_block_mask(mask_mod, None, None, self.n, self.n,
                                                                            device=self.device))  # fmt: skip


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None,
                    **kwargs):  # fmt: skip
    """Transformers' eager attention (the one the Llama family copies, with Gemma 2's soft-capping and GPT-OSS's
    attention sinks `s_aux`): float32 softmax, additive float mask."""
    scaling = scaling if scaling is not None else query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    if s_aux is not None:  # GPT-OSS: one sink logit per head joins the softmax, then is dropped
        sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined = torch.cat([weights, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(query.dtype)
    else:
        weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _repeat_kv(x: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=dim)


def segment_attention(fn, module, query, key, value, layout: TreeLayout, scaling, dropout, window=None, softcap=None,
                      s_aux=None):  # fmt: skip
    """Per segment: its queries attend to its gathered root-to-segment path, causally aligned bottom-right (within a
    sliding `window`, in depth). `fn` is the base's eager or SDPA attention function; soft-capping and attention
    sinks take eager."""
    fn = eager_attention if softcap or s_aux is not None else fn
    extra = {k: v for k, v in (("softcap", softcap), ("s_aux", s_aux)) if v is not None}
    outs = []
    for q0, q1, idx, allowed in layout.segments(window):
        k, v = key.index_select(2, idx), value.index_select(2, idx)
        if fn is eager_attention:
            mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
        else:
            mask = allowed
        out, _ = fn(module, query[:, :, q0:q1], k, v, mask, dropout=dropout, scaling=scaling, is_causal=False,
                    **extra)  # fmt: skip
        outs.append(out)
    return torch.cat(outs, dim=1), None


def flex_attention(flex, module, query, key, value, layout: TreeLayout, scaling, window=None, softcap=None):
    create_block_mask, flex_fn = flex
    block = layout.block_mask(create_block_mask, window)
    n_rep = getattr(module, "num_key_value_groups", 1)
    extra = {}
    if softcap:

        def capped(score, b, h, q, kv):
            return torch.tanh(score / softcap) * softcap

        extra["score_mod"] = capped
    out = flex_fn(query, key, value, block_mask=block, scale=scaling, enable_gqa=n_rep > 1, **extra)
    return out.transpose(1, 2).contiguous(), None


def torch_varlen_params(varlen_attn) -> frozenset:
    """The keyword arguments this torch's `varlen_attn` takes (its signature changed across torch releases)."""
    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_attention(varlen, module, query, key, value, layout: TreeLayout, scaling, window=None):
    """PyTorch's built-in varlen FlashAttention over the `tree_kv_index` layout: each segment's queries against its
    gathered root-to-segment path, causal aligned bottom-right (FlashAttention 2's convention for a query block
    shorter than its keys: query i of lq sees keys 0..lk-lq+i; checked once per process by `varlen_probe`). A
    sliding `window` is its left window `window - 1` in path positions, which are depths (the path is contiguous in
    depth); the caller checks that this torch's kernel takes `window_size`."""
    varlen_attn, params = varlen
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (tokens, heads, head_dim)
    q = q.contiguous()
    k, v = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
    n_rep = q.size(1) // k.size(1)
    kwargs = {}
    if n_rep > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling - q.size(-1) ** -0.5) > 1e-12:
        q = q * (scaling * q.size(-1) ** 0.5)
    if "window_size" in params:
        kwargs["window_size"] = (window - 1 if window else -1, 0)
    else:
        kwargs["is_causal"] = True
    out = varlen_attn(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, **kwargs)
    return out.unsqueeze(0), None


def flash_varlen_attention(flash, module, query, key, value, layout: TreeLayout, scaling, dropout, window=None,
                           softcap=None):  # fmt: skip
    """The `flash_attn` package's varlen function over the same layout (bottom-right causal, as TRL's), with its
    left window and soft-capping."""
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))
    idx = layout.kv_index
    extra = {"window_size": (window - 1, 0)} if window else {}
    if softcap:
        extra["softcap"] = softcap
    out = flash(q.contiguous(), k.index_select(0, idx), v.index_select(0, idx), layout.cu_q, layout.cu_k, layout.max_q,
                layout.max_k, dropout_p=dropout, softmax_scale=scaling, causal=True, **extra)  # fmt: skip
    return out.unsqueeze(0), None


def varlen_probe(attend, device, dtype, head_dim: int = 64) -> str | None:
    """Run a varlen kernel (`attend(module, q, k, v, layout, scaling)`) on a two-segment trie whose queries are
    shorter than their key paths, forward and backward, against an explicit bottom-right mask in float32. `None` if
    it agrees; else why not (a top-left causal convention, or an error)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    # trie: segment 0 = tokens 0..2 (root), segment 1 = tokens 3..4 (child of 0), segment 2 = token 5 (child of 0)
    pack = {
        "tree_cu_seqlens_q": torch.tensor([0, 3, 5, 6], dtype=torch.int32),
        "tree_cu_seqlens_k": torch.tensor([0, 3, 8, 12], dtype=torch.int32),
        "tree_kv_index": torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5]),
        "tree_max_seqlens": torch.tensor([3, 5]),
        "tree_seg_id": torch.tensor([0, 0, 0, 1, 1, 2]),
        "tree_seg_anc": torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
    }
    layout = TreeLayout(pack, device)
    q = torch.randn(1, 4, 6, head_dim, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(1, 2, 6, head_dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # grouped-query attention, as most models the trainer serves
    scaling = head_dim**-0.5
    try:
        out, _ = attend(module, q, k, v, layout, scaling)
        out.float().square().sum().backward()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
    ref, _ = segment_attention(eager_attention, module, *(x.detach().float() for x in (q, k, v)), layout, scaling, 0.0)
    err = (out.detach().float() - ref).abs().max().item()
    if not err < 3e-2:
        return f"it disagrees with bottom-right causal attention by {err:.3g} (a top-left causal convention?)"
    return None
