"""`APPOConfig`'s fields: `Literal` choices, one `--help` group per field, and the removed fields refused in one line
(Python, recipe key and command-line flag), each naming its replacement."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from trl import GRPOConfig

from appo_trl.config import REMOVED_FIELDS, APPOConfig, APPOScriptArguments
from appo_trl.configs.arguments import GROUPS
from tests.test_cli_errors import appo, one_error_line, recipe, workdir  # noqa: F401 - `workdir` is a fixture

BASE = dict(output_dir="/tmp/appo-fields-test", use_cpu=True, bf16=False, report_to="none",
            num_generations=4, per_device_train_batch_size=4)  # fmt: skip
OURS = [f for dc in (APPOScriptArguments, APPOConfig) for f in dataclasses.fields(dc) if "group" in f.metadata]


@pytest.mark.parametrize(
    "name,value,replacement",
    [("entropy_balanced_clipping", True, "use loss_mode"), ("exclude_whitespace_punct", False,
                                                             "use branch_token_filter")],
)  # fmt: skip
def test_a_removed_field_is_refused_in_one_line_naming_its_replacement(name, value, replacement, workdir, capfd):  # noqa: F811
    with pytest.raises(ValueError, match=rf"^APPOConfig: {name} was removed; {replacement} \(`\w+` is {name}: "):
        APPOConfig(**BASE, **{name: value})
    assert appo(["train", "--config", recipe(workdir), f"--{name}", str(value).lower()]) == 2
    assert f"{name} was removed; {replacement}" in one_error_line(capfd)
    assert appo(["train", "--config", recipe(workdir, **{name: value})]) == 2  # a YAML key
    assert f"{name} was removed; {replacement}" in one_error_line(capfd)
    assert name not in {f.name for f in dataclasses.fields(APPOConfig)} and set(REMOVED_FIELDS) == {
        "entropy_balanced_clipping",
        "exclude_whitespace_punct",
    }


def test_every_field_of_ours_names_one_help_group():
    own = {f.name for dc in (APPOScriptArguments, APPOConfig) for f in dataclasses.fields(dc)}
    own -= {f.name for f in dataclasses.fields(GRPOConfig)} - {"dataset_name"}
    own -= {"dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
            "gradient_checkpointing_use_reentrant", "ignore_bias_buffers"}  # fmt: skip  # TRL's ScriptArguments
    assert own <= {f.name for f in OURS}
    assert {f.metadata["group"] for f in OURS} <= set(GROUPS)


def test_group_tags_do_not_reach_argparse():
    from transformers import HfArgumentParser
    from trl import TrlParser

    for parser in (HfArgumentParser(APPOConfig), TrlParser((APPOScriptArguments, APPOConfig))):
        action = next(a for a in parser._actions if a.dest == "loss_mode")
        assert tuple(action.choices) == ("clip", "dual_clip", "future_kl", "entropy_balanced")


def test_literal_choices_are_the_sources_they_name():
    from appo_trl.configs.reference import REFERENCE_PRESETS
    from appo_trl.vllm.router import POLICIES

    hints = typing.get_type_hints(APPOConfig)
    assert typing.get_args(typing.get_args(hints["reference"])[0]) == tuple(REFERENCE_PRESETS)
    assert typing.get_args(hints["vllm_router_policy"]) == POLICIES


@pytest.mark.parametrize("where", ["flag", "yaml", "python"])
def test_a_bad_literal_value_is_one_line(where, workdir, capfd):  # noqa: F811
    if where == "python":
        with pytest.raises(ValueError, match=r"^APPOConfig: branch_zscore_scope='tokens'; choose one of \("):
            APPOConfig(**BASE, branch_zscore_scope="tokens")
        return
    if where == "flag":
        argv = ["train", "--config", recipe(workdir), "--branch_zscore_scope", "tokens"]
    else:
        argv = ["train", "--config", recipe(workdir, branch_zscore_scope="tokens")]
    assert appo(argv) == 2
    line = one_error_line(capfd)
    assert "branch_zscore_scope" in line and "'tokens'" in line and "candidates" in line and "loss_mask" in line


def test_help_lists_the_choices_of_a_literal_field(capsys):
    assert appo(["train", "--help"]) == 0
    block = capsys.readouterr().out.split("  --branch_token_filter ", 1)[1].split("\n  --", 1)[0]
    assert "{whitespace_punct,whitespace,none}" in block
