"""`appo study`: the variants' overrides, the compute-matched tables, and a tiny study end to end."""

from __future__ import annotations

import json

import pytest

from appo_trl.cli.study import parser, render, resolve, variant_overrides
from appo_trl.synthetic.chain_errors import CATEGORIES as CHAIN_CATEGORIES
from appo_trl.synthetic.compute import BUDGETS


def args(*argv):
    return resolve(parser().parse_args(list(argv)))


def test_quick_is_the_demo_shape_and_full_is_the_papers():
    quick = args()
    assert quick.strategies == ["grpo", "arpo", "aepo", "appo"] and quick.families == ["python", "search", "both"]
    # the recipes as they are (n = 4, 2 initial rollouts), at one KL weight: the demo's APPO recipe has its own beta
    assert variant_overrides("appo", quick) == ["--beta", "0.0"] and variant_overrides("grpo", quick) == []
    # the demo's cold start, at the constant learning rate the study's tables were measured with
    assert (quick.sft_steps, quick.sft_lr, quick.sft_max_length) == (2000, 3e-3, None)
    full = args("--full")
    assert (full.sft_steps, full.sft_lr, full.sft_max_length) == (4000, 1e-3, 512)
    assert quick.sft_schedule == full.sft_schedule == "constant_with_warmup"
    assert args("--full", "--sft_schedule", "cosine").sft_schedule == "cosine"
    assert args("--full", "--sft_steps", "10", "--sft_lr", "0.1").sft_steps == 10
    chains = args("--families", "python", "chain")  # a quick study with chains gets their budgets
    assert (chains.tool_call_limit, chains.max_completion_length, chains.sft_max_length) == (5, 384, 512)
    assert full.strategies[4:] == ["arpo+ref", "aepo+ref", "appo+ref", "arpo+tree", "aepo+tree", "appo+tree",
                                   "arpo+treerl", "arpo+treegrpo"]  # fmt: skip
    assert "chain" in full.families
    assert variant_overrides("appo+tree", full)[:2] == ["--advantage_estimator", "tree"]
    assert variant_overrides("grpo", full) == [
        "--num_generations",
        "16",
        "--per_device_train_batch_size",
        "64",
        "--tool_call_limit",
        "5",
        "--max_completion_length",
        "384",
    ]
    assert variant_overrides("aepo+ref", full) == [
        "--reference", "aepo",  # then the recipe's settings that the preset changes:
        "--loss_type", "bnpo", "--entropy_balanced_advantage", "False", "--dynamic_rollouts", "False",
        "--dynamic_rollouts_source", "probe",
        "--num_generations", "16", "--per_device_train_batch_size", "64",
        "--initial_rollouts", "8", "--tool_call_limit", "5", "--max_completion_length", "384"]  # fmt: skip


@pytest.mark.parametrize("variant", ["arpo+tree", "aepo+tree", "appo+tree"])
def test_each_tree_variant_builds_its_config(variant, tmp_path):
    from appo_trl.synthetic.pipeline import rl_arguments

    _, training, _ = rl_arguments(f"recipes/demo/{variant.partition('+')[0]}.yaml", str(tmp_path / "m"),
                                  str(tmp_path / "d"), str(tmp_path / "o"), "http://127.0.0.1:1", steps=2, seed=0,
                                  overrides=variant_overrides(variant, args("--full")))  # fmt: skip
    assert training.advantage_estimator == "tree" and training.num_generations == 16
    assert training.tree_credit_branch_rows is (True if variant == "appo+tree" else None)


