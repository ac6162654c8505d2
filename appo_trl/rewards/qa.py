"""SQuAD-style QA string metrics (ARPO paper, hierarchical reward; docs/fidelity.md).

`normalize_answer` lowercases, removes punctuation, removes the articles a|an|the and collapses whitespace.
Every metric accepts one gold string or a list of golds and returns the best score over them. Token-F1
scores a yes/no/noanswer mismatch as 0 (the reference behaviour of ARPO's `deep_research.py`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, drop articles (a|an|the), collapse whitespace (SQuAD normalisation).

    Example: `normalize_answer("The  Eiffel-Tower!")` → `"eiffeltower"`.
    """
    s = str(s).lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if `normalize_answer(prediction)` equals the normalised form of any gold, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def cover_exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """Sub-EM: 1.0 if a normalised gold occurs as a substring of the normalised prediction, else 0.0.

    An empty normalised gold never matches (it would cover everything).
    """
    p = normalize_answer(prediction)
    return float(any((g := normalize_answer(x)) and g in p for x in _golds(golds)))


sub_exact_match = cover_exact_match


def _f1_single(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    common = Counter(pt) & Counter(gt)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """Token-F1 of the normalised strings, max over golds (ARPO paper, hierarchical reward; docs/fidelity.md).

    F1 = 2·P·R/(P+R) with P = |common|/|pred tokens|, R = |common|/|gold tokens| (multiset intersection).
    A prediction or gold equal to yes/no/noanswer that differs from the other scores 0.
    """
    return max((_f1_single(prediction, g) for g in _golds(golds)), default=0.0)
