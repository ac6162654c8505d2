"""Agent overlap benchmark: step time of `agent=` training with background rounds (`max_staleness: 1`) against
synchronous rounds, for an agent whose tool calls wait on a slow tool.

The tiny chat model trains for real (in-process, CPU); a scripted sampler writes two parallel `<tool_call>`s and,
after the tool results, the answer (as `tests/trainer/test_agents.py`'s, so the runs are the same in both modes);
the agent is a plain `openai` SDK loop that runs each call with `--tool-s` seconds of latency (a slow tool or a
remote sandbox). The same workload runs twice in one process, one run after the other: `max_staleness: 0`, then
`max_staleness: 1`. Step time is the mean of `step_time` over the steps after the first (the first round is
synchronous in both modes). Figures: docs/benchmarks.md, "Agent overlap".

    python bench/agent_overlap.py                  # 8 steps, 0.25 s per tool call
    python bench/agent_overlap.py --threads 1 --tool-s 0.05
    python bench/agent_overlap.py --quick --json   # 3 steps (figures not meaningful)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]  # fmt: skip
CALLS = (
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>\n'
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)


class ScriptedBackend:
    """Two parallel calls, then (after a tool response) the answer, 42 or 41 in turn; logprob -0.5 per token."""

    def __init__(self, tok):
        self.tok, self.turn = tok, 0
        self.after = tok.convert_tokens_to_ids("</tool_response>")

    async def generate(self, prompt_ids, params):
        from appo_trl.rollout import Segment

        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if self.after in prompt_ids:
            self.turn += 1
            ids = enc("<answer> 42 </answer>" if self.turn % 2 else "<answer> 41 </answer>")
        else:
            ids = enc(CALLS)
        ids = (ids + [self.tok.eos_token_id])[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, "eos" if len(ids) < params.max_tokens else "length")


def make_agent(tool_s: float):
    def agent(row, base_url, model):
        import openai

        client = openai.OpenAI(base_url=base_url, api_key="-")
        messages = list(row["prompt"])
        for _ in range(4):
            msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:  # the slow tool, one call after the other
                time.sleep(tool_s)
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])})
        client.close()
        return float("42" in (msg.content or ""))

    return agent


def run(model_dir, tok, steps: int, staleness: int, tool_s: float, out: str) -> dict:
    from datasets import Dataset

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is 6 times 7 ({i})"}]
                                         for i in range(4 * steps)]})  # fmt: skip
    args = APPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", logging_steps=1, seed=0,
                      disable_tqdm=True, save_strategy="no", num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=96, max_steps=steps, max_staleness=staleness,
                      vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    trainer = APPOTrainer(model=model_dir, args=args, train_dataset=data, processing_class=tok,
                          agent=make_agent(tool_s))  # fmt: skip
    trainer.rollout_engine.backend = ScriptedBackend(tok)
    agents, generation = trainer.rounds.path.agents, []
    real_generate = agents.generate

    def timed_generate(*a):
        t0 = time.perf_counter()
        try:
            return real_generate(*a)
        finally:
            generation.append(time.perf_counter() - t0)

    agents.generate = timed_generate
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    later = times[1:] or times
    gen = generation[1:] or generation  # one round's agent runs (on the round's thread when in the background)
    return {"step_s": round(sum(later) / len(later), 3), "generation_s": round(sum(gen) / len(gen), 3),
            "wall_s": round(wall, 2), "steps": len(times)}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tool-s", type=float, default=0.25, help="seconds each tool call waits")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="3 steps (figures not meaningful)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 3
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="appo-bench-agent-overlap-") as tmp:  # removed after an error too
        return _figures(args, tmp)


def _figures(args: argparse.Namespace, tmp: str) -> dict:
    import torch
    from transformers import AutoTokenizer

    from appo_trl.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(tmp, "tiny"), chat_template="tools")
    tok = AutoTokenizer.from_pretrained(model_dir)
    figures: dict = {"agent_overlap_steps": args.steps, "agent_overlap_tool_s": args.tool_s,
                     "agent_overlap_torch_threads": torch.get_num_threads()}  # fmt: skip
    for staleness in (0, 1):
        result = run(model_dir, tok, args.steps, staleness, args.tool_s, tempfile.mkdtemp(dir=tmp))
        figures.update({f"agent_overlap_staleness{staleness}_{k}": v for k, v in result.items()})
        print(f"max_staleness {staleness}: {result['step_s']} s per step, a round's agent runs "
              f"{result['generation_s']} s ({result['steps']} steps, wall "
              f"{result['wall_s']} s)", flush=True)  # fmt: skip
    ratio = figures["agent_overlap_staleness1_step_s"] / figures["agent_overlap_staleness0_step_s"]
    figures["agent_overlap_step_time_ratio"] = round(ratio, 3)
    figures["agent_overlap_load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(f"step time, max_staleness 1 / synchronous: {ratio:.3f}", flush=True)
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
