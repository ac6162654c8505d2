"""The whole evaluation with a scripted policy: numbers by hand, report files, resume, judge errors."""

import asyncio
import json

import httpx
import pytest

from appo_trl.evaluation import EvalConfig, evaluate
from appo_trl.evaluation.judge import JudgeConfig, LLMJudge
from appo_trl.evaluation.runner import build_requests, derive_seed, read_jsonl, select_benchmarks

from .conftest import ScriptedPolicy


def config(eval_registry, tmp_path, **kw):
    reg, root = eval_registry
    base = dict(benchmarks=["mathb", "qab"], registry=reg, data_root=root, output_dir=str(tmp_path / "out"),
                num_samples=3, ks=[1, 2, 3], model="scripted", concurrency=4)  # fmt: skip
    return EvalConfig(**{**base, **kw})


def test_requests_prompts_seeds(eval_registry, tmp_path):
    cfg = config(eval_registry, tmp_path)
    benches = select_benchmarks(cfg)
    from appo_trl.evaluation.benchmarks import load_examples

    reqs = build_requests(cfg, benches[0], load_examples(benches[0], cfg.data_root))
    assert [r.key for r in reqs][:4] == [("mathb", 0, 0), ("mathb", 0, 1), ("mathb", 0, 2), ("mathb", 1, 0)]
    assert reqs[0].messages[0]["content"].startswith("You are a helpful assistant that can solve")
    assert reqs[3].messages[1] == {"role": "user", "content": "Half of 1?"}
    assert reqs[0].tools == ["python"] and reqs[0].call_limit == 3  # math default; QA gets 6
    assert len({r.seed for r in reqs}) == len(reqs)
    assert reqs[0].seed == derive_seed(0, "mathb", 0, 0) != derive_seed(1, "mathb", 0, 0)
    qa = build_requests(cfg, benches[1], load_examples(benches[1], cfg.data_root))
    assert qa[0].call_limit == 6 and "search engine" in qa[0].messages[0]["content"]


def test_full_eval_numbers_and_files(eval_registry, tmp_path):
    policy = ScriptedPolicy()
    report = evaluate(config(eval_registry, tmp_path), policy, show_progress=False)
    assert len(policy.requests) == 12
    m, q = report["benchmarks"]["mathb"], report["benchmarks"]["qab"]
    # math: q0 right on samples 0, 2; q1 right on 0 (0.5 == 1/2) and 1 -> c = 2, 2 of n = 3
    assert m["metric"] == "math_equal" and m["score"] == pytest.approx(4 / 6)
    assert m["pass@k"] == pytest.approx({"1": 2 / 3, "2": 1.0, "3": 1.0})
    assert m["avg@k"] == pytest.approx({"1": 1.0, "2": 0.75, "3": 2 / 3})
    # qa F1: q0 = 1, 2/3 ("paris france" vs "paris"), 0; q1 = 1, 1 ("beatles!" -> "beatles"), 0 -> 11/18
    assert q["metric"] == "f1" and q["score"] == pytest.approx(11 / 18)
    assert q["metrics"]["em"] == pytest.approx(3 / 6)
    assert q["metrics"]["cover_em"] == pytest.approx(4 / 6)
    assert q["pass@k"] == pytest.approx({"1": 2 / 3, "2": 1.0, "3": 1.0})  # cover-EM: c = 2, 2
    assert q["avg@k"]["2"] == pytest.approx((5 / 6 + 1.0) / 2)
    assert report["overall"]["score"] == pytest.approx((4 / 6 + 11 / 18) / 2)
    # tools: one python call in 6 math samples (limit hit there), one failed search in 6 QA samples
    assert m["tools_stats"]["calls_per_sample"] == pytest.approx(1 / 6)
    assert m["tools_stats"]["calls_per_sample_by_tool"] == pytest.approx({"python": 1 / 6})
    assert m["tools_stats"]["limit_hits"] == 1 and m["tools_stats"]["calls_histogram"] == {"0": 5, "1": 1}
    assert q["tools_stats"]["failed_call_share"] == 1.0 and q["tools_stats"]["share_with_tools"] == pytest.approx(
        1 / 6
    )
    # output length excludes "<result>\n2\n</result>" (20 chars) from the first math sample
    out_dir = tmp_path / "out"
    first = next(
        r
        for r in read_jsonl(out_dir / "samples.jsonl")
        if (r["benchmark"], r["index"], r["sample"]) == ("mathb", 0, 0)
    )
    assert first["completion"].count("<result>") == 1
    for name in ("samples.jsonl", "predictions.jsonl", "report.json", "report.md", "report.png"):
        assert (out_dir / name).stat().st_size > 0
    assert (out_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out_dir / "report.json").read_text())
    assert saved["config"]["num_samples"] == 3 and saved["model"] == "scripted"
    md = (out_dir / "report.md").read_text()
    assert "| mathb | 2 x 3 | math_equal | 66.7 |" in md and "| qab | 2 x 3 | f1 | 61.1 |" in md
    preds = read_jsonl(out_dir / "predictions.jsonl")
    assert {p["prediction"] for p in preds if p["benchmark"] == "qab"} >= {"Paris, France", "Beatles!"}


