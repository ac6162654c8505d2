"""`appo eval --config eval/<name>.yaml [--key value ...]` and `appo eval compare A.json B.json`."""

from __future__ import annotations

import sys

USAGE = """usage: appo eval --config EVAL.yaml [--key value ...]
       appo eval compare A/report.json B/report.json [--names A B]

Runs (or resumes) tool-integrated evaluation: k samples per question through the training rollout engine
(vLLM server or in-process transformers), EM / F1 / cover-EM / math equivalence, optional LLM judge
(OpenAI-compatible endpoint, key from $OPENAI_API_KEY or the variable named by --judge_api_key_env),
unbiased pass@k, tool statistics; writes report.json / report.md / report.png into --output_dir.
Keys are the fields of appo_trl.evaluation.EvalConfig, e.g. --benchmarks aime24 gaia --num_samples 8
--data_root ARPO/evaluation/data (or $APPO_EVAL_DATA_ROOT) --base_url http://127.0.0.1:8000
--search_cache ARPO/search_cache/search_cache.json (ARPO's files: git clone
https://github.com/dongguanting/ARPO; never bundled). `appo eval --config eval/tiny.yaml` runs offline on the
tiny sets shipped in eval/data/tiny. A rerun with the same --output_dir skips finished samples.
`compare` prints per-benchmark differences between two reports (e.g. SFT vs APPO checkpoint)."""


def compare(argv: list[str]) -> int:
    import argparse
    import json

    from appo_trl.evaluation.report import print_comparison

    parser = argparse.ArgumentParser(prog="appo eval compare")
    parser.add_argument("reports", nargs=2, help="two report.json files (or run folders)")
    parser.add_argument("--names", nargs=2, default=("A", "B"), help="column labels")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.reports:
        from pathlib import Path

        p = Path(path)
        p = p / "report.json" if p.is_dir() else p
        if not p.is_file():
            print(f"appo eval compare: no report at {p}", file=sys.stderr)
            return 2
        loaded.append(json.loads(p.read_text(encoding="utf-8")))
    print_comparison(loaded[0], loaded[1], names=tuple(args.names))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "compare":
        return compare(argv[1:])
    from appo_trl.configs.recipes import RecipeError, parse_recipe
    from appo_trl.evaluation.config import EvalConfig

    try:
        (config,) = parse_recipe([EvalConfig], argv)
    except (RecipeError, ValueError) as e:
        print(f"appo eval: {e}", file=sys.stderr)
        return 2
    from appo_trl.configs.errors import ConfigError, DataError
    from appo_trl.evaluation.inference import build_generator
    from appo_trl.evaluation.report import print_summary
    from appo_trl.evaluation.runner import check_output_dir, evaluate

    try:  # before the model loads: benchmarks, data files, tools, and resume only the same run
        check_output_dir(config)
    except ConfigError:
        raise
    except (KeyError, OSError, ValueError) as exc:  # registry and data-file problems: one line, exit 2
        raise DataError(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)) from exc
    report = evaluate(config, build_generator(config))
    print_summary(report)
    print(f"reports written to {config.output_dir}/report.{{json,md,png}}")
    return 0
