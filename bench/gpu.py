"""GPU benchmark of the tree forward against the row-wise forward, every kernel path side by side in one process.

    python bench/gpu.py [--json] [--out gpu.json] [--quick] [--budget-s 280]

Workload (a) of `bench/tree_forward.py` (prompt 1,536, n = 16, completions 512 with two tool results of 64 tokens;
GRPO: 16 independent rows, ARPO: 8 roots and 8 branches) on a random-init Qwen3-1.7B config in bf16 (built
locally, nothing downloaded), with and without gradient checkpointing. For the row-wise forward and each tree
kernel available (`torch_varlen`: PyTorch's varlen FlashAttention, `flash_attn`, `flex`: FlexAttention,
`segment`: per-segment SDPA), each forced in turn:
- `tokens`: tokens forwarded (row-wise: B x padded length; tree: unique tokens of the tries);
- `loss_step_s`: forward + backward of a policy-gradient loss over per-token logps and entropies;
- `step_s`: the whole step, TRL's no-grad old-logp pass + the loss step + AdamW;
- `peak_gib`: peak CUDA memory of the loss step (weights, gradients and optimizer state included);
- row-wise only: `tflops`, 6 x parameters x tokens / loss step time.
Each time is the median of 2 timed runs after 1 warm-up run (`--repeats`). An out-of-memory cell is recorded as
`"oom"`, never fatal. Then the four tiny recipes (`recipes/tiny/{grpo,arpo,aepo,appo}.yaml`) train 5 steps on CUDA
in bf16, each in its own process, the four side by side (to fit the budget), then (`--recipes-on-cpu`, the default)
the same on this machine's CPU in float32: `recipe_<name>_step_s` is the median step time after the first step,
`_step_s_after2` after the first two, `recipe_<name>_cuda_over_cpu` the CUDA / CPU ratio of the latter, and `_steps`
the per-step breakdown of `bench/recipe_probe.py` (sampler forwards, tree forwards, host syncs, compilations).
The recipes need TRL and the `datasets` package; without them they are skipped with one line.

Results go to `--out` (JSON, rewritten after every measured cell, so a run cut short keeps what it measured) and,
with `--json`, as one JSON object on the last line of stdout. Sections that would start after `--budget-s` seconds
are skipped and say so: the default fits one H100 or H200 in under 5 minutes. Without CUDA the benchmark prints one
line and exits 0; `--quick` then runs a scaled-down smoke of the same code on CPU (row-wise and the per-segment
path only), which is what `make test` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench.tree_forward import group_rows, trl_layout  # noqa: E402

QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)  # fmt: skip
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
WORKLOAD = {"full": (1536, 16, 512, 64), "quick": (64, 4, 32, 4)}  # prompt, n, completion, tool result
RECIPES = ("grpo", "arpo", "aepo", "appo")
KERNELS = ("torch_varlen", "flash_attn", "flex", "segment")


class Results:
    """The figures so far; rewritten to `path` after every cell."""

    def __init__(self, path: str | None):
        self.path, self.data = path, {}

    def update(self, **figures):
        self.data.update(figures)
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def kernel(name: str):
    """Force one tree kernel (the ones before it in the order absent); `row` changes nothing."""
    import appo_trl.tree.attention as ta

    saved = {k: getattr(ta, k) for k in ("_torch_varlen", "_flash_varlen", "_on_gpu")}
    try:
        if name in ("flash_attn", "flex", "segment"):
            ta._torch_varlen = lambda: None
        if name in ("flex", "segment"):
            ta._flash_varlen = lambda: None
        if name == "segment":
            ta._on_gpu = lambda query: False
        yield
    finally:
        for k, v in saved.items():
            setattr(ta, k, v)


def available_kernels(cuda: bool) -> list[str]:
    """The tree kernels this machine has, in the dispatch order; one line for each one it lacks."""
    import appo_trl.tree.attention as ta

    if not cuda:
        return ["segment"]
    have = {"torch_varlen": ta._torch_varlen() is not None, "flash_attn": ta._flash_varlen() is not None,
            "flex": ta._flex() is not None, "segment": True}  # fmt: skip
    for k, ok in have.items():
        if not ok:
            print(f"kernel {k}: not available here, not measured", flush=True)
    return [k for k, ok in have.items() if ok]


def build_model(config: dict, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from appo_trl.tree.attention import install_tree_attention

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the training dtype, on the device: no float32 copy
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="sdpa"))  # RoPE buffers stay fp32
    finally:
        torch.set_default_dtype(default)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install_tree_attention(model)  # the row-wise path (no tree layout) runs plain SDPA through it
    return model


def forward(model, ids, mask, c, tree: bool, entropy: bool, packs=None):
    from appo_trl.tree.forward import tree_logps_and_entropies

    if tree:
        logps, ent, _ = tree_logps_and_entropies(
            model, ids, mask, c, compute_entropy=entropy, token_budget=1 << 20, packs=packs
        )
        return logps, ent
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-c] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -c:], (out.entropy[:, -c:] if entropy else None)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, allocator, the varlen probe)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cell(model, opt, ids, mask, c, tree: bool, repeats: int, cuda: bool) -> dict:
    from appo_trl.tree.forward import PackCache

    packs = PackCache()  # the trainer's own cache: a step's passes over its rows share the tries

    mask_c = mask[:, -c:].float()
    adv = torch.randn(ids.size(0), 1, device=ids.device)

    def loss_step():
        logps, ent = forward(model, ids, mask, c, tree, entropy=True, packs=packs)
        (-((logps.float() * adv + 1e-3 * ent.float()) * mask_c).sum() / mask_c.sum()).backward()
        model.zero_grad(set_to_none=True)

    def step():
        packs.clear()  # a training step packs its rows once: in its first pass
        with torch.no_grad():
            forward(model, ids, mask, c, tree, entropy=False, packs=packs)
        logps, ent = forward(model, ids, mask, c, tree, entropy=True, packs=packs)
        (-((logps.float() * adv) * mask_c).sum() / mask_c.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"loss_step_s": timed(loss_step, repeats)}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        loss_step()
        sync()
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["step_s"] = timed(step, repeats)
    return out


def workload_a(res: Results, quick: bool, cuda: bool, repeats: int, deadline: float, strategies) -> None:
    from appo_trl.tree.forward import pack_rows

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = QUICK if quick else QWEN3_1_7B
    prompt, n, comp, tool = WORKLOAD["quick" if quick else "full"]
    model = build_model(config, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():  # the optimizer state exists before the first cell: every peak includes it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    kernels = available_kernels(cuda)
    res.update(model="Qwen3-1.7B config, random init" if not quick else "tiny Qwen3 (quick)", dtype=str(dtype),
               params=params, kernels=kernels, workload=dict(prompt=prompt, n=n, completion=comp, tool=tool))  # fmt: skip
    for strategy in strategies:
        rows = group_rows(strategy, prompt, n, comp, tool, config["vocab_size"], seed=1)
        ids, mask, c = trl_layout(rows)
        tree_tokens = sum(p.unique_tokens for p in pack_rows(ids, mask, c, 1 << 20))
        ids, mask = ids.to(device), mask.to(device)
        res.update(**{f"{strategy}_tokens_row": int(ids.numel()), f"{strategy}_tokens_tree": tree_tokens,
                      f"{strategy}_tokens_ratio": tree_tokens / ids.numel()})  # fmt: skip
        for ckpt in (False, True):
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            model.train()
            tag = f"{strategy}_{'gc' if ckpt else 'nogc'}"
            for path in ("row", *kernels):
                cell = f"{tag}_{path}"
                if time.monotonic() > deadline:
                    res.update(**{f"{cell}_skipped": "time budget"})
                    print(f"{cell}: skipped (time budget)", flush=True)
                    continue
                try:
                    with kernel(path):
                        figures = measure_cell(model, opt, ids, mask, c, path != "row", repeats, cuda)
                except torch.OutOfMemoryError:
                    figures = {"loss_step_s": "oom"}
                    opt.zero_grad(set_to_none=True)
                    model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.empty_cache()
                if path == "row" and isinstance(figures["loss_step_s"], float):
                    figures["tflops"] = 6 * params * ids.numel() / figures["loss_step_s"] / 1e12
                if path == "torch_varlen":  # its one-time check: None = passed, else why it did not serve
                    import appo_trl.tree.attention as ta

                    figures["check"] = "passed" if all(v is None for v in ta._PROBED.values()) else str(ta._PROBED)
                res.update(**{f"{cell}_{k}": v for k, v in figures.items()})
                print(f"{cell:28s} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in figures.items()), flush=True)  # fmt: skip
    del model, opt
    if cuda:
        torch.cuda.empty_cache()


PER_STEP = ("step_s", "decode_forwards", "decode_s", "tree_forwards", "tree_s", "host_syncs", "compiles",
            "triton_kernels")  # fmt: skip
PROBE = "import sys; sys.path.insert(0, sys.argv[1]); from bench.recipe_probe import run; sys.exit(run(sys.argv[2:]))"


def recipe_steps(res: Results, deadline: float, steps: int = 5, cuda: bool = True) -> None:
    """The four tiny recipes, `steps` steps each, in bf16 on CUDA (or float32 on the CPU: `recipe_cpu_<name>_*`); four
    processes side by side, so that they fit the time budget (tiny models: the per-call overheads on the host
    dominate). Each runs under `bench/recipe_probe.py`, which records per step the sampler's sequential forwards,
    the tree forwards, host syncs and compilations. One line if they cannot run."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        res.update(recipes_skipped=f"needs TRL and datasets ({exc})")
        print(f"tiny recipes: skipped, {exc}", flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="appo-gpu-bench-") as work:  # removed after an error too
        _run_recipes(res, deadline, steps, cuda, work)