def test_resume_skips_finished_samples(eval_registry, tmp_path):
    cfg = config(eval_registry, tmp_path, concurrency=1)
    crashing = ScriptedPolicy(fail_on=("qab", 0, 1))
    with pytest.raises(RuntimeError, match="scripted failure"):
        evaluate(cfg, crashing, show_progress=False)
    done = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert len(done) == len(crashing.requests) == 7  # 6 math + qab q0 s0, in order (concurrency 1)
    with open(tmp_path / "out" / "samples.jsonl", "a") as f:
        f.write('{"benchmark": "qab", "ind')  # a torn line from a killed run
    rerun = ScriptedPolicy()
    first = evaluate(cfg, rerun, show_progress=False)
    assert len(rerun.requests) == 5 and ("qab", 0, 0) not in {r.key for r in rerun.requests}
    again = ScriptedPolicy()
    second = evaluate(cfg, again, show_progress=False)
    assert again.requests == []
    assert second["benchmarks"] == first["benchmarks"]
    # a smaller n reuses the stored samples 0 and 1 (math: q0 [1, 0], q1 [1, 1])
    fewer = evaluate(config(eval_registry, tmp_path, num_samples=2, ks=[1, 2]), ScriptedPolicy(), show_progress=False)
    assert fewer["benchmarks"]["mathb"]["samples_per_question"] == 2
    assert fewer["benchmarks"]["mathb"]["pass@k"] == pytest.approx({"1": 0.75, "2": 1.0})


def test_judge_in_the_loop_with_errors_then_resume(eval_registry, tmp_path):
    cfg = config(eval_registry, tmp_path, benchmarks=["deep"], judge_base_url="http://judge.test/v1",
                 judge_model="judge-72b", judge_max_retries=1)  # fmt: skip
    calls = []

    def flaky(request):
        content = json.loads(request.content)["messages"][0]["content"]
        calls.append(content)
        if "Predicted Answer: Marlowe" in content:
            return httpx.Response(500)
        return httpx.Response(200, json={"choices": [{"message": {"content": "Correct"}}]})

    judge = LLMJudge(JudgeConfig(**{**cfg.judge.public(), "backoff_s": 0.0}), transport=httpx.MockTransport(flaky))
    report = evaluate(cfg, ScriptedPolicy(), judge=judge, show_progress=False)
    d = report["benchmarks"]["deep"]
    # s2 is an exact match (no call); s0 "Shakespeare" judged Correct; s1 fails twice -> error, counted wrong
    assert len(calls) == 1 + 2
    assert d["metric"] == "llm_judge" and d["score"] == pytest.approx(2 / 3)
    assert d["judge"] == {"calls": 2, "errors": 1, "by_rule": 1}
    assert report["judge_model"] == "judge-72b"
    assert "api_key" not in json.dumps(report["config"]).replace("api_key_env", "")

    def healthy(request):
        calls.append("retry")
        return httpx.Response(200, json={"choices": [{"message": {"content": "Incorrect"}}]})

    judge2 = LLMJudge(JudgeConfig(**{**cfg.judge.public(), "backoff_s": 0.0}), transport=httpx.MockTransport(healthy))
    report2 = evaluate(cfg, ScriptedPolicy(), judge=judge2, show_progress=False)
    assert calls[3:] == ["retry"]  # only the errored verdict is asked again; the cached one is reused
    assert report2["benchmarks"]["deep"]["judge"]["errors"] == 0
    assert report2["benchmarks"]["deep"]["score"] == pytest.approx(2 / 3)


def test_without_judge_deep_search_falls_back(eval_registry, tmp_path):
    report = evaluate(config(eval_registry, tmp_path, benchmarks=["deep"]), ScriptedPolicy(), show_progress=False)
    d = report["benchmarks"]["deep"]
    # cover-EM: "shakespeare" does not contain "william shakespeare"; "william shakespeare" does -> 1 of 3
    assert d["metric"] == "cover_em" and d["score"] == pytest.approx(1 / 3)
    assert "judge" not in d and report["judge_model"] is None


def test_generate_is_concurrent(eval_registry, tmp_path):
    active, peak = {"n": 0}, {"n": 0}
    policy = ScriptedPolicy()

    async def slow(request):
        active["n"] += 1
        peak["n"] = max(peak["n"], active["n"])
        await asyncio.sleep(0.01)
        active["n"] -= 1
        return await policy(request)

    evaluate(config(eval_registry, tmp_path, concurrency=3), slow, show_progress=False)
    assert peak["n"] == 3
