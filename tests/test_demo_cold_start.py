"""The `make test` guard of the demo's cold start: a short SFT on the demo's own data starts copying unseen names.

The demo's SFT start used to hinge on one skill appearing abruptly late in SFT: copying an unseen entity's name
from the question into the search query. Where it had not appeared by step 2,000 (a seed, or only a CPU's
floating-point kernels, away) the start fell from about 59 % to 34 % held-out pass@1 (docs/benchmarks.md,
"Demo"). The traces now name the entity first, in `<think>` and in the query, guesses included, and the copy is
learned early: its first syllable by step 300, the whole name by step 600-900. This test trains the demo's model
on the demo's SFT traces (seed 0, `STEPS` steps) and checks, with the greedy copying probe
(`appo_trl.synthetic.copying`) on the 64 held-out search and both questions (entities never seen in training):

- the training loss at `STEPS` lies in `LOSS_BAND` (the traces and their masking are the ones measured);
- at least `HEAD_MIN` of the questions get a query (or a guess's `<think>`) naming an entity whose first
  syllable is the asked entity's.

Measured (docs/benchmarks.md, "Demo"): step 300, loss 0.36, 64 of 64 first syllables right (step 200: 46 of 64);
the old teaching (`capital of Velmora`, no name in `<think>` or in a guess) fails it at step 300. The loss at step
300 (the mean of steps 251-300) depends on the CPU's kernels: 0.360 (`ATEN_CPU_CAPABILITY=avx2`) and 0.362
(`default`) on an Intel Xeon with AVX-512 and AMX, where its own kernels give 0.239; the band's lower end was 0.25
until a fresh-clone CI on that machine failed on it (2026-12-05). Break-it: with `mask_tool_results: false` (the
loss on the tools' output too) the copying check fails, 72 % against 80 %.
"""

from __future__ import annotations

import pytest

from appo_trl.synthetic import build_task, write_task
from appo_trl.synthetic.copying import copy_rate

SEED, STEPS, NUM_SFT, NUM_HELDOUT = 0, 300, 1800, 96
DEMO_STEPS = 2000  # the demo's cold start, whose first STEPS steps (its cosine schedule's start) this trains
LOSS_BAND = (0.2, 0.5)  # measured at step 300 on the current task: 0.24-0.36 (below)
HEAD_MIN = 0.8


@pytest.mark.slow
def test_a_short_cold_start_copies_unseen_names_into_its_search_queries(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from appo_trl.synthetic import pipeline as P

    paths = write_task(tmp_path / "data", SEED, num_sft=NUM_SFT, num_heldout=NUM_HELDOUT)
    P.build_model(str(tmp_path / "model"), SEED)
    losses: list[float] = []

    class FirstSteps(TrainerCallback):  # the demo's run, learning-rate schedule included, stopped at STEPS
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= STEPS:
                control.should_training_stop = True

    P.run_sft(str(tmp_path / "model"), paths["sft"], str(tmp_path / "sft"), steps=DEMO_STEPS, seed=SEED,
              callbacks=[FirstSteps()])  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    r = copy_rate(model, tokenizer, build_task(SEED, num_sft=NUM_SFT, num_heldout=NUM_HELDOUT).heldout)
    assert r["questions"] == 64
    assert LOSS_BAND[0] <= losses[-1] <= LOSS_BAND[1], losses
    assert r["head_copied"] >= HEAD_MIN, [x["completion"] for x in r["samples"][:4]]


def _percent_range(key: str) -> str:
    from appo_trl.cli.demo import DOCUMENTED_RANGE

    lo, hi = DOCUMENTED_RANGE[key]
    return f"{100 * lo:.0f}–{100 * hi:.0f} %"


def test_the_readme_quotes_the_documented_range_of_the_code():
    from appo_trl.cli.demo import DOCUMENTED_MIN_GAIN
    from appo_trl.configs.recipes import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## What the demo shows") :]
    section = section[: section.index("\n## ", 1)]
    for key in ("heldout_accuracy_sft", "heldout_accuracy_rl"):
        assert _percent_range(key) in section, (key, _percent_range(key))
    assert f"at least {100 * DOCUMENTED_MIN_GAIN:.0f} points" in section


def test_the_demo_says_whether_its_result_lies_in_the_documented_range():
    from appo_trl.cli.demo import DOCUMENTED_MIN_GAIN, DOCUMENTED_RANGE, parse_args, range_verdict

    (sft_lo, sft_hi), (rl_lo, rl_hi) = (
        DOCUMENTED_RANGE["heldout_accuracy_sft"],
        DOCUMENTED_RANGE["heldout_accuracy_rl"],
    )
    lines: list[str] = []
    a = parse_args([])
    inside = {"heldout_accuracy_sft": sft_lo, "heldout_accuracy_rl": max(rl_lo, sft_lo + DOCUMENTED_MIN_GAIN)}
    assert range_verdict(a, inside, lines.append) is True
    assert len(lines) == 3 and all("lies in the documented range" in x for x in lines), lines
    lines.clear()
    # the start and the end in range, but a gain below the documented least gain
    small_gain = {"heldout_accuracy_sft": sft_hi, "heldout_accuracy_rl": sft_hi + DOCUMENTED_MIN_GAIN - 0.01}
    assert rl_lo <= small_gain["heldout_accuracy_rl"] <= rl_hi  # (the example needs it)
    assert range_verdict(a, small_gain, lines.append) is False
    assert [("OUTSIDE" in x) for x in lines] == [False, False, True], lines
    lines.clear()
    below = {"heldout_accuracy_sft": sft_lo - 0.01, "heldout_accuracy_rl": rl_lo - 0.01}
    assert range_verdict(a, below, lines.append) is False
    want = f"SFT start: {100 * (sft_lo - 0.01):.1f} % lies OUTSIDE the documented range ({_percent_range('heldout_accuracy_sft').replace('–', '-')}"
    assert want in lines[0], lines
    # other settings than the documented ones: nothing to compare with, and it says so
    lines.clear()
    assert range_verdict(parse_args(["--rl_steps", "4"]), {}, lines.append) is None
    assert lines == ["[demo] no documented range for these settings (--rl_steps 4); the range of the defaults is "
                     "in README.md"]  # fmt: skip
    lines.clear()
    assert range_verdict(parse_args(["--learning_rate", "1e-4"]), {}, lines.append) is None
    assert "--learning_rate 1e-4" in lines[0]


def test_the_demo_cold_start_decays_its_learning_rate(monkeypatch):
    """Run E's cold start (docs/benchmarks.md, "Demo"): the recipe, the demo's default and what `run_sft` hands
    to the SFT stage agree; the study keeps the constant schedule its tables were measured with."""
    import yaml

    from appo_trl.cli.demo import SFT_SCHEDULE, parse_args
    from appo_trl.configs.recipes import REPO_ROOT
    from appo_trl.stages import sft
    from appo_trl.synthetic import pipeline as P

    recipe = yaml.safe_load((REPO_ROOT / "recipes" / "demo" / "sft.yaml").read_text())
    assert parse_args([]).sft_schedule == SFT_SCHEDULE == recipe["lr_scheduler_type"] == "cosine"
    seen = []
    monkeypatch.setattr(sft, "main", lambda *args, **kw: seen.append(args))
    P.run_sft("model", "data.jsonl", "out", steps=10, seed=0)
    P.run_sft("model", "data.jsonl", "out", steps=10, seed=0, schedule="constant_with_warmup")
    assert [str(a[1].lr_scheduler_type.value) for a in seen] == ["cosine", "constant_with_warmup"]