def _run_recipes(res: Results, deadline: float, steps: int, cuda: bool, work: str) -> None:
    from appo_trl.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(work, "tiny-qwen3"))
    device = ["--use_cpu", "false", "--bf16", "true", "--dtype", "bfloat16"] if cuda else \
        ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32"]  # fmt: skip
    tag = "recipe" if cuda else "recipe_cpu"
    procs = {}
    t0 = time.monotonic()
    for name in RECIPES:
        probe = os.path.join(work, f"{name}-{tag}.json")
        cmd = [sys.executable, "-c", PROBE, ROOT, probe, "--config", os.path.join(ROOT, "recipes/tiny", f"{name}.yaml"),
               "--model_name_or_path", model_dir, "--output_dir", os.path.join(work, f"{name}-{tag}"), *device,
               "--max_steps", str(steps), "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1",
               "--tool_config", json.dumps({"python": {"isolation": "none"}})]  # fmt: skip
        log = open(os.path.join(work, f"{name}-{tag}.log"), "w")
        env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(work, f"{name}-{tag}-triton")}  # counted per step
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env), log, probe)
    for name, (proc, log, probe) in procs.items():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        wall = time.monotonic() - t0
        if proc.returncode != 0 or not os.path.exists(probe):
            with open(log.name) as f:
                last = ([ln for ln in f.read().splitlines() if ln.strip()] or ["?"])[-1][:300]
            why = "killed at the time budget" if proc.returncode == -9 else last
            res.update(**{f"{tag}_{name}_error": why})
            print(f"{tag} {name}: failed ({why})", flush=True)
            continue
        with open(probe) as f:
            per_step = json.load(f)
        times = per_step.get("step_s", [])
        figures = {"first_step_s": times[0] if times else None, "wall_s": wall,
                   "step_s": statistics.median(times[1:]) if len(times) > 1 else None,  # as in the first H200 run
                   "step_s_after2": statistics.median(times[2:]) if len(times) > 2 else None,
                   "steps": per_step}  # fmt: skip
        res.update(**{f"{tag}_{name}_{k}": v for k, v in figures.items()})
        print(f"{tag} {name:5s} " + "  ".join(f"{k}={v:.3g}" for k, v in figures.items() if isinstance(v, float)),
              flush=True)  # fmt: skip
        for key in PER_STEP:
            print(f"    {key:15s} " + " ".join(f"{v:.3g}" for v in per_step.get(key, [])), flush=True)
        for line in per_step.get("tree_attention", [])[:4]:
            print(f"    tree attention: {line[:160]}", flush=True)


