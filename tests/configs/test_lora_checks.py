"""LoRA options refused in one line before the model loads (issue 48, causes 4 and 12): `configs/lora_checks.py`,
called from `preflight.check_peft` inside `stages.train.model_settings`."""

from __future__ import annotations

import pytest
from trl import ModelConfig

from appo_trl.configs.errors import PreflightError


def _model_settings(path, **kw):
    from appo_trl.config import APPOConfig
    from appo_trl.stages.train import model_settings

    args = APPOConfig(output_dir="/tmp/unused-appo-lora-check", use_cpu=True, report_to="none", bf16=False)
    return model_settings(ModelConfig(model_name_or_path=path, use_peft=True, **kw), args)


BAD = [
    ({"lora_r": 0}, "lora_r=0: the LoRA rank must be a whole number >= 1."),
    ({"lora_r": -4}, "lora_r=-4: the LoRA rank"),
    ({"lora_r": 4.5}, "lora_r=4.5: the LoRA rank"),
    ({"lora_dropout": 1.5}, "lora_dropout=1.5 must be in [0, 1)"),
    ({"lora_dropout": 1.0}, "lora_dropout=1.0 must be in [0, 1) (1 drops every input: nothing trains)."),
    ({"lora_dropout": -0.1}, "lora_dropout=-0.1 must be in [0, 1)"),
    ({"lora_alpha": 0}, "lora_alpha=0: the adapter's scale is lora_alpha / lora_r"),
    ({"lora_alpha": float("nan")}, "lora_alpha=nan"),
    ({"lora_target_modules": ["q_proj", "qkv"]}, "lora_target_modules: 'qkv' matches no module of the model (its "
                                                 "modules end in "),
    ({"lora_target_modules": ["nope"]}, "lora_target_modules='nope' matches no module"),  # one name: TRL's str
    ({"lora_target_modules": ["q_proj"]}, "lora_target_modules='q_proj' matches no module of the model"),
    ({"lora_modules_to_save": ["score_head"]}, "lora_modules_to_save: 'score_head' names no module of the model"),
    # own attack: peft tracebacks after the model loaded
    ({"lora_target_modules": []}, "lora_target_modules is an empty list"),
    ({"lora_modules_to_save": [""]}, "lora_modules_to_save=[''] holds an empty name"),
    ({"lora_target_modules": ["q_proj", ""]}, "lora_target_modules=['q_proj', ''] holds an empty name"),
]


@pytest.mark.parametrize("options, expected", BAD, ids=[str(o) for o, _ in BAD])
def test_bad_lora_options_are_one_line_before_the_model_loads(options, expected, tiny_model_path):
    with pytest.raises(PreflightError) as err:
        _model_settings(tiny_model_path, **options)
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options", [
    {}, {"lora_target_modules": ["q_proj", "v_proj"]}, {"lora_target_modules": ["all-linear"]},
    {"lora_target_modules": [".*q_proj"]}, {"lora_modules_to_save": ["lm_head"]}, {"lora_dropout": 0.0},
    {"lora_alpha": -8},
])  # fmt: skip
def test_good_lora_options_pass_and_peft_takes_them(options, tiny_model_path):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    peft_config = _model_settings(tiny_model_path, **options)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), peft_config)
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_a_model_that_cannot_be_built_from_its_config_is_left_to_peft():
    from appo_trl.configs.lora_checks import check_lora

    check_lora(ModelConfig(model_name_or_path="/nonexistent/model", use_peft=True))  # no names: nothing to match
    with pytest.raises(PreflightError, match="lora_r=0"):
        check_lora(ModelConfig(model_name_or_path="/nonexistent/model", use_peft=True, lora_r=0))
