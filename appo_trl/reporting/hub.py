"""Publishing trained checkpoints: the model card and one push of the final model, from the main process.

Both stages (`appo sft`, `appo train`) use it the same way:

```python
push = defer_push(training_args)          # before building the trainer: no repo is created at __init__
...
trainer.train(); trainer.save_model(out)
if push:
    push_model(trainer, algorithm="appo", args=(script_args, training_args, model_args))
```

`defer_push` turns transformers' own `push_to_hub` off for the run (it would create the repo inside
`Trainer.__init__` and push every checkpoint). `push_model` writes `README.md` (the model card: algorithm,
base model, datasets, the full recipe, key metrics; a LoRA run's adapter is marked `library_name: peft`) into the
output folder and uploads that folder once, without `checkpoint-*` sub-folders, to `hub_model_id` (default: the
output folder's name) at `hub_revision`, creating the repo with `hub_private_repo`. Only the world-process-zero
uploads; other ranks return None.

The recipe shown in the card lists every field that differs from its dataclass default. Fields that may
carry secrets (`*token*`, `*secret*`, `*key*` with a string value, `hub_*` credentials) are never written.
What this module does not do: push checkpoints during training, or push datasets.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

SECRET_MARKERS = ("token", "secret", "password", "api_key")
CARD_METRICS = (
    "train_loss",
    "loss",
    "reward",
    "reward_std",
    "entropy",
    "mean_token_accuracy",
    "completions/mean_length",
    "tools/call_frequency",
    "train_runtime",
    "epoch",
)
IGNORE_ON_UPLOAD = ("checkpoint-*", "checkpoint-*/**", "runs/**", "*.pt", "*.pth", "rng_state*", "training_args.bin")

# The method of each rollout strategy, for both model cards (TRL's local card and the pushed one). The strategies
# own these facts (`appo_trl.strategies`: each class's `paper` and `card_title`) and hand them over here
# when they are registered (`register_method`); this floor never imports the trainer.
STRATEGY_PAPERS: dict[str, dict[str, str]] = {}
TRL_NO_BASE_MODEL = "[None](https://huggingface.co/None)"  # what TRL's card template renders for a local base

ALGORITHM_TITLES = {"sft": "SFT cold start (supervised fine-tuning on tool-integrated reasoning traces)"}


def register_method(name: str, paper: Mapping[str, str], title: str | None = None) -> None:
    """Cite `paper` (name, title, arXiv id, BibTeX) in the cards of `algorithm: name`, under `title` if given."""
    STRATEGY_PAPERS[name] = dict(paper)
    if title is not None:
        ALGORITHM_TITLES[name] = title


def defer_push(training_args) -> bool:
    """Turn off transformers' in-training push and return whether the recipe asked for a push."""
    requested = bool(training_args.push_to_hub)
    training_args.push_to_hub = False
    return requested


def strategy_card(strategy: str) -> tuple[str, dict[str, str]]:
    """(trainer name, TRL `_paper` dict) of a rollout strategy, for TRL's `create_model_card`."""
    paper = STRATEGY_PAPERS.get(str(strategy).lower()) or STRATEGY_PAPERS["grpo"]
    return paper["name"], {k: paper[k] for k in ("title", "id", "citation")}