def recipes_against_cpu(res: Results) -> None:
    """`recipe_<name>_cuda_over_cpu`: the CUDA step after warm-up over the CPU step (the goal: at most 2)."""
    for name in RECIPES:
        gpu, cpu = res.data.get(f"recipe_{name}_step_s_after2"), res.data.get(f"recipe_cpu_{name}_step_s_after2")
        if isinstance(gpu, float) and isinstance(cpu, float) and cpu > 0:
            res.update(**{f"recipe_{name}_cuda_over_cpu": gpu / cpu})
            print(f"recipe {name:5s} CUDA / CPU step: {gpu / cpu:.2f} ({gpu:.3g} s vs {cpu:.3g} s)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a scaled-down smoke run (on CPU without CUDA)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    ap.add_argument("--out", help="write the figures here as JSON, after every measured cell")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell after one warm-up (median)")
    ap.add_argument("--budget-s", type=float, default=280.0, help="start no section after this many seconds")
    ap.add_argument("--strategy", choices=("grpo", "arpo"), action="append", help="only these (repeatable)")
    ap.add_argument("--no-recipes", action="store_true", help="skip the tiny recipes")
    ap.add_argument("--recipes-on-cpu", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the tiny recipes on this machine's CPU, for the CUDA / CPU step ratio")  # fmt: skip
    opts = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not opts.quick:
        line = "bench/gpu.py: no CUDA device here; nothing measured (run it on a GPU, or --quick for a CPU smoke)."
        print(json.dumps({"cuda": False, "note": line}) if opts.json else line)
        return 0
    start = time.monotonic()
    res = Results(opts.out)
    import transformers

    res.update(cuda=cuda, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               transformers=transformers.__version__, quick=opts.quick, repeats=opts.repeats)  # fmt: skip
    workload_a(res, opts.quick, cuda, opts.repeats, start + opts.budget_s, opts.strategy or ("grpo", "arpo"))
    if opts.quick or opts.no_recipes or not cuda:
        res.update(recipes_skipped="--quick" if opts.quick else "--no-recipes" if opts.no_recipes else "no CUDA")
        print(f"tiny recipes: skipped ({res.data['recipes_skipped']})", flush=True)
    else:
        recipe_steps(res, start + opts.budget_s)
        if opts.recipes_on_cpu and time.monotonic() < start + opts.budget_s:
            recipe_steps(res, start + opts.budget_s, cuda=False)
            recipes_against_cpu(res)
    res.update(total_s=time.monotonic() - start)
    print_table(res.data)
    print_goals(res.data)
    if opts.json:
        print(json.dumps(res.data))
    return 0


def print_table(d: dict) -> None:
    """Tree / row-wise ratios per strategy, checkpointing and kernel."""
    print("\n| cell | tokens | loss step | whole step | peak memory |\n|---|---|---|---|---|")
    for key in sorted(k for k in d if k.endswith("_loss_step_s") and "_row_" not in k and not k.startswith("recipe")):
        cell = key[: -len("_loss_step_s")]
        strategy, gc, path = cell.split("_", 2)
        row = f"{strategy}_{gc}_row"

        def ratio(fig, cell=cell, row=row):
            a, b = d.get(f"{cell}_{fig}"), d.get(f"{row}_{fig}")
            if isinstance(a, float) and isinstance(b, float) and b > 0:
                return f"{a / b:.3f} ({a:.3g} vs {b:.3g})"
            return f"{a} vs {b}"

        tokens = f"{d.get(f'{strategy}_tokens_ratio', float('nan')):.3f}"
        print(f"| {cell} | {tokens} | {ratio('loss_step_s')} | {ratio('step_s')} | {ratio('peak_gib')} |")


GOALS = {("grpo", "nogc", "loss_step_s"): 0.40, ("arpo", "nogc", "loss_step_s"): 0.32, ("grpo", "nogc", "step_s"): 0.45,
         ("arpo", "nogc", "step_s"): 0.38, ("grpo", "gc", "loss_step_s"): 0.45, ("arpo", "gc", "loss_step_s"): 0.38}  # fmt: skip


def print_goals(d: dict) -> None:
    """The issue's goals against the best tree kernel of this run (tree / row-wise), and the recipes' CUDA / CPU."""
    print("\n| goal | best kernel | tree / row-wise | limit | met |\n|---|---|---|---|---|")
    for (strategy, gc, fig), limit in GOALS.items():
        row = d.get(f"{strategy}_{gc}_row_{fig}")
        cells = {k: d.get(f"{strategy}_{gc}_{k}_{fig}") for k in KERNELS}
        cells = {k: v / row for k, v in cells.items() if isinstance(v, float) and isinstance(row, float) and row > 0}
        if cells:
            best = min(cells, key=cells.get)
            print(f"| {strategy} {gc} {fig} | {best} | {cells[best]:.3f} | {limit} | {cells[best] <= limit} |")
    for name in RECIPES:
        ratio = d.get(f"recipe_{name}_cuda_over_cpu")
        if isinstance(ratio, float):
            print(f"| recipe {name} CUDA / CPU step | - | {ratio:.2f} | 2 | {ratio <= 2} |")


if __name__ == "__main__":
    sys.exit(main())
