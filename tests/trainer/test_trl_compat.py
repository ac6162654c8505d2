"""TRL's constructor on `APPOTrainer`: the signature, no `args`, a plain `GRPOConfig`, and `rollout_func`."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os

import pytest
import trl
from trl import GRPOConfig

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, RewardSpy, dataset

MISSING = "/nonexistent/model-that-must-not-load"  # a refusal must come before the model loads


def length_reward(completions, **kw):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def test_signature_matches_trl_grpo_trainer():
    """TRL's parameters, in TRL's order and with TRL's defaults, then appo-trl's own (keyword-only use)."""
    trl_params = list(inspect.signature(trl.GRPOTrainer.__init__).parameters.values())
    ours = list(inspect.signature(APPOTrainer.__init__).parameters.values())
    assert [p.name for p in ours[: len(trl_params)]] == [p.name for p in trl_params]
    for p, q in zip(trl_params, ours):
        assert (q.kind, q.default) == (p.kind, p.default), p.name
    assert [p.name for p in ours[len(trl_params) :]] == ["rollout_engine", "tool_dirs", "agent"]


def test_no_args_builds_a_default_appo_config(tmp_path, tiny_model_path, tiny_tokenizer, monkeypatch):
    """`APPOTrainer(model, reward_funcs=..., train_dataset=...)` as TRL's `GRPOConfig(f"{name}-GRPO")`."""
    import transformers.training_args as ta

    monkeypatch.chdir(tmp_path)
    # the default config is TRL's (bf16=True), which transformers refuses on a CPU-only machine; pretend bf16 works
    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
    trainer = APPOTrainer(tiny_model_path, reward_funcs=RewardSpy(), train_dataset=dataset(),
                          processing_class=tiny_tokenizer)  # fmt: skip
    assert type(trainer.args) is APPOConfig
    assert trainer.args.output_dir == f"{os.path.basename(tiny_model_path.rstrip('/'))}-APPO"
    assert trainer.args.rollout_strategy == "grpo"
    default = APPOConfig(trainer.args.output_dir)
    assert (trainer.args.num_generations, trainer.args.learning_rate) == (
        default.num_generations,
        default.learning_rate,
    )


def test_grpo_config_is_converted_field_by_field(tmp_path, tiny_model_path, tiny_tokenizer, caplog):
    kw = {k: v for k, v in CPU.items()}
    grpo = GRPOConfig(str(tmp_path), **kw, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=24, temperature=0.7, scale_rewards="batch", max_steps=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="appo_trl.trainer.trl_compat"):
        trainer = APPOTrainer(tiny_model_path, reward_funcs=length_reward, args=grpo, train_dataset=dataset(),
                              processing_class=tiny_tokenizer)  # fmt: skip
    args = trainer.args
    assert isinstance(args, APPOConfig) and args.rollout_strategy == "grpo"
    for f in dataclasses.fields(GRPOConfig):
        if f.init:
            assert getattr(args, f.name) == getattr(grpo, f.name), f.name
    lines = [r.getMessage() for r in caplog.records if "GRPOConfig" in r.getMessage()]
    assert len(lines) == 1 and "rollout_strategy: grpo" in lines[0]
    assert trainer.sampling_path.trl_sampler  # grpo without tools: TRL's own sampler
    trainer.train()
    assert trainer.state.global_step == 1


def test_built_configs_take_trls_all_none_reward_behaviour(tmp_path):
    """TRL warns when every reward is None and trains on (its `test_warning_raised_all_rewards_none`): a config
    appo-trl builds never stops on it, nor by default an APPOConfig (issue 34: the stop is opt-in, the
    assertion on the default changed from 3 to 0)."""
    from appo_trl.trainer.trl_compat import resolve_args

    assert resolve_args("org/tiny", GRPOConfig(str(tmp_path), **CPU)).max_nan_reward_steps == 0
    mine = APPOConfig(str(tmp_path), **CPU)
    assert resolve_args("org/tiny", mine) is mine and mine.max_nan_reward_steps == 0


def test_built_configs_take_trls_tool_turn_limit(tmp_path, monkeypatch):
    """TRL limits tool-calling turns (`max_tool_calling_iterations`, None = no limit), never calls: a config
    appo-trl builds has no call limit and keeps TRL's turn limit; an APPOConfig keeps its call limit (3)."""
    import transformers.training_args as ta

    from appo_trl.trainer.trl_compat import resolve_args

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)  # the default config is TRL's (bf16)
    monkeypatch.chdir(tmp_path)
    default = resolve_args("org/tiny", None)
    assert (default.tool_call_limit, default.max_tool_calling_iterations) == (None, None)
    converted = resolve_args("org/tiny", GRPOConfig(str(tmp_path), **CPU, max_tool_calling_iterations=2))
    assert (converted.tool_call_limit, converted.max_tool_calling_iterations) == (None, 2)
    mine = APPOConfig(str(tmp_path), **CPU, max_tool_calling_iterations=2)
    assert (mine.tool_call_limit, mine.max_tool_calling_iterations) == (3, 2)  # both apply
    with pytest.raises(ValueError, match="max_tool_calling_iterations, min_remaining_tokens must be >= 0"):
        APPOConfig(str(tmp_path), **CPU, max_tool_calling_iterations=-1)


