"""Trainer benchmark: APPO vs GRPO steps on the same tiny model, data, group size and completion budget.

Generation goes through the fake vLLM server (bench/fake_vllm.py) with a busy-GPU capacity model: continuous
batching with at most 32 sequences decoding at once and 5 ms per decode step. A scripted sampler writes
reasoning segments of 30-70 tokens, two `<python>` calls (tool latency 50-150 ms, scripted) and an answer, so
the CPU time goes to the trainer, which computes real logps, entropies and losses on those tokens. GRPO uses
TRL's importance-sampling setting with vLLM (old logps computed). TRL's weight sync (`VLLMGeneration`) needs
CUDA and is replaced by a no-op recorder.

    python bench/trainer.py [--quick] [--json] [--tree-repeats N]

Figures: `step_time_ratio_appo_vs_grpo` (mean optimizer-step wall time after a warm-up step),
`sampled_tokens_ratio` (policy-sampled tokens per step, branch prefixes not counted), `tool_calls_ratio`,
`loss_rows_ratio` (rows reaching `_compute_loss`), `loss_time_ratio_future_kl_vs_trl` (`_compute_loss`
forward+backward on the same APPO batch, future_kl vs TRL's loss). The benchmark imports only the package and
`bench/` (never `tests/`), so it runs from any checkout; `make test` runs it once with `--quick --json`.
`tree_*` figures: the row-wise and the tree forward side by side (`bench/tree_forward.py`: workload (a) paper-shaped,
scaled down under `--quick`, and (b) the demo's shape, both paths with activation checkpointing as the trainer's
default; full-size (a) runs each strategy in a spawned process); `--tree-repeats N` times each path N times
(medians; default 1 for (a) and under `--quick`, else 3). Peak resident memory of the full run: 4.3 GiB (it
was 20 GB before the tree figures checkpointed and isolated workload (a): docs/benchmarks.md, "Trainer").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from appo_trl.tools.base import ToolResult  # noqa: E402
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy  # noqa: E402

WORDS = "the of a is what who when where capital country river city year born answer question".split()


class LatencyPython:
    """Scripted python tool with 50-150 ms latency (no sandbox: the benchmark measures the trainer)."""

    name, tag = "python", "python"

    def __init__(self, seed=0):
        self.rng, self.calls = random.Random(seed), 0

    async def call(self, text):
        self.calls += 1
        await asyncio.sleep(self.rng.uniform(0.05, 0.15))
        return ToolResult(text="4")

    async def aclose(self):
        pass


def make_script(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    result_id, eos = tok.convert_tokens_to_ids("<result>"), tok.eos_token_id

    def script(ctx, rng):
        turn = ctx.count(result_id)
        body = enc(" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 70))))
        if turn < 2:
            return body + enc(f" <python> print({rng.randint(0, 9)}) </python>")
        return body + enc(f" <answer> {rng.randint(0, 2)} </answer>") + [eos]

    return script


def reward(completions, answer, **kw):
    return [float(f"<answer> {a} </answer>" in c[0]["content"]) for c, a in zip(completions, answer)]


class _ServerInfo:
    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


class NoSyncVLLMGeneration:
    def __init__(self, **kw):
        self.vllm_client, self.syncs = _ServerInfo(), 0

    def sync_weights(self):
        self.syncs += 1


def run(strategy, model_path, tok, url, prompts, n, initial, steps, out_dir, budget):
    import trl.trainer.grpo_trainer as grpo_mod

    from appo_trl.config import APPOConfig
    from appo_trl.rollout import RolloutConfig, RolloutEngine
    from appo_trl.trainer.trainer import APPOTrainer
    from appo_trl.vllm import VLLMServerBackend

    grpo_mod.VLLMGeneration = NoSyncVLLMGeneration
    tool = LatencyPython()
    cfg = RolloutConfig(
        max_completion_length=budget,
        call_limit=3,
        tool_tags=["python"],
        concurrency=512,
        record_entropies=strategy == "appo",
        entropy_topk=10,
    )
    engine = RolloutEngine(VLLMServerBackend(url, max_concurrency=512), tok, cfg, {"python": tool})
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(prompts * steps)],
            "answer": [str(i % 3) for i in range(prompts * steps)],
        }
    )
    spg = 4
    args = APPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-4,
        beta=0.0,
        seed=0,
        loss_type="dapo",
        rollout_strategy=strategy,
        num_generations=n,
        initial_rollouts=initial if strategy == "appo" else n,
        per_device_train_batch_size=prompts * n // spg,
        steps_per_generation=spg,
        gradient_accumulation_steps=spg,
        max_steps=steps,
        max_completion_length=budget,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        tools=["python"],
        min_remaining_tokens=16,
        dataloader_drop_last=True,
    )
    trainer = APPOTrainer(
        model=model_path,
        reward_funcs=[reward],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        rollout_engine=engine,
    )
    rows, batches, marks = [], [], []
    orig = trainer._compute_loss

    def spy(model, inputs):
        rows.append(inputs["completion_ids"].size(0))
        if not batches:
            batches.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
        return orig(model, inputs)

    trainer._compute_loss = spy
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(["begin", time.perf_counter()])

        def on_step_end(self, *a, **k):
            marks.append(["end", time.perf_counter()])

    trainer.add_callback(Clock())
    trainer.train()
    step_times = [e[1] - b[1] for b, e in zip(marks[::2], marks[1::2])]
    hist = [h for h in trainer.state.log_history if "rollout/sampled_tokens" in h]
    engine.close()
    return (
        trainer,
        {
            "step_time_s": statistics.mean(step_times[1:] or step_times),
            "step_times_s": step_times,
            "sampled_tokens_per_step": statistics.mean(h["rollout/sampled_tokens"] for h in hist),
            "tool_calls_per_step": tool.calls / steps,
            "loss_rows_per_step": sum(rows) / steps,
        },
        batches[0],
    )


def loss_times(trainer, batch, repeats):
    """Median `_compute_loss` forward+backward time of TRL's loss and of future_kl, interleaved on one batch."""
    from trl import GRPOTrainer

    from appo_trl.trainer.loss import compute_policy_loss

    trainer.args.loss_mode = "future_kl"
    trainer.model.train()
    fns = {
        "trl": lambda: GRPOTrainer._compute_loss(trainer, trainer.model, batch),
        "future_kl": lambda: compute_policy_loss(trainer, trainer.model, batch),
    }
    times = {k: [] for k in fns}
    for i in range(repeats + 1):
        for key in ("trl", "future_kl") if i % 2 == 0 else ("future_kl", "trl"):
            t0 = time.perf_counter()
            fns[key]().backward()
            if i:  # the first round warms up both
                times[key].append(time.perf_counter() - t0)
            trainer.model.zero_grad(set_to_none=True)
    return statistics.median(times["trl"]), statistics.median(times["future_kl"])


