"""APPOTrainer with `tree_forward` (the default) against the row-by-row forward, on the tiny model with the scripted
engine (tool-masked spans, branch rows that share their parent's prefix), for every strategy:

- the loss and every parameter's gradient of a real micro-batch agree within 1e-5 (float32, CPU);
- `beta > 0`: the reference log-probs the run computed through the tree equal the row-wise reference pass;
- APPO's `score_trajectories` (its branch-selection forward) gives the row-wise logps and entropies;
- micro-batches hold whole groups (groups are shuffled, not rows) and `tree/tokens_ratio` is logged, below 1;
- the chat tool format (the trainer's own engine, Qwen-style `<tool_call>` turns with `tool` messages, ARPO branches
  after the tool result): the loss and every gradient agree within 1e-5 as well.
"""

from __future__ import annotations

import pytest
import torch

from appo_trl.strategies import TokenScores
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_trainer import RewardSpy, make_trainer

TOL = 1e-5
STRATEGIES = {
    "grpo": dict(rollout_strategy="grpo"),
    "arpo": dict(rollout_strategy="arpo", initial_rollouts=2),
    "aepo": dict(rollout_strategy="aepo", initial_rollouts=2),
    "appo": dict(rollout_strategy="appo", initial_rollouts=2),
}


def run_one_step(tmp_path, tokenizer, model_path, compare=False, **kw):
    """One optimizer step (two micro-batches of one group each); with `compare`, each micro-batch's loss and
    gradients are also computed row-wise and through the tree, inside the step, and recorded."""
    engine = ScriptedEngine(tokenizer, filler=6)
    trainer = make_trainer(
        tmp_path, tokenizer, model_path, engine, RewardSpy(), tools=["python"], num_generations=4,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, max_completion_length=96,
        min_remaining_tokens=4, **kw,
    )  # fmt: skip
    seen, compared = train_recording(trainer, compare)
    return trainer, engine, seen, compared


