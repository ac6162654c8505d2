"""TreeRL's released form and Tree-GRPO's estimator in the trainer: one step of arpo, aepo and appo on the tiny
model (scripted engine, branch rows sharing their parent's prefix), exact through the tree forward, whose loss gets
exactly the released functions' values (the ports in tests/algorithms, fed only the dump's parents, positions,
lengths and rewards); APPO's dropped branch rows count in the means but are not selected; the config's refusals."""

from __future__ import annotations

import pytest
import torch

from appo_trl.reporting.rollout_dump import read_dumps
from tests.algorithms import tree_grpo_port, treerl_port
from tests.trainer.test_tree_credit_trainer import expand
from tests.trainer.test_tree_trainer import STRATEGIES, VariedChat, assert_step_exact, run_one_step, train_recording

BRANCHING = ("arpo", "aepo", "appo")


def run(request, tmp_path, strategy, compare, **kw):
    """One step, two groups of 4 rows (2 roots) dumped: arpo / aepo on the chat engine branching after every tool
    result (VariedChat), appo on the scripted engine; with `compare`, the loss and gradients row-wise too."""
    if strategy == "appo":
        tok, path = (request.getfixturevalue(f) for f in ("tiny_tokenizer", "tiny_model_path"))
        trainer, _, seen, compared = run_one_step(tmp_path, tok, path, compare=compare, dump_rollouts=2,
                                                  **STRATEGIES["appo"], **kw)  # fmt: skip
        return trainer, seen, compared
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_chat_tools import Reward, multiply, prompts
    from tests.trainer.test_trainer import CPU

    tok, path = (request.getfixturevalue(f) for f in ("tiny_chat_tokenizer", "tiny_chat_model_path"))
    always = 1.0 if strategy == "arpo" else 0.0  # AEPO's P = clip(1 − τ/f + βΔH): 1 at τ = 0
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                      max_completion_length=120, tool_format="chat", initial_rollouts=2, branch_probability=always,
                      beam_size=2, dump_rollouts=2, **kw)  # fmt: skip
    trainer = APPOTrainer(model=path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tok, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = VariedChat(tok)
    seen, compared = train_recording(trainer, compare=compare)
    return trainer, seen, compared


def dumped_groups(tmp_path):
    _, groups = read_dumps(tmp_path)
    assert len(groups) == 2
    return groups


def tree_of(rows, i):
    while rows[i]["parent"] is not None:
        i = rows[i]["parent"]
    return i


def trained_rows(seen, per_token: bool):
    key = lambda values: tuple(round(x, 4) for x in values)  # noqa: E731
    out = []
    for inputs in seen:
        for adv, mask in zip(inputs["advantages"], inputs["completion_mask"]):
            n = int(mask.sum())
            out.append(key(adv[:n].tolist() if per_token else [adv.item()] * n))
    return sorted(out), key


@pytest.mark.parametrize("strategy", BRANCHING)
def test_tree_grpo_advantages_reach_the_loss(strategy, request, tmp_path):
    trainer, seen, compared = run(request, tmp_path, strategy, True, advantage_estimator="tree_grpo")
    assert_step_exact(trainer, seen, compared)  # through the tree forward: the row-wise loss and gradients
    groups = dumped_groups(tmp_path)
    rewards, uid, tree_uid = [], [], []
    for g, group in enumerate(groups):
        rows = group["rows"]
        rewards += [r["reward"] for r in rows]
        uid += [f"p{g}"] * len(rows)
        tree_uid += [f"p{g}t{tree_of(rows, i)}" for i in range(len(rows))]
    assert len(set(tree_uid)) < len(tree_uid), "the case is not trivial: some tree holds a branch"
    want = tree_grpo_port.released_tree(torch.tensor(rewards, dtype=torch.float64), uid, tree_uid)
    dumped = [r["advantage"] for group in groups for r in group["rows"]]
    assert dumped == pytest.approx(want.tolist(), abs=1e-5)
    trained, key = trained_rows(seen, per_token=False)
    assert all(inputs["advantages"].dim() == 1 for inputs in seen)
    kept = sorted(key([r["advantage"]] * r["length"]) for group in groups for r in group["rows"] if r["kept"])
    assert trained == kept and len(set(trained)) > 2


@pytest.mark.parametrize("strategy,branch_rows", [("arpo", None), ("aepo", None), ("appo", True), ("appo", False)])
def test_treerl_released_values_reach_the_loss(strategy, branch_rows, request, tmp_path):
    kw = {} if branch_rows is None else {"tree_credit_branch_rows": branch_rows}
    trainer, seen, compared = run(request, tmp_path, strategy, strategy == "arpo", advantage_estimator="tree",
                                  tree_credit_form="treerl_released", **kw)  # fmt: skip
    if compared:
        assert_step_exact(trainer, seen, compared)
    groups = dumped_groups(tmp_path)
    expected = []
    for group in groups:
        rows = group["rows"]
        parents = [-1 if r["parent"] is None else r["parent"] for r in rows]
        bp = [r["branch_pos"] or 0 for r in rows]
        kept = {i for i, r in enumerate(rows) if r["kept"]}
        if strategy == "appo" and branch_rows is False:
            assert len(kept) == 2 < len(rows), "APPO's branch rows are dropped, so not selected"
        want, _ = treerl_port.released_values(parents, bp, [r["length"] for r in rows],
                                              [r["reward"] for r in rows], 0, 0, selected_rows=kept)  # fmt: skip
        for i, r in enumerate(rows):
            got = expand(r["advantage_runs"], r["length"])
            assert got == pytest.approx(want[i] if i in kept else [0.0] * r["length"], abs=1e-5)
            if i in kept:
                expected.append(tuple(round(x, 4) for x in got))
    assert any(p is not None for g in groups for p in (r["parent"] for r in g["rows"])), "rows share a prefix"
    trained, _ = trained_rows(seen, per_token=True)
    assert trained == sorted(expected)


def test_config_refuses_what_the_released_forms_cannot_honour(tmp_path):
    from tests.algorithms.fidelity_helpers import make

    with pytest.raises(ValueError, match="advantage_estimator=tree_grpo needs a branching strategy"):
        make(advantage_estimator="tree_grpo")  # grpo
    with pytest.raises(ValueError, match="tree_credit_form only apply with advantage_estimator=tree"):
        make(rollout_strategy="arpo", advantage_estimator="tree_grpo", tree_credit_form="treerl_released")
    with pytest.raises(ValueError, match="tree_credit_local_weight only apply with advantage_estimator=tree "):
        make(rollout_strategy="arpo", advantage_estimator="tree_grpo", tree_credit_local_weight=0.0)
    with pytest.raises(ValueError, match="tree_grpo_combine only applies with advantage_estimator=tree_grpo"):
        make(rollout_strategy="arpo", advantage_estimator="tree", tree_grpo_combine="nested")
    with pytest.raises(ValueError, match="treerl_released fixes tree_credit_scale"):
        make(rollout_strategy="arpo", advantage_estimator="tree", tree_credit_form="treerl_released",
             tree_credit_scale="none")  # fmt: skip
    with pytest.raises(ValueError, match="released ε 1e-6; advantage_std_eps=0.001 does not apply"):
        make(rollout_strategy="arpo", advantage_estimator="tree_grpo", advantage_std_eps=1e-3)
    with pytest.raises(ValueError, match="scale_rewards='none' does not apply"):
        make(rollout_strategy="arpo", advantage_estimator="tree_grpo", scale_rewards="none")
    with pytest.raises(ValueError, match="tree_credit_branch_rows only applies with advantage_estimator=tree or"):
        make(rollout_strategy="appo", tree_credit_branch_rows=False)
    with pytest.raises(ValueError, match="tree_credit_form"):
        make(rollout_strategy="arpo", advantage_estimator="tree", tree_credit_form="treerl")
    assert make(rollout_strategy="appo", advantage_estimator="tree_grpo").tree_credit_branch_rows is True
    cfg = make(reference="tree_grpo")
    assert (cfg.rollout_strategy, cfg.entropy_weight, cfg.loss_mode) == ("arpo", 0.0, "dual_clip")
    assert (cfg.advantage_estimator, cfg.tree_grpo_combine, cfg.advantage_std_eps) == ("tree_grpo", "sum", 1e-6)
    with pytest.raises(ValueError, match="reference=tree_grpo sets advantage_estimator='tree_grpo'"):
        make(reference="tree_grpo", advantage_estimator="tree")


def test_per_turn_rewards_are_refused_by_the_released_forms(tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    """The released estimators take one outcome per row: a per-turn list is a one-line error naming the function."""
    from appo_trl.trainer.reward_checks import RewardFunctionError
    from tests.trainer.test_turn_rewards import TurnReward, make

    for i, kw in enumerate(({"advantage_estimator": "tree", "tree_credit_form": "treerl_released"},
                            {"advantage_estimator": "tree_grpo"})):  # fmt: skip
        trainer = make(tmp_path / str(i), tiny_chat_tokenizer, tiny_chat_model_path, TurnReward(), **kw)
        with pytest.raises(
            RewardFunctionError, match="'turn_reward' .* set advantage_estimator=tree, tree_credit_form=paper"
        ):
            trainer.train()


def test_lineage_roots_follow_the_typed_parent_not_the_shared_tokens():
    """Tree-GRPO's trees: a row joins the tree of the row it was branched from, even when it shares only the prompt
    (an agent run branched by replay); a refill and an initial rollout are roots; a parent outside the group is none."""
    from types import SimpleNamespace as Row

    from appo_trl.rollout.group_tree import GroupTree, lineage_roots

    rows = [
        Row(uid="a", parent=None, branch_pos=0, prompt_ids=[1], completion_ids=[5, 6, 7]),
        Row(uid="b", parent="a", branch_pos=2, prompt_ids=[1], completion_ids=[5, 6, 9]),  # a fork of a
        Row(uid="c", parent="b", branch_pos=2, prompt_ids=[1], completion_ids=[8, 8]),  # replayed: only the prompt
        Row(uid="d", parent=None, branch_pos=0, prompt_ids=[1], completion_ids=[4]),  # a refill
        Row(uid="e", parent="zz", branch_pos=1, prompt_ids=[1], completion_ids=[4, 4]),  # parent not in the group
    ]
    assert GroupTree.of(rows).parents == (-1, 0, -1, -1, -1)  # token sharing: c shares only the prompt
    assert lineage_roots(rows) == (0, 0, 0, 3, 4)
    rows[0].parent = "c"
    with pytest.raises(ValueError, match="parent chain loops"):
        lineage_roots(rows)


def test_tree_grpo_on_agent_runs_branched_by_replay(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """An agent's fork (branched by replay) joins its root's tree: each group of (root, fork) is one tree, and the
    loss gets the port's advantages over it."""
    pytest.importorskip("openai")
    from tests.trainer.test_agents import make_trainer, sdk_agent
    from tests.trainer.test_trainer import spy_loss

    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent, "arpo",
                              initial_rollouts=1, branch_probability=1.0, advantage_estimator="tree_grpo")  # fmt: skip
    strat, calls = trainer.rounds.strategy, []
    real = strat.advantages
    strat.advantages = lambda batch, rewards, *a: (
        calls.append((batch, rewards, real(batch, rewards, *a))) or calls[-1][2]
    )
    seen = spy_loss(trainer)
    trainer.train()
    assert len(calls) == 2
    trained = sorted(round(x, 5) for s in seen for x in s["advantages"].tolist())
    expected = []
    for batch, rewards, adv in calls:
        uid, tree_uid = [], []
        for g, (root, fork) in enumerate(batch.groups):
            assert fork.parent == root.uid and fork.origin == "fork"
            uid += [f"p{g}"] * 2
            tree_uid += [f"p{g}r"] * 2  # one tree: the root and its replayed fork
        want = tree_grpo_port.released_tree(rewards.double(), uid, tree_uid)
        assert adv.tolist() == pytest.approx(want.tolist(), abs=1e-5)
        expected += [round(x, 5) for x in adv.tolist()]
    assert trained == sorted(expected)
