"""Floor 5: the evaluation stage. Tool-integrated inference on benchmarks, pass@k, LLM judge and reports.

Imports `tools`, `rollout`, `vllm`, `rewards`, `configs` and `data`; never `reporting`, `trainer`, `stages`,
`synthetic` or `cli` (it evaluates a model, not a training run).

`appo eval --config eval/<name>.yaml` runs `evaluate(config, generate)`; the pieces are importable alone:
`pass_at_k` (unbiased estimator), `load_registry` / `load_examples` (ARPO's files), `LLMJudge`,
`compare_reports`. Heavy dependencies (torch, the rollout engine) are imported only by `inference`.
"""

from appo_trl.evaluation.benchmarks import Benchmark, Example, load_examples, load_registry, system_prompt
from appo_trl.evaluation.config import EvalConfig
from appo_trl.evaluation.judge import JudgeConfig, LLMJudge, parse_verdict
from appo_trl.evaluation.passk import avg_at_k, mean_pass_at_k, pass_at_k
from appo_trl.evaluation.report import compare_reports, print_comparison, print_summary
from appo_trl.evaluation.runner import Generation, Request, evaluate

__all__ = [
    "Benchmark", "EvalConfig", "Example", "Generation", "JudgeConfig", "LLMJudge", "Request", "avg_at_k",
    "compare_reports", "evaluate", "load_examples", "load_registry", "mean_pass_at_k", "parse_verdict",
    "pass_at_k", "print_comparison", "print_summary", "system_prompt",
]  # fmt: skip
