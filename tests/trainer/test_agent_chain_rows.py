"""Forked rows: an agent that compacts its history trains on every chain of its run, each exactly as sampled.

The sampler is `test_agents.ScriptedBackend` (a tool call before a tool result, an answer after), recording every
(prompt, answer) it served. A row is exact when each of its sampled spans is one sampler call, asked on exactly the
row's ids before the span, and the tokens between (tool turns, the template's) are masked.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

openai = pytest.importorskip("openai")

from appo_trl.config import APPOConfig  # noqa: E402
from appo_trl.rollout.agent_session import AgentSession, ChatRenderer  # noqa: E402
from appo_trl.rollout.chat_format import ChatToolFormat  # noqa: E402
from appo_trl.rollout.types import SamplingParams  # noqa: E402
from appo_trl.trainer.trainer import APPOTrainer  # noqa: E402
from tests.trainer.test_agents import TOOLS, ScriptedBackend, make_trainer, prompts  # noqa: E402
from tests.trainer.test_trainer import CPU, spy_loss  # noqa: E402


class LoggedBackend(ScriptedBackend):
    """`ScriptedBackend` that also keeps (prompt ids, answer ids) of every call."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.log = []

    async def generate(self, prompt_ids, params):
        seg = await super().generate(prompt_ids, params)
        self.log.append((list(prompt_ids), list(seg.token_ids)))
        return seg


def solve(client, model, messages):
    """One tool round trip: the call, its results, the answer; `messages` grows by the turns."""
    msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in msg.tool_calls or ()]
    return client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message.content


COMPACTS, LOCK = {}, threading.Lock()


def compacting_agent(row, base_url, model, tagged=False):
    """Solves, then compacts: drops its history for one user note and solves again (deterministic requests:
    replayable). Reward: 1 for every other run of a prompt, so every group of an even size has both rewards (the
    scripted answers alternate in the order the concurrent runs reach the sampler, which no run can know).

    `tagged`: the note names the reward's parity, so a rewarded run's rows are never all a failed run's: runs that
    reach the sampler one after the other get the same answers, (42, 41) each, and with one note their opposite
    advantages cancel to a zero gradient (a run by replay must not be tagged: its note would not replay)."""
    with LOCK:
        k = COMPACTS[row["prompt"][0]["content"]] = COMPACTS.get(row["prompt"][0]["content"], -1) + 1
    client = openai.OpenAI(base_url=base_url, api_key="-")
    solve(client, model, list(row["prompt"]))
    tag = f", run {k % 2}" if tagged else ""
    note = [{"role": "user", "content": row["prompt"][0]["content"] + f" (notes: multiply said 42{tag})"}]
    solve(client, model, note)
    client.close()
    return float(k % 2 == 0)


def tagged_compacting_agent(row, base_url, model):
    return compacting_agent(row, base_url, model, tagged=True)


RUNS = {}


def every_other_run_compacts(row, base_url, model):
    """Run k of a prompt: even k compacts (two chains) and returns 1.0, odd k does not (one chain) and returns 0.0."""
    with LOCK:
        k = RUNS[row["prompt"][0]["content"]] = RUNS.get(row["prompt"][0]["content"], -1) + 1
    client = openai.OpenAI(base_url=base_url, api_key="-")
    solve(client, model, list(row["prompt"]))
    if k % 2 == 0:
        solve(client, model, [{"role": "user", "content": row["prompt"][0]["content"] + " (notes: 42)"}])
    client.close()
    return 1.0 if k % 2 == 0 else 0.0


def loss_rows(seen):
    """(prompt ids, completion ids, tool mask, advantage) of every row that reached the loss."""
    out = []
    for s in seen:
        for i in range(s["completion_ids"].size(0)):
            p, c = s["prompt_mask"][i].bool(), s["completion_mask"][i].bool()
            adv = s["advantages"][i]
            out.append((s["prompt_ids"][i][p].tolist(), s["completion_ids"][i][c].tolist(),
                        s["tool_mask"][i][c].tolist(), float(adv if adv.dim() == 0 else adv[0])))  # fmt: skip
    return out