def fix_local_base_model(readme_path: str, base_model: str | None) -> None:
    """TRL's card names a local base model "[None](https://huggingface.co/None)": name the folder instead."""
    if not base_model or not os.path.isfile(readme_path):
        return
    with open(readme_path, encoding="utf-8") as f:
        text = f.read()
    if TRL_NO_BASE_MODEL in text:
        with open(readme_path, "w", encoding="utf-8") as f:
            f.write(text.replace(TRL_NO_BASE_MODEL, f"the local model `{base_model}`"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _is_secret(name: str) -> bool:
    """`hub_token`, `api_key`, `client_secret`...: a marker as a whole `_`-separated part (so `min_remaining_tokens`
    or `entropy_tokens`, which are settings, stay in the recipe)."""
    lowered = name.lower()
    parts = set(lowered.split("_"))
    return any(marker in parts if "_" not in marker else marker in lowered for marker in SECRET_MARKERS)


# fields that `__post_init__` fills from others, or that one run sets for itself: never part of a recipe
DERIVED_FIELDS = ("generation_batch_size", "logging_dir", "model_init_kwargs", "push_to_hub", "hub_token")


# passed through to the baseline so that it can be built on this machine (bf16 needs a GPU); still recorded
BASELINE_PASSTHROUGH = ("output_dir", "use_cpu", "bf16", "fp16")


def _baseline(obj: Any) -> Any | None:
    """An instance of `type(obj)` built from its defaults (post-init normalised), or None when that fails."""
    try:
        return type(obj)(**{k: getattr(obj, k) for k in BASELINE_PASSTHROUGH if hasattr(obj, k)})
    except Exception:  # noqa: BLE001 - fall back to the declared defaults
        return None


def recipe_dict(*args: Any) -> dict[str, Any]:
    """The settings of a run as a recipe that re-runs: every field that differs from its default.

    Defaults are taken after `__post_init__` (so normalised values such as TrainingArguments'
    `accelerator_config` do not show up), fields derived from others are left out (`DERIVED_FIELDS`: GRPO's
    `generation_batch_size` follows from `steps_per_generation`, and the two may not both be set), and no
    value is a Python repr. Pass the recipe itself to `push_model(recipe=...)` to show the YAML as written.
    """
    recipe: dict[str, Any] = {}
    for obj in args:
        baseline = _baseline(obj)
        for f in dataclasses.fields(obj):
            if not f.init or _is_secret(f.name) or f.name in DERIVED_FIELDS:
                continue
            if baseline is not None and f.name not in BASELINE_PASSTHROUGH:
                default = getattr(baseline, f.name)
            elif f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            value = getattr(obj, f.name)
            if default is dataclasses.MISSING or _plain(value) != _plain(default):
                recipe[f.name] = _plain(value)
    return recipe


def recipe_from_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The recipe as the user gave it: the `--config` YAML (without `env:`) updated by `--key value` flags.

    Launch flags (`--accelerate_config`, `--num_processes`, ...) are left out; values are YAML-typed.
    """
    from appo_trl.configs.recipes import load_recipe, split_launch_args

    _, argv = split_launch_args(argv)
    argv, recipe = list(argv), {}
    if "--config" in argv:
        i = argv.index("--config")
        recipe = {k: v for k, v in load_recipe(argv[i + 1]).items() if k != "env"}
        del argv[i : i + 2]
    i = 0
    while i < len(argv):
        key, eq, value = argv[i][2:].partition("=")
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else "true"
            i += 1 + has_value
        else:
            i += 1
        recipe[key] = _typed(value)
    return {k: _plain(v) for k, v in recipe.items() if not _is_secret(k)}


def _typed(text: str) -> Any:
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "2e-5" (no dot) as a string
        except ValueError:
            return value
    return value


def key_metrics(log_history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The last logged value of each metric in `CARD_METRICS` (plus `global_step`)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        for name, value in entry.items():
            if name in CARD_METRICS and isinstance(value, (int, float)):
                metrics[name] = float(value)
        if "step" in entry:
            metrics["global_step"] = float(entry["step"])
    return metrics


def _hub_datasets(dataset_name: Any) -> list[str]:
    """Hub dataset ids among the run's sources (local files are described in the card, not linked)."""
    from appo_trl.data import parse_sources

    if not dataset_name:
        return []
    ids = []
    for source in parse_sources(dataset_name):
        path = source.path
        local = path.startswith((".", "/", "~")) or os.path.exists(path) or os.path.splitext(path)[1]
        if not local and path.count("/") == 1:
            ids.append(path)
    return ids


def build_model_card(
    *,
    algorithm: str,
    base_model: str | None,
    datasets: Any,
    recipe: Mapping[str, Any],
    metrics: Mapping[str, float],
    repo_id: str,
    framework_versions: Mapping[str, str] | None = None,
    adapter: Mapping[str, Any] | None = None,
) -> str:
    """Markdown model card with YAML metadata (`base_model`, `datasets`, `tags`, `library_name`). `adapter`: the
    uploaded folder is a PEFT adapter (its `adapter_config.json`): `library_name: peft`, a `lora` tag, and the
    usage loads the base model, then the adapter."""
    algorithm = algorithm.lower()
    title = ALGORITHM_TITLES.get(algorithm, algorithm.upper())
    hub_ids = _hub_datasets(datasets)
    meta: dict[str, Any] = {"library_name": "peft" if adapter else "transformers",
                            "tags": ["appo-trl", "trl", algorithm] + (["lora"] if adapter else [])}  # fmt: skip
    if base_model:
        meta["base_model"] = base_model
    if hub_ids:
        meta["datasets"] = hub_ids
    sources = (
        datasets if isinstance(datasets, str) else yaml.safe_dump(_plain(datasets), default_flow_style=True).strip()
    )
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"Trained with [appo-trl](https://github.com/appo-trl/appo-trl) using **{title}**.",
        "",
        f"- **Algorithm:** `{algorithm}`",
        f"- **Base model:** `{base_model or 'unknown'}`",
        f"- **Datasets:** `{sources or 'unknown'}`",
    ]
    if adapter:
        kind, r, alpha = adapter.get("peft_type", "LORA"), adapter.get("r"), adapter.get("lora_alpha")
        lines.append(f"- **Adapter:** {kind} (r = {r}, alpha = {alpha}) on `{base_model or 'unknown'}`; "
                     "this repo holds the adapter only")  # fmt: skip
    lines += [
        "",
        "## Key metrics",
        "",
    ]
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value:.6g} |" for name, value in metrics.items()]
    else:
        lines.append("No metrics were logged.")
    lines += [
        "",
        "## Recipe",
        "",
        "The full recipe (every setting that differs from the defaults); rerun it with "
        "`appo train --config recipe.yaml` (`appo sft` for the SFT stage).",
        "",
        "```yaml",
        yaml.safe_dump(dict(recipe), sort_keys=True).strip(),
        "```",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
    ]
    if adapter:
        lines += ["from peft import PeftModel", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
                  f'model = PeftModel.from_pretrained(base, "{repo_id}")  # or .merge_and_unload()']  # fmt: skip
    else:
        lines.append(f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")')
    lines += [f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```", ""]
    if framework_versions:
        lines += ["## Framework versions", ""] + [f"- {k}: {v}" for k, v in framework_versions.items()] + [""]
    paper = STRATEGY_PAPERS.get(algorithm)
    if paper is not None:
        lines += ["## Citation", "", f"{paper['name']} was introduced in [{paper['title']}]"
                  f"(https://huggingface.co/papers/{paper['id']}):", "", "```bibtex", paper["citation"], "```", ""]  # fmt: skip
    return "\n".join(lines)


def framework_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("appo-trl", "trl", "transformers", "torch", "peft", "accelerate", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def _adapter_config(output_dir: str) -> dict[str, Any] | None:
    """The saved PEFT adapter's config (a LoRA run's final model), or None for a full model."""
    import json

    path = os.path.join(output_dir, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def push_model(
    trainer,
    *,
    algorithm: str,
    args: Sequence[Any],
    recipe: Mapping[str, Any] | None = None,
    commit_message: str | None = None,
    api=None,
) -> str | None:
    """Write the model card into `output_dir` and upload the folder; returns the commit URL on rank 0.

    Args:
        trainer: a finished `transformers.Trainer` whose model was saved to `args.output_dir`.
        algorithm: `sft`, `grpo`, `arpo`, `aepo` or `appo` (named in the card and its tags).
        args: the run's parsed dataclasses (script arguments, training config, model config).
        recipe: the recipe to print in the card; default `recipe_dict(*args)` (secrets never included).
        commit_message: defaults to "appo-trl: <algorithm> model".
        api: a `huggingface_hub.HfApi` (tests pass a fake); default `HfApi(token=hub_token)`.
    """
    if not trainer.is_world_process_zero():
        return None
    training_args = trainer.args
    output_dir = training_args.output_dir
    repo_id = training_args.hub_model_id or os.path.basename(os.path.normpath(output_dir))
    script_args = next((a for a in args if hasattr(a, "dataset_name")), None)
    model_args = next((a for a in args if hasattr(a, "model_name_or_path")), None)
    recipe = {k: v for k, v in (recipe if recipe is not None else recipe_dict(*args)).items() if not _is_secret(k)}
    recipe.pop("push_to_hub", None)  # `defer_push` switched it off; the card shows the run, not the switch
    card = build_model_card(
        algorithm=algorithm,
        base_model=getattr(model_args, "model_name_or_path", None),
        datasets=getattr(script_args, "dataset_name", None),
        recipe=recipe,
        metrics=key_metrics(trainer.state.log_history),
        repo_id=repo_id,
        framework_versions=framework_versions(),
        adapter=_adapter_config(output_dir),
    )
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=training_args.hub_token)
    repo_url = api.create_repo(repo_id=repo_id, private=training_args.hub_private_repo, exist_ok=True)
    repo_id = getattr(repo_url, "repo_id", None) or repo_id
    revision = training_args.hub_revision
    if revision:
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=output_dir,
        commit_message=commit_message or f"appo-trl: {algorithm} model",
        revision=revision,
        ignore_patterns=list(IGNORE_ON_UPLOAD),
    )
    return str(getattr(commit, "commit_url", commit))
