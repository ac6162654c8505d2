"""Reward functions with TRL's signature (ARPO paper, hierarchical reward; TRL's reward-function API).

`fn(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]`. A completion is a string or a
list of chat messages; for messages the text is the concatenation of every message's content in order
(assistant turns and any tool-result turns, like the reference's decoded response). Gold answers come from the
per-row kwarg `answer` (str or list[str]), with aliases `ground_truth` and `solution`; `ability` is optional.
A row without a gold answer scores None (TRL ignores it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from appo_trl.rewards.deep_research import compute_score, extract_boxed_answer, validate_format
from appo_trl.rewards.extract import extract_answer
from appo_trl.rewards.math import math_equal as _math_equal
from appo_trl.rewards.qa import exact_match, f1_score

GOLD_KEYS = ("answer", "ground_truth", "solution")


def completion_text(completion: Any) -> str:
    """Text of a completion: a string as is; chat messages joined by content (text parts of list contents)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for msg in completion or []:
        content = msg.get("content", "") if isinstance(msg, dict) else str(msg)
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content or "")
    return "".join(parts)


def _golds(kwargs: dict, n: int) -> list[Any]:
    for key in GOLD_KEYS:
        if kwargs.get(key) is not None:
            golds = kwargs[key]
            if isinstance(golds, str):  # one gold for the whole batch
                return [golds] * n
            return list(golds)
    return [None] * n


def _rows(completions, kwargs):
    texts = [completion_text(c) for c in completions]
    golds = _golds(kwargs, len(texts))
    ability = kwargs.get("ability")
    abilities = (
        list(ability) if isinstance(ability, Sequence) and not isinstance(ability, str) else [ability] * len(texts)
    )
    return zip(texts, golds, abilities)


def _gold_list(g) -> list[str]:
    return [g] if isinstance(g, str) else [str(x) for x in g]


def arpo_deep_research(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
    """ARPO's training reward (ARPO paper): −1 on format/extraction failure, else token-F1 (+0.1 with both tools)."""
    return [None if g is None else compute_score(t, g) for t, g, _ in _rows(completions, kwargs)]


def arpo_deep_research_mathverify(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
    """`arpo_deep_research`, but rows with `ability == "math"` use math equivalence (1/0) instead of F1."""
    return [
        None if g is None else compute_score(t, g, a, math_verify_for_math=True)
        for t, g, a in _rows(completions, kwargs)
    ]


def math_verify(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
    """1.0 if the extracted answer (`extract_answer`) is mathematically equal to any gold, else 0.0."""
    out = []
    for t, g, _ in _rows(completions, kwargs):
        if g is None:
            out.append(None)
            continue
        pred = extract_answer(t)
        out.append(float(pred is not None and any(_math_equal(pred, x) for x in _gold_list(g))))
    return out


def _string_metric(metric, completions, kwargs) -> list[float | None]:
    out = []
    for t, g, _ in _rows(completions, kwargs):
        pred = extract_answer(t)
        out.append(None if g is None else 0.0 if pred is None else metric(pred, _gold_list(g)))
    return out


def qa_f1(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
    """Max-over-golds token-F1 of the extracted answer (0.0 when none can be extracted); no format penalty."""
    return _string_metric(f1_score, completions, kwargs)


def qa_em(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
    """Exact match (SQuAD-normalised) of the extracted answer against any gold (0.0 when none is extracted)."""
    return _string_metric(exact_match, completions, kwargs)


def format_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Format-only reward: 0.0 if `validate_format` passes and a boxed answer is inside `<answer>`, else −1.0."""
    out = []
    for c in completions:
        t = completion_text(c)
        out.append(0.0 if validate_format(t)[0] and extract_boxed_answer(t) is not None else -1.0)
    return out


format_reward.__name__ = "format"
