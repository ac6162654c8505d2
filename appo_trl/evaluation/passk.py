"""Unbiased pass@k and avg@k over k-sample evaluations.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code") estimates, from n samples of
which c are correct, the probability that at least one of k samples drawn without replacement is correct:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form avoids the huge binomials (n = 1000 would overflow floats) and is exact in the edge cases:
c = 0 gives 0, n - c < k gives 1. avg@k is the plain mean of a per-sample score over the first k samples of a
question (ARPO's "Pass@1 = average over runs"). Neither function looks at text; they take counts and scores.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one question with `n` samples of which `c` are correct.

    Args:
        n: number of samples drawn for the question (n >= 1).
        c: number of correct samples (0 <= c <= n).
        k: budget (1 <= k <= n).

    Returns:
        The probability that a random k-subset of the n samples contains a correct one.
    """
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean pass@k over questions given `(n, c)` per question; questions with n < k are an error."""
    if not counts:
        return 0.0
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def avg_at_k(scores_per_question: Sequence[Sequence[float]], k: int) -> float:
    """Mean over questions of the mean score of each question's first `k` samples (in sample order)."""
    if not scores_per_question:
        return 0.0
    total = 0.0
    for scores in scores_per_question:
        if len(scores) < k:
            raise ValueError(f"avg@{k} needs at least {k} samples per question, got {len(scores)}")
        total += sum(scores[:k]) / k
    return total / len(scores_per_question)


def default_ks(n: int) -> list[int]:
    """The k values reported for n samples: 1, 2, 4, 8, ... below n, plus n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]
