"""The `appo` command registry: help, unknown commands, every registered module importable with `main`."""

import importlib

import pytest

from appo_trl.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_suggests(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_module_has_main_and_help(name, capsys):
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(module.main)
    try:
        code = module.main(["--help"])
    except SystemExit as exc:  # argparse exits after printing help
        code = exc.code
    assert code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_train_bad_recipe_key_exits_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: m\nnum_generatons: 4\n")
    assert main(["train", "--config", str(recipe)]) == 2
    assert "num_generatons (did you mean: num_generations," in capsys.readouterr().err


def test_env_reports_optional_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "trl" in out and "vllm (optional)" in out and "deepspeed (optional)" in out
