"""pass@k / avg@k against hand-computed values."""

import math

import pytest

from appo_trl.evaluation import avg_at_k, mean_pass_at_k, pass_at_k
from appo_trl.evaluation.passk import default_ks


def test_issue_example_n5_c2():
    # 1 - C(3,k)/C(5,k): k=1 -> 1 - 3/5; k=2 -> 1 - 3/10; k=5 -> 1 - 0/1
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 4) == 1.0  # n - c = 3 < 4
    assert pass_at_k(5, 2, 5) == 1.0


def test_edges():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(1, 0, 1) == 0.0
    for n, c, k in [(10, 3, 4), (16, 1, 8), (7, 6, 2)]:  # matches the binomial form where it is exact
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_large_n_is_stable():
    # C(2000, 1000) overflows a float; the product form does not. 1 - (1999/2000 ... ) with c=1: k/n
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert 0.0 < pass_at_k(5000, 3, 10) < 1.0


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_invalid(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_and_avg_at_k():
    # questions: (n=4, c=1) -> pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5 ; (n=4, c=0) -> 0 ; (n=4, c=4) -> 1
    assert mean_pass_at_k([(4, 1), (4, 0), (4, 4)], 2) == pytest.approx(0.5)
    # avg@2 uses the first two samples of each question: (1+0)/2, (0.5+0.5)/2 -> mean 0.5
    assert avg_at_k([[1, 0, 1, 1], [0.5, 0.5, 0, 0]], 2) == pytest.approx(0.5)
    assert avg_at_k([[1, 0, 1, 1], [0.5, 0.5, 0, 0]], 4) == pytest.approx((0.75 + 0.25) / 2)
    with pytest.raises(ValueError):
        avg_at_k([[1.0]], 2)
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(5) == [1, 2, 4, 5]
    assert default_ks(1) == [1]
