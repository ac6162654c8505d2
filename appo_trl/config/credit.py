"""`APPOConfig`'s tree-credit fields: their help and their one check (`check_credit`).

The fields are declared on `APPOConfig`; the maths is `appo_trl.algorithms.tree_credit`, the adapter from a round's
trajectories `appo_trl.strategies.credit`.
"""

from __future__ import annotations

import math
from dataclasses import field

from appo_trl.config.checks import fail
from appo_trl.config.script import _strategy

CREDIT_HELP = {
    "advantage_estimator": _strategy(
        "`group` (default): the strategy's own advantages (TRL's group advantage; APPO's dual group). `tree`: "
        "TreeRL's step-level credit on the group's branch tree (arpo, aepo, appo): each token gets "
        "(w_global·(V(n) − V(root)) + w_local·(V(n) − V(parent(n)))) / sqrt(rows through n), n the deepest node "
        "holding it, V(n) the mean reward (return-to-go with per-turn rewards) of the rows through n, V(root) the "
        "group mean; no std normalisation (the paper's equations; `tree_credit_form: treerl_released` for the "
        "released code). Tokens shared by several rows get one value. `tree_grpo`: Tree-GRPO's outcome advantage, "
        "the reward z-scored within the prompt's group and within its tree (a root rollout and every row branched "
        "from it), unbiased std, ε 1e-6. Both refused for grpo (no branch: `tree` would be 2·(r − mean), TRL's "
        "`scale_rewards: none` doubled; every `tree_grpo` tree a single row)."
    ),
    "tree_credit_global_weight": _strategy("advantage_estimator=tree: w_global, weight of V(n) − V(root)."),
    "tree_credit_local_weight": _strategy(
        "advantage_estimator=tree: w_local, weight of V(n) − V(parent(n)) (0: the global term alone, which "
        "without branches is exactly GRPO's centred advantage r − mean)."
    ),
    "tree_credit_scale": _strategy(
        "advantage_estimator=tree: `sqrt_rows` (TreeRL) divides a token's advantage by sqrt(rows through its "
        "node), so a prefix shared by k rows, trained k times, weighs like sqrt(k) rows; `none` does not."
    ),
    "tree_credit_form": _strategy(
        "advantage_estimator=tree: `paper` (default, the equations of arXiv 2506.11902) or `treerl_released` "
        "(THUDM/TreeRL's released code and script: leave-one-out leaf baseline, the sqrt per node over the "
        "selected rows, local terms below 1e-8 carried forward, an empty node under a branch at a row's first "
        "token; outcome rewards only, weights 1 and scale sqrt_rows). Selected rows: those that reach the loss "
        "(APPO's branch rows count only with tree_credit_branch_rows). docs/fidelity.md, Tree credit."
    ),
    "tree_grpo_combine": _strategy(
        "advantage_estimator=tree_grpo: `sum` (default; the released scripts' `adv_estimator=tree`): "
        "z_group(r) + z_tree(r); `nested` (the released `compute_tree_grpo_outcome_advantage`): "
        "z_tree(z_group(r))."
    ),
    "tree_credit_branch_rows": _strategy(
        "appo with advantage_estimator=tree or tree_grpo: the branch rows reach the loss too (default true: their "
        "tokens after the branch point carry their own node values); false keeps APPO's rule (initial rollouts "
        "only)."
    ),
}


def credit_field(name: str, default):
    """The dataclass field `name` of `APPOConfig`, with its help."""
    return field(default=default, metadata=CREDIT_HELP[name])


# the advantages are float32 and scale with the weights: a gradient's squared norm overflows float32 (3.4e38) once a
# token's advantage nears 1.8e19 / sqrt(parameters), 1.8e13 for a 1e12-parameter model; weights up to 1e6 leave the
# rewards a range of 1e7 below that (larger weights mean nothing but overflow: the clip then zeroes every update)
MAX_WEIGHT = 1e6
MIN_WEIGHT = 1.2e-38  # float32's smallest normal number: below it the weights flush to 0 there

