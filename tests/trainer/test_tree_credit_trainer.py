"""`advantage_estimator: tree` in the trainer: a tiny ARPO run (chat tools, branches after the tool result) whose
loss gets the estimator's token advantages, exactly through the tree forward; the dump's `advantage_runs` recomputed
from `parent`, `branch_pos`, `length` and `reward` alone; APPO's branch rows in or out of the loss; the config."""

from __future__ import annotations

import math

import pytest

from appo_trl.reporting.rollout_dump import read_dumps
from tests.trainer.test_tree_trainer import VariedChat, assert_step_exact, train_recording


def recompute(rows: list[dict]) -> list[list[float]]:
    """TreeRL's advantages from the dump fields alone, naively (independent of appo_trl.algorithms.tree_credit)."""
    R = len(rows)
    par = [-1 if r["parent"] is None else r["parent"] for r in rows]
    bp = [r["branch_pos"] or 0 for r in rows]
    L, rw = [r["length"] for r in rows], [r["reward"] for r in rows]

    def canon(i, t):  # the highest row of i's lineage holding its token t
        while par[i] >= 0 and t < bp[i]:
            i = par[i]
        return i

    def holders(i, t):
        return frozenset(j for j in range(R) if t < L[j] and canon(j, t) == canon(i, t))

    mean = lambda s: sum(rw[j] for j in s) / len(s)  # noqa: E731
    root = sum(rw) / R
    out = []
    for i in range(R):
        adv = []
        for t in range(L[i]):
            s, u = holders(i, t), t
            while u > 0 and holders(i, u - 1) == s:  # back to the node's first token
                u -= 1
            v_parent = mean(holders(i, u - 1)) if u > 0 else root
            adv.append(((mean(s) - root) + (mean(s) - v_parent)) / math.sqrt(len(s)))
        out.append(adv)
    return out


def expand(runs: list[list], length: int) -> list[float]:
    assert runs[0][0] == 0 and runs[-1][1] == length and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    return [v for s, e, v in runs for _ in range(s, e)]


def test_arpo_tree_credit_reaches_the_loss_exactly_and_the_dump_recomputes(
    tiny_chat_model_path, tiny_chat_tokenizer, tmp_path
):
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_chat_tools import Reward, multiply, prompts
    from tests.trainer.test_trainer import CPU

    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                      max_completion_length=120, tool_format="chat", initial_rollouts=2, branch_probability=1.0,
                      beam_size=2, advantage_estimator="tree", dump_rollouts=2)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tiny_chat_tokenizer, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = VariedChat(tiny_chat_tokenizer)
    seen, compared = train_recording(trainer, compare=True)
    assert_step_exact(trainer, seen, compared)  # token advantages through the tree forward: the row-wise loss
    _, groups = read_dumps(tmp_path)
    assert len(groups) == 2
    branched = 0
    for g in groups:
        rows = g["rows"]
        branched += sum(r["parent"] is not None and r["branch_pos"] > 0 for r in rows)
        for row, want in zip(rows, recompute(rows)):
            assert expand(row["advantage_runs"], row["length"]) == pytest.approx(want, abs=1e-5)
            assert row["node_runs"][-1][1] == row["length"]
        for row in rows:  # a token shared with the parent carries the parent's value
            if row["parent"] is not None:
                mine, theirs = (expand(r["advantage_runs"], r["length"]) for r in (row, rows[row["parent"]]))
                assert mine[: row["branch_pos"]] == theirs[: row["branch_pos"]]
    assert branched > 0, "the case is not trivial: rows share a prefix past the prompt"
    # the loss saw (B, T) advantages: for each of the round's 8 rows, exactly one dumped row's values
    key = lambda values: tuple(round(x, 5) for x in values)  # noqa: E731
    dumped = sorted(key(expand(r["advantage_runs"], r["length"])) for g in groups for r in g["rows"])
    trained = []
    for inputs in seen:
        assert inputs["advantages"].dim() == 2
        for adv, mask in zip(inputs["advantages"], inputs["completion_mask"]):
            trained.append(key(adv[: int(mask.sum())].tolist()))
    assert sorted(trained) == dumped and len(set(dumped)) > 2
    from rich.console import Console

    from appo_trl.cli.rollouts import group_tree

    console = Console(record=True, width=200)
    console.print(group_tree(groups[0]))
    text = console.export_text()
    assert "  V [0," in text and "×2 [" in text and "·  A " in text  # node values on the tree


def run_appo(tmp_path, tokenizer, model_path, **kw):
    from tests.trainer.fakes import ScriptedEngine
    from tests.trainer.test_trainer import RewardSpy, make_trainer

    engine = ScriptedEngine(tokenizer, filler=6)
    trainer = make_trainer(
        tmp_path, tokenizer, model_path, engine, RewardSpy(), tools=["python"], num_generations=4,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, max_completion_length=96,
        min_remaining_tokens=4, rollout_strategy="appo", initial_rollouts=2, advantage_estimator="tree", **kw,
    )  # fmt: skip
    seen, _ = train_recording(trainer, compare=False)
    return trainer, seen


@pytest.mark.parametrize("branch_rows", [True, False])
def test_appo_tree_credit_branch_rows_option(branch_rows, tiny_model_path, tiny_tokenizer, tmp_path):
    trainer, seen = run_appo(tmp_path, tiny_tokenizer, tiny_model_path, tree_credit_branch_rows=branch_rows)
    rows = sum(s["completion_ids"].size(0) for s in seen)
    assert rows == (8 if branch_rows else 4), "two groups of 4 rows (2 initial) per round: branch rows in or out"
    assert all(s["advantages"].dim() == 2 for s in seen)
    assert trainer.args.drops_branch_rows is (not branch_rows)


def test_config_refuses_what_tree_credit_cannot_honour(tmp_path):
    from appo_trl.config import APPOConfig
    from tests.trainer.test_trainer import CPU

    def make(**kw):
        return APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4, **kw)

    with pytest.raises(ValueError, match="advantage_estimator=tree needs a branching strategy"):
        make(advantage_estimator="tree")  # grpo
    with pytest.raises(ValueError, match="tree_credit_local_weight only apply with advantage_estimator=tree"):
        make(rollout_strategy="arpo", tree_credit_local_weight=0.0)
    with pytest.raises(ValueError, match="must be finite"):
        make(rollout_strategy="arpo", advantage_estimator="tree", tree_credit_global_weight=0.0,
             tree_credit_local_weight=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="tree_credit_branch_rows is an appo option"):
        make(rollout_strategy="aepo", advantage_estimator="tree", tree_credit_branch_rows=True)
    assert make(rollout_strategy="appo", advantage_estimator="tree").tree_credit_branch_rows is True
    assert make(rollout_strategy="appo").tree_credit_branch_rows is None
    with pytest.raises(ValueError, match="advantage_estimator"):
        make(rollout_strategy="arpo", advantage_estimator="treerl")
