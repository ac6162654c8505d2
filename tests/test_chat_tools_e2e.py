"""Chat-format tools end to end on the tiny model: a TRL user's script unchanged, and the SFT cold start.

1. A GRPO-style script with `tools=[func]`, written for TRL's `GRPOTrainer`, runs unchanged on `APPOTrainer`
   for all four strategies (random tiny model with the tool-calling template; two optimizer steps).
2. The tiny chat-template model, cold-started by `appo sft` on recipes/tiny/sft_chat.jsonl, calls the
   user-defined tool of recipes/tiny/tools.py natively, branches after its results under arpo and appo, and
   its parameters move.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe

TINY = REPO_ROOT / "recipes" / "tiny"


def trl_user_script(model_path: str, output_dir: str, strategy: str):
    """What a TRL user writes (`GRPOConfig`/`GRPOTrainer` renamed), tools given as plain Python functions."""
    from datasets import Dataset

    from appo_trl import APPOConfig, APPOTrainer

    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city name.
        """
        return f"Sunny, 21 C in {city}"

    async def get_time(city: str) -> str:
        """Get the local time in a city.

        Args:
            city: the city name.
        """
        return "12:00"

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "What's the weather in Paris?"}]}] * 8)

    def reward_len(completions, **kwargs):
        return [-len(json.dumps(c)) / 100 for c in completions]

    training_args = APPOConfig(
        output_dir=output_dir, rollout_strategy=strategy, num_generations=4, per_device_train_batch_size=4,
        max_steps=2, max_completion_length=24, learning_rate=1e-2, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1,
    )  # fmt: skip
    trainer = APPOTrainer(
        model=model_path, reward_funcs=reward_len, args=training_args, train_dataset=dataset,
        tools=[get_weather, get_time],
    )  # fmt: skip
    trainer.train()
    return trainer


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_trl_user_script_with_tools_runs_unchanged(strategy, tiny_chat_model_path, tmp_path):
    trainer = trl_user_script(tiny_chat_model_path, str(tmp_path), strategy)
    assert trainer.state.global_step == 2
    assert trainer.tool_format == "chat" and [t.__name__ for t in trainer.tools] == ["get_weather", "get_time"]
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert len(logs) == 2 and all("tools/call_frequency" in e for e in logs)


@pytest.fixture(scope="session")
def tiny_chat_sft_model_path(tiny_chat_model_path, tmp_path_factory) -> str:
    """The tool-template tiny model after `appo sft --config recipes/tiny/sft_chat.yaml` (cold start)."""
    from appo_trl.stages import sft

    out = tmp_path_factory.mktemp("tiny-sft-chat")
    args = parse_recipe(sft.dataclass_types(), [
        "--config", str(TINY / "sft_chat.yaml"), "--model_name_or_path", tiny_chat_model_path,
        "--output_dir", str(out), "--dataset_name", str(TINY / "data" / "sft_chat.jsonl"),
    ])  # fmt: skip
    sft.main(*args)
    return str(out)


class ToolAnswerReward:
    """1 when the boxed answer repeats the last tool result, plus a tiny length term (never a zero-std group);
    records what the trainer passes along (branch origins and positions, tool-call counts)."""

    __name__ = "tool_answer"

    def __init__(self):
        self.rounds = []

    def __call__(self, completions, branch_origin, branch_pos, num_tool_calls, **kwargs):
        self.rounds.append({"origin": list(branch_origin), "pos": list(branch_pos), "calls": list(num_tool_calls),
                            "completions": completions})  # fmt: skip
        out = []
        for c in completions:
            tools = [m["content"] for m in c if m["role"] == "tool"]
            boxed = re.findall(r"\\boxed\{([^}]*)\}", c[-1]["content"])
            out.append(float(bool(tools and boxed and boxed[-1].strip() == tools[-1].strip())) - 1e-3 * len(str(c)))
        return out


@pytest.mark.parametrize("strategy", ["arpo", "appo"])
def test_cold_started_chat_model_calls_the_custom_tool_branches_and_trains(strategy, tiny_chat_sft_model_path,
                                                                          tmp_path):  # fmt: skip
    from appo_trl.stages.train import dataclass_types

    parsed = parse_recipe(dataclass_types(), [
        "--config", str(TINY / f"{strategy}_chat.yaml"), "--model_name_or_path", tiny_chat_sft_model_path,
        "--output_dir", str(tmp_path), "--dataset_name", str(TINY / "data" / "arith.jsonl"),
        *(["--branch_probability", "1.0"] if strategy == "arpo" else []),
    ])  # fmt: skip
    script_args, args, model_args = parsed
    assert args.tools == ["tools.calculator"] and args.tool_format == "chat"
    from transformers import AutoTokenizer

    from appo_trl.data import load_rl_dataset
    from appo_trl.trainer.trainer import APPOTrainer

    reward = ToolAnswerReward()
    trainer = APPOTrainer(
        model=model_args.model_name_or_path, reward_funcs=[reward], args=args,
        train_dataset=load_rl_dataset(script_args),
        processing_class=AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left"),
        tool_dirs=[parsed.folder],
    )  # fmt: skip
    assert trainer.tool_specs[0].__name__ == "calculator"  # tools.calculator from the recipe's folder
    before = [p.detach().clone() for p in trainer.model.parameters()]
    batches, generate = [], trainer.strategy.generate
    trainer.strategy.generate = lambda *a, **k: batches.append(generate(*a, **k)) or batches[-1]
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert sum(e.get("tools/calculator/calls", 0) for e in logs) > 0, "the cold-started model never called the tool"
    # the calls are the model's own JSON through the template, answered by the real function
    results = [m["content"] for r in reward.rounds for c in r["completions"] for m in c if m["role"] == "tool"]
    assert any(re.fullmatch(r"-?\d+", s) for s in results)
    origins = [o for r in reward.rounds for o in r["origin"]]
    if strategy == "arpo":  # P = 1: every tool result forks (until the group is full)
        forks = [(r["pos"][i], r["calls"][i]) for r in reward.rounds for i, o in enumerate(r["origin"]) if o == "fork"]
        assert forks and all(pos > 0 and calls >= 1 for pos, calls in forks)
        assert sum(e["branch/points_per_prompt"] for e in logs) > 0
    else:
        assert origins.count("branch") == 2 * len(reward.rounds)  # n - N = 2 branches per prompt per round
        # some branch points lie after a tool result: the branch keeps the parent's tool turn token for token
        after = []
        for batch in batches:
            by_uid = {t.uid: t for t in batch.rows}
            for t in batch.rows:
                parent = by_uid.get(t.parent)
                if t.origin == "branch" and any(c.end <= t.branch_pos for c in parent.tool_calls):
                    assert t.completion_ids[: t.branch_pos] == parent.completion_ids[: t.branch_pos]
                    assert t.tool_calls[0] == parent.tool_calls[0] and t.loss_mask[t.branch_pos] == 1  # sampled on
                    after.append(t)
        assert after, "no APPO branch point after a tool result"
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters())), "no update"
