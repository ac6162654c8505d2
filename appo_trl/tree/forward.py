"""The tree forward: the rows of a forward folded into prefix tries, each shared token sent through the model once.

`tree_logps_and_entropies` replaces the row-by-row body of TRL's `_get_per_token_logps_and_entropies` (the one
override point, in `APPOTrainer`): it takes TRL's `(B, P + C)` layout (left-padded prompts, right-padded
completions), packs the rows into tries, runs one forward per trie with tree attention
(`appo_trl.tree.attention`) and TRL's fused LM head (`shift_labels`: one label per packed position), and
scatters the per-token log-probabilities and entropies back into TRL's `(B, C)` layout, zero where the row-wise
forward has no label (padding). TRL's loss code and ours then run unchanged, with per-token advantages in `(B, C)`
as before; nothing of the loss is moved into the packed layout.

The trie is TRL's `trl.experimental.async_grpo.packing.TreeRow` (`appo_trl.tree.trie.SortedTrie` builds the same one per row,
not per token, from the sorted rows): its nodes are keyed on a token
*and* the next one, so a node has exactly one next-token label and the trie forks one token before rows diverge.
That keeps the two traps of a stored-once prefix closed: the last prompt token is duplicated per distinct first
completion token, so every first completion token is scored (the NeMo Automodel trap), and a row's last token is a
leaf keyed on `None` that predicts nothing (AReaL #1308's extra logprob at the last node). Only its layout and
`token_index` (the packed position predicting each trained token) are used, and the trained positions are mapped
back to `(row, column)` here, so per-token advantages stay in TRL's
layout. Each trie is bounded by `token_budget` unique tokens (`TreeRow.fits`); a row longer than the budget gets a
trie of its own (it cannot be split). Rows are packed in lexicographic order, so rows that share a prefix meet in
the same trie.

Exactness: a token's hidden state depends only on its own root-to-token path, which equals its row's prefix at the
same positions (position ids are depths, i.e. what the sampler used); so the results equal the row-wise forward up
to float summation order (float32: 1e-5, `tests/trainer/test_tree_forward.py`). The MoE load-balancing loss is
computed over the packed tokens, each weighted by the number of rows that share it (`moe_aux_loss`), which equals
the row-wise loss. Not supported (a clear error): multimodal inputs.

Costs paid once: the rows of a batch are packed once (a `PackCache` the trainer owns, keyed on the rows' content, in any row order), so
TRL's reference and old-logp passes (each of TRL's `batch_size` chunks packed on its own), APPO's scoring and the
loss over the same rows share the tries; each trie's attention layout (`appo_trl.tree.kernels.TreeLayout`) is built once per
forward and reused by every decoder layer and by the recomputation under activation checkpointing.

Sharded parameters (DeepSpeed ZeRO-3, FSDP): every forward and backward of the policy (or of a sharded reference
model) gathers parameters collectively, so every rank must run the same number of them, but the number of tries
depends on the rows (one-token rollouts on one rank fit one trie, long ones on another need several). With
`agree_forwards` (the trainer passes the maximum over ranks, `appo_trl.trainer.sharded.agree_forward_count`) a
rank with fewer tries runs padding forwards on a two-token trie; the padding's log-probability times 0 is added to
the result, so the backward runs through the padding forwards too, and the result is unchanged (x + 0 == x). DDP,
one process, and the forwards of a generation round under `full_weights_for_round` need no such agreement.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from appo_trl.tree.attention import prepare_kernels, tree_forward_active
from appo_trl.tree.kernels import TreeLayout
from appo_trl.tree.trie import SortedTrie

MODEL_INPUTS = ("input_ids", "position_ids", "shift_labels")  # the rest of `TreePack.inputs` is the tree layout


@dataclass
class TreePack:
    """One trie: model inputs (`(1, N)` tensors and the tree layout) and where its scores go in `(B, C)`."""

    inputs: dict[str, torch.Tensor]
    flat_index: torch.Tensor  # (M,) row * C + column of each trained target
    source: torch.Tensor  # (M,) packed position whose prediction is that target
    unique_tokens: int
    weights: torch.Tensor | None = None  # (N,) how many rows share each packed token (the MoE aux loss's weights)


def row_spans(attention_mask: torch.Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each row's real tokens; they must be one contiguous run (left pad, tokens, right pad)."""
    mask = attention_mask.bool().cpu()
    spans = []
    for i, row in enumerate(mask):
        idx = row.nonzero().flatten()
        if idx.numel() == 0:
            spans.append((0, 0))
            continue
        start, end = int(idx[0]), int(idx[-1]) + 1
        if end - start != idx.numel():
            raise ValueError(f"tree_forward: row {i}'s attention mask has a hole; rows must be pad/tokens/pad.")
        spans.append((start, end))
    return spans


