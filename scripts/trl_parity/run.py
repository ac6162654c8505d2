"""Run TRL's own `tests/test_grpo_trainer.py` twice, with `GRPOTrainer` and with `APPOTrainer`, and compare.

A developer tool, not part of `make test`: TRL's test file is held out of this repository, so pass the path of a
TRL checkout's `tests/` folder (its `test_grpo_trainer.py`, `testing_utils.py`, `conftest.py`, `__init__.py` are
copied to two scratch folders). In the second copy only the line `from trl import GRPOConfig, GRPOTrainer` is
changed, to import `appo_trl.APPOTrainer` under the name `GRPOTrainer`; nothing else in TRL's tests is edited.

Runs offline on CPU: the Hub fixtures come from `build_fixtures.py` (built on first use), datasets through
`plugin.py`. GPU, vLLM, liger, bitsandbytes and vision/multimodal tests are deselected by name (`DESELECT`); the
accelerator-only ones also skip themselves. The tool and environment tests need `jmespath` importable (TRL's
optional dependency): without it they skip in both runs.

Usage: `python scripts/trl_parity/run.py TRL/tests [--work DIR] [--timeout S] [-k EXPR] [--only TRAINER]`
Prints per-run counts and every test whose outcome differs; exits 1 when a test passes for `GRPOTrainer` only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMPORT_LINE = "from trl import GRPOConfig, GRPOTrainer"
SWAPPED = "from trl import GRPOConfig; from appo_trl import APPOTrainer as GRPOTrainer  # noqa: E702"
DESELECT = "not vllm and not liger and not vlm and not multimodal and not bitsandbytes and not Slow"
LABELS = ("GRPOTrainer", "APPOTrainer")
FILES = ("test_grpo_trainer.py", "testing_utils.py", "conftest.py", "__init__.py")


def prepare(trl_tests: Path, dest: Path, swap: bool) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "tests").mkdir(parents=True)
    for name in FILES:
        if (trl_tests / name).exists():
            shutil.copy(trl_tests / name, dest / "tests" / name)
    if swap:
        path = dest / "tests" / "test_grpo_trainer.py"
        text = path.read_text()
        if text.count(IMPORT_LINE + "\n") != 1:
            sys.exit(f"{path}: expected the line {IMPORT_LINE!r} exactly once")
        path.write_text(text.replace(IMPORT_LINE + "\n", SWAPPED + "\n"))


def run_pytest(dest: Path, fixtures: Path, kexpr: str, timeout: int) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_CACHE=str(fixtures / "hub"))
    env.update(TRL_PARITY_FIXTURES=str(fixtures), WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only contend
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(REPO), env.get("PYTHONPATH")]))
    xml = dest / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/test_grpo_trainer.py", "-p", "plugin", "-p", "no:cacheprovider"]
    cmd += ["-q", "-rN", "-k", kexpr, f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    if _has("pytest_timeout"):
        cmd += [f"--timeout={timeout}"]
    with open(dest / "pytest.log", "w") as log:
        subprocess.run(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if not xml.is_file():
        sys.exit(f"pytest wrote no results (collection failed?); see {dest / 'pytest.log'}")
    return outcomes(xml)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped / xfailed (from pytest's JUnit XML)."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                state = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        result[name] = state
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trl_tests", type=Path, help="TRL's tests/ folder (holding test_grpo_trainer.py)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl_parity"), help="scratch folder")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (with pytest-timeout)")
    parser.add_argument("-k", dest="kexpr", default="", help="extra -k expression, and-ed with the deselection")
    parser.add_argument("--only", choices=LABELS, help="run one trainer; compare with the other's last results")
    args = parser.parse_args()
    if not (args.trl_tests / "test_grpo_trainer.py").is_file():
        sys.exit(f"{args.trl_tests}: no test_grpo_trainer.py there")
    fixtures = args.work / "fixtures"
    if not (fixtures / "hub").is_dir():
        subprocess.run([sys.executable, str(HERE / "build_fixtures.py"), str(fixtures)], check=True)
    kexpr = DESELECT + (f" and ({args.kexpr})" if args.kexpr else "")
    runs = {}
    for label in LABELS:  # one after the other, never at once (each is CPU heavy)
        if args.only in (None, label):
            prepare(args.trl_tests, args.work / label, swap=label == "APPOTrainer")
            runs[label] = run_pytest(args.work / label, fixtures, kexpr, args.timeout)
        elif (args.work / label / "junit.xml").is_file():
            runs[label] = outcomes(args.work / label / "junit.xml")
        else:
            sys.exit(f"--only {args.only}: no earlier {label} results under {args.work}")
        counts = {s: sum(v == s for v in runs[label].values()) for s in ("passed", "failed", "error", "skipped")}
        print(f"{label}: {len(runs[label])} run, " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    grpo, appo = runs["GRPOTrainer"], runs["APPOTrainer"]
    differ = sorted(t for t in grpo.keys() | appo.keys() if grpo.get(t) != appo.get(t))
    both = sum(grpo.get(t) == "passed" == appo.get(t) for t in grpo)
    print(f"pass for both: {both}; differ: {len(differ)} (logs: {args.work}/<trainer>/pytest.log)")
    for test in differ:
        print(f"  {test}: GRPOTrainer {grpo.get(test, 'absent')}, APPOTrainer {appo.get(test, 'absent')}")
    sys.exit(1 if any(grpo.get(t) == "passed" for t in differ) else 0)


if __name__ == "__main__":
    main()
