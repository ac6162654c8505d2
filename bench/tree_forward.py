"""Row-wise against tree forward, side by side in one process (used by `bench/trainer.py`; runnable alone).

One group per micro-batch, as `APPOTrainer` forms them with `tree_forward` (groups are shuffled, not rows), on a
random Qwen3 model. For each workload and strategy shape the two forwards run interleaved on the same rows:

- `tokens`: tokens sent through the model per step (row-wise: B x padded length, as TRL's forward; tree: unique
  tokens of the tries), and their ratio (the `tree/tokens_ratio` the trainer logs);
- `pack_ms`: host time to plan the tries of the rows (`pack_rows`, once per batch: the passes reuse them);
- `loss_step_s`: forward + backward of a policy-gradient loss over per-token logps and entropies (median);
- `step_s`: TRL's no-grad old-logp pass + the loss step + an AdamW step (median);
- `saved_mb`: bytes of the tensors autograd saves for the backward (distinct storages) during the loss forward
  *without* activation checkpointing, the activation memory that sets a non-checkpointed step's peak on top of
  weights and optimizer state. It is counted, not held: the hook records each saved storage and drops it, so this
  forward costs the memory of a no-grad one. Deterministic, unlike RSS on a shared machine;
- `peak_rss_mb` (`--peak`): the process peak of the loss step (with checkpointing unless `--no-checkpointing`).
  Each path's loss step runs in a fresh spawned process after the model and rows are built; the figure is that
  process's peak resident set (`ru_maxrss`) during the step minus its peak before it, so weights, rows and the
  interpreter cancel out.

Both paths train with activation checkpointing (non-reentrant, per decoder layer), as TRL's and `APPOConfig`'s
default `gradient_checkpointing: true` does, so the times include each layer's recomputation. Until 2026-11-29 they
ran without it: workload (a)'s row-wise step then held 6-8 GiB of activations, and the whole `bench/trainer.py`
peaked at 20 GB. `--no-checkpointing` measures that way again (about 10 GB for workload (a)). Workload (a) runs
each strategy in its own spawned process, so nothing of one strategy's step stays resident for the next.

Workloads (rows are synthetic token ids; the forward cost does not depend on their values):
- (a) paper-shaped: prompt 1,536 tokens, n = 16, completions of about 512 tokens holding two tool results of 64
  tokens; GRPO (16 independent rows) and ARPO (8 roots; 8 branches, each copying its parent up to the end of its
  first or second tool result); hidden 512, 4 layers.
- (b) the demo's shape: prompt 200 tokens, n = 4, completions up to 96 tokens with two tool results of 12 tokens,
  GRPO and ARPO (2 roots + 2 branches); the demo's model (hidden 128, 2 layers, vocab 512).
`--quick` shrinks (a) to prompt 192, completions 64, hidden 64, 2 layers, so `make test` stays fast.
`--repeats N` times each path N times (interleaved, medians); the default is 1 for (a) and under `--quick`, else 3.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def group_rows(strategy: str, prompt_len: int, n: int, completion_len: int, tool_len: int, vocab: int, seed: int):
    """One group of (prompt, completion) token lists; ARPO branches share their parent up to a tool result."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(4, vocab) for _ in range(k)]  # noqa: E731
    prompt = tok(prompt_len)
    seg = (completion_len - 2 * tool_len) // 3

    def root():
        return tok(seg) + tok(tool_len) + tok(seg) + tok(tool_len) + tok(completion_len - 2 * tool_len - 2 * seg)

    if strategy == "grpo":
        return [(prompt, root()) for _ in range(n)]
    roots = [root() for _ in range(n // 2)]
    branches = []
    for j in range(n - n // 2):
        parent = roots[j % len(roots)]
        cut = (seg + tool_len) if j % 2 == 0 else (2 * seg + 2 * tool_len)  # after the 1st / 2nd tool result
        branches.append(parent[:cut] + tok(rng.randint(completion_len - cut - seg // 2, completion_len - cut)))
    return [(prompt, c) for c in roots + branches]


def trl_layout(rows):
    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, width_p - len(p) : width_p], mask[i, width_p - len(p) : width_p] = torch.tensor(p), 1
        ids[i, width_p : width_p + len(c)], mask[i, width_p : width_p + len(c)] = torch.tensor(c), 1
    return ids, mask, width_c


CHECKPOINTING = {"use_reentrant": False}  # TRL's setting of `gradient_checkpointing_kwargs`


def build_model(hidden: int, layers: int, vocab: int, max_len: int, checkpointing: bool = True):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from appo_trl.tree.attention import install_tree_attention

    heads = max(1, hidden // 64)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                         max_position_embeddings=max_len, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install_tree_attention(model)  # the row-wise path (no tree kwargs) runs plain SDPA through it
    if checkpointing:  # as the trainer does by default (`gradient_checkpointing: true`), on both paths
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
    return model.train()


def forward(model, ids, mask, c, tree: bool, entropy: bool, packs=None):
    """`packs`: the `PackCache` the passes over these rows share (as the trainer's `tree_packs`); None packs afresh."""
    from appo_trl.tree.forward import tree_logps_and_entropies

    if tree:
        logps, ent, _ = tree_logps_and_entropies(
            model, ids, mask, c, compute_entropy=entropy, token_budget=1 << 20, autocast=contextlib.nullcontext,
            packs=packs,
        )  # fmt: skip
        return logps, ent
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-c] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -c:], (out.entropy[:, -c:] if entropy else None)


def saved_bytes(model, fn) -> tuple[int, object]:
    """Bytes of the distinct storages, parameters excluded, that autograd saves for the backward while `fn` runs,
    without activation checkpointing. Counted, not kept: each saved tensor is dropped once recorded (a weak
    reference tells a storage seen before from a new one at a freed address), so the graph `fn` returns cannot run
    backward and the forward costs the memory of a no-grad one."""
    from trl.models.utils import disable_gradient_checkpointing

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, weakref.ref] = {}
    total = 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and (ptr not in seen or seen[ptr]() is not storage):
            seen[ptr] = weakref.ref(storage)
            total += storage.nbytes()

    def unpack(_):
        raise RuntimeError("saved_bytes: the saved tensors were dropped; this graph cannot run backward")

    with disable_gradient_checkpointing(model, CHECKPOINTING), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn()
    return total, out


def measure(model, rows, repeats: int) -> dict:
    ids, mask, c = trl_layout(rows)
    mask_c = mask[:, -c:].float()
    adv = torch.randn(len(rows), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    from appo_trl.tree.forward import PackCache, pack_rows

    packs = PackCache()  # packed once, as the trainer's cache does for a step's passes
    t0 = time.perf_counter()
    tree_tokens = sum(p.unique_tokens for p in pack_rows(ids, mask, c, 1 << 20))
    pack_ms = 1e3 * (time.perf_counter() - t0)  # the host work of a step's first pass over these rows

    def loss_step(tree):
        logps, ent = forward(model, ids, mask, c, tree, entropy=True, packs=packs)
        loss = -((logps * adv + 1e-3 * ent) * mask_c).sum() / mask_c.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    def step(tree):
        with torch.no_grad():
            forward(model, ids, mask, c, tree, entropy=False, packs=packs)
        logps, ent = forward(model, ids, mask, c, tree, entropy=True, packs=packs)
        (-((logps * adv) * mask_c).sum() / mask_c.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"tokens_row": int(ids.numel()), "tokens_tree": tree_tokens, "tokens_ratio": tree_tokens / ids.numel(),
           "pack_ms": pack_ms}  # fmt: skip
    for name, fn in (("loss_step_s", loss_step), ("step_s", step)):
        times = {False: [], True: []}
        for i in range(repeats):
            for tree in (False, True) if i % 2 == 0 else (True, False):
                t0 = time.perf_counter()
                fn(tree)
                times[tree].append(time.perf_counter() - t0)
                gc.collect()  # nothing of one path's step outlives it (outside the timed span)
        out[f"{name}_row"], out[f"{name}_tree"] = (statistics.median(times[k]) for k in (False, True))
        out[f"{name}_ratio"] = out[f"{name}_tree"] / out[f"{name}_row"]
    for tree in (False, True):
        nbytes, _ = saved_bytes(model, lambda t=tree: forward(model, ids, mask, c, t, entropy=True))
        out[f"saved_mb_{'tree' if tree else 'row'}"] = nbytes / 2**20
        del _
        gc.collect()
    out["saved_mb_ratio"] = out["saved_mb_tree"] / out["saved_mb_row"]
    return out


def _spawned(target, *args):
    """Run `target(*args, queue)` in a fresh spawned process and return what it put on the queue."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    while True:  # the result before join (a large one would block the child's exit), and no wait on a dead child
        try:
            result = queue.get(timeout=5)
            break
        except queues.Empty:
            if not proc.is_alive() and queue.empty():
                proc.join()
                raise RuntimeError(f"{target.__name__}{args} exited {proc.exitcode} without a result") from None
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{target.__name__}{args} exited {proc.exitcode}")
    return result


def _peak_child(workload: str, strategy: str, tree: bool, checkpointing: bool, queue) -> None:
    """In a fresh process: build the model and rows, then one loss step; put the step's added peak RSS (MiB)."""
    import resource

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    prompt, n, comp, tool, hidden, layers, vocab = WORKLOADS[workload]
    model = build_model(hidden, layers, vocab, prompt + comp + 8, checkpointing)
    ids, mask, c = trl_layout(group_rows(strategy, prompt, n, comp, tool, vocab, seed=1))
    mask_c, adv = mask[:, -c:].float(), torch.randn(ids.shape[0], 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    logps, ent = forward(model, ids, mask, c, tree, entropy=True)
    (-((logps * adv + 1e-3 * ent) * mask_c).sum() / mask_c.sum()).backward()
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)


def peak_rss_mb(workload: str, strategy: str, checkpointing: bool = True) -> dict:
    """`peak_rss_mb_{row,tree}` and their ratio: each loss step in its own spawned process (see the docstring)."""
    out = {
        f"peak_rss_mb_{'tree' if tree else 'row'}": _spawned(_peak_child, workload, strategy, tree, checkpointing)
        for tree in (False, True)
    }
    # at toy sizes the step fits in memory the build already touched: no added peak, no ratio
    row = out["peak_rss_mb_row"]
    out["peak_rss_mb_ratio"] = out["peak_rss_mb_tree"] / row if row > 0 else None
    return out


def _measure_child(workload: str, strategy: str, repeats: int, checkpointing: bool, queue) -> None:
    """In a fresh process: `measure` one strategy of a workload on its own model; put the figures."""
    prompt, n, comp, tool, hidden, layers, vocab = WORKLOADS[workload]
    model = build_model(hidden, layers, vocab, prompt + comp + 8, checkpointing)
    queue.put(measure(model, group_rows(strategy, prompt, n, comp, tool, vocab, seed=1), repeats))


WORKLOADS = {  # prompt, n, completion, tool result, hidden, layers, vocab
    "a": (1536, 16, 512, 64, 512, 4, 8192),
    "a_quick": (192, 8, 64, 8, 64, 2, 512),
    "b": (200, 4, 96, 12, 128, 2, 512),
}


def tree_figures(
    quick: bool,
    workloads=None,
    strategies=("grpo", "arpo"),
    peak: bool = False,
    repeats: int | None = None,
    checkpointing: bool = True,
) -> dict:
    """`{workload}_{strategy}_{figure}` for workloads (a) (scaled down with `quick`) and (b), GRPO and ARPO; each
    time is the median of `repeats` runs per path (default: 1 for (a) and with `quick`, else 3). Full-size (a) runs
    each strategy in a spawned process (its own model, built from the same seed), the others share one model."""
    figures = {}
    for workload in workloads or ("a_quick" if quick else "a", "b"):
        prompt, n, comp, tool, hidden, layers, vocab = WORKLOADS[workload]
        runs = repeats or (1 if quick or workload == "a" else 3)
        model = None if workload == "a" else build_model(hidden, layers, vocab, prompt + comp + 8, checkpointing)
        for strategy in strategies:
            peaks = peak_rss_mb(workload, strategy, checkpointing) if peak else {}
            if model is None:
                result = _spawned(_measure_child, workload, strategy, runs, checkpointing)
            else:
                result = measure(model, group_rows(strategy, prompt, n, comp, tool, vocab, seed=1), runs)
            result.update(peaks)
            figures.update({f"tree_{workload}_{strategy}_{k}": v for k, v in result.items()})
    return figures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="workload (a) scaled down (prompt 192, completion 64)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), action="append", help="only these (repeatable)")
    ap.add_argument("--strategy", choices=("grpo", "arpo"), action="append", help="only these (repeatable)")
    ap.add_argument("--peak", action="store_true", help="also the process peak RSS of each loss step (spawns)")
    ap.add_argument("--repeats", type=int, help="timed runs per path (medians; default 1 for (a), --quick; else 3)")
    ap.add_argument("--no-checkpointing", action="store_true", help="train without activation checkpointing")
    opts = ap.parse_args(argv)
    if opts.repeats is not None and opts.repeats < 1:
        ap.error(f"--repeats {opts.repeats} must be >= 1")
    strategies = tuple(opts.strategy or ("grpo", "arpo"))
    checkpointing = not opts.no_checkpointing
    figures = tree_figures(opts.quick, opts.workload, strategies, opts.peak, opts.repeats, checkpointing)
    for k, v in figures.items():
        print(f"{k:44s} {v:.4f}" if isinstance(v, float) else f"{k:44s} {v}")
    if opts.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
