"""The default config (`tree_forward` on) trains one step under `APPOTrainer` on tiny sliding-window, soft-capped and
MoE models built locally (Gemma 2, Cohere 2, Qwen3-MoE, GPT-OSS with its attention sinks), all with the tree
forward; a model the tree cannot wrap (a paged attention implementation) trains row-wise after one log line."""

from __future__ import annotations

import logging

import pytest
import torch

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, dataset
from tests.trainer.test_trl_compat import length_reward

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, max_position_embeddings=256)  # fmt: skip


def build(arch: str, tok):
    import transformers as tf

    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id)  # fmt: skip
    window = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    moe = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, **ids, **window))
    if arch == "cohere2":
        return tf.Cohere2ForCausalLM(tf.Cohere2Config(**SMALL, **ids, **window))
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**SMALL, **ids, **moe, num_experts=4, moe_intermediate_size=16)
        )
    return tf.GptOssForCausalLM(tf.GptOssConfig(**SMALL, **ids, **moe, **window, num_local_experts=4))


@pytest.mark.parametrize("arch", ["gemma2", "cohere2", "qwen3_moe", "gpt_oss"])
def test_default_config_trains_one_step(arch, tmp_path, tiny_model_path, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    path = str(tmp_path / arch)
    build(arch, tok).save_pretrained(path)
    tok.save_pretrained(path)
    args = APPOConfig(str(tmp_path / "out"), **CPU, num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_steps=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="appo_trl.trainer.trl_compat"):
        trainer = APPOTrainer(path, reward_funcs=length_reward, args=args, train_dataset=dataset(2))
    assert trainer.args.tree_forward is True
    assert not any("tree_forward is off" in r.getMessage() for r in caplog.records)
    trainer.train()
    assert trainer.state.global_step == 1
    assert any("tree/tokens_ratio" in h for h in trainer.state.log_history)  # the loss ran the tree forward


def test_paged_attention_trains_row_wise_with_one_log_line(caplog):
    from appo_trl.trainer.trl_compat import row_forward_where_tree_cannot

    class Model:
        config = type("Config", (), {"_attn_implementation": "paged|sdpa"})()

    args = APPOConfig("out", **CPU)
    with caplog.at_level(logging.INFO, logger="appo_trl.trainer.trl_compat"):
        row_forward_where_tree_cannot(args, Model())
    assert args.tree_forward is False
    assert [r.getMessage() for r in caplog.records] == [
        "APPOTrainer: paged attention need(s) TRL's row-wise forward, so tree_forward is off."
    ]
