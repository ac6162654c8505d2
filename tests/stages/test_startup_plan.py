"""The start-up plan: `appo train` and `APPOTrainer` resolve the tools and check the reward columns once per run."""

from __future__ import annotations

import pytest

from appo_trl.configs import plan as plan_module
from appo_trl.configs.plan import StartupPlan
from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.stages.train import dataclass_types
from appo_trl.tools import registry

TINY = REPO_ROOT / "recipes" / "tiny"


@pytest.fixture
def counted(monkeypatch):
    """Counts of `build_tools` and `check_reward_columns` calls; the built tool sets in `counts["built"]`."""
    counts = {"build_tools": 0, "check_reward_columns": 0, "built": []}
    build, check = registry.build_tools, plan_module.check_reward_columns

    def build_tools(*args, **kwargs):
        counts["build_tools"] += 1
        counts["built"].append(build(*args, **kwargs))
        return counts["built"][-1]

    def check_reward_columns(*args, **kwargs):
        counts["check_reward_columns"] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(registry, "build_tools", build_tools)
    monkeypatch.setattr(plan_module, "check_reward_columns", check_reward_columns)
    return counts


def test_appo_train_builds_the_recipes_tools_once(counted, tiny_chat_model_path, tmp_path, monkeypatch):
    """`stages.train.main`: preflight plans (a dotted tool from the recipe's folder), the trainer and its rollout
    engine use that plan: one build, one reward-column check, over a whole training step."""
    from appo_trl.stages.train import main

    monkeypatch.chdir(tmp_path)  # `tools.calculator` must come from the recipe's folder, not the working directory
    parsed = parse_recipe(dataclass_types(), [
        "--config", str(TINY / "appo_chat.yaml"), "--model_name_or_path", tiny_chat_model_path,
        "--output_dir", str(tmp_path / "run"), "--dataset_name", str(TINY / "data" / "arith.jsonl"),
        "--rollout_strategy", "grpo", "--initial_rollouts", "4", "--max_steps", "1", "--max_completion_length", "24",
    ])  # fmt: skip
    trainer = main(*parsed, tool_dirs=[parsed.folder])
    assert trainer.state.global_step == 1
    assert (counted["build_tools"], counted["check_reward_columns"]) == (1, 1)
    engine_tools = list(trainer.rollout_engine.executor.tools.values())
    assert engine_tools == list(counted["built"][0].values())  # the engine runs the planned tools
    assert trainer.tool_specs[0].__name__ == "calculator"


def test_python_api_trainer_plans_once_before_the_model_loads(counted, tiny_model_path, tiny_tokenizer, tmp_path):
    """`APPOTrainer(tools=[...])` without a plan resolves its own in `__init__`, once; errors come before the model."""
    from datasets import Dataset

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer

    cpu = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, beta=0.0)
    args = APPOConfig(output_dir=str(tmp_path), **cpu, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=16, max_steps=1)  # fmt: skip
    data = Dataset.from_list([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)])
    trainer = APPOTrainer(model=tiny_model_path, reward_funcs="math_verify", args=args, train_dataset=data,
                          processing_class=tiny_tokenizer, tools=["python"])  # fmt: skip
    trainer.train()
    assert (counted["build_tools"], counted["check_reward_columns"]) == (1, 1)
    assert list(trainer.rollout_engine.executor.tools.values()) == list(counted["built"][0].values())
    with pytest.raises(ValueError, match="needs gold answers"):  # before the model loads: no such model folder
        APPOTrainer(model="/nonexistent/model", reward_funcs="math_verify", args=args,
                    train_dataset=data.remove_columns("answer"), tools=["python"])  # fmt: skip


def test_an_engine_after_the_first_gets_fresh_tools(counted):
    from types import SimpleNamespace

    plan = StartupPlan.resolve(SimpleNamespace(tools=["python"], tool_config={"python": {"timeout_s": 5}}))
    assert (plan.tool_format, plan.tool_dirs, plan.tool_config) == ("tags", (), {"python": {"timeout_s": 5}})
    first = plan.take_tools()
    assert first is counted["built"][0] and plan.tools is None
    second = plan.take_tools()
    assert second is not first and set(second) == set(first) == {"python"}
    assert counted["build_tools"] == 2
    plan.tools = second
    plan.close()  # closes the tools no engine took
    assert plan.tools is None
    import asyncio

    asyncio.run(first["python"].aclose())