def test_the_released_tree_variants_are_arpo_with_the_released_estimators(tmp_path):
    """`arpo+treerl` is ARPO's recipe with TreeRL's released estimator (its sampling ARPO's); `arpo+treegrpo` is
    ARPO's recipe with Tree-GRPO's estimator and random expansion (no entropy term). Both keep the --full shape:
    n = 16 from 8 initial rollouts, so the branch budget is 8 expansions per prompt."""
    from appo_trl.synthetic.pipeline import rl_arguments

    full = args("--full")
    shape = ["--num_generations", "16", "--per_device_train_batch_size", "64", "--initial_rollouts", "8",
             "--tool_call_limit", "5", "--max_completion_length", "384"]  # fmt: skip
    assert variant_overrides("arpo+treerl", full) == ["--advantage_estimator", "tree", "--tree_credit_form",
                                                      "treerl_released", *shape]  # fmt: skip
    assert variant_overrides("arpo+treegrpo", full) == ["--advantage_estimator", "tree_grpo", "--tree_grpo_combine",
                                                        "sum", "--entropy_weight", "0.0", *shape]  # fmt: skip
    built = {}
    for variant in ("arpo+tree", "arpo+treerl", "arpo+treegrpo"):
        _, built[variant], _ = rl_arguments("recipes/demo/arpo.yaml", str(tmp_path / "m"), str(tmp_path / "d"),
                                            str(tmp_path / variant), "http://127.0.0.1:1", steps=2, seed=0,
                                            overrides=variant_overrides(variant, full))  # fmt: skip
    paper, released, tree_grpo = built.values()
    assert (paper.advantage_estimator, paper.tree_credit_form) == ("tree", "paper")
    assert (released.advantage_estimator, released.tree_credit_form) == ("tree", "treerl_released")
    assert released.entropy_weight == paper.entropy_weight == 0.2  # TreeRL's variant samples as ARPO does
    assert (tree_grpo.advantage_estimator, tree_grpo.tree_grpo_combine, tree_grpo.entropy_weight) == (
        "tree_grpo", "sum", 0.0)  # fmt: skip
    for cfg in built.values():  # the same shape, branching rule, loss and learning rate as every variant
        assert (cfg.rollout_strategy, cfg.num_generations, cfg.initial_rollouts, cfg.beam_size) == ("arpo", 16, 8, 2)
        assert (cfg.branch_probability, cfg.loss_type, cfg.learning_rate, cfg.beta) == (0.5, "dapo", 2e-4, 0.0)


@pytest.mark.parametrize("variant", ["arpo+ref", "aepo+ref", "appo+ref"])
def test_each_reference_variant_builds_its_config(variant, tmp_path):
    """A `+ref` variant is its demo recipe with `reference:`; a recipe setting that the preset changes yields to
    the preset (the study crashed on aepo+ref: the recipe's entropy_balanced_advantage conflicted with it)."""
    from appo_trl.configs.reference import REFERENCE_PRESETS
    from appo_trl.synthetic.pipeline import rl_arguments

    strategy = variant.partition("+")[0]
    _, training, _ = rl_arguments(f"recipes/demo/{strategy}.yaml", str(tmp_path / "m"), str(tmp_path / "d"),
                                  str(tmp_path / "o"), "http://127.0.0.1:1", steps=2, seed=0,
                                  overrides=variant_overrides(variant, args("--full")))  # fmt: skip
    assert training.reference == strategy and training.num_generations == 16
    assert {k: getattr(training, k) for k in REFERENCE_PRESETS[strategy]} == REFERENCE_PRESETS[strategy]


@pytest.mark.parametrize("beta", [None, "0.04"])
def test_every_variant_trains_at_the_one_kl_weight(beta, tmp_path):
    """The study compares strategies at one beta (0 by default, as docs/study.md was measured), although
    recipes/demo/appo.yaml carries its own (the demo's KL to the cold start)."""
    from appo_trl.synthetic.pipeline import rl_arguments

    a = args("--full", *(["--beta", beta] if beta else []))
    for variant in a.strategies:
        _, cfg, _ = rl_arguments(f"recipes/demo/{variant.partition('+')[0]}.yaml", str(tmp_path / "m"),
                                 str(tmp_path / "d"), str(tmp_path / variant), "http://127.0.0.1:1", steps=2, seed=0,
                                 overrides=variant_overrides(variant, a))  # fmt: skip
        assert cfg.beta == float(beta or 0.0), variant