def _segment_ancestry(cu_q: torch.Tensor, kv_index: torch.Tensor, cu_k: torch.Tensor) -> tuple:
    """Segment id of every packed token, and `anc[s, t]` = segment t lies on segment s's root path (or is s)."""
    lengths = (cu_q[1:] - cu_q[:-1]).long()
    seg_id = torch.zeros(int(cu_q[-1]), dtype=torch.long)  # segments are never empty: a step at each start
    seg_id[cu_q[1:-1].long()] = 1
    seg_id = seg_id.cumsum(0)  # (CPU repeat_interleave takes ~10 ms here)
    anc = torch.zeros(len(lengths), len(lengths), dtype=torch.bool)
    for s in range(len(lengths)):
        anc[s, seg_id[kv_index[cu_k[s] : cu_k[s + 1]]]] = True
    return seg_id, anc


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, token_budget: int):
    """Fold the rows into tries of at most `token_budget` unique tokens; see the module docstring."""
    batch, width = input_ids.shape
    prompt_width = width - logits_to_keep
    spans = row_spans(attention_mask)
    ids = input_ids.cpu()
    tokens = [ids[i, s:e] for i, (s, e) in enumerate(spans)]
    order = sorted((i for i in range(batch) if spans[i][1] > spans[i][0]), key=lambda i: tokens[i].tolist())
    tries: list[tuple[SortedTrie, list[int]]] = []
    for i in order:
        start, end = spans[i]
        trained = torch.zeros(end - start, dtype=torch.long)
        trained[max(prompt_width - start, 1) :] = 1  # completion positions; position 0 has no predecessor
        shared = tries[-1][0].shared(tokens[i]) if tries else 0
        if not tries or (tries[-1][1] and not tries[-1][0].fits(tokens[i], trained, token_budget, shared)):
            tries.append((SortedTrie(), []))
            shared = 0
        tries[-1][0].add(tokens[i], trained, shared)
        tries[-1][1].append(i)
    packs = []
    for trie, rows in tries:
        packed = trie.pack()
        columns = []
        for i in rows:
            start, end = spans[i]
            first = max(prompt_width - start, 1)
            columns.append(i * logits_to_keep + torch.arange(start + first, end) - prompt_width)
        flat_index = torch.cat(columns)
        if flat_index.numel() != packed["token_index"].numel():
            raise RuntimeError("tree_forward: trained targets and packed predictions disagree")
        seg_id, seg_anc = _segment_ancestry(packed["tree_cu_seqlens_q"], packed["tree_kv_index"],
                                            packed["tree_cu_seqlens_k"])  # fmt: skip
        inputs = {
            "input_ids": packed["input_ids"][None],
            "position_ids": packed["position_ids"][None],
            "shift_labels": packed["shift_labels"][None],
            "tree_kv_index": packed["tree_kv_index"],
            "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
            "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"],
            "tree_max_seqlens": packed["tree_max_seqlens"],
            "tree_seg_id": seg_id,
            "tree_seg_anc": seg_anc,
        }
        packs.append(TreePack(inputs, flat_index, packed["token_index"], trie.num_tokens, trie.row_weights()))
    return packs


@functools.cache
def padding_pack() -> TreePack:
    """The smallest trie with one trained target (two tokens): the input of a padding forward."""
    return pack_rows(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1, 2)[0]


