"""Bytes and seconds per weight sync of a LoRA run: the adapter alone against the merged full weights.

    python bench/lora_sync.py [--quick] [--json] [--syncs N] [--rank R]

Two shapes, LoRA rank `--rank` (16) on every linear layer of every decoder layer (`target_modules: all-linear`):

- `tiny`: the tiny CPU model (`appo tiny-model`, float32). Sizes computed and counted on the PEFT model; seconds
  measured: `DiskWeightSync.sync_weights` against the fake vLLM server (bench/fake_vllm.py, LoRA on), `--syncs`
  times per route, median. The adapter route saves the adapter (safetensors + adapter_config.json) and the fake
  reads it back at `/v1/load_lora_adapter`; the merged route merges, copies and writes `model.safetensors` (the
  fake does not load it: a real server's reload is extra, and larger for the merged route).
- `qwen3_1p7b`: Qwen3-1.7B's config (random init, never allocated: counted on the `meta` device). Sizes: base
  weights in bfloat16 (what the server holds), the adapter in float32 (PEFT keeps adapters in float32). Seconds:
  writing and reading an adapter of the real shapes (safetensors, random values) is measured; the merged route's
  would need the 3.4 GB base plus a merged copy in memory, so its seconds are estimated from the adapter's
  measured write throughput (`merged_s_est`), not measured.

With --json the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960)  # fmt: skip


def lora_config(rank: int):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


def analytic_params(c, rank: int) -> tuple[int, int]:
    """(base parameters, LoRA parameters) of a Qwen3 config with LoRA rank `rank` on all seven linear layers."""
    h, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    per_layer = sum(a * b for a, b in linears) + 2 * h + 2 * hd  # + input/post norms, q/k norms
    base = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * per_layer + h
    return base, c.num_hidden_layers * rank * sum(a + b for a, b in linears)


def counted_params(config, rank: int) -> tuple[int, int]:
    """The same two counts on a PEFT model built on the `meta` device (no memory)."""
    from peft import get_peft_model
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = get_peft_model(Qwen3ForCausalLM(config), lora_config(rank))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n), lora


def shape_sizes(config, rank: int, base_bytes: int) -> dict:
    base, lora = analytic_params(config, rank)
    counted = counted_params(config, rank)
    if counted != (base, lora):
        raise AssertionError(f"analytic {(base, lora)} != counted {counted}")
    merged_b, adapter_b = base * base_bytes, lora * 4
    return {"base_params": base, "lora_params": lora, "merged_bytes": merged_b, "adapter_bytes": adapter_b,
            "bytes_ratio": merged_b / adapter_b}  # fmt: skip


def time_tiny(rank: int, syncs: int, tmp: str) -> dict:
    """Median seconds of `DiskWeightSync.sync_weights` per route on the tiny model, against the fake server."""
    from accelerate import Accelerator
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from appo_trl.tiny import build_tiny_model
    from appo_trl.vllm.weight_sync import DiskWeightSync
    from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy

    path = build_tiny_model(os.path.join(tmp, "tiny"))
    tok = AutoTokenizer.from_pretrained(path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora_config(rank))
    out = {}
    with FakeVLLMServer(ScriptedPolicy(tok, lambda ctx, rng: [tok.eos_token_id]), tok, max_lora_rank=rank) as server:
        for route, adapter in (("adapter", True), ("merged", False)):
            sync = DiskWeightSync(model=model, accelerator=Accelerator(cpu=True), processing_class=tok,
                                  mode="server", server_base_url=server.url, sync_dir=os.path.join(tmp, route),
                                  adapter=adapter)  # fmt: skip
            times = []
            for _ in range(syncs):
                t0 = time.perf_counter()
                sync.sync_weights()
                times.append(time.perf_counter() - t0)
            folder = os.path.join(tmp, route, sync.adapters.current) if adapter else os.path.join(tmp, route)
            out[f"{route}_s"] = statistics.median(times)
            out[f"{route}_files_bytes"] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    out["seconds_ratio"] = out["merged_s"] / out["adapter_s"]
    return out


def time_big_adapter(config, rank: int, tmp: str) -> dict:
    """Write and read an adapter of `config`'s real shapes (random float32, safetensors), as a sync does."""
    from safetensors.torch import load_file, save_file

    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    mods = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i),
            "mlp.down_proj": (i, h)}  # fmt: skip
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for mod, (a, b) in mods.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, a)
            tensors[f"{key}.lora_B.weight"] = torch.randn(b, rank)
    path = os.path.join(tmp, "adapter_model.safetensors")
    t0 = time.perf_counter()
    save_file(tensors, path, metadata={"format": "pt"})
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_file(path)
    read_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.remove(path)
    return {"adapter_write_s": write_s, "adapter_read_s": read_s, "adapter_file_bytes": size,
            "write_bytes_per_s": size / write_s}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="rank 8 and 2 syncs (what `make test` runs)")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--syncs", type=int, default=None)
    p.add_argument("--rank", type=int, default=None)
    a = p.parse_args(argv)
    rank = a.rank or (8 if a.quick else 16)
    syncs = a.syncs or (2 if a.quick else 5)
    from transformers import Qwen3Config

    from appo_trl.tiny import build_tiny_model

    result: dict = {"rank": rank, "syncs": syncs}
    with tempfile.TemporaryDirectory() as tmp:
        tiny_config = Qwen3Config.from_pretrained(build_tiny_model(os.path.join(tmp, "cfg")))
        result["tiny"] = {**shape_sizes(tiny_config, rank, base_bytes=4), **time_tiny(rank, syncs, tmp)}
        big = Qwen3Config(**QWEN3_1P7B)
        sizes = shape_sizes(big, rank, base_bytes=2)
        timed = time_big_adapter(big, rank, tmp) if not a.quick else {}
        if timed:
            timed["merged_s_est"] = sizes["merged_bytes"] / timed["write_bytes_per_s"]
        result["qwen3_1p7b"] = {**sizes, **timed}
    for shape in ("tiny", "qwen3_1p7b"):
        r = result[shape]
        line = (f"{shape}: merged {r['merged_bytes'] / 2**20:.1f} MiB vs adapter {r['adapter_bytes'] / 2**20:.2f} "
                f"MiB per sync ({r['bytes_ratio']:.0f}x)")  # fmt: skip
        if "adapter_s" in r:
            line += f"; sync {r['merged_s'] * 1e3:.1f} ms merged vs {r['adapter_s'] * 1e3:.1f} ms adapter"
        if "adapter_write_s" in r:
            line += f"; adapter write {r['adapter_write_s']:.2f} s, merged est. {r['merged_s_est']:.1f} s"
        print(line, file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
