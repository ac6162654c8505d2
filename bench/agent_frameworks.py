"""Agent frameworks benchmark: what rebuilding the prompt on every call costs, against a plain `openai` SDK agent,
with the tree forward on.

An agent that sends back the messages it got extends one chain (one row per run); a framework that re-renders its
history on every call (smolagents' `ToolCallingAgent`, DSPy's `ReAct`) starts a new chain at every call after its
first, and each chain is a row of its own (`agent/chain_rows`). The tiny chat model (8k positions: smolagents' system
prompt alone is about 2.6k tokens) trains for real on the CPU; a scripted sampler answers a tool call, then the
answer, in each framework's format, so each agent solves the same task (6 x 7) in two calls. Agents:

- `sdk`: the `openai` SDK tool loop (one chain per run);
- `rebuild`: the same loop, but it rebuilds its prompt on every call (its tool call and the result go back as user
  text, as smolagents does): the cost of the rows alone, on the SDK agent's short prompt;
- `smolagents`: `ToolCallingAgent` with `OpenAIServerModel`;
- `dspy`: `dspy.ReAct` (when `dspy` is installed).

Per agent: rows per run (1 + chain rows / runs), completion tokens and row tokens (prompt included) per run, step
time (mean over the steps after the first) and the part of it a round's agent runs take (`agent_runs_s`), and
`tree/tokens_ratio`: the tokens the tree forward sends through the model over the rows' tokens (its trie packs the
rows of a micro-batch together, so rows that share a prefix, the chains of one run and the runs of one prompt, share
its compute already); `round_trie_tokens_ratio` is the same for one trie over all of a round's rows (the least any
merge of shared prefixes could forward), and `forwarded_tokens_per_run` (row tokens x `tree/tokens_ratio`) the
training forward's work per run, a figure that the machine's load does not move. `smolagents` (`--quick`:
`rebuild`) also runs with the tree forward off, for the step-time ratio. Figures: docs/benchmarks.md, "Agent frameworks".

    python bench/agent_frameworks.py                 # 4 steps per agent
    python bench/agent_frameworks.py --quick --json  # 2 steps (figures not meaningful)
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
MULTIPLY = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
DSPY_CALL = ('[[ ## next_thought ## ]]\nMultiply.\n\n[[ ## next_tool_name ## ]]\nmultiply\n\n[[ ## next_tool_args ## ]]\n'
             '{"a": 6, "b": 7}\n\n[[ ## completed ## ]]')  # fmt: skip
DSPY_FINISH = ('[[ ## next_thought ## ]]\nDone.\n\n[[ ## next_tool_name ## ]]\nfinish\n\n[[ ## next_tool_args ## ]]\n{}'
               '\n\n[[ ## completed ## ]]')  # fmt: skip
DSPY_ANSWER = "[[ ## reasoning ## ]]\n6 x 7.\n\n[[ ## answer ## ]]\n42\n\n[[ ## completed ## ]]"


class ScriptedBackend:
    """Each framework's tool call, then (after the result) its answer, 42 and 41 in turn (so groups have both rewards
    and the loss trains); logprob -0.5 per token."""

    def __init__(self, tok):
        self.tok, self.answers = tok, 0

    def text(self, prompt: str) -> str:
        text = self.script(prompt)
        if "42" in text:
            self.answers += 1
            text = text.replace("42", "42" if self.answers % 2 else "41")
        return text

    def script(self, prompt: str) -> str:
        last_user = prompt.split("<|im_start|>user")[-1]
        if "[[ ## completed ## ]]" in prompt:  # DSPy's ChatAdapter: ReAct's steps, then its extract step
            if "[[ ## next_thought ## ]]" not in prompt.split("<|im_start|>user")[0]:
                return DSPY_ANSWER
            return DSPY_FINISH if "observation_0" in last_user else DSPY_CALL
        if "final_answer" in prompt:  # smolagents: multiply, then after its observation the final_answer tool
            if "Observation" in last_user:
                return '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "42"}}\n</tool_call>'
            return MULTIPLY
        done = "</tool_response>" in prompt or "Observation" in last_user
        return "<answer> 42 </answer>" if done else MULTIPLY

    async def generate(self, prompt_ids, params):
        from appo_trl.rollout import Segment

        ids = self.tok.encode(self.text(self.tok.decode(prompt_ids)), add_special_tokens=False)
        ids = (ids + [self.tok.eos_token_id])[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, "eos" if len(ids) < params.max_tokens else "length")


def sdk_agent(row, base_url, model, rebuild=False):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages, msg = list(row["prompt"]), None
    for _ in range(4):
        msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        if not msg.tool_calls:
            break
        results = [str(json.loads(c.function.arguments)["a"] * json.loads(c.function.arguments)["b"])
                   for c in msg.tool_calls]  # fmt: skip
        if rebuild:  # the history re-rendered as text, as smolagents sends it: a new prompt on every call
            called = ", ".join(f"{c.function.name}({c.function.arguments})" for c in msg.tool_calls)
            messages.append({"role": "user", "content": f"Called {called}. Observation: {', '.join(results)}"})
            continue
        messages.append(msg.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(msg.tool_calls, results)]
    client.close()
    return float("42" in (msg.content or ""))


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def smolagents_agent(row, base_url, model):
    import smolagents

    llm = smolagents.OpenAIServerModel(model_id=model, api_base=base_url, api_key="-")
    agent = smolagents.ToolCallingAgent(tools=[smolagents.tool(multiply)], model=llm, max_steps=3, verbosity_level=0)
    return float(str(agent.run(row["prompt"][0]["content"])) == "42")


def dspy_agent(row, base_url, model):
    import dspy

    lm = dspy.LM(f"openai/{model}", api_base=base_url, api_key="-", cache=False, num_retries=0)
    react = dspy.ReAct("question -> answer", tools=[multiply], max_iters=3)
    with dspy.context(lm=lm):
        return float("42" in str(react(question=row["prompt"][0]["content"]).answer))


AGENTS = {"sdk": sdk_agent, "rebuild": lambda row, url, model: sdk_agent(row, url, model, rebuild=True),
          "smolagents": smolagents_agent, "dspy": dspy_agent}  # fmt: skip


def trie_tokens(rows: list[list[int]]) -> int:
    """Tokens of one prefix trie over all `rows` (a round's rows in a single forward): each sorted row adds what it
    does not share with the row before it."""
    total, prev = 0, []
    for row in sorted(rows):
        common = next((i for i, (a, b) in enumerate(zip(prev, row)) if a != b), min(len(prev), len(row)))
        total, prev = total + len(row) - common, row
    return total


def run(model_dir, tok, name: str, steps: int, tree: bool, out: str) -> dict:
    from datasets import Dataset

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"what is 6 times 7 ({i})"}]
                                         for i in range(2 * steps)]})  # fmt: skip
    args = APPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", logging_steps=1, seed=0,
                      disable_tqdm=True, save_strategy="no", num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=256, max_steps=steps, tree_forward=tree,
                      vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    trainer = APPOTrainer(model=model_dir, args=args, train_dataset=data, processing_class=tok, agent=AGENTS[name])
    trainer.rollout_engine.backend = ScriptedBackend(tok)
    sizes, counts, unique = [], [], []  # (completion, row tokens) of each row a round trains on; runs; trie tokens
    real = trainer.rounds.strategy.generate

    def generate(*a, **k):
        batch = real(*a, **k)
        rows = [x for r in batch.rows for x in (r, *r.chain_rows)]
        sizes.append([(len(x.completion_ids), len(x.prompt_ids) + len(x.completion_ids)) for x in rows])
        counts.append(len(batch.rows))
        unique.append(trie_tokens([list(x.prompt_ids) + list(x.completion_ids) for x in rows]))
        return batch

    trainer.rounds.strategy.generate = generate
    agents, generation = trainer.rounds.path.agents, []
    real_runs = agents.generate

    def timed_runs(*a):
        t0 = time.perf_counter()
        try:
            return real_runs(*a)
        finally:
            generation.append(time.perf_counter() - t0)

    agents.generate = timed_runs
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    later = logs[1:] or logs
    runs = sum(counts)
    rows = sum(len(s) for s in sizes)
    result = {"rows_per_run": rows / max(runs, 1), "step_s": sum(h["step_time"] for h in later) / len(later),
              "completion_tokens_per_run": sum(c for s in sizes for c, _ in s) / max(runs, 1),
              "row_tokens_per_run": sum(t for s in sizes for _, t in s) / max(runs, 1),
              "reward": sum(h["reward"] for h in logs) / len(logs), "wall_s": wall, "steps": len(logs)}  # fmt: skip
    result["agent_runs_s"] = sum(generation[1:] or generation) / max(len(generation[1:] or generation), 1)
    result["round_trie_tokens_ratio"] = sum(unique) / max(sum(t for s in sizes for _, t in s), 1)
    if tree:
        ratios = [h["tree/tokens_ratio"] for h in logs if "tree/tokens_ratio" in h]
        result["tree_tokens_ratio"] = sum(ratios) / max(len(ratios), 1)
        result["forwarded_tokens_per_run"] = result["row_tokens_per_run"] * result["tree_tokens_ratio"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--agents", default="sdk,rebuild,smolagents,dspy")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="2 steps (figures not meaningful)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # DSPy's litellm: no download at import
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="appo-bench-agent-frameworks-") as tmp:  # removed after an error too
        return _figures(args, tmp)


def _figures(args: argparse.Namespace, tmp: str) -> dict:
    import importlib.util

    import torch
    from transformers import AutoTokenizer

    from appo_trl.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(tmp, "tiny"), chat_template="tools", max_position_embeddings=8192)
    tok = AutoTokenizer.from_pretrained(model_dir)
    figures: dict = {"agent_frameworks_steps": args.steps, "agent_frameworks_torch_threads": torch.get_num_threads()}
    names = [n for n in args.agents.split(",") if n in ("sdk", "rebuild") or importlib.util.find_spec(n)]
    for name in args.agents.split(","):
        if name not in names:
            print(f"{name}: not installed, skipped", flush=True)
    rowwise = "rebuild" if args.quick else "smolagents"  # with the tree forward off too (quick: the short prompt)
    settings = [(n, True) for n in names] + ([(rowwise, False)] if rowwise in names else [])
    for name, tree in settings:
        result = run(model_dir, tok, name, args.steps, tree, tempfile.mkdtemp(dir=tmp))
        key = f"agent_frameworks_{name}" + ("" if tree else "_rowwise")
        figures.update({f"{key}_{k}": v for k, v in result.items()})
        print(f"{name} (tree forward {'on' if tree else 'off'}): {result}", flush=True)
    sdk = figures.get("agent_frameworks_sdk_step_s")
    for name in names[1:]:
        if sdk:
            figures[f"agent_frameworks_{name}_step_ratio_vs_sdk"] = round(figures[f"agent_frameworks_{name}_step_s"]
                                                                          / sdk, 3)  # fmt: skip
    if f"agent_frameworks_{rowwise}_rowwise_step_s" in figures:
        figures[f"agent_frameworks_{rowwise}_tree_vs_rowwise_step_ratio"] = round(
            figures[f"agent_frameworks_{rowwise}_step_s"] / figures[f"agent_frameworks_{rowwise}_rowwise_step_s"], 3
        )
    figures["agent_frameworks_load_avg_1m"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