class PackCache:
    """The tries of recent batches, keyed on their rows' content: TRL's old-logp pass, the reference pass, APPO's
    scoring and the loss over the same rows pack them once. Order-insensitive: the packs are made for the rows in
    a canonical order, and each lookup maps their `(row, column)` targets to the caller's row order. `packs` counts
    the batches packed (misses), `hits` the reuses."""

    def __init__(self, size: int = 32):
        self.size, self.packs, self.hits = size, 0, 0
        self._entries: OrderedDict = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def get(self, input_ids, attention_mask, logits_to_keep: int, token_budget: int) -> list[TreePack]:
        ids, mask = (t if t.device.type == "cpu" else t.cpu() for t in (input_ids, attention_mask))
        rows = [ids[i].numpy().tobytes() + mask[i].numpy().tobytes() for i in range(ids.size(0))]
        perm = sorted(range(len(rows)), key=rows.__getitem__)  # canonical row order
        digest = hashlib.blake2b(b"".join(rows[i] for i in perm), digest_size=16).digest()
        key = (tuple(ids.shape), str(ids.dtype), logits_to_keep, token_budget, digest)
        packs = self._entries.get(key)
        if packs is None:
            self.packs += 1
            packs = pack_rows(ids[perm], mask[perm], logits_to_keep, token_budget)
            self._entries[key] = packs
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        to_caller = torch.tensor(perm, dtype=torch.long)
        if to_caller.equal(torch.arange(len(perm))):
            return packs
        c = logits_to_keep
        return [replace(p, flat_index=to_caller[p.flat_index // c] * c + p.flat_index % c) for p in packs]


def tree_logps_and_entropies(
    model,
    input_ids,
    attention_mask,
    logits_to_keep,
    *,
    compute_entropy,
    token_budget,
    autocast=contextlib.nullcontext,
    agree_forwards: Callable[[int], int] | None = None,
    batch_size: int | None = None,
    compute_aux_loss: bool = False,
    packs: PackCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Per-token log-probs and entropies `(B, C)` through the tree forward, plus the token counts it forwarded (and,
    with `compute_aux_loss`, `"aux_loss"`: the MoE load-balancing loss of the row-wise forward, `moe_aux_loss`).

    `autocast` makes one context per trie (e.g. `accelerator.autocast`). `model` must carry TRL's fused LM head
    (`add_fused_lm_head`) and tree attention (`install_tree_attention`). `agree_forwards(n)`: the number of forwards
    to run given this rank's n tries (>= n), the rest being padding forwards that change nothing (module doc).
    `batch_size` (TRL's chunking of a long batch, e.g. its reference and old-logp passes over a generation batch):
    each chunk of rows is packed on its own, so the loss pass's micro-batch finds its tries in `packs`, the caller's
    `PackCache` (the trainer owns one: `APPOTrainer.tree_packs`; None packs afresh).
    """
    batch = input_ids.size(0)
    device = input_ids.device
    chunk = batch_size or batch or 1  # TRL's chunks: each packed (and cached) on its own
    cache = packs if packs is not None else PackCache()
    packs, chunk_of = [], []
    host_ids, host_mask = input_ids.cpu(), attention_mask.cpu()  # one copy to the host (a sync), not one per chunk
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        for pack in cache.get(host_ids[rows], host_mask[rows], logits_to_keep, token_budget):
            packs.append(replace(pack, flat_index=pack.flat_index + start * logits_to_keep) if start else pack)
            chunk_of.append(start)
    router_logits: list = []
    forwards = agree_forwards(len(packs)) if agree_forwards is not None else len(packs)
    if forwards < len(packs):
        raise RuntimeError(f"tree_forward: {forwards} agreed forwards for {len(packs)} tries")
    index, logps, entropies, padding = [], [], [], None
    for n in range(forwards):
        pack = packs[n] if n < len(packs) else padding_pack()
        inputs = {k: pack.inputs[k].to(device) for k in MODEL_INPUTS}
        layout = TreeLayout(pack.inputs, device)  # once per trie: every layer and the recomputation reuse it
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        hook = _router_logits_hook(model, router_logits) if compute_aux_loss else contextlib.nullcontext()
        with autocast(), tree_forward_active(), hook:
            prepare_kernels(model, device)  # one-time kernel checks, outside the layers
            out = model(**inputs, tree_layout=layout, fused_lm_head=True, **extra)
        source = pack.source.to(device)
        if n >= len(packs):  # a padding forward: its finite log-prob times 0 joins the graph, adding exactly 0
            term = out.log_probs[0].index_select(0, source).sum() * 0
            padding = term if padding is None else padding + term
            continue
        index.append(pack.flat_index.to(device))
        logps.append(out.log_probs[0].index_select(0, source))
        if compute_entropy:
            entropies.append(out.entropy[0].index_select(0, source))

    def scatter(values):
        flat = torch.zeros(batch * logits_to_keep, dtype=values[0].dtype if values else torch.float32, device=device)
        if values:
            flat = flat.index_put((torch.cat(index),), torch.cat(values))
        return flat.view(batch, logits_to_keep)

    counts = {
        "tree_tokens": sum(p.unique_tokens for p in packs),
        "row_tokens": int(input_ids.numel()),
        "tries": len(packs),
        "padding_forwards": forwards - len(packs),
    }
    if compute_aux_loss:
        n = len(packs)
        counts["aux_loss"] = moe_aux_loss(model, router_logits[:n], [p.weights for p in packs], chunk_of)
    out_logps = scatter(logps)
    if padding is not None:
        out_logps = out_logps + padding
    return out_logps, scatter(entropies) if compute_entropy else None, counts


@contextlib.contextmanager
def _router_logits_hook(model, into: list):
    """Collect the backbone's `router_logits` of each forward (TRL's fused LM head does not return them)."""
    while hasattr(model, "module"):  # DDP and friends
        model = model.module
    handle = model.get_decoder().register_forward_hook(lambda m, args, out: into.append(out.router_logits))
    try:
        yield
    finally:
        handle.remove()


def moe_aux_loss(model, router_logits: list, weights: list, chunk_of: list) -> torch.Tensor:
    """The load-balancing loss of the row-wise forward from the tries' router logits: TRL's function (Mixtral's)
    with each packed token weighted by the number of rows that share it, over the tokens of each of TRL's chunks,
    then the mean over chunks, as TRL averages them. The loss is a product of per-expert means over tokens, so
    weighting each token by its row count gives the row-wise value exactly (up to float summation order)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    while hasattr(model, "module"):
        model = model.module
    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    losses = []
    for start in sorted(set(chunk_of)):
        tries = [n for n, c in enumerate(chunk_of) if c == start]
        layers = [torch.cat([router_logits[n][layer].reshape(-1, router_logits[n][layer].size(-1)) for n in tries])
                  for layer in range(len(router_logits[tries[0]]))]  # fmt: skip
        w = torch.cat([weights[n] for n in tries]).to(layers[0].device)[None]
        losses.append(load_balancing_loss_func(tuple(layers), experts, config.num_experts_per_tok, w))
    return torch.stack(losses).mean()
