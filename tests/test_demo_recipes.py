"""The demo's cold start as one command (`appo demo --sft_only`, `make cold-start`) and `recipes/demo/*.yaml` that run
from it alone (issue 49, item 2).

Asserted: every demo RL recipe names the files the cold start writes and carries the task's system prompt and search
settings itself (compared with what `appo_trl.synthetic` writes into the SFT traces and the eval registry, so they
cannot drift apart); `--sft_only` refuses the options it would ignore; a tiny cold start writes exactly what the
recipes read; `appo train` on a recipe alone (plus the cold start's folder) starts and stops its search server and
calls both tools; `search_corpus` settings it cannot honour are one line before the model loads; the agent recipe's
own tools compute and search as the tool loop does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from appo_trl.cli import main as appo
from appo_trl.cli.demo import COLD_START_WORKDIR, cold_start, cold_start_paths, parse_args
from appo_trl.configs.recipes import REPO_ROOT
from tests.test_cli_errors import one_error_line

DEMO = REPO_ROOT / "recipes" / "demo"
RL_RECIPES = sorted(p.name for p in DEMO.glob("*.yaml") if p.name != "sft.yaml")
FEATURES = {"lora.yaml": {"use_peft": True}, "tree.yaml": {"advantage_estimator": "tree"},
            "async.yaml": {"max_staleness": 1}, "agent.yaml": {"agent": "demo_agent:agent"}}  # fmt: skip


def _recipe(name: str) -> dict:
    return yaml.safe_load((DEMO / name).read_text())


def test_the_feature_recipes_exist_and_each_sets_its_feature():
    assert set(FEATURES) <= set(RL_RECIPES)
    for name, keys in FEATURES.items():
        r = _recipe(name)
        assert {k: r.get(k) for k in keys} == keys, name
        assert r["output_dir"] == f"outputs/demo-{name[:-5]}" and r["max_steps"] <= 60


@pytest.mark.parametrize("name", RL_RECIPES)
def test_a_demo_recipe_holds_the_task_settings_itself(name):
    from appo_trl.synthetic.pipeline import SEARCH_TOOL
    from appo_trl.synthetic.task import build_task

    r = _recipe(name)
    paths = cold_start_paths(COLD_START_WORKDIR)
    assert r["model_name_or_path"] == paths["model_name_or_path"] == "outputs/demo/sft"
    assert r["dataset_name"] == paths["dataset_name"]
    # the system prompt the SFT traces start with, and the one the held-out evaluation uses
    sft_system = build_task(0, num_sft=3, num_rl=3, num_heldout=3).sft[0].sft_row()["messages"][0]
    assert sft_system["role"] == "system" and r["system_prompt"] == sft_system["content"]
    if "agent" in r:
        assert "tools" not in r and "search_corpus" not in r
        return
    assert r["tools"] == ["python", "search"] and r["search_corpus"] == paths["search_corpus"]
    assert r["tool_config"] == {"search": SEARCH_TOOL}  # what the demo's evaluation searches with
    assert "url" not in r["tool_config"]["search"]  # appo train points it at the server it starts


def test_the_eval_registry_prompt_is_the_recipes(tmp_path):
    from appo_trl.synthetic.task import write_task

    files = write_task(tmp_path, 0, num_sft=3, num_rl=3, num_heldout=3)
    prompt = json.loads(Path(files["registry"]).read_text())["benchmarks"]["synthetic"]["prompt"]
    assert prompt == _recipe("appo.yaml")["system_prompt"]


def test_the_demo_rl_stage_adds_nothing_but_its_paths_and_server(tmp_path):
    """`rl_arguments` (appo demo, appo study) takes the prompt and search settings from the recipe: no default of
    synthetic/ that a recipe run by `appo train` would lack."""
    from appo_trl.configs.recipes import parse_recipe
    from appo_trl.stages.train import dataclass_types
    from appo_trl.synthetic.pipeline import rl_arguments

    own_script, own_training, _ = parse_recipe(dataclass_types(), ["--config", str(DEMO / "appo.yaml")])
    script, training, _ = rl_arguments("recipes/demo/appo.yaml", "m", "d.jsonl", str(tmp_path), "http://h:1/retrieve",
                                       steps=3, seed=1)  # fmt: skip
    assert script.system_prompt == own_script.system_prompt
    assert training.tool_config == {"search": {**own_training.tool_config["search"], "url": "http://h:1/retrieve"}}
    assert script.search_corpus is None  # the demo's own server serves the corpus


@pytest.mark.parametrize("flags", [["--rl_steps", "5"], ["--recipe", "recipes/demo/grpo.yaml"], ["--checkpoints", "0"],
                                   ["--eval_samples", "2"], ["--learning_rate", "1e-4"]])  # fmt: skip
def test_sft_only_refuses_what_it_would_ignore(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        appo(["demo", "--sft_only", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"appo demo: error: --sft_only runs no RL and no evaluation: {flags[0]} would be ignored"


def test_the_cold_start_writes_what_the_recipes_read(tmp_path):
    """A tiny cold start (2 SFT steps); the real one is `make cold-start` (2,000 steps, 32 min on 2 loaded cores)."""
    lines: list[str] = []
    work = tmp_path / "demo"
    a = parse_args(["--sft_only", "--workdir", str(work), "--sft_steps", "2", "--num_sft", "24"])
    out = cold_start(a, printer=lines.append)
    assert out == cold_start_paths(work)
    assert (work / "sft" / "config.json").is_file() and (work / "sft" / "model.safetensors").is_file()
    assert os.path.getsize(out["dataset_name"]) > 0 and os.path.getsize(out["search_corpus"]) > 0
    assert any("RL from it: appo train --config recipes/demo/lora.yaml" in line for line in lines)
    # another --workdir than the recipes': the flags that point them there
    flags = " ".join(f"--{k} {v}" for k, v in out.items())
    assert lines[-1].strip() == f"recipes/demo/*.yaml read outputs/demo; for this --workdir add: {flags}"


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("cold") / "demo"
    return cold_start(parse_args(["--sft_only", "--workdir", str(work), "--sft_steps", "2", "--num_sft", "24"]),
                      printer=lambda _: None)  # fmt: skip


def _flags(paths: dict[str, str], out: Path, **more) -> list[str]:
    keys = {**paths, "output_dir": str(out), "max_steps": 1, "per_device_train_batch_size": 8, **more}
    return [x for k, v in keys.items() for x in (f"--{k}", str(v))]


def test_appo_train_on_a_recipe_alone_starts_and_stops_its_search_server(cold, tmp_path, caplog):
    """The search tool checks its server's `/health` at start-up: without the server the run would stop there."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="appo_trl.stages.train")
    out = tmp_path / "run"
    assert appo(["train", "--config", str(DEMO / "grpo.yaml"), *_flags(cold, out)]) == 0
    assert "documents, index" in (out / "search_server.log").read_text()  # appo serve-search ran on the corpus
    err = caplog.text
    found = re.search(r"search: appo serve-search on (http://127\.0\.0\.1:\d+/retrieve) over (\S+) \(pid (\d+)", err)
    assert found and found.group(2) == cold["search_corpus"], err[-2000:]
    with pytest.raises(ProcessLookupError):  # stopped when training ended
        os.kill(int(found.group(3)), 0)
    assert (out / "model.safetensors").is_file()


