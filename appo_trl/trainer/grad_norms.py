"""A grad norm that is not finite, said out loud: one warning line, and an error once nothing trains.

transformers clips the gradient by its total norm; when that norm is inf or NaN (huge advantages, say tree-credit
weights of 1e30, or a NaN in the loss) the clip scales every gradient to zero or NaN, so the step changes nothing or
ruins the weights, while the console only shows `grad_norm: inf`. `GradNormWatch.step` sees each optimizer step's norm
(`APPOTrainer._maybe_log_save_evaluate`): the first non-finite one is one warning line naming the step; `STREAK`
steps in a row (or every step of a shorter run) raise `GradNormError`, which ends the stage with one line, and so
does a step that left the weights themselves not finite (an inf gradient times the clip's zero is NaN): nothing
after it could train or sample.

What it does not do: find which parameter overflowed, or skip the step (transformers has taken it already).
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

STREAK = 3  # optimizer steps in a row with a non-finite grad norm: the run trains nothing, it stops


class GradNormError(RuntimeError):
    """Optimizer steps in a row whose grad norm was not finite: none of them changed the weights usefully."""


_HINT = ("the advantages or the loss are too large for float32 or not finite (tree_credit weights, reward "
         "scale, a NaN reward reaching the loss)")  # fmt: skip


class GradNormWatch:
    """Counts optimizer steps whose total grad norm is inf or NaN (see the module head).

    Args:
        max_steps: the run's optimizer steps (a shorter run than `STREAK` stops once all of its steps were).
    """

    def __init__(self, max_steps: int = 0):
        self.limit = min(STREAK, max_steps) if max_steps > 0 else STREAK
        self.streak, self.bad_steps, self.last_step = 0, 0, -1
        self._warned = False

    def step(self, grad_norm, global_step: int, model=None) -> None:
        """Note the grad norm of optimizer step `global_step` (None: not computed, e.g. no clipping); `model`: the
        weights checked for inf / NaN after a non-finite norm (this process's shard under ZeRO-3 / FSDP)."""
        if grad_norm is None or global_step == self.last_step:  # transformers passes one step's norm twice at an
            return  # epoch's end
        self.last_step = global_step
        value = float(grad_norm.item() if hasattr(grad_norm, "item") else grad_norm)
        if math.isfinite(value):
            self.streak = 0
            return
        self.streak, self.bad_steps = self.streak + 1, self.bad_steps + 1
        if model is not None and not all(bool(p.isfinite().all()) for p in model.parameters()):
            raise GradNormError(f"step {global_step}: the grad norm was {value} and the weights are no longer finite "
                                f"after the update, so training cannot go on; {_HINT}")  # fmt: skip
        if self.streak >= self.limit:
            raise GradNormError(
                f"the grad norm was {value} at {self.streak} optimizer steps in a row (up to step {global_step}): "
                f"clipping made every update zero or NaN, so nothing trains; {_HINT}"
            )
        if not self._warned:
            self._warned = True
            logger.warning("step %d: the grad norm is %s, so this step's update is lost (clipped to zero or NaN); %s. "
                           "%d such steps in a row stop the run (this warning is shown once)", global_step, value,
                           _HINT, self.limit)  # fmt: skip


__all__ = ["STREAK", "GradNormError", "GradNormWatch"]