def test_full_budgets_fit_the_longest_chain_solution(tmp_path):
    """--full's completion budget and SFT length hold every trace whole, tokenised by the demo's tokenizer (the
    first n = 16 grid trained and sampled chains at 256 tokens: every 3-5 call trace was cut before its answer)."""
    from transformers import AutoTokenizer

    from appo_trl.synthetic.pipeline import build_model
    from appo_trl.synthetic.task import ALL_FAMILIES, build_task

    tok = AutoTokenizer.from_pretrained(build_model(str(tmp_path / "m"), 0))
    full = args("--full")
    task = build_task(0, num_sft=1800, num_rl=8, num_heldout=8, families=ALL_FAMILIES)
    longest_completion = longest_row = 0
    for q in task.sft:
        messages = q.sft_row()["messages"]
        prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        n_row = len(tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"])
        longest_completion, longest_row = max(longest_completion, n_row - n_prompt), max(longest_row, n_row)
    assert 256 < longest_completion <= full.max_completion_length  # a 5-call chain is longer than the old budget
    assert 256 < longest_row <= full.sft_max_length


def test_a_study_resumes_only_with_its_own_settings(tmp_path):
    from appo_trl.cli.study import run
    from appo_trl.configs.errors import ConfigError

    (tmp_path / "study.json").write_text(json.dumps({"runs": {}, "config": vars(args("--workdir", "elsewhere"))}))
    with pytest.raises(ConfigError, match=r"study.json was made with other settings \(rl_steps 120 -> 60\)"):
        run(args("--workdir", str(tmp_path), "--rl_steps", "60"), printer=print)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.json"]  # refused before anything is built


def test_a_study_json_from_before_the_schedule_setting_resumes_with_the_constant_schedule(tmp_path):
    """A study.json written before `--sft_schedule` existed ran its cold start at a constant learning rate: it
    resumes with that schedule (the default) and is refused with another."""
    from appo_trl.cli.study import check_resume
    from appo_trl.configs.errors import ConfigError

    old = vars(args("--full"))
    del old["sft_schedule"]
    check_resume({"config": old}, args("--full", "--strategies", "grpo"), "study.json")
    with pytest.raises(ConfigError, match=r"sft_schedule 'constant_with_warmup' -> 'cosine'"):
        check_resume({"config": old}, args("--full", "--sft_schedule", "cosine"), "study.json")


def test_render_has_the_three_tables():
    run = lambda s, seed, tok, a2, a4: {  # noqa: E731
        "strategy": s, "seed": seed, "rl_wall_s": 1.0,
        "history": [{"step": i, "reward": 0.1, "sampled_tokens": tok, "calls": 1.0, "tool_calls": 4,
                     "loss_rows": 8, "loss_rows_frac": 0.5, "step_time": 1.0, "cpu_s": 1.0, "wall_s": 1.0}
                    for i in (1, 2, 3, 4)],
        "evals": {"2": {"pass@1": a2, "by_family": {"python": a2, "chain": a2 / 2}},
                  "4": {"pass@1": a4, "pass@k": a4, "calls_per_sample": 1.0,
                                               "by_family": {"python": a4, "chain": a4 / 2}}},
    }  # fmt: skip
    from appo_trl.cli.study import matched, summarize

    runs = {"grpo/seed0": run("grpo", 0, 100, 0.6, 0.8), "appo/seed0": run("appo", 0, 50, 0.55, 0.7)}
    for r in runs.values():
        r["eval"] = r["evals"]["4"]
    done = {"sft": {"pass@1": 0.5, "pass@k": 0.6, "k": 4, "questions": 8, "by_family": {"python": 0.5, "chain": 0.2}},
            "runs": runs, "config": {"rl_steps": 4}}  # fmt: skip
    done["summary"] = summarize(done, ["grpo", "appo"])
    done["matched"] = matched(done, ["grpo", "appo"])
    assert set(done["matched"]) == {*BUDGETS, "chain_sampled_tokens"}
    text = render(done)
    # the chains at appo's 200 tokens: grpo's step 2 (60 % / 2), appo's end (70 % / 2)
    assert "| chain family only, policy-sampled tokens | 200 | appo | 30.0 ± 0.0 % | 35.0 ± 0.0 % |" in text
    # tokens: appo spent 200 in K steps, grpo 400; at 200 tokens grpo had its step-2 accuracy, 60 %
    assert "| policy-sampled tokens | 200 | appo | 60.0 ± 0.0 % | 70.0 ± 0.0 % |" in text
    assert "| tool calls | 16 | grpo | 80.0 ± 0.0 % | 70.0 ± 0.0 % |" in text  # equal calls: compared at the end
    assert "| chain | 20.0 % | 40.0 ± 0.0 % | 35.0 ± 0.0 % |" in text
    assert "Where the chain questions fail" not in text  # no chain error tables in `done`: none rendered
    shares = dict(zip(CHAIN_CATEGORIES, (0.5, 0.25, 0.25, 0.0, 0.0, 0.0)))
    done["chain_errors"] = {"SFT": {"shares": shares, "samples": 4, "dirs": ["sft"]}}
    assert "| SFT | 50 % | 25 % | 25 % | 0 % | 0 % | 0 % | 4 | sft |" in render(done)
    # two seeds: chain 40 % and 20 % -> mean 30 %, sample sd sqrt(2 * 10^2 / 1) = 14.1 points
    runs["grpo/seed1"] = run("grpo", 1, 100, 0.6, 0.4)
    runs["grpo/seed1"]["eval"] = runs["grpo/seed1"]["evals"]["4"]
    done["summary"] = summarize(done, ["grpo", "appo"])
    assert "| chain | 20.0 % | 30.0 ± 14.1 % | 35.0 ± 0.0 % |" in render(done)


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
    from appo_trl.cli.study import run

    argv = ["--workdir", str(tmp_path), "--sft_steps", "30", "--num_sft", "90", "--num_heldout", "8",
            "--eval_samples", "1", "--rl_steps", "2", "--checkpoints", "1", "--seeds", "0",
            "--strategies", "grpo", "appo", "--families", "python", "chain", "--tool_call_limit", "5"]  # fmt: skip
    lines: list[str] = []
    done = run(args(*argv), printer=lines.append)
    saved = json.loads((tmp_path / "study.json").read_text())
    for key in ("grpo/seed0", "appo/seed0"):
        r = saved["runs"][key]
        assert sorted(r["evals"], key=int) == ["1", "2"]  # the checkpoint at step 1 and the end
        assert [h["step"] for h in r["history"]] == [1, 2]
        assert all(h["loss_rows"] > 0 and "tool_calls" in h and h["cpu_s"] > 0 for h in r["history"])
        assert set(r["eval"]["by_family"]) == {"python", "chain"}
    assert set(done["matched"]) == {*BUDGETS, "chain_sampled_tokens"}
    text = (tmp_path / "study.md").read_text()
    assert "at matched compute" in text and "| chain |" in text
    assert "Where the chain questions fail" in text and "appo/seed0/step2 |" in text
    assert (tmp_path / "study_compute.png").stat().st_size > 10_000
    assert any("[SFT]" in x for x in lines) and any("[eval]" in x for x in lines)
    lines.clear()
    run(args(*argv), printer=lines.append)  # resumed: nothing is trained or evaluated again
    assert not any(x.startswith(("[study] grpo/seed0", "[study] appo/seed0")) for x in lines), lines
    assert not any("[RL" in x or "[eval]" in x for x in lines), lines


def test_the_demo_rl_stage_takes_the_model_settings(tmp_path, tiny_model_path, monkeypatch):
    """`appo demo --use_peft true ...` trains an adapter: the RL stage hands the trainer the PEFT config (it was
    dropped silently, so a "LoRA" demo trained every weight)."""
    import appo_trl.data
    import appo_trl.trainer.trainer
    from appo_trl.synthetic.pipeline import rl_arguments, run_rl

    class Built(Exception):
        pass

    def trainer(**kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(appo_trl.trainer.trainer, "APPOTrainer", trainer)
    monkeypatch.setattr(appo_trl.data, "load_rl_dataset", lambda script_args: None)
    args = rl_arguments("recipes/demo/appo.yaml", tiny_model_path, str(tmp_path / "d"), str(tmp_path / "rl"),
                        "http://127.0.0.1:9", steps=1, seed=0,
                        overrides=["--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "all-linear"])  # fmt: skip
    with pytest.raises(Built) as built:
        run_rl(args)
    peft = built.value.args[0]["peft_config"]
    assert peft is not None and peft.r == 8 and peft.target_modules == "all-linear"
    assert built.value.args[0]["args"].model_init_kwargs["dtype"] == "float32"
