"""Checks on what reward functions return, so a broken reward stops the run with one line naming it.

- `checked_reward_func(func, name)` wraps a reward function (sync or async, as TRL calls it): its output must be
  a list of numbers or None, one per completion. A string, a list or any other value raises `RewardFunctionError`
  naming the function, the completion and the value (TRL would fail later with `too many dimensions 'str'`,
  naming nothing).
- Per-turn rewards (with `advantage_estimator: tree`): a function may return, for a completion, a list with one
  reward per assistant turn; `checked_reward_func(..., turns=record)` hands each list to `record(name, index,
  values)` and gives TRL their sum (the completion's return), so TRL's logs and statistics see one number per row.
  Where they land: `appo_trl.trainer.turn_rewards`. Without the tree estimator a list is refused, naming the setting.
  A list holding a reward that is not finite (NaN included, or over `REWARD_LIMIT`, its sum included) is not
  recorded: the completion's reward is None, as below; a list holding anything but numbers is refused.
- A reward that is not finite (inf, -inf, NaN) or beyond `REWARD_LIMIT` in size (1e308: the float32 group mean and
  std TRL computes overflow, and the whole group's gradient is dropped) is handled like None (TRL's NaN: this
  function does not score that completion), with one warning per function naming it (`finite_rewards`; the user's
  agent's own reward goes through the same rule, `appo_trl.trainer.agents`).
- `NaNRewardGuard` counts training rounds in a row in which every reward function gave None/NaN for every
  completion. As TRL, such a round logs a warning (one line naming the functions) and training goes on; with
  `max_steps > 0` (`max_nan_reward_steps`, off by default) the run stops after that many rounds with
  `RewardFunctionError` naming the functions. Rewards are checked after TRL's gather, so every rank counts alike
  and stops at the same round.

What this does not do: judge whether rewards are sensible (a constant reward trains nothing too, by design of
group advantages), or check reward models (`nn.Module`s return logits, never strings).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from trl.trainer.utils import is_async_callable

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function returned something that is not a reward (or nothing, round after round)."""


def _is_reward(value: Any) -> bool:
    """None, a number (numpy's scalars included) or a 0-d array / tensor."""
    return value is None or isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def check_rewards(name: str, output: Any, turns: bool = False) -> None:
    """Raise `RewardFunctionError` naming `name` unless `output` is a list of numbers / None (`turns`: per-turn
    lists are on, and were taken out already; what is left is not one)."""
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence) and not hasattr(output, "tolist"):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(output).__name__} {_short(output)}; it must return a list "
            "with one float (or None) per completion"
        )
    for i, value in enumerate(output):
        if not _is_reward(value):
            hint = ""
            if _is_turns(value):
                hint = (" (per-turn rewards are a Python list of per-completion lists; a 2-d array is not read as "
                        "turns: return .tolist() for per-turn rewards, or a flat array for one per completion)"
                        if turns else " (a list per completion is per-turn rewards: set advantage_estimator=tree, tree_credit_form=paper)")
            raise RewardFunctionError(
                f"reward function {name!r} returned {type(value).__name__} {_short(value)} for completion {i}; "
                f"a reward must be a number (or None to skip it){hint}"
            )


def _is_turns(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or getattr(value, "ndim", None) == 1


def take_turn_rewards(name: str, output: Any, record: Callable) -> Any:
    """`output` with each per-turn list replaced by its sum, after `record(name, index, [floats])`."""
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence):
        return output
    out = list(output)
    for i, value in enumerate(out):
        if not _is_turns(value):
            continue
        turns = list(value.tolist() if hasattr(value, "tolist") else value)
        if not all(isinstance(x, numbers.Number) for x in turns):  # no None / text / lists inside (NaN: below)
            raise RewardFunctionError(
                f"reward function {name!r} returned per-turn rewards {_short(value)} for completion {i}; each turn's "
                "reward must be a number"
            )
        total = float(sum(turns))
        bad = next((float(x) for x in turns if not usable_reward(x)), None if usable_reward(total) else total)
        if bad is not None:  # NaN / inf / over REWARD_LIMIT: the completion's reward is None (`finite_rewards` warns)
            out[i] = bad
            continue
        record(name, i, [float(x) for x in turns])
        out[i] = total
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Beyond this size a reward's float32 group statistics are meaningless: its square overflows float32 (3.4e38) from
# about 1.8e19, and next to it every other reward of its group is lost in rounding.
REWARD_LIMIT = 1e15