def four_times(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


class FourCallTurns:
    """Scripted chat policy: `turns` assistant turns of four `four_times` calls each (closed by the sampled
    `<|im_end|>`, as Qwen3's parallel calls), then the answer and EOS."""

    def __init__(self, tok, turns):
        self.tok, self.turns = tok, turns
        self.result = tok.convert_tokens_to_ids("</tool_response>")

    async def generate(self, prompt_ids, params):
        from appo_trl.rollout import Segment

        if sum(t == self.result for t in prompt_ids) >= 4 * self.turns:
            text = " <answer> done </answer>"
        else:
            text = "\n".join(
                f'<tool_call>\n{{"name": "four_times", "arguments": {{"a": {a}, "b": 2}}}}\n</tool_call>'
                for a in range(1, 5)
            )
        ids = (self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])[: params.max_tokens]
        return Segment(ids, [-0.5] * len(ids), None, "eos" if len(ids) < params.max_tokens else "length", None)


@pytest.mark.parametrize(
    "config, turns, calls, finish",
    [
        ("grpo", 2, 8, "eos"),  # TRL: no limit; both 4-call turns run
        ("grpo_turns_1", 2, 4, "call_limit"),  # TRL's max_tool_calling_iterations=1: the 2nd turn runs no call
        ("appo_calls_3", 1, 0, "call_limit"),  # an APPOConfig's tool_call_limit=3: the 4-call turn runs none
        ("appo_calls_4", 1, 4, "eos"),
    ],
)
def test_a_four_call_turn_under_trl_and_appo_limits(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, config,
                                                    turns, calls, finish):  # fmt: skip
    """The trainer's own engine (built from the config) on a scripted policy that emits four calls per turn."""
    kw = dict(**CPU, num_generations=4, per_device_train_batch_size=4, max_completion_length=1000)
    args = {
        "grpo": lambda: GRPOConfig(str(tmp_path), **kw),
        "grpo_turns_1": lambda: GRPOConfig(str(tmp_path), **kw, max_tool_calling_iterations=1),
        "appo_calls_3": lambda: APPOConfig(str(tmp_path), **kw, tool_call_limit=3),
        "appo_calls_4": lambda: APPOConfig(str(tmp_path), **kw, tool_call_limit=4),
    }[config]()
    tok = tiny_chat_tokenizer
    trainer = APPOTrainer(tiny_chat_model_path, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                          processing_class=tok, tools=[four_times])  # fmt: skip
    engine = trainer.rollout_engine
    engine.backend = FourCallTurns(tok, turns)
    prompt = tok.apply_chat_template([{"role": "user", "content": "multiply"}], tools=[four_times],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
    [[traj]] = engine.run(engine.rollout([list(prompt)], 1, seed=1))
    assert (traj.num_calls, traj.finish_reason) == (calls, finish)
    assert [c.result for c in traj.tool_calls] == ["2", "4", "6", "8"] * (calls // 4)
    if finish == "call_limit":  # the refused turn is the row's last: sampled, closed by its own end of turn
        assert traj.completion_ids[-1] == tok.eos_token_id and traj.loss_mask[-1] == 1


def test_other_args_types_are_refused():
    with pytest.raises(TypeError, match="APPOConfig or a GRPOConfig"):
        APPOTrainer(MISSING, reward_funcs=RewardSpy(), args={"output_dir": "x"})


def test_rollout_func_runs_for_grpo_with_trl_contract(tmp_path, tiny_model_path, tiny_tokenizer):
    """TRL's contract: prompts + trainer in; prompt_ids, completion_ids, logprobs (+ extra reward fields) out."""
    seen = {}

    def rollout_func(prompts, trainer):
        seen["n"], seen["trainer"] = len(prompts), trainer
        tok = trainer.processing_class
        texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        prompt_ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        completion = tok.encode(" <answer> 1 </answer>", add_special_tokens=False) + [tok.eos_token_id]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(completion) for _ in prompts],
            "logprobs": [[-0.5] * len(completion) for _ in prompts],
            "source": ["scripted"] * len(prompts),
        }

    rewarded = []

    def reward(completions, source, **kw):
        rewarded.append(list(source))
        return [float(i % 2) for i in range(len(completions))]

    args = APPOConfig(str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4, max_steps=1,
                      max_completion_length=24)  # fmt: skip
    trainer = APPOTrainer(tiny_model_path, reward_funcs=reward, args=args, train_dataset=dataset(),
                          processing_class=tiny_tokenizer, rollout_func=rollout_func)  # fmt: skip
    assert trainer.rollout_func is rollout_func
    trainer.train()
    assert seen["n"] == 4 and seen["trainer"] is trainer
    assert rewarded == [["scripted"] * 4]
    assert trainer.state.global_step == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"rollout_strategy": "arpo", "num_generations": 4, "per_device_train_batch_size": 4}, "grpo only"),
        ({"tools": ["python"]}, "drop the tools"),
    ],
)
def test_rollout_func_is_refused_before_the_model_loads(tmp_path, kw, match):
    args = APPOConfig(str(tmp_path), **CPU, **kw)
    with pytest.raises(ValueError, match=match):
        APPOTrainer(MISSING, reward_funcs=RewardSpy(), args=args, rollout_func=lambda prompts, trainer: {})