def train_recording(trainer, compare):
    """Train; record each micro-batch's inputs and, with `compare`, its loss and gradients row-wise and through the
    tree, inside the step."""
    seen, compared = [], []
    orig = trainer._compute_loss

    def spy(model, inputs):
        seen.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
        if compare:
            compared.append({tree: loss_and_grads(trainer, model, inputs, tree) for tree in (False, True)})
            trainer.args.tree_forward = True
        return orig(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    return seen, compared


def loss_and_grads(trainer, model, inputs, tree: bool):
    trainer.args.tree_forward = tree
    model = trainer.accelerator.unwrap_model(model)  # DDP: compare on the rank's own module, no collective
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = type(trainer)._compute_loss(trainer, model, inputs)  # the class's, not the spy
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return loss.detach(), {n: g for (n, _), g in zip(params, grads) if g is not None}


def assert_step_exact(trainer, seen, compared):
    """Whole groups per micro-batch, a logged tokens ratio below 1, and per micro-batch the tree's loss and every
    gradient equal to the row-wise ones."""
    assert trainer.args.tree_forward  # the default
    prompts = [{tuple(r[m.bool()].tolist()) for r, m in zip(i["prompt_ids"], i["prompt_mask"])} for i in seen]
    assert all(len(p) == 1 for p in prompts), "a micro-batch holds one whole group"
    ratios = [log["tree/tokens_ratio"] for log in trainer.state.log_history if "tree/tokens_ratio" in log]
    assert ratios and 0 < ratios[0] < 1
    assert len(compared) == 2
    for pair in compared:
        (loss_row, g_row), (loss_tree, g_tree) = pair[False], pair[True]
        torch.testing.assert_close(loss_tree, loss_row, atol=TOL, rtol=0)
        assert set(g_tree) == set(g_row) and g_row
        for name in g_row:
            torch.testing.assert_close(g_tree[name], g_row[name], atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_loss_and_gradients_equal_rowwise(strategy, tiny_model_path, tiny_tokenizer, tmp_path):
    trainer, engine, seen, compared = run_one_step(
        tmp_path, tiny_tokenizer, tiny_model_path, compare=True, **STRATEGIES[strategy]
    )
    assert_step_exact(trainer, seen, compared)


class VariedChat:
    """Chat turns that differ from call to call: a thought (one of three, each with its own first token) and one
    `multiply` call ending the turn, then, after the tool result, an answer (one of four). Rows of a group share the
    prompt and diverge at the first completion token (or share it); an ARPO branch shares its parent's turn and tool
    result and then diverges. Each token's logprob is -0.5, with a two-entry top-k."""

    THOUGHTS = ("<think> six times seven </think>", "Six times seven:", "I call multiply.")

    def __init__(self, tokenizer):
        self.tok, self.count = tokenizer, 0
        self.after = tokenizer.convert_tokens_to_ids("</tool_response>")

    async def generate(self, prompt_ids, params):
        from appo_trl.rollout import Segment

        self.count += 1
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if self.after in prompt_ids:
            text = f" <answer> {40 + self.count % 4} </answer>"
        else:
            call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
            text = f"{self.THOUGHTS[self.count % 3]}\n{call}"
        ids = (enc(text) + [self.tok.eos_token_id])[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, "eos", None)


def test_chat_tool_format_loss_and_gradients_equal_rowwise(tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    """`tool_format="chat"` with the trainer's own engine (`tools=[multiply]`), ARPO: two micro-batches of one
    group each, whose rows share the prompt and, for the branches, the turn up to the tool result."""
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_chat_tools import Reward, multiply, prompts
    from tests.trainer.test_trainer import CPU

    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                      max_completion_length=120, tool_format="chat", initial_rollouts=2, branch_probability=1.0,
                      beam_size=2)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tiny_chat_tokenizer, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = VariedChat(tiny_chat_tokenizer)
    seen, compared = train_recording(trainer, compare=True)
    for inputs in seen:  # the case is not trivial: chat tool turns, rows that differ from the first token on
        assert inputs["tool_mask"].eq(0).any(), "a tool result is masked out of the loss"
        assert len(set(inputs["completion_ids"][:, 0].tolist())) > 1
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logged["branch/points_per_prompt"] > 0
    assert_step_exact(trainer, seen, compared)


def test_reference_pass_with_beta(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer, _, seen, _ = run_one_step(tmp_path, tiny_tokenizer, tiny_model_path, rollout_strategy="arpo",
                                    initial_rollouts=2, beta=0.04)  # fmt: skip
    assert trainer.ref_model is not None
    for inputs in seen:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        trainer.args.tree_forward = False
        with torch.no_grad():
            ref, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, inputs["completion_ids"].size(1)
            )
        m = inputs["completion_mask"].bool()
        torch.testing.assert_close(inputs["ref_per_token_logps"][m], ref[m], atol=TOL, rtol=0)


def test_score_trajectories_equal_rowwise(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer, engine, _, _ = run_one_step(tmp_path, tiny_tokenizer, tiny_model_path, **STRATEGIES["appo"])
    trajectories = engine.initial[:4]
    out = {}
    for tree in (False, True):
        trainer.args.tree_forward = tree
        out[tree] = trainer.score_trajectories(trajectories)
    assert isinstance(out[True], TokenScores)
    for key in ("logps", "entropies"):
        torch.testing.assert_close(getattr(out[True], key), getattr(out[False], key), atol=TOL, rtol=0)
        assert getattr(out[True], key).abs().sum() > 0


@pytest.mark.slow
def test_two_process_gloo(tiny_model_path, tmp_path):
    """Two ranks (gloo, DDP): each rank's micro-batches give the row-wise loss and gradients through the tree."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(here, "ddp_tree.py"), tiny_model_path, str(tmp_path)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=500, env=env, cwd=os.path.join(here, "..", "..")
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    assert result["world"] == 2 and result["ddp"] == "DistributedDataParallel", result
    for loss_diff, grad_diff, micro_batches in result["diffs"]:
        assert micro_batches == 2 and loss_diff <= TOL and grad_diff <= TOL, result


def test_small_token_budget_several_tries_per_forward(tiny_model_path, tiny_tokenizer, tmp_path):
    """A budget below one group's unique tokens: every forward runs several tries (each in its own autocast
    context), still exact."""
    from appo_trl.tree.forward import pack_rows

    trainer, _, seen, compared = run_one_step(
        tmp_path, tiny_tokenizer, tiny_model_path, compare=True, tree_token_budget=64, **STRATEGIES["arpo"]
    )
    inputs = seen[0]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    assert len(pack_rows(ids, mask, inputs["completion_ids"].size(1), 64)) > 1
    for pair in compared:
        torch.testing.assert_close(pair[True][0], pair[False][0], atol=TOL, rtol=0)
        for name, grad in pair[False][1].items():
            torch.testing.assert_close(pair[True][1][name], grad, atol=TOL, rtol=0, msg=name)


def test_each_micro_batch_is_packed_once_per_step(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    """ARPO with `beta > 0`: TRL's reference pass (over the generation batch, in chunks of one micro-batch) and
    the loss pass of each micro-batch see the same rows, which are packed once in the trainer's own `PackCache`
    (`trainer.tree_packs`): one pack per distinct batch of rows, the other passes reuse it."""
    from appo_trl.tree.forward import PackCache

    batches = []
    inner = PackCache.get

    def recorded(self, ids, mask, *args):
        batches.append(frozenset(zip(map(tuple, ids.tolist()), map(tuple, mask.tolist()))))
        return inner(self, ids, mask, *args)

    monkeypatch.setattr(PackCache, "get", recorded)
    trainer, *_ = run_one_step(tmp_path, tiny_tokenizer, tiny_model_path, rollout_strategy="arpo", initial_rollouts=2,
                               beta=0.04)  # fmt: skip
    cache = trainer.tree_packs
    assert cache.packs == len(set(batches)) == 2 and cache.hits == len(batches) - 2 >= 2
