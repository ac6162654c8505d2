"""`appo tiny-model --chat_template tools` runs under stock `GRPOTrainer(tools=...)` and `APPOTrainer` (issue 34).

TRL only adds its response parser to templates it knows (`add_response_schema` compares the template text with
its bundled ones): `tools` writes TRL's own `qwen3.jinja`, read from the installed `trl`.
"""

from __future__ import annotations

import pytest
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema, supports_tool_calling

from appo_trl.cli import tiny_model
from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, dataset


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def length_reward(completions, **kw):
    return [float(len(c[-1]["content"]) % 3) for c in completions]


@pytest.fixture(scope="module")
def tools_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tools-trl")
    assert tiny_model.main([str(out), "--chat_template", "tools"]) == 0
    return str(out)


@pytest.mark.parametrize("trainer_cls, config_cls", [(GRPOTrainer, GRPOConfig), (APPOTrainer, APPOConfig)])
def test_both_trainers_train_one_step_with_tools(tools_tiny, tmp_path, trainer_cls, config_cls):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tools_tiny)
    assert supports_tool_calling(tok) and add_response_schema(tok) is tok  # TRL recognises the template
    args = config_cls(str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=12, max_steps=1)  # fmt: skip
    trainer = trainer_cls(tools_tiny, reward_funcs=length_reward, args=args, train_dataset=dataset(2),
                          tools=[multiply])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1
