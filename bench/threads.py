"""CPU thread settings under load: why the demo's SFT slowed down far more than the machine did.

    python bench/threads.py [--quick] [--json] [--load N]

Workload: SFT-shaped training steps (forward + backward + AdamW) of the demo's model (2 layers, hidden 128,
4 heads of 64, vocabulary 512+) on a batch of 8 x 128 tokens, each variant in a fresh interpreter so that the
OpenMP settings apply before torch loads:

- `default`: torch's own choice (one OpenMP thread per core, threads spin-wait between parallel regions);
- `passive`: `OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads sleep instead of spinning);
- `one_thread`: `OMP_NUM_THREADS=1` (`torch.set_num_threads(1)`).

Each variant runs with the machine as it is (`quiet`) and with `--load` extra busy processes at nice 19
(`loaded`, default: one per core + 1, like the three nice-19 jobs that made the demo stall). Variants run
round-robin, `--rounds` times, so that drifts in the machine's own load hit every variant alike; the figure
is the median seconds per step and the ratio to `default` in the same condition. With --json the last line is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
}

WORKER = r"""
import sys, time, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
steps = int(sys.argv[1])
torch.manual_seed(0)
config = Qwen3Config(vocab_size=600, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                     tie_word_embeddings=True)
model = Qwen3ForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 600, (8, 128))
def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
step()  # warm-up
start = time.perf_counter()
for _ in range(steps):
    step()
print((time.perf_counter() - start) / steps, torch.get_num_threads())
"""


def run_variant(name: str, steps: int) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(VARIANTS[name])
    out = subprocess.run([sys.executable, "-c", WORKER, str(steps)], env=env, capture_output=True, text=True,
                         timeout=900, check=True).stdout.split()  # fmt: skip
    return float(out[-2]), int(out[-1])


def start_load(n: int) -> list[subprocess.Popen]:
    spin = "while True:\n    pass\n"
    return [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", spin]) for _ in range(n)]


def measure(steps: int, rounds: int, load: int) -> dict:
    result: dict = {}
    for condition, n in (("quiet", 0), ("loaded", load)):
        procs = start_load(n)
        try:
            time.sleep(0.5 if n else 0)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            threads: dict[str, int] = {}
            for _ in range(rounds):
                for v in VARIANTS:
                    t, threads[v] = run_variant(v, steps)
                    times[v].append(t)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        med = {v: statistics.median(ts) for v, ts in times.items()}
        result[condition] = {
            v: {"s_per_step": med[v], "vs_default": med[v] / med["default"], "threads": threads[v], "runs": times[v]}
            for v in VARIANTS
        }
    for v in VARIANTS:  # how much each setting slows down when the machine is loaded
        result.setdefault("slowdown_loaded_vs_quiet", {})[v] = (
            result["loaded"][v]["s_per_step"] / result["quiet"][v]["s_per_step"]
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few steps and one round (what `make test` runs)")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--load", type=int, default=(os.cpu_count() or 2) + 1, help="busy nice-19 processes")
    a = p.parse_args()
    steps = a.steps or (3 if a.quick else 20)
    rounds = a.rounds or (1 if a.quick else 3)
    result = measure(steps, rounds, a.load)
    result.update(steps=steps, rounds=rounds, load=a.load, cpus=os.cpu_count())
    for condition in ("quiet", "loaded"):
        for v, r in result[condition].items():
            print(f"{condition:7} {v:11} {1e3 * r['s_per_step']:8.1f} ms/step  x{r['vs_default']:.2f} vs default"
                  f"  ({r['threads']} threads)")  # fmt: skip
    for v, s in result["slowdown_loaded_vs_quiet"].items():
        print(f"slowdown under load, {v}: x{s:.2f}")
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
