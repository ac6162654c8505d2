"""Eval resume never mixes runs: model, sample settings and questions are checked against `run.json`."""

import json
from pathlib import Path

import pytest

from appo_trl.evaluation import EvalConfig, evaluate
from appo_trl.evaluation.runner import read_jsonl

from .conftest import ScriptedPolicy


def config(eval_registry, tmp_path, **kw):
    reg, root = eval_registry
    base = dict(benchmarks=["mathb", "qab"], registry=reg, data_root=root, output_dir=str(tmp_path / "out"),
                num_samples=3, ks=[1, 2, 3], model="scripted", concurrency=4)  # fmt: skip
    return EvalConfig(**{**base, **kw})


def _run(cfg):
    policy = ScriptedPolicy()
    return evaluate(cfg, policy, show_progress=False), policy


def test_another_model_is_refused_and_nothing_is_generated(eval_registry, tmp_path):
    from appo_trl.configs.errors import ConfigError

    _run(config(eval_registry, tmp_path))
    policy = ScriptedPolicy()
    with pytest.raises(ConfigError, match="holds samples of another run \\(model 'scripted' != 'other'\\)"):
        evaluate(config(eval_registry, tmp_path, model="other"), policy, show_progress=False)
    assert policy.requests == []
    with pytest.raises(ConfigError, match="temperature 0.6 != 1.0"):
        evaluate(config(eval_registry, tmp_path, temperature=1.0), ScriptedPolicy(), show_progress=False)


def test_overwrite_output_dir_starts_fresh(eval_registry, tmp_path):
    _run(config(eval_registry, tmp_path))
    report, policy = _run(config(eval_registry, tmp_path, model="other", overwrite_output_dir=True))
    assert len(policy.requests) == 12  # every sample generated again
    assert report["config"]["model"] == "other"
    assert len(read_jsonl(tmp_path / "out" / "samples.jsonl")) == 12


def test_changed_questions_are_refused_and_more_samples_or_a_judge_are_not(eval_registry, tmp_path):
    from appo_trl.configs.errors import ConfigError

    _run(config(eval_registry, tmp_path, num_samples=2, ks=[1, 2]))
    _, policy = _run(config(eval_registry, tmp_path))  # n 2 -> 3: only the third samples are new
    assert len(policy.requests) == 4
    _, policy = _run(config(eval_registry, tmp_path, judge_base_url="http://127.0.0.1:9/v1", judge_model="j"))
    assert policy.requests == []  # a judge added later re-scores the stored samples
    _, root = eval_registry
    data = Path(root) / "qab" / "test.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    rows[1]["Question"] = "Band of McCartney?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match="benchmark 'qab': 1 question\\(s\\) changed \\(first: row 1\\)"):
        _run(config(eval_registry, tmp_path))


def test_samples_without_run_file_are_refused(eval_registry, tmp_path):
    from appo_trl.configs.errors import ConfigError

    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.jsonl").write_text('{"benchmark": "mathb", "index": 0, "sample": 0, "completion": "x"}\n')
    with pytest.raises(ConfigError, match="without run.json"):
        _run(config(eval_registry, tmp_path))


def test_eval_search_cache_defaults_into_the_output_dir(tmp_path):
    cfg = EvalConfig(output_dir=str(tmp_path / "ev"), search_backend="local")
    assert cfg.tool_params(["search"])["search"]["cache_path"] == str(tmp_path / "ev" / "search_cache.sqlite")


def test_eval_checks_the_search_server_before_the_model_loads(eval_registry, tmp_path):
    from appo_trl.configs.errors import PreflightError
    from appo_trl.evaluation.runner import check_output_dir

    cfg = config(eval_registry, tmp_path, benchmarks=["qab"], search_backend="local",
                 tool_config={"search": {"url": "http://127.0.0.1:9/retrieve", "timeout_s": 2}})  # fmt: skip
    with pytest.raises(PreflightError, match="no search server at http://127.0.0.1:9/health"):
        check_output_dir(cfg)


def test_appo_eval_unknown_benchmark_is_one_line_exit_2(eval_registry, tmp_path, capfd):
    from appo_trl.cli import main as appo

    reg, root = eval_registry
    argv = ["eval", "--registry", reg, "--data_root", root, "--benchmarks", "mathb", "nope",
            "--model", "m", "--output_dir", str(tmp_path / "o")]  # fmt: skip
    assert appo(argv) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Unknown benchmarks ['nope']" in err[0]