DEFAULTS = {
    "tree_credit_global_weight": 1.0,
    "tree_credit_local_weight": 1.0,
    "tree_credit_scale": "sqrt_rows",
    "tree_credit_form": "paper",
}
TREE_GRPO_EPS = 1e-6  # the released ε (AMAP-ML/Tree-GRPO, core_algos.py)


def check_credit(cfg, strategy) -> None:
    """Refuse a tree-credit setting that cannot be honoured; resolve `tree_credit_branch_rows` (appo only)."""
    estimator = cfg.advantage_estimator
    changed = [k for k, v in DEFAULTS.items() if getattr(cfg, k) != v]
    if estimator != "tree" and changed:
        fail(f"{', '.join(changed)} only apply with advantage_estimator=tree (it is {estimator!r}).")
    if estimator != "tree_grpo" and cfg.tree_grpo_combine != "sum":
        fail(f"tree_grpo_combine only applies with advantage_estimator=tree_grpo (it is {estimator!r}).")
    if estimator == "group":
        if cfg.tree_credit_branch_rows is not None:
            fail(
                f"tree_credit_branch_rows only applies with advantage_estimator=tree or tree_grpo (it is {estimator!r})."
            )
        return
    if not strategy.branches:
        fail(
            f"advantage_estimator={estimator} needs a branching strategy (arpo, aepo, appo): {strategy.name}'s groups "
            + (
                "have no branch, where tree credit is 2·(r − mean), TRL's `scale_rewards: none` doubled."
                if estimator == "tree"
                else "have no branch, so every tree is one row and Tree-GRPO adds its raw reward to GRPO's advantage."
            )
        )
    if estimator == "tree":
        w = (cfg.tree_credit_global_weight, cfg.tree_credit_local_weight)
        for name, x in zip(("tree_credit_global_weight", "tree_credit_local_weight"), w):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                fail(f"{name}={x!r} must be a number.")
        if not all(math.isfinite(x) and x >= 0 for x in w) or not any(w):
            fail(f"tree_credit weights (global, local) = {w} must be finite, >= 0 and not both 0.")
        if sum(w) < MIN_WEIGHT:
            fail(f"tree_credit weights (global, local) = {w} sum to under {MIN_WEIGHT:g}, which is 0 in float32: "
                 "the advantages would all be 0 and nothing would train.")
        if sum(w) > MAX_WEIGHT:
            fail(f"tree_credit weights (global, local) = {w} sum to over {MAX_WEIGHT:g}: the float32 advantages would "
                 "overflow the gradient norm and clipping would zero every update (the scale of the advantages does not "
                 "matter to the clipped loss beyond that; scale the rewards instead).")
        fixed = [
            k for k in ("tree_credit_global_weight", "tree_credit_local_weight", "tree_credit_scale") if k in changed
        ]
        if cfg.tree_credit_form == "treerl_released" and fixed:
            fail(
                f"tree_credit_form=treerl_released fixes {', '.join(fixed)} (the released code has weights 1, the sqrt scale)."
            )
    else:  # tree_grpo: the released ε and the group std
        if cfg.advantage_std_eps not in (1e-4, TREE_GRPO_EPS):
            fail(
                f"advantage_estimator=tree_grpo normalises with the released ε 1e-6; advantage_std_eps={cfg.advantage_std_eps} does not apply."
            )
        if cfg.scale_rewards not in ("group", True):
            fail(
                f"advantage_estimator=tree_grpo scales by the group and tree std; scale_rewards={cfg.scale_rewards!r} does not apply."
            )
    if cfg.tree_credit_branch_rows is not None and not strategy.drops_branch_rows:
        fail(f"tree_credit_branch_rows is an appo option; {strategy.name} trains every row already.")
    if strategy.drops_branch_rows and cfg.tree_credit_branch_rows is None:
        cfg.tree_credit_branch_rows = True
