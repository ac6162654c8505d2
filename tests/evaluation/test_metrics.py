"""Evaluation metrics on tricky strings: articles, punctuation, gold lists, LaTeX, tool statistics."""

import pytest

from appo_trl.evaluation import metrics


@pytest.mark.parametrize(
    "pred,golds,em,f1,cover",
    [
        ("The Beatles!", ["Beatles"], 1.0, 1.0, 1.0),  # article and punctuation removed
        ("Paris, France", ["Paris"], 0.0, 2 / 3, 1.0),  # P = 1/2, R = 1
        ("New York City", ["NYC", "New York"], 0.0, 0.8, 1.0),  # best gold: P = 2/3, R = 1
        ("Par", ["Paris"], 0.0, 0.0, 0.0),
        ("  an   apple ", ["Apple"], 1.0, 1.0, 1.0),
        ("1999", ["1999", "the year 1999"], 1.0, 1.0, 1.0),
        ("anything", [], 0.0, 0.0, 0.0),  # no gold: nothing to match
    ],
)
def test_string_metrics(pred, golds, em, f1, cover):
    assert metrics.em(pred, golds) == pytest.approx(em)
    assert metrics.f1(pred, golds) == pytest.approx(f1)
    assert metrics.cover_em(pred, golds) == pytest.approx(cover)


@pytest.mark.parametrize(
    "pred,gold,equal",
    [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("3\\sqrt{3} - 6", "3\\sqrt{3}-6", 1.0),  # ARPO's token F1 scores this 0
        ("\\frac{\\pi}{2}", "\\frac{\\pi}{2}", 1.0),
        ("204", "204", 1.0),
        ("3", "4", 0.0),
        ("\\frac{1}{3}", "\\frac{1}{2}", 0.0),
    ],
)
def test_math_equal(pred, gold, equal):
    assert metrics.math_equal(pred, [gold]) == equal


def test_score_sample_by_task():
    assert set(metrics.score_sample("2", ["2"], "math")) == {"em", "f1", "cover_em", "math_equal"}
    assert set(metrics.score_sample("Paris", ["Paris"], "qa")) == {"em", "f1", "cover_em"}


def test_extract_prediction():
    text = "<think>x</think><answer> The final answer is \\[ \\boxed{\\frac{1}{2}} \\] </answer>"
    assert metrics.extract_prediction(text) == "\\frac{1}{2}"


def test_output_length_and_tool_stats():
    assert metrics.output_length("ab<result>\nxyz\n</result>cd") == 4
    assert metrics.output_length("ab<result>cut off by the limit") == 2
    records = [
        {"completion": "a<result>zz</result>b", "tool_calls": [{"tag": "search", "ok": True}, {"tag": "python", "ok": False}],
         "limit_hit": True, "completion_tokens": 10, "finish_reason": "call_limit"},
        {"completion": "abcd", "tool_calls": [], "completion_tokens": 4, "finish_reason": "eos"},
    ]  # fmt: skip
    stats = metrics.tool_stats(records, ["search", "python"])
    assert stats["calls_per_sample"] == 1.0
    assert stats["calls_per_sample_by_tool"] == {"python": 0.5, "search": 0.5}
    assert stats["share_with_tools"] == 0.5 and stats["failed_call_share"] == 0.5
    assert stats["limit_hits"] == 1 and stats["output_length_chars"] == 3.0 and stats["completion_tokens"] == 7.0
    assert stats["calls_histogram"] == {"0": 1, "2": 1}
    assert stats["finish_reasons"] == {"call_limit": 1, "eos": 1}
    assert metrics.tool_stats([]) == {"samples": 0}