def usable_reward(value: Any) -> bool:
    """None, or a finite number of size at most `REWARD_LIMIT`."""
    if value is None:
        return True
    number = float(value)
    return math.isfinite(number) and abs(number) <= REWARD_LIMIT


def non_finite_note(value: float) -> str:
    """How a reward that is not `usable_reward` is named in its warning."""
    return "NaN" if math.isnan(value) else f"{value:g}" + ("" if math.isinf(value) else f" (over {REWARD_LIMIT:g})")


def finite_rewards(name: str, output: Any, warned: set[str]) -> Any:
    """`output` (already `check_rewards`-checked) with each reward that is not `usable_reward` as None; the first
    such reward of `name` logs one warning (`warned` holds the names already warned about)."""
    values = output.tolist() if hasattr(output, "tolist") else list(output)
    bad = [i for i, v in enumerate(values) if not usable_reward(v)]
    if not bad:
        return output
    if name not in warned:
        warned.add(name)
        logger.warning(
            "reward function %r returned %s for completion %d; a reward that is not finite (or over %g) is handled "
            "as None (NaN: not scored), here and for the rest of the run without another warning",
            name, non_finite_note(float(values[bad[0]])), bad[0], REWARD_LIMIT,
        )  # fmt: skip
    return [None if i in bad else v for i, v in enumerate(values)]


def checked_reward_func(func: Callable, name: str, turns: Callable | None = None) -> Callable:
    """`func` with its output checked by `check_rewards` and non-finite rewards made None (`finite_rewards`); async
    stays async; TRL's name is kept. With `turns`, per-turn lists go to `turns(name, index, values)` and TRL gets
    their sums (a sum that is not finite is None too)."""
    warned: set[str] = set()

    def check(output):
        if turns is not None:
            output = take_turn_rewards(name, output, turns)
        check_rewards(name, output, turns=turns is not None)
        return finite_rewards(name, output, warned)

    if is_async_callable(func):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            return check(await func(*args, **kwargs))

        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return check(func(*args, **kwargs))

    return checked


class NaNRewardGuard:
    """Warn on each training round without a single reward; stop after `max_steps` in a row (module docstring).

    Args:
        max_steps: rounds in a row allowed to have no reward; 0 (the default, TRL's behaviour) never stops.
    """

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.streak = 0

    def update(self, rewards_per_func, names: Sequence[str], step: int) -> None:
        """`rewards_per_func`: the gathered (N, F) tensor of one training round."""
        import torch

        if rewards_per_func.numel() and not torch.isnan(rewards_per_func).all():
            self.streak = 0
            return
        self.streak += 1
        if self.max_steps <= 0 or self.streak < self.max_steps:
            funcs = ", ".join(repr(n) for n in names)
            stop = f"; the run stops after {self.max_steps} in a row" if self.max_steps > 0 else ""
            logger.warning(
                "step %d: reward function(s) %s returned None/NaN for every completion (round %d in a row), so this "
                "round trains nothing%s", step, funcs, self.streak, stop,
            )  # fmt: skip
            return
        if self.streak >= self.max_steps:
            funcs = ", ".join(repr(n) for n in names)
            raise RewardFunctionError(
                f"reward function(s) {funcs} returned None/NaN for every completion in {self.streak} training "
                f"rounds in a row (up to step {step}): nothing can be learned. Check that the reward functions "
                "get the columns they need (e.g. the gold answers) and return floats; set max_nan_reward_steps=0 "
                "to allow such rounds."
            )
