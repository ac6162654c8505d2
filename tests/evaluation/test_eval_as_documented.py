"""`eval/tiny.yaml` and the documented `appo eval` commands (README.md, docs/reference.md) work as written on a fresh
clone.

A fresh clone has no ARPO files: the tiny config reads only what ships in `eval/data/tiny/`, from any working
directory, and every README command parses (paths that need ARPO's files are the user's clone, never a path
of this machine).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from appo_trl.configs.recipes import parse_recipe
from appo_trl.evaluation import EvalConfig

ROOT = Path(__file__).resolve().parents[2]


DOCUMENTED = (ROOT / "README.md", ROOT / "docs" / "reference.md")  # the README's first run, the reference's rest


def _documented() -> str:
    return "\n".join(path.read_text() for path in DOCUMENTED)


def _readme_eval_commands() -> list[list[str]]:
    text = _documented()
    text = re.sub(r"\\\n\s*", " ", text)  # join continued lines
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("appo eval --config"):
            out.append(shlex.split(line.replace("<checkpoint>", "ckpt"))[2:])
    return out


def test_readme_eval_commands_parse():
    commands = _readme_eval_commands()
    assert len(commands) >= 3
    for argv in commands:
        config = argv[argv.index("--config") + 1]
        assert (ROOT / config).is_file(), config
        (cfg,) = parse_recipe([EvalConfig], ["--config", str(ROOT / config), *argv[2:]])
        assert cfg.benchmarks


def test_no_machine_specific_paths_in_eval_configs_or_readme():
    for path in [*DOCUMENTED, *sorted((ROOT / "eval").glob("*.yaml"))]:
        assert "../shared" not in path.read_text(), path.name


def test_readme_says_where_arpo_eval_files_come_from():
    text = _documented()
    assert "github.com/dongguanting/ARPO" in text and "evaluation/data" in text


def test_tiny_config_reads_only_shipped_files_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (cfg,) = parse_recipe([EvalConfig], ["--config", str(ROOT / "eval" / "tiny.yaml")])
    assert Path(cfg.data_root) == ROOT / "eval" / "data" / "tiny"
    assert Path(cfg.search_cache).is_file()
    from appo_trl.evaluation import load_registry
    from appo_trl.evaluation.benchmarks import load_examples

    registry = load_registry()
    for name in cfg.benchmarks:
        assert len(load_examples(registry[name], cfg.data_root, cfg.limit)) == 4
    assert cfg.model == "outputs/tiny-qwen3"  # what `appo tiny-model outputs/tiny-qwen3` writes


@pytest.mark.slow
def test_tiny_eval_runs_as_written(tmp_path, monkeypatch, tiny_model_path):
    from appo_trl.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "tiny-qwen3").symlink_to(tiny_model_path)
    assert main(["eval", "--config", str(ROOT / "eval" / "tiny.yaml")]) == 0
    report = json.loads((tmp_path / "eval_results" / "tiny" / "report.json").read_text())
    assert {"gsm8k", "bamboogle"} <= set(json.dumps(report).split('"'))


def test_readme_eval_commands_write_to_distinct_folders():
    """Issue 34: the chat eval command ran after the Evaluation section's found `eval_results/tiny` taken."""
    dirs = []
    for argv in _readme_eval_commands():
        (cfg,) = parse_recipe([EvalConfig], ["--config", str(ROOT / argv[argv.index("--config") + 1]), *argv[2:]])
        dirs.append((cfg.output_dir, cfg.model))
    by_dir = {}
    for out, model in dirs:
        by_dir.setdefault(out, set()).add(model)
    assert all(len(models) == 1 for models in by_dir.values()), by_dir


def test_eval_results_are_ignored_by_git():
    assert "eval_results/" in (ROOT / ".gitignore").read_text().split()
