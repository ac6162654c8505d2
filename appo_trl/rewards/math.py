"""Thread-safe mathematical equivalence through math-verify (an option beside ARPO's token-F1).

math-verify's own timeouts use `signal.alarm`, which raises `ValueError` outside the main thread (reward
functions and evaluation run in worker threads). `math_equal` therefore calls `parse(..., parsing_timeout=None)`
and `verify(..., timeout_seconds=None)` and enforces its own deadline: the comparison runs on a small bounded
`ThreadPoolExecutor` and the caller waits at most `timeout` seconds (`Future.result(timeout=…)`), scoring a
timeout as not equal. A Python thread cannot be killed, so a pathological sympy call keeps one worker busy
until it returns; the pool size (`_MAX_WORKERS`) bounds how many such calls can pile up, and a saturated pool
makes further calls time out instead of blocking forever.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from appo_trl.rewards.extract import extract_answer

_MAX_WORKERS = 4
_POOL: ThreadPoolExecutor | None = None
DEFAULT_TIMEOUT = 5.0


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_MAX_WORKERS, thread_name_prefix="math_verify")
    return _POOL


def _as_latex(s: str) -> str:
    """Wrap a bare expression in `$…$` so LaTeX (`\\frac{1}{2}`) and plain (`1/2`) forms both parse."""
    s = s.strip()
    return s if ("$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s) else f"${s}$"


def _verify(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence the "timeout disabled" warning
    g = parse(_as_latex(gold), parsing_timeout=None)
    p = parse(_as_latex(pred), parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def math_equal(prediction: str, gold: str, timeout: float | None = DEFAULT_TIMEOUT) -> bool:
    """True when `prediction` and `gold` are mathematically equivalent under math-verify.

    The answer is first extracted from `prediction` with `extract_answer` (`<answer>` block, then the last
    `\\boxed{}`), falling back to the raw text; `gold` is used as given (a boxed gold is unwrapped the same way).
    Examples: `1/2` ≡ `0.5` ≡ `\\frac{1}{2}`. Safe to call from any thread (no signals); exceeding `timeout`
    seconds, or any parse/verify error, returns False.
    """
    if prediction is None or gold is None:
        return False
    pred = extract_answer(str(prediction)) or str(prediction)
    gold_s = extract_answer(str(gold)) or str(gold)
    if not pred.strip() or not gold_s.strip():
        return False
    import math_verify  # noqa: F401 - import (seconds on a cold start) outside the comparison deadline

    future = _pool().submit(_verify, pred, gold_s)
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        future.cancel()
        return False
    except Exception:  # noqa: BLE001 - any math-verify failure means "not shown equal"
        return False
