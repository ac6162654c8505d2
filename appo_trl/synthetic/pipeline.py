"""The stages `appo demo` and `appo study` chain on the synthetic task: model, SFT, search server, eval, RL, plot.

- `search_server(corpus)`: `appo serve-search` as a subprocess on 127.0.0.1 on a free port, always stopped
  (`appo_trl.tools.search_process`).
- `build_model(dir, seed)`: the tiny Qwen3 at the demo size (explicit sizes, `appo_trl.tiny.build_tiny_model`).
- `run_sft(...)`: the cold start through `appo_trl.stages.sft.main` on the task's SFT traces.
- `evaluate_heldout(...)`: `appo eval` (`appo_trl.evaluation.evaluate`, in-process transformers backend, the
  real python sandbox and search tool) on the held-out split; returns pass@1, pass@k and tool calls per sample.
- `run_rl(...)`: `appo_trl.stages.train`'s trainer on a `recipes/demo/<strategy>.yaml` recipe, with one short console
  line per step instead of TRL's metric dictionaries, and checkpoints saved at the given steps.

Nothing here tunes anything or picks a seed: every number comes from the arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from appo_trl.tools.search_process import free_port, search_server  # noqa: F401 - the demo's stages

# the demo model: big enough to learn copying in a few hundred SFT steps, small enough for seconds per RL step
MODEL_SIZE = {"num_layers": 2, "hidden_size": 128, "vocab_size": 512, "max_position_embeddings": 1024}
# attention: 4 heads of 64 dims, so that a head can attend sharply to one earlier position (Qwen3 normalises q
# and k, which caps attention logits near sqrt(head_dim)). Measured, 600 SFT steps, held-out pass@1: 16-dim heads
# 0.3 % (2 or 4 layers, copying never learned); 64-dim heads 15.6 % (2 layers), 12.2 % (4 layers).
ATTENTION = {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
SEARCH_TOOL = {"backend": "local", "max_results": 1, "cache": False}  # every query reaches the server


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in the main thread, so `search_server` and other `finally` blocks run."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def build_model(out_dir: str, seed: int) -> str:
    """The tiny Qwen3 at `MODEL_SIZE`, with a tokenizer whose pre-tokenizer isolates spaces, digits and
    punctuation, and with the name syllables of the task as tokens: a number or a name is then the same token
    sequence in the question, the tool call, the tool result and the answer, so the copying the task needs is an
    identity map that a tiny model learns in minutes. (`build_tiny_model`'s vocabulary and merges are kept.)"""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from appo_trl.synthetic.task import SYLLABLES
    from appo_trl.tiny import build_tiny_model

    build_tiny_model(out_dir, seed=seed, **MODEL_SIZE)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation("isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.add_tokens(SYLLABLES, special_tokens=False)
    tok.save_pretrained(out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    config.update({**ATTENTION, "vocab_size": len(tok)})  # set here whatever build_tiny_model's defaults are
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = AutoModelForCausalLM.from_pretrained(out_dir).generation_config
    model.save_pretrained(out_dir)
    return out_dir


def run_sft(model: str, data: str, out_dir: str, *, steps: int, seed: int, lr: float = 3e-3, batch: int = 8,
            max_length: int | None = None, schedule: str | None = None, printer=None,
            callbacks: list | None = None) -> str:  # fmt: skip
    """The SFT cold start; with `printer`, a progress line (steps/s, ETA, loss) at most every 20 s.
    `callbacks`: more `TrainerCallback`s (the cold-start guard reads the loss through one).

    `max_length`: tokens per trace (default: `recipes/demo/sft.yaml`'s, which fits the demo's families; the SFT
    stage refuses a trace it would truncate). `schedule`: the learning-rate schedule (transformers'
    `lr_scheduler_type`; default: the recipe's, `cosine`)."""
    from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
    from appo_trl.reporting.console import ProgressLineCallback
    from appo_trl.stages import sft

    args = parse_recipe(sft.dataclass_types(), [
        "--config", str(REPO_ROOT / "recipes" / "demo" / "sft.yaml"), "--model_name_or_path", model,
        "--dataset_name", data, "--output_dir", out_dir, "--max_steps", str(steps), "--seed", str(seed),
        "--learning_rate", str(lr), "--per_device_train_batch_size", str(batch),
        "--logging_steps", str(max(1, min(50, steps // 10))),  # the loss on the progress line
        *(["--max_length", str(max_length)] if max_length else []),
        *(["--lr_scheduler_type", schedule] if schedule else []),
    ])  # fmt: skip
    callbacks = [*(callbacks or []), *([ProgressLineCallback("SFT", _through_stdout(printer))] if printer else [])]
    with _quiet():
        sft.main(*args, callbacks=callbacks or None)
    return out_dir


def _through_stdout(printer):
    """`printer`, writing to the stdout of now even while `_quiet` sends the libraries' prints to /dev/null."""
    stream = sys.stdout

    def say(msg: str) -> None:
        with contextlib.redirect_stdout(stream):
            printer(msg)

    return say


def evaluate_heldout(model: str, registry: str, url: str, out_dir: str, *, num_samples: int, seed: int,
                     max_completion_length: int = 128, temperature: float = 1.0, call_limit: int = 3,
                     printer=None) -> dict:  # fmt: skip
    """`appo eval` of `model` on the held-out split; returns the headline numbers (and writes report.json).

    With `printer`, a progress line (samples/s, ETA) at most every 20 s.
    """
    from appo_trl.evaluation import evaluate
    from appo_trl.evaluation.config import EvalConfig
    from appo_trl.evaluation.inference import build_generator
    from appo_trl.reporting.console import ProgressLine

    config = EvalConfig(
        benchmarks=["synthetic"], registry=registry, output_dir=out_dir, model=model, backend="transformers",
        num_samples=num_samples, seed=seed, temperature=temperature, top_p=1.0, top_k=-1,
        max_completion_length=max_completion_length, max_model_len=1024, call_limit=call_limit,
        tool_config={"search": {**SEARCH_TOOL, "url": url}}, concurrency=16,
    )  # fmt: skip
    lines: list[ProgressLine] = []

    def progress(done: int, total: int) -> None:
        if not lines:
            lines.append(ProgressLine("eval", total, unit="samples", printer=_through_stdout(printer)))
        lines[0].update(done)

    with _quiet():
        report = evaluate(config, build_generator(config), show_progress=False, progress=progress if printer else None)
    r = report["benchmarks"]["synthetic"]
    ks = sorted(int(k) for k in r["pass@k"])
    stats = r["tools_stats"]
    return {
        "pass@1": r["pass@k"]["1"],
        "pass@k": r["pass@k"][str(ks[-1])],
        "k": ks[-1],
        "questions": r["questions"],
        "calls_per_sample": stats["calls_per_sample"],
        "calls_by_tool": stats["calls_per_sample_by_tool"],
        "failed_call_share": stats["failed_call_share"],
        **heldout_breakdown(out_dir, registry),
    }


def heldout_breakdown(out_dir: str, registry: str) -> dict[str, float | dict[str, float]]:
    """From the stored samples: pass@1 per question family (`by_family`, em of the extracted answer), python and
    search calls per sample per family (`calls_by_family`), and the mean training reward of the held-out samples
    (`reward`, ARPO's `compute_score`, the RL reward: -1 bad format, else F1, +0.1 with both tools), so that the
    training reward and the held-out split can be read in the same units."""
    from appo_trl.evaluation.metrics import extract_prediction
    from appo_trl.rewards.deep_research import compute_score
    from appo_trl.rewards.qa import exact_match

    heldout = json.loads(Path(registry).read_text())["benchmarks"]["synthetic"]["path"]
    rows = [json.loads(line) for line in Path(heldout).read_text().splitlines() if line.strip()]
    hits: dict[str, list[float]] = {}
    calls: dict[str, list[dict[str, int]]] = {}
    rewards: list[float] = []
    for line in Path(out_dir, "samples.jsonl").read_text().splitlines():
        rec = json.loads(line)
        row = rows[rec["index"]]
        hits.setdefault(row["family"], []).append(exact_match(extract_prediction(rec["completion"]), row["answer"]))
        tags = [c["tag"] for c in rec.get("tool_calls", [])]
        calls.setdefault(row["family"], []).append({t: tags.count(t) for t in ("python", "search")})
        rewards.append(compute_score(rec["completion"], row["answer"]))
    return {
        "by_family": {f: sum(v) / len(v) for f, v in sorted(hits.items())},
        "calls_by_family": {
            f: {t: sum(c[t] for c in v) / len(v) for t in ("python", "search")} for f, v in sorted(calls.items())
        },
        "reward": sum(rewards) / len(rewards) if rewards else None,
    }


@contextlib.contextmanager
def _quiet():
    """Library loggers down to warnings while a stage runs (the demo prints its own progress lines)."""
    import logging

    import transformers

    logging.basicConfig(level=logging.WARNING)  # later basicConfig(level=INFO) calls become no-ops
    old = logging.getLogger().level, transformers.logging.get_verbosity()
    logging.getLogger().setLevel(logging.WARNING)
    transformers.logging.set_verbosity_warning()
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            yield
    finally:
        logging.getLogger().setLevel(old[0])
        transformers.logging.set_verbosity(old[1])


def rl_arguments(recipe: str, model: str, data: str, out_dir: str, url: str, *, steps: int, seed: int,
                 save_steps: list[int] | None = None, overrides: list[str] | None = None):  # fmt: skip
    """(script, training, model) arguments of `recipe` with the demo's model, data, search URL and seed.

    The system prompt and the search settings are the recipe's own (`recipes/demo/*.yaml` are self-contained); the
    recipe's `search_corpus` is dropped, because the demo's server (`url`) already serves that corpus."""
    from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
    from appo_trl.configs.search_corpus import search_tool_config
    from appo_trl.stages.train import dataclass_types

    path = recipe if os.path.exists(recipe) else str(REPO_ROOT / recipe)
    args = parse_recipe(dataclass_types(), [
        "--config", path, "--model_name_or_path", model, "--dataset_name", data, "--output_dir", out_dir,
        "--max_steps", str(steps), "--seed", str(seed), *(overrides or []),
    ])  # fmt: skip
    script_args, training_args, _ = args
    if not script_args.system_prompt:
        raise ValueError(f"{recipe} has no system_prompt; the demo's SFT traces start with the one of "
                         "recipes/demo/appo.yaml")  # fmt: skip
    script_args.search_corpus = None
    training_args.tool_config = search_tool_config(training_args, url)
    return args


class StepLine:
    """A `TrainerCallback` printing one short line per RL step and keeping the per-step numbers.

    `history` holds, per step: reward, held-out-free training metrics (tool calls per sample and in all, sampled
    tokens, rows reaching the loss of the `rows_per_step` sampled) and the step's wall and CPU seconds: the
    budgets of `appo_trl.synthetic.compute`. Checkpoints are saved (model only) at `save_steps`.
    """

    KEYS = {"reward": "reward", "tools/call_frequency": "calls", "rollout/sampled_tokens": "sampled_tokens",
            "branch/loss_rows_frac": "loss_rows_frac", "step_time": "step_time", "entropy": "entropy",
            "tools/python/calls": "python_calls", "tools/search/calls": "search_calls",
            "tools/failure_frequency": "tool_failures", "tools/calls": "tool_calls"}  # fmt: skip

    def __init__(self, total: int, save_steps: list[int] | None = None, printer=print, label: str = "RL",
                 every_s: float | None = None, rows_per_step: int | None = None):  # fmt: skip
        """`every_s`: instead of a line per step, a `ProgressLine` at most every `every_s` seconds (the study)."""
        from appo_trl.reporting.console import ProgressLine

        self.total, self.save_steps, self.printer, self.label = total, set(save_steps or []), printer, label
        self.rows_per_step = rows_per_step
        self.progress = ProgressLine(label, total, printer=printer, every_s=every_s) if every_s else None
        self.history: list[dict] = []
        self._t, self._cpu = time.monotonic(), time.process_time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        from transformers import TrainerControl  # noqa: F401 - the callback protocol

        if not logs or "reward" not in logs:
            return
        now = time.monotonic()
        row = {"step": state.global_step, **{v: float(logs[k]) for k, v in self.KEYS.items() if k in logs}}
        row["wall_s"], row["cpu_s"] = now - self._t, time.process_time() - self._cpu
        if self.rows_per_step:  # grpo logs no loss_rows_frac: every row reaches the loss
            row["loss_rows"] = self.rows_per_step * row.get("loss_rows_frac", 1.0)
        self._t, self._cpu = now, time.process_time()
        self.history.append(row)
        if self.progress is not None:
            self.progress.update(state.global_step, f"reward {row['reward']:+.2f}")
            return
        self.printer(f"  [{self.label}] step {state.global_step:>3}/{self.total}  reward {row['reward']:+.2f}  "
                     f"tool calls/sample {row.get('calls', 0):.2f}  {row['wall_s']:.1f} s")  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.save_steps:
            control.should_save = True
        return control


def _callback_class():
    from transformers import TrainerCallback

    return type("StepLineCallback", (StepLine, TrainerCallback), {})


def run_rl(
    args, *, save_steps: list[int] | None = None, printer=print, label: str = "RL", every_s: float | None = None
):
    """Train like `appo_trl.stages.train.main` (same trainer, data and rewards) with `StepLine` progress instead of
    TRL's metric dictionaries; returns (trainer, per-step history). Checkpoints: `<output_dir>/checkpoint-<s>`."""
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback, set_seed

    from appo_trl.data import load_rl_dataset
    from appo_trl.rewards import get_reward_func
    from appo_trl.stages.train import model_settings
    from appo_trl.trainer.trainer import APPOTrainer

    script_args, training_args, model_args = args
    peft_config = model_settings(model_args, training_args)  # --use_peft, --dtype, ... reach the trainer
    training_args.save_strategy = "steps" if save_steps else "no"
    training_args.save_steps = 10**9  # saving happens at `save_steps` only (StepLine sets should_save)
    training_args.save_only_model = True
    training_args.disable_tqdm = True
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    # rows sampled per optimizer step (one generation round feeds steps_per_generation micro-steps)
    rows = training_args.generation_batch_size * training_args.gradient_accumulation_steps
    rows //= training_args.steps_per_generation
    callback = _callback_class()(training_args.max_steps, save_steps, printer, label, every_s, rows)
    with _quiet():
        trainer = APPOTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=[get_reward_func(n) for n in script_args.reward_funcs],
            args=training_args,
            train_dataset=load_rl_dataset(script_args),
            processing_class=tokenizer,
            callbacks=[callback],
            peft_config=peft_config,
        )
        for cb in list(trainer.callback_handler.callbacks):  # TRL's / appo_trl.reporting.console's per-step printing
            if isinstance(cb, (PrinterCallback, ProgressCallback)) or type(cb).__name__.startswith("StepLinePrinter"):
                trainer.remove_callback(cb)
    with _quiet_logging_only():
        trainer.train()
    with _quiet():
        trainer.save_model(training_args.output_dir)
    return trainer, callback.history


@contextlib.contextmanager
def _quiet_logging_only():
    import logging

    import transformers

    logging.basicConfig(level=logging.WARNING)
    old = logging.getLogger().level, transformers.logging.get_verbosity()
    logging.getLogger().setLevel(logging.WARNING)
    transformers.logging.set_verbosity_warning()
    try:
        yield
    finally:
        logging.getLogger().setLevel(old[0])
        transformers.logging.set_verbosity(old[1])