# ---- overlap: synchronous vs max_staleness 1 and 2 (issue 23) -----------------------------------------------
def overlap_script(tok):
    """Three segments of 30-70 tokens: a `<python>` call, a `<search>` call, then an answer (bench/rollout.py's
    tool latencies: python 50 ± 20 ms, search lognormal with median 300 ms, sigma 0.7)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    result_id, eos = tok.convert_tokens_to_ids("<result>"), tok.eos_token_id

    def script(ctx, rng):
        turn = ctx.count(result_id)
        body = enc(" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 70))))
        if turn == 0:
            return body + enc(f" <python> print({rng.randint(0, 9)}) </python>")
        if turn == 1:
            return body + enc(f" <search> q{rng.getrandbits(32)} </search>")
        return body + enc(f" <answer> {rng.randint(0, 2)} </answer>") + [eos]

    return script


def run_overlap(k, model_path, tok, server, prompts, n, steps, out_dir, budget):
    """One GRPO run with `max_staleness: k` on the fake server: per-step wall time, trainer and server idle."""
    import threading

    import trl.trainer.grpo_trainer as grpo_mod
    from transformers import TrainerCallback

    from appo_trl.config import APPOConfig
    from appo_trl.rollout import RolloutConfig, RolloutEngine
    from appo_trl.trainer.trainer import APPOTrainer
    from appo_trl.vllm import VLLMServerBackend
    from bench.rollout import SimTool

    grpo_mod.VLLMGeneration = NoSyncVLLMGeneration
    cfg = RolloutConfig(max_completion_length=budget, call_limit=3, tool_tags=["python", "search"], concurrency=512)
    tools = {"python": SimTool("python"), "search": SimTool("search")}
    engine = RolloutEngine(VLLMServerBackend(server.url, max_concurrency=512), tok, cfg, tools)
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"what is {i} times 4"}] for i in range(prompts * steps)],
            "answer": [str(i % 3) for i in range(prompts * steps)],
        }
    )
    spg = 2
    args = APPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, learning_rate=1e-5, beta=0.0, seed=0, loss_type="dapo",
        rollout_strategy="grpo", num_generations=n, per_device_train_batch_size=prompts * n // spg,
        steps_per_generation=spg, gradient_accumulation_steps=spg, max_steps=steps, max_completion_length=budget,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, tools=["python"],
        dataloader_drop_last=True, max_staleness=k, weight_sync_steps=1,
        vllm_importance_sampling_mode="token_truncate",
    )  # fmt: skip
    trainer = APPOTrainer(
        model=model_path, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok,
        rollout_engine=engine,
    )  # fmt: skip
    waited = [0.0]  # trainer-thread seconds spent generating or waiting for a background round
    generate = trainer.strategy.generate

    def timed(*a, **kw):
        if threading.current_thread() is not threading.main_thread():
            return generate(*a, **kw)
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            waited[0] += time.perf_counter() - t0

    trainer.strategy.generate = timed
    marks = []

    def mark():
        wait = waited[0] + (trainer.rounds.async_rounds.wait_s if trainer.rounds.async_rounds is not None else 0.0)
        marks.append((time.perf_counter(), wait, server.busy_s()))

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            mark()

        def on_step_end(self, *a, **kw):
            mark()

    trainer.add_callback(Clock())
    trainer.train()
    engine.close()
    spans = [(b, e) for b, e in zip(marks[::2], marks[1::2])][1:]  # step 1 is synchronous in every mode
    wall = sum(e[0] - b[0] for b, e in spans)
    gen = [e[1] - b[1] for b, e in spans]
    train = [e[0] - b[0] - g for (b, e), g in zip(spans, gen)]
    return {
        "step_time_s": wall / len(spans),
        "median_generation_wait_s": statistics.median(gen),
        "median_trainer_busy_s": statistics.median(train),
        "step_times_s": [round(e[0] - b[0], 4) for b, e in zip(marks[::2], marks[1::2])],
        "trainer_idle_frac": sum(e[1] - b[1] for b, e in spans) / wall,
        "server_idle_frac": 1.0 - sum(e[2] - b[2] for b, e in spans) / wall,
        "weight_syncs": trainer.vllm_generation.num_syncs,
        "max_staleness_seen": max((h.staleness for h in trainer.rounds.async_rounds.history), default=0)
        if trainer.rounds.async_rounds is not None
        else 0,
    }


def overlap_figures(model_path, tok, quick: bool, tmp: str) -> dict:
    """Synchronous vs `max_staleness` 1 and 2, one after another on the same workload and server.

    Full mode trains a wider model (hidden 256, 4 layers: on a quiet 2-core CPU the demo-sized model trains a
    step in about 0.3 s, below the tool latencies' floor on generation, so no decode time could balance the two),
    then calibrates the server's decode time per token on a 4-step synchronous run, so that a round's generation
    takes about as long as its training on this machine (measured, then scaled).
    """
    prompts, n, steps, budget, decode_s = (1, 4, 2, 128, 0.004) if quick else (2, 8, 6, 256, 0.01)
    out = {"overlap_prompts_per_step": prompts, "overlap_n": n, "overlap_steps": steps}
    if not quick:
        from appo_trl.tiny import build_tiny_model

        model_path = build_tiny_model(os.path.join(tmp, "overlap-model"), hidden_size=256, num_layers=4)
        out["overlap_model"] = "hidden 256, 4 layers"
    policy = ScriptedPolicy(tok, overlap_script(tok))
    with FakeVLLMServer(policy, tok, decode_step_s=decode_s, max_num_seqs=32) as server:
        if not quick:
            cal = run_overlap(0, model_path, tok, server, prompts, n, 4, os.path.join(tmp, "overlap-cal"), budget)
            ratio = cal["median_trainer_busy_s"] / max(cal["median_generation_wait_s"], 1e-3)
            decode_s = min(max(decode_s * ratio, 0.001), 0.5)
            server.decode_step_s = decode_s
        out["overlap_decode_step_s"] = decode_s
        for k in (0, 1) if quick else (0, 1, 2):
            res = run_overlap(k, model_path, tok, server, prompts, n, steps, os.path.join(tmp, f"overlap{k}"), budget)
            out.update({f"overlap_k{k}_{key}": v for key, v in res.items()})
    idle = out["overlap_k0_trainer_idle_frac"]
    out["overlap_generation_vs_training_sync"] = idle / max(1 - idle, 1e-9)
    for k in (1,) if quick else (1, 2):
        out[f"overlap_step_time_ratio_k{k}_vs_sync"] = out[f"overlap_k{k}_step_time_s"] / out["overlap_k0_step_time_s"]
    return out


def tree_forward_figures(quick: bool, repeats: int | None = None) -> dict:
    """Row-wise against tree forward (`bench/tree_forward.py`): tokens, loss-step and step time, saved activations."""
    from bench.tree_forward import tree_figures

    return tree_figures(quick, repeats=repeats)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts per step, n = 8 (4 initial), 2 steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the figures as the last line")
    ap.add_argument("--overlap-only", action="store_true", help="only the sync vs max_staleness comparison")
    ap.add_argument("--tree-repeats", type=int, help="tree_* figures: timed runs per path (medians)")
    opts = ap.parse_args(argv)
    if opts.tree_repeats is not None and opts.tree_repeats < 1:
        ap.error(f"--tree-repeats {opts.tree_repeats} must be >= 1")
    tmp = tempfile.mkdtemp(prefix="bench-trainer-")
    try:
        return _figures(opts, tmp)
    finally:  # the tiny model, the runs' outputs: removed after an error or Ctrl-C too
        shutil.rmtree(tmp, ignore_errors=True)


def _figures(opts, tmp: str):
    prompts, n, initial, steps, budget = (4, 8, 4, 2, 256) if opts.quick else (16, 16, 8, 3, 320)
    torch.manual_seed(0)
    from appo_trl.tiny import build_tiny_model

    model_path = build_tiny_model(os.path.join(tmp, "tiny"))
    tok = AutoTokenizer.from_pretrained(model_path)
    policy = ScriptedPolicy(tok, make_script(tok))
    figures = {
        "prompts_per_step": prompts,
        "n": n,
        "initial_rollouts": initial,
        "steps": steps,
        "completion_budget": budget,
    }
    if opts.overlap_only:
        figures.update(overlap_figures(model_path, tok, opts.quick, tmp))
        return _print(figures, opts)
    with FakeVLLMServer(policy, tok, decode_step_s=0.005, max_num_seqs=32) as server:
        results = {}
        for strategy in ("grpo", "appo"):
            trainer, results[strategy], batch = run(
                strategy, model_path, tok, server.url, prompts, n, initial, steps, os.path.join(tmp, strategy), budget
            )
            if strategy == "appo":
                appo_trainer, appo_batch = trainer, batch
    g, a = results["grpo"], results["appo"]
    figures.update({f"{k}_{s}": v for s in results for k, v in results[s].items()})
    figures["step_time_ratio_appo_vs_grpo"] = a["step_time_s"] / g["step_time_s"]
    figures["sampled_tokens_ratio"] = a["sampled_tokens_per_step"] / g["sampled_tokens_per_step"]
    figures["tool_calls_ratio"] = a["tool_calls_per_step"] / g["tool_calls_per_step"]
    figures["loss_rows_ratio"] = a["loss_rows_per_step"] / g["loss_rows_per_step"]
    t_trl, t_fkl = loss_times(appo_trainer, appo_batch, 3 if opts.quick else 10)
    figures.update(loss_time_trl_s=t_trl, loss_time_future_kl_s=t_fkl, loss_time_ratio_future_kl_vs_trl=t_fkl / t_trl)
    del trainer, batch, appo_trainer, appo_batch  # nothing of the trainer runs stays resident for what follows
    gc.collect()
    figures.update(tree_forward_figures(opts.quick, opts.tree_repeats))  # row-wise vs tree, workloads (a), (b)
    figures.update(overlap_figures(model_path, tok, opts.quick, tmp))
    _print(figures, opts)


def _print(figures, opts):
    for k, v in figures.items():
        if not isinstance(v, list):
            print(f"{k:40s} {v:.4f}" if isinstance(v, float) else f"{k:40s} {v}")
    if opts.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
