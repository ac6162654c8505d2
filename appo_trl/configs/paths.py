"""Where recipes and their files are found: recipe-relative paths, and the copies shipped inside the wheel.

- `SHIPPED_ROOT`: the folder holding `recipes/`, `accelerate_configs/` and `eval/`: the repository in a
  checkout (or an editable install), else `appo_trl/_resources/`, where the wheel build (`setup.py`) copies
  them. So `pip install appo-trl && appo demo` and `appo train --config recipes/tiny/grpo.yaml` work outside
  a checkout.
- `find_recipe(path)`: the path as written when it exists (from the working directory), else the shipped
  copy (`recipes/tiny/grpo.yaml` from any directory).
- `looks_local(name)`: a model or dataset name that can only be a local path (never a Hub id).
- `resolve_recipe_paths(config, recipe_file)`: a relative *input* path written in a recipe (dataset files,
  model folder, chat template, DeepSpeed/FSDP config, search cache files, eval data) is looked up next to
  the recipe file first; when it exists there it becomes that absolute path. Otherwise it is left as written
  (relative to the working directory, or a Hub id). Output paths (`output_dir`) and command-line values stay
  relative to the working directory, as in every other tool.

What this does not do: check that the paths exist (the stages do that, naming the missing path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parents[1]  # appo_trl/
_CHECKOUT = _PACKAGE.parent
SHIPPED_ROOT = _CHECKOUT if (_CHECKOUT / "recipes").is_dir() else _PACKAGE / "_resources"
SHIPPED_DIRS = ("recipes", "accelerate_configs", "eval")

# recipe keys whose value is a file or folder the run reads
PATH_KEYS = ("dataset_name", "model_name_or_path", "chat_template_path", "deepspeed", "fsdp_config",
             "registry", "data_root", "search_cache", "model", "corpus")  # fmt: skip
TOOL_PATH_KEYS = ("cache_path", "seed_path", "corpus", "index_dir")
# the data files a dataset source may be (suffix -> `datasets` builder; `appo_trl.data` loads them)
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def looks_local(name: str) -> bool:
    """True when `name` can only be a local path, never a Hub id (`name`, `org/name`): `./x`, `/x`, `~/x`,
    `a/b/c`, a backslash (`C:\\x`), or a data file's suffix (`x.jsonl`). Such a name that does not exist is a
    missing path, named as such, not a Hub lookup (models: `configs.preflight`, datasets: `appo_trl.data`)."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or "\\" in name
        or os.path.splitext(name)[1].lower() in DATA_FILE_BUILDERS
    )


def find_recipe(path: str | os.PathLike) -> Path:
    """`path` itself when it exists, else the shipped copy (`SHIPPED_ROOT / path`) when that exists."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    shipped = SHIPPED_ROOT / path
    return shipped if shipped.exists() else path


def _next_to(base: Path, value: Any) -> Any:
    if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith(("~", "$")):
        return value
    candidate = base / value
    return str(candidate.resolve()) if candidate.exists() else value


def _dataset(base: Path, value: Any) -> Any:
    """`dataset_name` forms: a path or Hub id, `{path: weight}`, or `"a@0.5,b@2"`."""
    if isinstance(value, dict):
        return {_next_to(base, k): w for k, w in value.items()}
    if isinstance(value, str) and ("," in value or "@" in value):
        parts = []
        for part in value.split(","):
            name, at, weight = part.strip().rpartition("@") if "@" in part else (part.strip(), "", "")
            parts.append(_next_to(base, name) + at + weight)
        return ",".join(parts)
    return _next_to(base, value)


def resolve_recipe_paths(config: dict, recipe_file: str | os.PathLike) -> dict:
    """A copy of `config` whose relative input paths that exist next to `recipe_file` are made absolute."""
    base = Path(recipe_file).resolve().parent
    out = dict(config)
    for key in PATH_KEYS:
        if key in out:
            out[key] = _dataset(base, out[key]) if key == "dataset_name" else _next_to(base, out[key])
    tools = out.get("tool_config")
    if isinstance(tools, dict):
        out["tool_config"] = {
            name: {k: (_next_to(base, v) if k in TOOL_PATH_KEYS else v) for k, v in params.items()}
            if isinstance(params, dict)
            else params
            for name, params in tools.items()
        }
    return out