def test_search_corpus_settings_it_cannot_honour_are_one_line(cold, tmp_path, capfd):
    out = tmp_path / "run"
    base = ["train", "--config", str(DEMO / "grpo.yaml")]
    cases = [
        (_flags({**cold, "search_corpus": str(tmp_path / "none.jsonl")}, out), "is not a file"),
        (_flags(cold, out, tools="python"), "the run has no `search` tool"),
        (_flags(cold, out, tool_config='{"search": {"url": "http://127.0.0.1:9/retrieve"}}'), "names another"),
        (_flags(cold, out, tool_config='{"search": {"backend": "cache", "cache_path": "c.json"}}'), "backend is 'cache'"),
    ]  # fmt: skip
    for flags, want in cases:
        assert appo([*base, *flags]) == 2
        line = one_error_line(capfd)
        assert line.startswith("appo train: error: search_corpus") and want in line, line
    assert not out.exists()


def test_the_agent_recipe_runs_through_the_endpoint(cold, tmp_path):
    pytest.importorskip("openai")
    out = tmp_path / "agent"
    assert appo(["train", "--config", str(DEMO / "agent.yaml"), *_flags(
        {k: v for k, v in cold.items() if k != "search_corpus"}, out)]) == 0  # fmt: skip
    logged = json.loads((out / "trainer_state.json").read_text())["log_history"][0]
    assert logged["agent/requests"] >= 8 and logged["agent/errors"] == 0


def test_the_agent_tools_answer_as_the_tool_loop_does(cold, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_agent", DEMO / "demo_agent.py")
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert agent.arithmetic("print(37 * 14 + 52)") == "570"
    assert agent.arithmetic("print(2 - (3 * -4))") == "14"
    assert agent.arithmetic("print(__import__('os').getcwd())").startswith("Error:")
    assert agent.arithmetic("print(2 ** 99)").startswith("Error:")  # no power: nothing but + - *
    assert agent.arithmetic("open('x')") == "Error: this agent runs print(<arithmetic>) only"
    monkeypatch.setattr(agent, "CORPUS", cold["search_corpus"])
    doc = json.loads(Path(cold["search_corpus"]).read_text().splitlines()[0])
    name = doc["id"].split("-")[0]
    assert agent.search(f"{name} {doc['id'].split('-')[1]}") == f"Page 1: {doc['contents']}"


def test_feature_runs_window_stats_by_hand():
    import importlib.util

    spec = importlib.util.spec_from_file_location("feature_runs", REPO_ROOT / "scripts" / "feature_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = mod.window_stats([0.0, 1.0, 9.0, 2.0, 3.0], 2)  # first [0, 1], last [2, 3]; the middle is left out
    assert s["first_mean"] == 0.5 and s["last_mean"] == 2.5 and s["change"] == 2.0
    assert s["first_sd"] == pytest.approx(0.5**0.5) and s["last_sd"] == pytest.approx(0.5**0.5)  # sqrt(0.5 / 1)
    with pytest.raises(ValueError, match="need at least 4 values for two windows of 2"):
        mod.window_stats([1.0, 2.0, 3.0], 2)
