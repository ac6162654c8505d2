"""A two-benchmark registry in tmp files (math + QA, hand-checkable) and a scripted policy."""

import json

import pytest

from appo_trl.evaluation.runner import Generation

QUESTIONS = {
    "mathb": [{"question": "What is 1+1?", "answer": "2"}, {"problem": "Half of 1?", "answer": "\\frac{1}{2}"}],
    "qab": [{"question": "Capital of France?", "answer": ["Paris"]},
            {"Question": "Band of Lennon?", "answer": ["The Beatles", "Beatles"]}],
    "deep": [{"Question": "Who wrote Hamlet?", "answer": "William Shakespeare"}],
}  # fmt: skip

PY_CALL = "<think>add</think><python>print(1+1)</python><result>\n2\n</result>"
SEARCH_CALL = "<search>capital of France</search><result>\nno results\n</result>"


def ans(x):
    return f"<think>done</think><answer> The final answer is \\[ \\boxed{{{x}}} \\] </answer>"


# (benchmark, question, sample) -> (completion, tool calls)
SCRIPT = {
    ("mathb", 0, 0): (PY_CALL + ans("2"), [{"tag": "python", "ok": True}]),
    ("mathb", 0, 1): (ans("3"), []),
    ("mathb", 0, 2): (ans("2"), []),
    ("mathb", 1, 0): (ans("0.5"), []),
    ("mathb", 1, 1): (ans("\\frac{1}{2}"), []),
    ("mathb", 1, 2): (ans("\\frac{1}{3}"), []),
    ("qab", 0, 0): (SEARCH_CALL + ans("Paris"), [{"tag": "search", "ok": False}]),
    ("qab", 0, 1): (ans("Paris, France"), []),
    ("qab", 0, 2): (ans("London"), []),
    ("qab", 1, 0): (ans("the beatles"), []),
    ("qab", 1, 1): (ans("Beatles!"), []),
    ("qab", 1, 2): (ans("The Rolling Stones"), []),
    ("deep", 0, 0): (ans("Shakespeare"), []),
    ("deep", 0, 1): (ans("Marlowe"), []),
    ("deep", 0, 2): (ans("William Shakespeare"), []),
}


class ScriptedPolicy:
    """Async `generate` returning SCRIPT's completions; records every request it served."""

    def __init__(self, fail_on=None):
        self.requests = []
        self.fail_on = fail_on

    async def __call__(self, request):
        if request.key == self.fail_on:
            raise RuntimeError(f"scripted failure at {request.key}")
        self.requests.append(request)
        text, calls = SCRIPT[request.key]
        return Generation(completion=text, tool_calls=calls, finish_reason="stop",
                          completion_tokens=len(text) // 4, limit_hit=request.key == ("mathb", 0, 0))  # fmt: skip


@pytest.fixture
def eval_registry(tmp_path):
    for name, rows in QUESTIONS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    reg = tmp_path / "benchmarks.yaml"
    reg.write_text(
        "tasks:\n"
        "  math: {metric: math_equal, pass_metric: math_equal, tools: [python]}\n"
        "  qa: {metric: f1, pass_metric: cover_em, tools: [search, python]}\n"
        "  deep_search: {metric: llm_judge, pass_metric: llm_judge, fallback: cover_em, tools: [search]}\n"
        "defaults: {prompt: code_search}\n"
        "benchmarks:\n"
        "  mathb: {path: mathb/test.jsonl, task: math}\n"
        "  qab: {path: qab/test.jsonl, task: qa, prompt: tir_search}\n"
        "  deep: {path: deep/test.jsonl, task: deep_search}\n",
        encoding="utf-8",
    )
    return str(reg), str(tmp_path)
