"""Evaluation through the real rollout engine and python tool, driven by a scripted Backend on the tiny
model's tokenizer: the tool loop, stop strings, sampling parameters, call limits and the report files."""

import pytest

from appo_trl.evaluation import EvalConfig, evaluate
from appo_trl.evaluation.runner import read_jsonl

rollout = pytest.importorskip("appo_trl.rollout")
if not hasattr(rollout, "RolloutEngine"):
    pytest.skip("appo_trl.rollout.RolloutEngine has not landed yet", allow_module_level=True)

from appo_trl.evaluation.inference import RolloutGenerator  # noqa: E402
from appo_trl.rollout.types import Segment  # noqa: E402

PY = "<think>add</think><python>print(1+1)</python>"
ANSWER = "<think>done</think><answer> The final answer is \\[ \\boxed{{{}}} \\] </answer>"
SCRIPTS = {  # question -> model segments, one per tool round
    "What is 1+1?": [PY, ANSWER.format(2)],
    "Half of 1?": [PY, PY, PY, PY, ANSWER.format("1/2")],  # a 4th call breaks the limit of 3
}


class ScriptedBackend:
    """Implements the rollout `Backend` protocol: the next scripted segment for the conversation so far."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.params = []

    async def generate(self, prompt_ids, params):
        self.params.append(params)
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        question = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        done = text.rsplit("<|im_start|>assistant\n", 1)[1].count("<result>")
        segment = SCRIPTS[question][done]
        ids = self.tokenizer.encode(segment, add_special_tokens=False)
        stop = next((s for s in params.stop if segment.endswith(s)), None)
        if stop is None:
            ids = ids + [self.tokenizer.eos_token_id]
        top = [{i: -0.5} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), top, "stop" if stop else "eos", stop)


def test_eval_through_rollout_engine(eval_registry, tmp_path, tiny_tokenizer):
    reg, root = eval_registry
    cfg = EvalConfig(benchmarks=["mathb"], registry=reg, data_root=root, output_dir=str(tmp_path / "out"),
                     num_samples=2, model="tiny", temperature=0.7, top_p=0.9, max_completion_length=256,
                     max_model_len=2048)  # fmt: skip
    backend = ScriptedBackend(tiny_tokenizer)
    report = evaluate(cfg, RolloutGenerator(cfg, backend, tiny_tokenizer), show_progress=False)
    records = {(r["index"], r["sample"]): r for r in read_jsonl(tmp_path / "out" / "samples.jsonl")}
    first = records[(0, 0)]
    assert "<python>print(1+1)</python>" in first["completion"] and "<result>\n2\n</result>" in first["completion"]
    assert [c["tag"] for c in first["tool_calls"]] == ["python"] and first["tool_calls"][0]["ok"]
    assert not first["limit_hit"]
    over = records[(1, 0)]
    assert over["limit_hit"] and over["finish_reason"] == "call_limit" and len(over["tool_calls"]) == 3
    assert all(p.stop == ["</python>"] for p in backend.params)  # math benchmarks get the python tool only
    assert {(p.temperature, p.top_p) for p in backend.params} == {(0.7, 0.9)}
    m = report["benchmarks"]["mathb"]
    assert m["score"] == pytest.approx(0.5)  # q0 right twice; q1 never answers (stopped at the limit)
    assert m["pass@k"] == pytest.approx({"1": 0.5, "2": 0.5})
    assert m["tools_stats"]["limit_hits"] == 2 and m["tools_stats"]["calls_per_sample"] == pytest.approx((1 + 3) / 2)
    for name in ("report.json", "report.md", "report.png"):
        assert (tmp_path / "out" / name).exists()


def test_appo_eval_cli_tiny_model_transformers_backend(eval_registry, tmp_path, tiny_model_path):
    """`appo eval` end to end: the tiny random model in-process, real tool loop, report files, then resume."""
    import json

    from appo_trl.cli import main as appo

    reg, root = eval_registry
    out = tmp_path / "cli"
    argv = ["eval", "--registry", reg, "--data_root", root, "--benchmarks", "mathb", "qab", "--model", tiny_model_path,
            "--backend", "transformers", "--prompt", "plain", "--num_samples", "2", "--max_completion_length", "12",
            "--max_model_len", "1024", "--search_cache", str(tmp_path / "empty.json"), "--output_dir", str(out)]  # fmt: skip
    (tmp_path / "empty.json").write_text("{}")
    assert appo(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [b["questions"] * b["samples_per_question"] for b in report["benchmarks"].values()] == [4, 4]
    assert report["config"]["backend"] == "transformers" and report["model"] == tiny_model_path
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(x)["completion_tokens"] <= 12 for x in lines)
    assert appo(argv) == 0  # resumed: nothing left to generate
    assert (out / "samples.jsonl").read_text().splitlines() == lines


class ScriptedChatBackend:
    """`tool_format: chat`: one python call as `<tool_call>` JSON, then the boxed answer once a result is back."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts, self.params = tokenizer, [], []

    async def generate(self, prompt_ids, params):
        self.params.append(params)
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.prompts.append(text)
        if "</tool_response>" in text:
            segment = "The interpreter printed 2, so \\boxed{2}."
        else:  # the call, then the end of the assistant turn (the engine samples to EOS, as TRL's tool loop)
            segment = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1+1)"}}\n</tool_call>'
        ids = self.tokenizer.encode(segment, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Segment(ids, [-0.5] * len(ids), None, "eos", None)


def test_eval_with_chat_tool_format(eval_registry, tmp_path, tiny_chat_tokenizer):
    reg, root = eval_registry
    cfg = EvalConfig(benchmarks=["mathb"], registry=reg, data_root=root, output_dir=str(tmp_path / "out"),
                     model="tiny", max_completion_length=256, max_model_len=2048, tool_format="chat",
                     prompt="plain", limit=1)  # fmt: skip
    backend = ScriptedChatBackend(tiny_chat_tokenizer)
    report = evaluate(cfg, RolloutGenerator(cfg, backend, tiny_chat_tokenizer), show_progress=False)
    [record] = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert '"name": "python"' in backend.prompts[0] and "<tools>" in backend.prompts[0]  # schema in the prompt
    assert all(p.stop == [] for p in backend.params)
    assert backend.prompts[1].endswith("<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert [(c["tag"], c["ok"], c["query"]) for c in record["tool_calls"]] == [
        ("python", True, '{"code": "print(1+1)"}')
    ]
    assert report["benchmarks"]["mathb"]["score"] == pytest.approx(1.0)


def test_eval_config_rejects_unknown_tool_format():
    with pytest.raises(ValueError, match="tool_format must be 'tags' or 'chat'"):
        EvalConfig(tool_format="json")
