"""Rebuild, offline, the Hub fixtures that TRL's `tests/test_grpo_trainer.py` loads (a developer tool).

TRL's GRPO tests load tiny models from `trl-internal-testing/*` and the `trl-internal-testing/zen` prompts. This
script writes stand-ins into a folder laid out as a Hugging Face Hub cache (`<out>/hub/models--org--name/...`), so
that `from_pretrained("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")` resolves with `HF_HUB_OFFLINE=1` and no
patching, plus the zen prompts as parquet files under `<out>/datasets/` (`plugin.py` points `load_dataset` there).

What differs from the Hub originals, and may matter:
- The tokenizer is `appo_trl.tiny`'s byte-level BPE (about 600 tokens), not the real Qwen/Llama vocabulary. Each
  model gets the chat template TRL ships for its family (`trl/chat_templates/*.jinja`), so TRL's tool-call
  parsing recognises it.
- Weights are random (seeded) with TRL's tiny sizes (hidden 8/16, 2 layers); dtype float32 rather than bfloat16.
- The zen prompts are lines of the Zen of Python in the two prompt-only formats, 6 train and 2 test rows (TRL's
  has 17 train rows; with 6, a test's 3 default epochs take 18 steps, which keeps a CPU run near an hour).
- Not rebuilt: remote-code, vision and multimodal models, models without a TRL chat template here. Tests that
  need them fail for `GRPOTrainer` and `APPOTrainer` alike, so they drop out of the comparison.

Usage: `python scripts/trl_parity/build_fixtures.py OUT_DIR` (about a minute on CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ORG = "trl-internal-testing"
ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.", "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]  # fmt: skip


def _template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


# repo name -> (model_type, AutoModel kind, TRL chat template, config overrides)
TINY = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen2_5", dict(hidden_size=8, intermediate_size=32)),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seqcls", "qwen2_5", dict(hidden_size=16)),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal", "qwen3", dict(hidden_size=8, head_dim=4)),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "seqcls", "qwen3", dict(hidden_size=16, head_dim=4)),
    "tiny-Qwen3MoeForCausalLM": (
        "qwen3_moe", "causal", "qwen3",
        dict(hidden_size=8, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "tiny-LlamaForCausalLM-3.2": ("llama", "causal", "llama3_2", dict(hidden_size=8)),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "seqcls", "llama3_2", dict(hidden_size=16)),
    "tiny-Gemma2ForCausalLM": ("gemma2", "causal", "gemma", dict(hidden_size=8, head_dim=4)),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal", "cohere2", dict(hidden_size=8)),
    "tiny-Glm4MoeForCausalLM": (
        "glm4_moe", "causal", "glm4moe",
        dict(hidden_size=8, head_dim=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             first_k_dense_replace=1, n_group=1, topk_group=1),
    ),
    "tiny-GptOssForCausalLM": (
        "gpt_oss", "causal", "gptoss", dict(hidden_size=8, head_dim=4, num_local_experts=4, num_experts_per_tok=2),
    ),
}  # fmt: skip
COMMON = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)


def _write_snapshot(hub: Path, repo_type: str, repo_id: str, src: Path) -> None:
    """Lay `src`'s files out as the Hub cache would after a download of `repo_id` (refs/main -> snapshot)."""
    root = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.rmtree(root, ignore_errors=True)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(src, root / "snapshots" / commit)


def build_models(hub: Path) -> list[str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from appo_trl.tiny import build_tiny_model

    built = []
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "base", chat_template="tools")
        for name, (model_type, kind, template, overrides) in TINY.items():
            tok = AutoTokenizer.from_pretrained(base)
            tok.chat_template = _template(template)
            kwargs = {**COMMON, **overrides, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
            kwargs.update(eos_token_id=tok.eos_token_id, bos_token_id=None)
            if kind == "seqcls":
                kwargs["num_labels"] = 1
            try:
                config = AutoConfig.for_model(model_type, **kwargs)
                torch.manual_seed(0)
                auto = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
                model = auto.from_config(config)
            except Exception as exc:  # an architecture this transformers cannot build at these sizes
                print(f"skipped {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            out = Path(tmp) / name
            model.save_pretrained(out)
            tok.save_pretrained(out)
            _write_snapshot(hub, "model", f"{ORG}/{name}", out)
            built.append(name)
    return built


def build_datasets(out: Path) -> None:
    from datasets import Dataset

    rows = [line.rsplit(" ", 1)[0] for line in ZEN]  # "Beautiful is better than", as a prompt to complete
    splits = {"train": rows[:6], "test": rows[17:]}
    for split, prompts in splits.items():
        standard = Dataset.from_dict({"prompt": prompts})
        conversational = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
        for config, ds in (("standard_prompt_only", standard), ("conversational_prompt_only", conversational)):
            path = out / "zen" / config / f"{split}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    built = build_models(args.out_dir / "hub")
    build_datasets(args.out_dir / "datasets")
    print(f"built {len(built)} of {len(TINY)} tiny models and trl-internal-testing/zen under {args.out_dir}")


if __name__ == "__main__":
    main()
