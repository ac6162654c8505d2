"""Resume from the last checkpoint (SFT and RL) equals the uninterrupted run; checkpoints load in transformers.

"Interrupting" is reproduced exactly: run A trains uninterrupted and saves every step; run B starts from a
copy of A's early checkpoint (what a crashed run leaves on disk) with `resume_from_checkpoint: true`.
"""

import shutil

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.trainer.checkpoints import resolve_resume_checkpoint


def _optimizer_state(path):
    return torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)["state"]


def _assert_same_checkpoint(a, b):
    import json

    from transformers import AutoModelForCausalLM

    state_a, state_b = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert state_a["global_step"] == state_b["global_step"]
    opt_a, opt_b = _optimizer_state(a), _optimizer_state(b)
    assert opt_a.keys() == opt_b.keys() and opt_a
    for k in opt_a:
        assert float(opt_a[k]["step"]) == float(opt_b[k]["step"])
        torch.testing.assert_close(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(opt_a[k]["exp_avg_sq"], opt_b[k]["exp_avg_sq"], rtol=1e-4, atol=1e-8)
    model_a = AutoModelForCausalLM.from_pretrained(a).state_dict()  # plain transformers, no conversion
    model_b = AutoModelForCausalLM.from_pretrained(b).state_dict()
    for k in model_a:
        torch.testing.assert_close(model_a[k], model_b[k], rtol=1e-4, atol=1e-6)


def _complete(folder, step=1):
    """A minimal complete checkpoint folder (what `checkpoint_problem` accepts)."""
    import json

    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "optimizer.pt").write_bytes(b"x" * 10)
    return folder


def test_resolve_resume_checkpoint(tmp_path):
    assert resolve_resume_checkpoint(None, str(tmp_path)) is None
    assert resolve_resume_checkpoint("false", str(tmp_path)) is None
    assert resolve_resume_checkpoint(True, str(tmp_path / "missing")) is None  # nothing yet: start fresh
    _complete(tmp_path / "checkpoint-2")
    _complete(tmp_path / "checkpoint-10")
    assert resolve_resume_checkpoint("true", str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert resolve_resume_checkpoint(str(tmp_path / "checkpoint-2"), "x") == str(tmp_path / "checkpoint-2")
    with pytest.raises(FileNotFoundError):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-3"), "x")


def test_sft_resume_equals_uninterrupted(tiny_model_path, tmp_path):
    from appo_trl.stages.sft import dataclass_types, main

    def run(out, *extra):
        args = parse_recipe(
            dataclass_types(),
            [
                "--config",
                str(REPO_ROOT / "recipes/tiny/sft.yaml"),
                "--model_name_or_path",
                tiny_model_path,
                "--output_dir",
                str(out),
                "--max_steps",
                "4",
                "--save_steps",
                "2",
                *extra,
            ],
        )
        return main(*args)

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(full)
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    trainer = run(resumed, "--resume_from_checkpoint", "true")
    assert trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3, 4]  # 1-2 restored from disk
    _assert_same_checkpoint(full / "checkpoint-4", resumed / "checkpoint-4")


def test_rl_resume_equals_uninterrupted(tiny_model_path, tmp_path):
    # APPOTrainer as it stands (TRL's GRPO generation path, default rollout strategy).
    from appo_trl.stages.train import dataclass_types, main

    def run(out, *extra):
        args = parse_recipe(
            dataclass_types(),
            [
                "--config",
                str(REPO_ROOT / "recipes/tiny/grpo.yaml"),
                "--model_name_or_path",
                tiny_model_path,
                "--output_dir",
                str(out),
                "--dataset_name",
                str(REPO_ROOT / "recipes/tiny/data/arith.jsonl"),
                "--max_steps",
                "2",
                "--save_steps",
                "1",
                *extra,
            ],
        )
        return main(*args)

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(full)
    shutil.copytree(full / "checkpoint-1", resumed / "checkpoint-1")
    trainer = run(resumed, "--resume_from_checkpoint", "true")
    assert trainer.state.global_step == 2
    _assert_same_checkpoint(full / "checkpoint-2", resumed / "checkpoint-2")