def assert_exact(prompt, completion, mask, log):
    """Each sampled span is one sampler call asked on exactly the row's ids before it; nothing else is sampled."""
    covered = [0] * len(completion)
    for asked, ids in log:
        k = len(asked) - len(prompt)
        if ids and k >= 0 and asked[: len(prompt)] == prompt and asked[len(prompt) :] == completion[:k]:
            if completion[k : k + len(ids)] == ids:
                covered[k : k + len(ids)] = [1] * len(ids)
    assert covered == mask


def test_forked_rows_are_exact_and_share_their_runs_advantage(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """GRPO, one step, 2 prompts x 2 runs; one run per prompt compacts. Rewards per group (1, 0): the advantages are
    over the 2 runs, ±0.5/(std(1, 0) + eps) with the unbiased std √0.5 (over the 3 rows it would be +0.577 / −1.155);
    the fork row carries its run's +. 4 micro-steps (per_device 1) split the 6 rows 2/2/1/1: none is dropped."""
    RUNS.clear()
    tok = tiny_chat_tokenizer
    cpu = {**CPU, "beta": 0.04}  # TRL's reference forward, and its old-logp forward (num_iterations=2), on every row
    args = APPOConfig(output_dir=str(tmp_path), **cpu, num_generations=2, per_device_train_batch_size=1,
                      gradient_accumulation_steps=4, max_completion_length=96, max_steps=1, num_iterations=2)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, args=args, train_dataset=prompts(), processing_class=tok,
                          agent=every_other_run_compacts)  # fmt: skip
    backend = trainer.rollout_engine.backend = LoggedBackend(tok)
    seen = spy_loss(trainer)
    trainer.train()
    rows = loss_rows(seen)
    assert len(rows) == 6 and sorted(s["completion_ids"].size(0) for s in seen) == [1, 1, 2, 2]
    for prompt, completion, mask, _ in rows:
        assert_exact(prompt, completion, mask, backend.log)
    # every sampler call is in exactly one row: 2 prompts x (2 + 2 + 2 calls)
    assert len(backend.log) == 12 and sum(sum(1 for a, b in zip([0] + m, m) if b and not a) for *_, m, _ in rows) == 12
    eps = trainer.args.advantage_std_eps
    a = 0.5 / (math.sqrt(0.5) + eps)
    assert sorted(round(r[3], 5) for r in rows) == sorted([round(-a, 5)] * 2 + [round(a, 5)] * 4)
    # the two rows of a compacting run: one prompt is the original, the other the note; both advantage +a
    notes = [r for r in rows if "(notes: 42)" in tok.decode(r[0])]
    assert len(notes) == 2 and all(r[3] == pytest.approx(a) for r in notes)
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/restarts"] == 2.0 and log["agent/chain_rows"] == 2.0 and log["reward"] == 0.5
    assert all(int(s["num_items_in_batch"]) == sum(sum(m) for *_, m, _ in rows) for s in seen)
    # the fork rows' reference / old logps are their own rows' (a forward of each row alone); old == ref at step 0
    for s in seen:
        for i in range(s["completion_ids"].size(0)):
            p, c = s["prompt_mask"][i].bool(), s["completion_mask"][i].bool()
            ids = torch.cat([s["prompt_ids"][i][p], s["completion_ids"][i][c]]).unsqueeze(0)
            with torch.no_grad():
                ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, torch.ones_like(ids),
                                                                 int(c.sum()))[0][0]  # fmt: skip
            assert torch.allclose(s["ref_per_token_logps"][i][c], ref, atol=1e-4)
            assert torch.allclose(s["old_per_token_logps"][i][c], ref, atol=1e-4)


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_compacting_agent_trains_two_steps(tmp_path, strategy, tiny_chat_tokenizer, tiny_chat_model_path):
    """Every run compacts once: 2 rows per run. APPO branches its 1 run per prompt by replay: the branch call lies in
    the run's row (its second chain), the first chain is replayed (0 divergence) and is not a row of the branch."""
    tok = tiny_chat_tokenizer
    extra = {"initial_rollouts": 1, "min_remaining_tokens": 2} if strategy == "appo" else {"dump_rollouts": 2}
    agent = tagged_compacting_agent if strategy == "grpo" else compacting_agent
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tok, agent, strategy, **extra)
    backend = trainer.rollout_engine.backend = LoggedBackend(tok)
    batches, real = [], trainer.rounds.strategy.generate
    trainer.rounds.strategy.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    seen = spy_loss(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    if strategy == "grpo":  # (appo with 1 run and 1 branch per prompt: every dual-group advantage is 0)
        assert any(not (x == y.detach()).all() for x, y in zip(before, trainer.model.parameters()))
    rows = loss_rows(seen)
    runs = 4 if strategy == "grpo" else 2  # per step; appo's branch rows leave the batch
    assert len(rows) == 2 * 2 * runs
    for prompt, completion, mask, _ in rows:
        assert_exact(prompt, completion, mask, backend.log)
    for batch in batches:
        for row in batch.rows:
            [fork] = row.chain_rows if row.parent is None else [None]
            if fork is not None:  # the run's first chain: its own row, on the original prompt
                assert "(notes:" not in tok.decode(fork.prompt_ids) and "(notes:" in tok.decode(row.prompt_ids)
                fork.check()
                # lineage and role apart: the run's row is the chain it restarted, its first chain a chain row
                assert (row.origin, row.role, fork.origin, fork.role) == ("restart", "sample", "root", "chain")
    if strategy == "grpo":  # the restart survives into the dump (as text), the role beside it
        from appo_trl.reporting.rollout_dump import read_dumps

        _, groups = read_dumps(tmp_path)
        seen = {(r["origin"], r["role"]) for g in groups for r in g["rows"]}
        assert seen == {("restart", "sample"), ("root", "chain")}  # the run's row, and its first chain as a chain row
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if strategy == "grpo":
        assert all(h["agent/restarts"] == 4.0 and h["agent/chain_rows"] == 4.0 for h in logs)
        return
    for batch in batches:
        for parent, branch in batch.groups:
            p = branch.branch_pos
            assert branch.parent == parent.uid and branch.chain_rows == []  # the replayed chain is the parent's
            assert branch.prompt_ids == parent.prompt_ids and "(notes:" in tok.decode(branch.prompt_ids)
            assert branch.completion_ids[:p] == parent.completion_ids[:p]
    # forks: each run and each branch compacts once; rows: the runs' first chains only
    assert all(h["agent/restarts"] == 4.0 and h["agent/chain_rows"] == 2.0 for h in logs)
    assert all(h["agent/replay_divergence"] == 0.0 and h["agent/branches"] == 2.0 for h in logs)


def _session(tok, backend, replay=None):
    renderer = ChatRenderer(tok, tool_format=ChatToolFormat(tok))
    session = AgentSession(renderer, backend.generate, SamplingParams(max_tokens=200), 4096, seed=3)
    session.replay = replay
    return session


def _ask(session, messages):
    return asyncio.run(session.complete({"messages": messages, "tools": TOOLS}))["choices"][0]["message"]


def _solve(session, messages):
    msg = _ask(session, messages)
    messages += [msg] + [{"role": "tool", "tool_call_id": c["id"], "content": "42"} for c in msg["tool_calls"]]
    return _ask(session, messages)


def test_a_branch_that_forks_after_its_branch_call_keeps_its_row_on_the_branch_chain(tiny_chat_tokenizer):
    """Parent: one chain. Its branch replays the call, branches in the answer, then compacts: the branch's row is the
    chain of its branch call (where `branch_pos` lies), the compacted chain is its fork row (freshly sampled)."""
    tok = tiny_chat_tokenizer
    backend = LoggedBackend(tok)
    parent = _session(tok, backend)
    _solve(parent, [{"role": "user", "content": "6 times 7?"}])
    assert parent.row is parent.chains[-1] and parent.chain_rows() == []
    answer_start = parent.calls[1]["start"]
    position = answer_start + 2
    branch = _session(tok, backend, parent.branch_call(position))
    _solve(branch, [{"role": "user", "content": "6 times 7?"}])
    _solve(branch, [{"role": "user", "content": "6 times 7? (notes: 42)"}])
    assert len(branch.chains) == 2 and branch.replayed == 2 and not branch.diverged
    assert branch.row is branch.chains[0] and branch.chain_rows() == [branch.chains[1]]
    assert branch.row.completion_ids[:position] == parent.row.completion_ids[:position]
    assert branch.row.prompt_ids + branch.row.completion_ids[:position] in [a for a, _ in backend.log]
    for chain in branch.chains:
        chain.check()


def test_a_branch_of_a_forked_run_replays_its_earlier_chain(tiny_chat_tokenizer):
    """Parent: two chains (it compacted); its row is the last, the first is its fork row. A branch in the last chain
    replays the first chain's calls (answers as recorded, no row of the branch) and branches in the second."""
    tok = tiny_chat_tokenizer
    backend = LoggedBackend(tok)
    parent = _session(tok, backend)
    _solve(parent, [{"role": "user", "content": "6 times 7?"}])
    _solve(parent, [{"role": "user", "content": "6 times 7? (notes: 42)"}])
    assert parent.row is parent.chains[1] and parent.chain_rows() == [parent.chains[0]]
    with pytest.raises(ValueError):  # a position in no sampled answer of the row
        parent.branch_call(len(parent.row.completion_ids) + 5)
    position = parent.calls[3]["start"] + 1  # in the answer of the second chain
    replay = parent.branch_call(position)
    assert replay.branch_call == 3 and replay.cut == 1
    sampled = len(backend.log)
    branch = _session(tok, backend, replay)
    _solve(branch, [{"role": "user", "content": "6 times 7?"}])
    _solve(branch, [{"role": "user", "content": "6 times 7? (notes: 42)"}])
    assert len(backend.log) == sampled + 1 and branch.replayed == 4 and not branch.diverged
    assert branch.row is branch.chains[1] and branch.chain_rows() == []
    assert branch.chains[0].completion_ids == parent.chains[0].completion_ids
    assert branch.row.completion_ids[:position] == parent.row.completion_ids[:position]


class VersionedBackend(LoggedBackend):
    """`LoggedBackend` stamping versions as a streamed server sampler does: the first call all version 2, the second
    3 for its first two tokens and 4 after (an update in flight mid-answer), later ones 4."""

    async def generate(self, prompt_ids, params):
        seg = await super().generate(prompt_ids, params)
        n = len(seg.token_ids)
        k = len(self.log)
        seg.version_runs = [(2, n)] if k == 1 else [(3, min(2, n)), (4, n - min(2, n))] if k == 2 else [(4, n)]
        return seg


def test_an_agent_row_records_the_version_of_every_token_and_a_branch_keeps_its_prefixs(tiny_chat_tokenizer):
    """Through the endpoint's session: each sampled token takes its segment's version, the tool turn between the
    version before it; a branch replays the parent's recorded versions up to its branch point."""
    tok = tiny_chat_tokenizer
    backend = VersionedBackend(tok)
    parent = _session(tok, backend)
    _solve(parent, [{"role": "user", "content": "6 times 7?"}])
    row, calls = parent.row, parent.calls
    first, second = calls[0], calls[1]
    assert row.versions is not None and len(row.versions) == len(row.completion_ids)
    assert row.versions[: len(first["ids"])] == [2] * len(first["ids"])
    assert set(row.versions[len(first["ids"]) : second["start"]]) == {2}  # the tool turn: the version before it
    assert row.versions[second["start"] : second["start"] + 2] == [3, 3]
    assert set(row.versions[second["start"] + 2 :]) == {4}
    assert row.version_runs[-1][0] == 4
    position = second["start"] + 3  # after the update: the branch keeps the parent's 2, ..., 3, 3, 4
    branch = _session(tok, backend, parent.branch_call(position))
    _solve(branch, [{"role": "user", "content": "6 times 7?"}])
    assert branch.row.versions[:position] == row.versions[:position]
    assert set(branch.row.versions[position:]) == {4}  # sampled fresh, after the update
