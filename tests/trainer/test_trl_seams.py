"""`appo_trl.trainer.trl_seams`: each seam into TRL writes exactly its attribute and restores what it swapped, also
when the body raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appo_trl.trainer import trl_seams


def test_vllm_generation_is_swapped_within_and_restored_even_on_error():
    import trl.trainer.grpo_trainer as grpo_trainer

    original = grpo_trainer.VLLMGeneration
    seen = []
    with trl_seams.vllm_generation_replaced(lambda trl_class: seen.append(trl_class) or "factory"):
        assert grpo_trainer.VLLMGeneration == "factory"
    assert seen == [original] and grpo_trainer.VLLMGeneration is original
    with pytest.raises(RuntimeError, match="init failed"):
        with trl_seams.vllm_generation_replaced(lambda trl_class: "factory"):
            raise RuntimeError("init failed")
    assert grpo_trainer.VLLMGeneration is original


def test_synced_step_sleeping_flag_and_importance_correction():
    trainer = SimpleNamespace(_last_loaded_step=-1, state=SimpleNamespace(global_step=3), use_vllm=False)
    assert trl_seams.weights_synced_at(trainer) == -1
    trl_seams.mark_weights_synced(trainer)
    assert trl_seams.weights_synced_at(trainer) == trainer._last_loaded_step == 3
    generation = SimpleNamespace()
    assert trl_seams.weights_sleeping(generation) is False  # server mode: TRL never sets it
    trl_seams.mark_weights_sleeping(generation)
    assert trl_seams.weights_sleeping(generation) is True and generation._llm_weights_sleeping is True
    with trl_seams.trl_importance_correction(trainer):
        assert trainer.use_vllm is True
    assert trainer.use_vllm is False
    with pytest.raises(KeyError), trl_seams.trl_importance_correction(trainer):
        raise KeyError("loss failed")
    assert trainer.use_vllm is False
    trainer.use_vllm = True  # a vLLM run: already on, left on
    with trl_seams.trl_importance_correction(trainer):
        pass
    assert trainer.use_vllm is True


def test_a_metric_joins_trls_list_for_the_step():
    from collections import defaultdict

    trainer = SimpleNamespace(_metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    trl_seams.log_metric(trainer, "train", "tree/tokens_ratio", 0.5)
    trl_seams.log_metric(trainer, "train", "tree/tokens_ratio", 0.25)
    assert trainer._metrics["train"]["tree/tokens_ratio"] == [0.5, 0.25] and not trainer._metrics["eval"]
