"""Where a tiny recipe's training step spends its time: `appo train` in this process, with counters per step.

`bench/gpu.py` runs each tiny recipe through `run(["OUT.json", *appo_train_args])` (a helper, not a benchmark of its
own). Per optimizer step it records, as lists in OUT.json:
- `step_s`: the step's wall time (`training_step`, generation included);
- `decode_forwards`, `decode_batches`, `decode_s`: the in-process sampler's sequential model forwards (one per
  decoded token of a batch), its batches and their time;
- `tree_forwards`, `tree_s`: tree forwards (APPO's scoring, old-logp and loss passes) and their time, the device
  synchronised around each;
- `host_syncs`: calls that wait for the device on CUDA (`item`, `tolist`, `cpu`, `nonzero`, `__bool__`, ...) on
  tensors that live there, outside the sampler thread (whose per-token copy is one `cpu` per decoded token);
- `compiles`: `torch._dynamo` graphs compiled so far (a FlexAttention recompilation shows as a step here);
- `triton_kernels`: entries in the Triton cache so far (`TRITON_CACHE_DIR`, which `bench/gpu.py` makes fresh per
  recipe): a kernel compiled for a new specialisation (TRL's fused LM head, FlexAttention) shows as a step here.
Plus `tree_attention`: the tree attention's log lines (which kernel served, what was skipped and why).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

import torch

SYNCS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _triton_kernels() -> int:
    cache = os.environ.get("TRITON_CACHE_DIR")
    return len(os.listdir(cache)) if cache and os.path.isdir(cache) else 0


def run(argv: list[str]) -> int:
    out_path, args = argv[0], argv[1:]
    import appo_trl.cli as cli
    import appo_trl.rollout.transformers_backend as tb
    import appo_trl.trainer.tree as tree
    from appo_trl.trainer.trainer import APPOTrainer

    now = collections.Counter()
    steps: list[dict] = []
    lines: list[str] = []

    def sampler_thread() -> bool:
        return threading.current_thread().name.startswith("appo-sampler")

    def count_syncs(name):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, **k):
            if self.device.type != "cpu" and not sampler_thread():
                now["host_syncs"] += 1
            return orig(self, *a, **k)

        setattr(torch.Tensor, name, counted)

    for name in SYNCS:
        count_syncs(name)

    decode = tb.TransformersBackend._decode

    def timed_decode(self, model, batch):
        def counted(module, args):
            if sampler_thread():
                now["decode_forwards"] += 1

        hook = model.register_forward_pre_hook(counted)
        t0 = time.perf_counter()
        try:
            return decode(self, model, batch)
        finally:
            hook.remove()
            now["decode_batches"] += 1
            now["decode_s"] += time.perf_counter() - t0

    tb.TransformersBackend._decode = timed_decode
    tree_forward = tree.tree_logps_and_entropies

    def timed_tree(*a, **k):
        _sync()
        t0 = time.perf_counter()
        try:
            return tree_forward(*a, **k)
        finally:
            _sync()
            now["tree_forwards"] += 1
            now["tree_s"] += time.perf_counter() - t0

    tree.tree_logps_and_entropies = timed_tree
    training_step = APPOTrainer.training_step

    def timed_step(self, *a, **k):
        from torch._dynamo.utils import counters

        now.clear()
        now.update(dict.fromkeys(("decode_forwards", "decode_batches", "decode_s", "tree_forwards", "tree_s",
                                  "host_syncs"), 0))  # fmt: skip
        t0 = time.perf_counter()
        try:
            return training_step(self, *a, **k)
        finally:
            _sync()
            steps.append({"step_s": time.perf_counter() - t0, **now, "compiles": counters["stats"]["unique_graphs"],
                          "triton_kernels": _triton_kernels()})  # fmt: skip

    APPOTrainer.training_step = timed_step

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    tree_log = logging.getLogger("appo_trl.tree.attention")
    tree_log.addHandler(Lines())
    tree_log.setLevel(logging.INFO)
    try:
        return cli.main(["train", *args])
    finally:
        keys = sorted({k for s in steps for k in s})
        with open(out_path, "w") as f:
            json.dump({**{k: [s.get(k, 0) for s in steps] for k in keys}, "tree_attention": lines}, f)
