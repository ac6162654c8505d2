"""Report comparison and the `appo eval` command line (help, compare, bad keys)."""

import json

import pytest

from appo_trl.cli import main as appo
from appo_trl.evaluation import EvalConfig, compare_reports, evaluate
from appo_trl.evaluation.runner import Generation

from .conftest import QUESTIONS, ScriptedPolicy, ans


async def oracle(request):
    row = QUESTIONS[request.benchmark][request.index]
    gold = row["answer"][0] if isinstance(row["answer"], list) else row["answer"]
    return Generation(completion=ans(gold), tool_calls=[{"tag": "python", "ok": True}] * 2, finish_reason="stop")


@pytest.fixture
def two_reports(eval_registry, tmp_path):
    reg, root = eval_registry
    paths = []
    for name, policy in (("sft", ScriptedPolicy()), ("appo", oracle)):
        cfg = EvalConfig(benchmarks=["mathb", "qab"], registry=reg, data_root=root, num_samples=3, model=name,
                         output_dir=str(tmp_path / name))  # fmt: skip
        evaluate(cfg, policy, show_progress=False)
        paths.append(tmp_path / name / "report.json")
    return paths


def test_compare_numbers(two_reports):
    a, b = (json.loads(p.read_text()) for p in two_reports)
    rows = {r["benchmark"]: r for r in compare_reports(a, b)}
    va, vb, d = rows["mathb"]["score"]
    assert (va, vb) == (pytest.approx(2 / 3), 1.0) and d == pytest.approx(1 / 3)
    assert rows["qab"]["score"][2] == pytest.approx(1 - 11 / 18)
    assert rows["mathb"]["calls/sample"] == (pytest.approx(1 / 6), 2.0, pytest.approx(2 - 1 / 6))
    b["benchmarks"].pop("qab")
    rows = {r["benchmark"]: r for r in compare_reports(a, b)}
    assert rows["qab"]["score"] == (pytest.approx(11 / 18), None, None)


def test_cli_compare_prints_side_by_side(two_reports, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")  # rich would shorten cells on a narrow terminal
    assert appo(["eval", "compare", str(two_reports[0]), str(two_reports[1].parent), "--names", "SFT", "APPO"]) == 0
    out = capsys.readouterr().out
    assert "SFT" in out and "APPO" in out
    assert "66.7" in out and "100.0" in out and "+33.3" in out  # mathb score A, B, difference
    assert appo(["eval", "compare", str(two_reports[0]), "/nonexistent/report.json"]) == 2


def test_cli_help_and_bad_key(capsys):
    assert appo(["eval", "--help"]) == 0
    assert "appo eval compare" in capsys.readouterr().out
    assert appo(["eval", "--num_sampels", "4"]) == 2
    assert "num_samples" in capsys.readouterr().err  # the suggestion


def test_config_validation():
    assert EvalConfig(benchmarks="aime24, gaia", ks="1,4", num_samples=4).benchmarks == ["aime24", "gaia"]
    with pytest.raises(ValueError, match="k <= n"):
        EvalConfig(num_samples=2, ks=[1, 4])
    with pytest.raises(ValueError, match="backend"):
        EvalConfig(backend="tgi")


def test_printed_summary(two_reports):
    from rich.console import Console

    from appo_trl.evaluation import print_summary

    console = Console(record=True, width=200)
    print_summary(json.loads(two_reports[0].read_text()), console=console)
    text = console.export_text()
    assert "mathb" in text and "66.7" in text and "overall" in text
    assert "63.9" in text  # overall = (2/3 + 11/18) / 2 = 0.6389


def test_tool_params_frozen_search_cache():
    cfg = EvalConfig(
        search_cache="cache.json", tool_config='{"python": {"timeout_s": 5}, "search": {"max_results": 3}}'
    )
    assert cfg.tool_params(["python"]) == {"python": {"timeout_s": 5}}
    assert cfg.tool_params(["search"]) == {
        "search": {"max_results": 3, "backend": "cache", "cache_path": "cache.json"}
    }
    explicit = EvalConfig(search_cache="a.json", tool_config={"search": {"backend": "local", "cache_path": "b.db"}})
    assert explicit.tool_params(["search"])["search"] == {"backend": "local", "cache_path": "b.db"}
