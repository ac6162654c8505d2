"""Per-sample scores and tool statistics of the evaluation stage.

Scores compare an extracted prediction with a list of gold answers and take the best gold:

| name         | what                                                                  |
|--------------|-----------------------------------------------------------------------|
| `em`         | exact match after SQuAD normalisation (lowercase, no punctuation/articles) |
| `f1`         | token F1 after the same normalisation                                  |
| `cover_em`   | a normalised gold occurs inside the normalised prediction (sub-EM)    |
| `math_equal` | mathematical equivalence (math-verify)                                 |
| `llm_judge`  | the LLM judge's verdict (filled in by `judge.py`, not computed here)   |

The string and math comparisons are the project's reward functions (`appo_trl.rewards.qa`,
`appo_trl.rewards.math`), so training and evaluation agree on what "correct" means; answers are extracted
with `appo_trl.rewards.extract.extract_answer`. Tool statistics are computed from the sample record
(tool calls as the rollout engine recorded them, completion text), never by re-parsing tags.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

RESULT_BLOCK = re.compile(r"<result>.*?(</result>|$)", re.DOTALL)


def _best(fn: Callable[[str, str], Any], prediction: str, golds: Sequence[str]) -> float:
    return max((float(fn(prediction, g)) for g in golds), default=0.0)


def em(prediction: str, golds: Sequence[str]) -> float:
    from appo_trl.rewards.qa import exact_match

    return _best(exact_match, prediction, golds)


def f1(prediction: str, golds: Sequence[str]) -> float:
    from appo_trl.rewards.qa import f1_score

    return _best(f1_score, prediction, golds)


def cover_em(prediction: str, golds: Sequence[str]) -> float:
    from appo_trl.rewards.qa import cover_exact_match

    return _best(cover_exact_match, prediction, golds)


def math_equal(prediction: str, golds: Sequence[str]) -> float:
    from appo_trl.rewards.math import math_equal as _math_equal

    return _best(_math_equal, prediction, golds)


# name -> fn(prediction, golds) -> float in [0, 1]. `llm_judge` is added by the judge pass.
METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "em": em,
    "f1": f1,
    "cover_em": cover_em,
    "math_equal": math_equal,
}
STRING_METRICS = ("em", "f1", "cover_em")


def metrics_for_task(task: str) -> tuple[str, ...]:
    """The rule-based metrics computed for every sample of a task (math adds `math_equal`)."""
    return (*STRING_METRICS, "math_equal") if task == "math" else STRING_METRICS


def extract_prediction(completion: str) -> str:
    """The final answer of a completion (last `\\boxed{}` of the last `<answer>`, with fallbacks)."""
    from appo_trl.rewards.extract import extract_answer

    return extract_answer(completion) or ""


def score_sample(prediction: str, golds: Sequence[str], task: str) -> dict[str, float]:
    """All rule-based scores of one prediction."""
    return {name: METRICS[name](prediction, golds) for name in metrics_for_task(task)}


def output_length(completion: str) -> int:
    """Characters the model wrote: the completion without `<result>...</result>` blocks (ARPO's measure)."""
    return len(RESULT_BLOCK.sub("", completion))


def tool_stats(records: Sequence[dict[str, Any]], tags: Sequence[str] | None = None) -> dict[str, Any]:
    """Tool-use statistics over sample records (`tool_calls: [{tag, ok}]`, `limit_hit`, text, tokens).

    Returns calls per sample by tool, the share of samples with at least one call, the failed-call share,
    how often the call limit was hit, the mean output length (characters, tool results excluded) and
    completion tokens (model tokens only), finish reasons, and the histogram of calls per sample.
    """
    n = len(records)
    if n == 0:
        return {"samples": 0}
    seen = sorted({c["tag"] for r in records for c in r.get("tool_calls", [])} | set(tags or ()))
    calls = [len(r.get("tool_calls", [])) for r in records]
    total_calls = sum(calls)
    failed = sum(1 for r in records for c in r.get("tool_calls", []) if not c.get("ok", True))
    hist: dict[str, int] = {}
    for c in calls:
        hist[str(c)] = hist.get(str(c), 0) + 1
    finish: dict[str, int] = {}
    for r in records:
        key = str(r.get("finish_reason"))
        finish[key] = finish.get(key, 0) + 1
    return {
        "samples": n,
        "calls_per_sample": total_calls / n,
        "calls_per_sample_by_tool": {
            t: sum(1 for r in records for c in r.get("tool_calls", []) if c["tag"] == t) / n for t in seen
        },
        "share_with_tools": sum(1 for c in calls if c > 0) / n,
        "failed_call_share": failed / total_calls if total_calls else 0.0,
        "limit_hits": sum(1 for r in records if r.get("limit_hit")),
        "limit_hit_share": sum(1 for r in records if r.get("limit_hit")) / n,
        "output_length_chars": sum(output_length(r.get("completion", "")) for r in records) / n,
        "completion_tokens": sum(int(r.get("completion_tokens", 0)) for r in records) / n,
        "finish_reasons": dict(sorted(finish.items())),
        "calls_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
    }
