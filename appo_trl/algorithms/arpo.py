"""ARPO / AEPO rollout-time branching maths (ARPO paper, entropy-based adaptive rollout; docs/fidelity.md).

Scalar functions of entropies, probabilities and counts used by the rollout hook, plus `ARPOBranchState`, a
small per-rollout-call state holder (H_root per trajectory, inherited by branches; consecutive-branch counter per
prompt). A fresh state per `generate` call avoids the reference's never-cleared global dict (docs/fidelity.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any


def _clip01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def arpo_branch_probability(
    entropy: float,
    root_entropy: float = 0.0,
    *,
    base: float = 0.5,
    weight: float = 0.2,
    penalty_factor: float | None = None,
) -> float:
    """Per-attempt branch probability from ΔH = `entropy` − `root_entropy` (NaN on either side → ΔH = 0).

    ARPO (`penalty_factor=None`, ARPO paper Eq. for P_t = α + β·ΔH_t, made stochastic by the released rollout):
    the released code draws u ~ U(0,1) and branches iff clip(u − βΔH, 0, 1) ≤ τ, i.e. with probability
    P = clip(τ + β·ΔH, 0, 1) for τ ∈ [0, 1) (τ = `base`, β = `weight`). At τ = 1 the clipped value is always
    ≤ 1, so the reference always branches: P = 1 whatever ΔH (the closed form would give clip(1 + βΔH)).

    AEPO (`penalty_factor=f`, AEPO paper's consecutive-branch penalty): the released code branches iff
    clip(f·(u + βΔH), 0, 1) ≥ τ. For f > 0 and τ ∈ (0, 1] this is u ≥ τ/f − βΔH, so P = clip(1 − τ/f + β·ΔH, 0, 1);
    f ≤ 0 gives 0. At τ = 0 every value passes (≥ 0): P = 1 whatever ΔH and f. At f = 1 the AEPO form equals
    ARPO's only for τ = 0.5. f comes from `aepo_consecutive_penalty`.
    Examples: ΔH = 1, τ = 0.5, β = 0.2 → ARPO 0.7; AEPO f = 0.9 → 1 − 0.5556 + 0.2 = 0.6444;
    ARPO τ = 1, β = 0.5, ΔH = −3 → 1.0; AEPO τ = 0, ΔH = −3 → 1.0 (docs/fidelity.md, "τ at its bounds").
    """
    delta = 0.0 if math.isnan(entropy) or math.isnan(root_entropy) else entropy - root_entropy
    if penalty_factor is None:
        return 1.0 if base >= 1.0 else _clip01(base + weight * delta)
    if base <= 0.0:
        return 1.0
    if penalty_factor <= 0:
        return 0.0
    return _clip01(1.0 - base / penalty_factor + weight * delta)


def aepo_consecutive_penalty(k: int, rate: float = 0.05) -> float:
    """AEPO's consecutive-branch factor f = max(0, 1 − rate·k) after k consecutive branching rounds (AEPO paper).

    Example: k = 2, rate 0.05 → 0.9. Pass it as `penalty_factor` to `arpo_branch_probability`.
    """
    return max(0.0, 1.0 - rate * k)


def aepo_initial_rollouts(h_root: float, h_tool_avg: float, n: int, beta: float = 0.5) -> int:
    """AEPO dynamic global budget: clamp(int(n·σ(β·(H_root − H_tool_avg))) + 1, 1, n) (AEPO paper; docs/fidelity.md).

    Example: ΔH = 0, n = 16 → int(8) + 1 = 9; ΔH = +∞ → 16; ΔH = −∞ → 1.
    """
    z = beta * (h_root - h_tool_avg)
    sig = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return min(max(int(n * sig) + 1, 1), n)


def sample_branch_copies(prob: float, max_copies: int, rng: Any, slots: int | None = None) -> int:
    """Number of branch copies from one source: one Bernoulli(`prob`) per potential copy (ARPO paper).

    min(`max_copies` (= beam_size − 1), `slots` (remaining group budget; None = unlimited)) attempts are drawn with
    `rng.random()` (a `random.Random`); each success is one copy.
    """
    attempts = max_copies if slots is None else min(max_copies, max(slots, 0))
    return sum(1 for _ in range(max(attempts, 0)) if rng.random() < prob)


@dataclass
class ARPOBranchState:
    """Branching state of one rollout call (docs/fidelity.md): create one per `generate`, never a module-level global.

    `root_entropy[uid]` is H_root of a trajectory (its first-window entropy), inherited by its branches;
    `consecutive[prompt]` counts the rounds in a row in which that prompt created new trajectories (AEPO paper).
    """

    root_entropy: dict[Hashable, float] = field(default_factory=dict)
    consecutive: dict[Hashable, int] = field(default_factory=dict)

    def set_root(self, uid: Hashable, h_root: float) -> None:
        """Record H_root of a fresh trajectory (first call wins: later segments never overwrite it)."""
        self.root_entropy.setdefault(uid, h_root)

    def inherit(self, child: Hashable, parent: Hashable) -> None:
        """A branch copies its parent's H_root."""
        self.root_entropy[child] = self.root_entropy.get(parent, math.nan)

    def root(self, uid: Hashable) -> float:
        """H_root of `uid` (NaN if unknown, which makes ΔH = 0)."""
        return self.root_entropy.get(uid, math.nan)

    def end_round(self, prompt: Hashable, created: bool) -> int:
        """Update the prompt's consecutive counter after a round (+1 if it created trajectories, else reset to 0)."""
        self.consecutive[prompt] = self.consecutive.get(prompt, 0) + 1 if created else 0
        return self.consecutive[prompt]

    def end_batch_round(self, prompts: Iterable[Hashable], created: Iterable[Hashable]) -> None:
        """The released AEPO rollout's update after one synchronous round of the whole batch.

        Every prompt of `prompts` goes through `end_round` (+1 if it is in `created`, i.e. it made at least one new
        trajectory this round: a branch *or* a refill from the bare prompt; else reset to 0), but only when some
        prompt created something: a round in which nothing in the batch was created changes no counter.
        Example: prompt a creates in rounds 1 and 2, nothing is created anywhere in round 3, a creates in round 4
        → counters 1, 2, 2, 3 (a per-lineage count would reset in round 3).
        """
        made = set(created)
        if not made:
            return
        for p in prompts:
            self.end_round(p, p in made)

    def penalty_factor(self, prompt: Hashable, rate: float = 0.05) -> float:
        """`aepo_consecutive_penalty` of the prompt's current counter."""
        return aepo_consecutive_penalty(self.consecutive.get(prompt, 0), rate)


@dataclass
class PromptRoundCounter:
    """The released AEPO consecutive-branch counter (per prompt, refills count, no reset in empty rounds),
    fed by decisions that may arrive out of round order (an asynchronous sampler has no round barrier).

    Round r is the r-th synchronous generation round of the released rollout: a root's k-th tool call is decided in
    round k, a fork continues its parent's rounds, a refill created at the end of round R decides its first call in
    round R + 1. `record(prompt, round)` notes that `prompt` created a trajectory in `round`; `counter(prompt,
    round)` first closes every round < `round` not yet closed, in order, with `ARPOBranchState.end_batch_round`,
    then returns the prompt's counter. Exact when decisions arrive in round order (as in the released sampler);
    with asynchronous trajectories a creation recorded for an already closed round is counted in the next open one.
    """

    state: ARPOBranchState = field(default_factory=ARPOBranchState)
    created: dict[int, set] = field(default_factory=dict)
    prompts: set = field(default_factory=set)
    closed: int = 0  # rounds < closed have been applied

    def record(self, prompt: Hashable, round_index: int) -> None:
        self.prompts.add(prompt)
        self.created.setdefault(max(round_index, self.closed), set()).add(prompt)

    def counter(self, prompt: Hashable, round_index: int) -> int:
        self.prompts.add(prompt)
        while self.closed < round_index:
            self.state.end_batch_round(sorted(self.prompts, key=repr), self.created.pop(self.closed, set()))
            self.closed += 1
        return self.state.consecutive.get(prompt, 0)
