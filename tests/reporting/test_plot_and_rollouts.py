"""`appo plot OUTPUT_DIR` draws the training curves; `appo rollouts OUTPUT_DIR` shows dumped groups as trees."""

from __future__ import annotations

import json

import pytest

from appo_trl.cli import main
from appo_trl.cli.plot import find_trainer_state, plot_training_curves, series
from appo_trl.cli.rollouts import group_tree

HISTORY = [
    {"step": 1, "reward": -0.5, "reward_std": 0.2, "rewards/math_verify/mean": 0.25, "tools/call_frequency": 1.0,
     "branch/points_per_prompt": 2.0, "loss": 0.1, "step_time": 1.5},
    {"step": 2, "reward": 0.0, "reward_std": 0.1, "rewards/math_verify/mean": 0.5, "tools/call_frequency": 1.5,
     "branch/points_per_prompt": 2.0, "loss": 0.05, "step_time": 1.2},
    {"step": 2, "eval_reward": 0.3, "eval_loss": 0.0},
    {"step": 2, "train_runtime": 3.0, "train_loss": 0.075},
]  # fmt: skip


def test_series_and_panels(tmp_path):
    assert series(HISTORY, "reward") == ([1, 2], [-0.5, 0.0])
    assert series(HISTORY, "accuracy") == ([1, 2], [0.25, 0.5])
    out = tmp_path / "curves.png"
    drawn = plot_training_curves(HISTORY, out)
    assert drawn == [
        "reward",
        "accuracy",
        "tool calls / completion",
        "branch points / prompt",
        "loss",
        "step time (s)",
    ]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a grpo run without a correctness reward: no accuracy, no branch panel
    grpo = [{k: v for k, v in e.items() if not k.startswith(("branch/", "rewards/"))} for e in HISTORY]
    assert plot_training_curves(grpo, tmp_path / "g.png") == ["reward", "tool calls / completion", "loss",
                                                               "step time (s)"]  # fmt: skip


def test_trainer_state_found_in_output_dir_or_newest_checkpoint(tmp_path):
    for n in (9, 10):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "trainer_state.json").write_text(json.dumps({"log_history": HISTORY}))
    assert find_trainer_state(tmp_path) == tmp_path / "checkpoint-10" / "trainer_state.json"
    (tmp_path / "trainer_state.json").write_text("{}")
    assert find_trainer_state(tmp_path) == tmp_path / "trainer_state.json"


def test_plot_without_state_is_one_clear_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("appo plot: No trainer_state.json in") and err.count("\n") == 1


RECORD = {
    "step": 3, "group": 0, "strategy": "appo", "prompt": "what is 3 times 4", "answer": "12",
    "rows": [
        {"index": 0, "uid": "a", "parent": None, "origin": "root", "branch_pos": None, "fork_context": "",
         "reward": 1.0, "advantage": 0.5, "kept": True, "num_calls": 1,
         "tool_calls": [{"tag": "python", "query": "print(3*4)", "ok": True, "result": "12"}],
         "finish_reason": "eos", "length": 30, "completion": "<python> print(3*4) </python> <answer> 12 </answer>"},
        {"index": 1, "uid": "b", "parent": None, "origin": "root", "branch_pos": None, "fork_context": "",
         "reward": -1.0, "advantage": -0.5, "kept": True, "num_calls": 0, "tool_calls": [],
         "finish_reason": "length", "length": 96, "completion": "the the the"},
        {"index": 2, "uid": "c", "parent": 0, "origin": "branch", "branch_pos": 5, "fork_context": "<python> print",
         "reward": 0.0, "advantage": 0.0, "kept": False, "num_calls": 1,
         "tool_calls": [{"tag": "python", "query": "1/0", "ok": False, "result": "ZeroDivisionError"}],
         "finish_reason": "eos", "length": 20, "completion": "<python> 1/0 </python>"},
    ],
}  # fmt: skip


def _render(renderable) -> str:
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_group_tree_shows_forks_rewards_and_tool_calls():
    text = _render(group_tree(RECORD, chars=0))
    lines = text.splitlines()
    assert "what is 3 times 4" in lines[0] and "answer: 12" in lines[0]
    root0 = next(i for i, line in enumerate(lines) if "#0 root" in line)
    branch = next(i for i, line in enumerate(lines) if "#2 branch @ token 5" in line)
    assert branch == root0 + 1 and lines[branch].index("#2") > lines[root0].index("#0")  # nested under #0
    assert "reward +1.000" in lines[root0] and "[python ✓]" in lines[root0]
    assert 'after "…<python> print"' in lines[branch] and "[python ✗]" in lines[branch]
    assert "(not in loss)" in lines[branch] and "no tool calls" in text


def test_rollouts_without_dump_says_how_to_get_one(tmp_path, capsys):
    assert main(["rollouts", str(tmp_path)]) == 2
    assert "--dump_rollouts" in capsys.readouterr().err


def test_dump_rollouts_on_trl_sampler_is_an_error(tmp_path, tiny_model_path, tiny_tokenizer):
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_trainer import CPU, dataset

    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=16, dump_rollouts=1)  # fmt: skip
    with pytest.raises(ValueError, match="dump_rollouts needs appo-trl's rollout engine"):
        APPOTrainer(model=tiny_model_path, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                    args=args, train_dataset=dataset(), processing_class=tiny_tokenizer)  # fmt: skip


@pytest.mark.slow
def test_appo_train_then_plot_and_rollouts(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "recipes/tiny/appo.yaml", "--model_name_or_path", tiny_model_path,
                 "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no", "--dump_rollouts", "1"]) == 0  # fmt: skip
    assert (out / "trainer_state.json").is_file()  # written by `appo train` for `appo plot`
    dumps = sorted((out / "rollouts").glob("step_*.jsonl"))
    assert [p.name for p in dumps] == ["step_000001.jsonl", "step_000002.jsonl"]
    record = json.loads(dumps[0].read_text().splitlines()[0])
    rows = record["rows"]
    assert len(rows) == 4 and [r["parent"] is None for r in rows] == [True, True, False, False]  # n=4, 2 initial
    assert all(rows[r["parent"]]["parent"] is None for r in rows[2:])  # APPO branches fork from initial rows
    assert [r["kept"] for r in rows] == [True, True, False, False]  # branch rows leave the batch
    assert [r["branch_score"] is not None for r in rows] == [False, False, True, True]  # APPO's score per branch point
    capsys.readouterr()
    assert main(["rollouts", str(out), "--step", "1"]) == 0
    shown = capsys.readouterr().out
    assert "step 1" in shown and "#2 branch @ token" in shown and "(not in loss)" in shown
    assert main(["plot", str(out)]) == 0
    assert (out / "training_curves.png").is_file()
    assert "reward" in capsys.readouterr().out


def test_group_tree_shows_where_a_row_crossed_a_weight_update():
    import copy

    record = copy.deepcopy(RECORD)
    record["rows"][0]["version_runs"] = [[0, 5, 3], [5, 12, 4]]  # tokens 0-4 sampled under version 3, then 4
    record["rows"][1]["version_runs"] = [[0, 9, 4]]
    lines = _render(group_tree(record, chars=0)).splitlines()
    root0 = next(line for line in lines if "#0 root" in line)
    assert "v3 [0,5) → 4 [5,12) (crossed 1 update(s))" in root0
    assert any("#1 " in line and "v4" in line and "crossed" not in line for line in lines)