def test_rollout_func_with_rollout_engine_is_refused(tmp_path):
    args = APPOConfig(str(tmp_path), **CPU)
    with pytest.raises(ValueError, match="not both"):
        APPOTrainer(
            MISSING, reward_funcs=RewardSpy(), args=args, rollout_func=lambda p, t: {}, rollout_engine=object()
        )


def test_rollout_func_with_environment_factory_is_refused(tmp_path):
    """The rollout_func replaces the tool loop that calls the environments' methods: one line, before the model."""

    class Env:
        def reset(self, **kwargs):
            return None

    args = APPOConfig(str(tmp_path), **CPU)
    with pytest.raises(ValueError, match="rollout_func replaces the sampler and the tool loop that calls the environ"):
        APPOTrainer(
            MISSING, reward_funcs=RewardSpy(), args=args, rollout_func=lambda p, t: {}, environment_factory=Env
        )


@pytest.fixture(scope="module")
def tiny_moe_path(tiny_model_path, tmp_path_factory):
    """A tiny Qwen3-MoE policy (the tiny tokenizer): its load-balancing loss is on, as in TRL's tiny MoE fixture."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("tiny-moe"))
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_grpo_config_with_a_moe_policy_trains_tree_wise_with_the_aux_loss(tmp_path, tiny_moe_path, caplog):
    """TRL's script with a MoE model runs unchanged, now with the tree forward: the load-balancing loss is computed
    over the packed tokens (each weighted by its rows; `tests/trainer/test_tree_moe.py` checks it equals row-wise)."""
    grpo = GRPOConfig(str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="appo_trl.trainer.trl_compat"):
        trainer = APPOTrainer(tiny_moe_path, reward_funcs=length_reward, args=grpo, train_dataset=dataset(2))
    assert trainer.aux_loss_enabled and trainer.args.tree_forward is True
    assert not any("tree_forward is off" in r.getMessage() for r in caplog.records)
    trainer.train()
    assert trainer.state.global_step == 1
    assert any("aux_loss" in h for h in trainer.state.log_history)


def test_appo_config_tree_forward_with_a_moe_policy_trains(tmp_path, tiny_moe_path):
    """An APPOConfig's tree_forward with a MoE aux loss is no longer refused: it trains, with the aux loss."""
    args = APPOConfig(str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1)  # fmt: skip
    assert args.tree_forward
    trainer = APPOTrainer(tiny_moe_path, reward_funcs=length_reward, args=args, train_dataset=dataset(2))
    assert trainer.args.tree_forward is True
    trainer.train()
    assert trainer.state.global_step == 1
    assert any("aux_loss" in h for h in trainer.state.log_history)


def test_grpo_config_with_a_sliding_window_policy_trains_tree_wise(tmp_path, tiny_model_path, caplog):
    """Sliding-window attention (Gemma 2, Cohere 2, Qwen with use_sliding_window) runs in the tree forward (a token
    sees its ancestors within the window, in depth); a converted GRPOConfig keeps tree_forward and trains."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_sliding_window=True,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path / "sliding")
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    grpo = GRPOConfig(str(tmp_path / "out"), **CPU, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="appo_trl.trainer.trl_compat"):
        trainer = APPOTrainer(path, reward_funcs=length_reward, args=grpo, train_dataset=dataset(2))
    assert trainer.args.tree_forward is True
    assert not any("tree_forward is off" in r.getMessage() for r in caplog.records)
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_trainer_made_without_init_generates_with_trls_sampler(monkeypatch):
    """TRL's own unit tests build `object.__new__(GRPOTrainer)` with fakes and call `_generate` (e.g. to check that
    `rollout_func` is preferred); on `APPOTrainer` that reaches TRL's `_generate`: the sampling path's class default
    is TRL's own sampler (docs/trl-parity.md)."""
    monkeypatch.setattr(trl.GRPOTrainer, "_generate", lambda self, prompts: ("trl", prompts))
    trainer = object.__new__(APPOTrainer)
    assert trainer._generate(["p"]) == ("trl", ["p"])
