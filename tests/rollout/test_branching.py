"""Branching from a prefix, and in-loop forking through a hook (group caps, refill, look-ahead, entropies)."""

from __future__ import annotations

import math

import pytest

from tests.rollout.conftest import ScriptedTool
from tests.rollout.test_engine import PROMPT_TEXT, by_results, lp, make_engine, same, two_call_case  # noqa: F401


@pytest.fixture
def parent_case(make_engine, tiny_tokenizer, enc, two_call_case):  # noqa: F811
    c = two_call_case
    engine, policy = make_engine(by_results(tiny_tokenizer, c["turns"]), c["tools"])
    prompt = enc(PROMPT_TEXT)
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=0))
    return engine, policy, parent, prompt, c


def test_branch_resample_from_position(parent_case):
    engine, policy, parent, prompt, c = parent_case
    t0, r0, t1, r1, t2 = c["t0"], c["r0"], c["t1"], c["r1"], c["t2"]
    p = len(t0) + len(r0) + 2  # two tokens into the second turn
    n_before = len(policy.requests)
    engine.reset_metrics()
    child = engine.run(engine.branch(parent, p, seed=7))
    assert child.completion_ids[:p] == parent.completion_ids[:p]
    assert child.loss_mask[:p] == parent.loss_mask[:p] and same(child.logprobs[:p], parent.logprobs[:p])
    assert child.parent == parent.uid and child.branch_pos == p and child.group == parent.group
    assert child.tool_calls[0] == parent.tool_calls[0]
    # the first request continues from exactly prompt + completion[:p]: the prefix is never regenerated
    assert policy.requests[n_before][0] == prompt + parent.completion_ids[:p]
    # the script finishes turn 1 after the two kept tokens; the continuation starts at position p
    assert child.completion_ids[p:] == t1[2:] + r1 + t2
    assert child.logprobs[p] == lp(len(prompt) + p)
    assert child.num_calls == 2 and child.finish_reason == "eos"
    m = engine.metrics()
    assert m["rollout/prefix_tokens_reused"] == p and m["rollout/branches"] == 1
    assert m["rollout/tokens_sampled"] == len(t1) - 2 + len(t2)


def test_branch_keep_token(parent_case):
    engine, policy, parent, prompt, c = parent_case
    t = len(c["t0"]) + len(c["r0"]) + 1
    n_before = len(policy.requests)
    child = engine.run(engine.branch(parent, t, seed=7, resample=False))
    assert child.branch_pos == t + 1
    assert child.completion_ids[: t + 1] == parent.completion_ids[: t + 1]
    assert policy.requests[n_before][0] == prompt + parent.completion_ids[: t + 1]


def test_branch_right_after_stop_tag_reruns_the_call(parent_case):
    engine, policy, parent, prompt, c = parent_case
    p = len(c["t0"])  # the prefix ends with </python>; the result is not part of it
    python = c["tools"]["python"]
    calls_before = len(python.queries)
    child = engine.run(engine.branch(parent, p, seed=3))
    assert len(python.queries) == calls_before + 1 and python.queries[-1] == "print(2+3)"
    assert child.completion_ids == parent.completion_ids and child.num_calls == 2
    assert child.tool_calls[0].start == p


def test_branch_counter_from_prefix_and_bad_positions(parent_case):
    engine, _, parent, _, c = parent_case
    after_first = len(c["t0"]) + len(c["r0"])
    child = engine.run(engine.branch(parent, after_first, seed=1))
    assert [x.tag for x in child.tool_calls] == ["python", "search"]  # python from the prefix, search sampled
    with pytest.raises(ValueError, match="inside the result"):
        engine.run(engine.branch(parent, len(c["t0"]) + 1, seed=1))
    with pytest.raises(ValueError, match="outside"):
        engine.run(engine.branch(parent, len(parent.completion_ids) + 1, seed=1))
    # a prefix ending with the sampled EOS is a finished copy, nothing sampled
    whole = engine.run(engine.branch(parent, len(parent.completion_ids), seed=1))
    assert whole.completion_ids == parent.completion_ids and whole.finish_reason == "eos"


def test_branch_many_keeps_request_order_and_distinct_seeds(parent_case):
    engine, policy, parent, prompt, c = parent_case
    positions = [len(c["t0"]) + len(c["r0"]) + k for k in (3, 0, 1)]
    n_before = len(policy.requests)
    children = engine.run(engine.branch_many([(parent, p) for p in positions], seed=5))
    assert [ch.branch_pos for ch in children] == positions
    firsts = {tuple(ctx) for ctx, _ in policy.requests[n_before:]}
    assert all(tuple(prompt + parent.completion_ids[:p]) in firsts for p in positions)
    seeds = [p.seed for _, p in policy.requests[n_before:]]
    assert len(set(seeds)) == len(seeds)


def _call_turns(tok, enc, calls: int):
    return by_results(tok, [enc(f"<python>{i}</python>") for i in range(calls)] + [enc("done") + [tok.eos_token_id]])


def test_hook_forks_to_exact_group_sizes(make_engine, tiny_tokenizer, enc):  # noqa: F811
    seen = []

    def hook(ctx):
        seen.append((ctx.position, len(ctx.trajectory.completion_ids), ctx.group_size, ctx.target))
        return 2

    tool = ScriptedTool("python", lambda q: "r" + q)
    engine, _ = make_engine(_call_turns(tiny_tokenizer, enc, 3), {"python": tool})
    groups = engine.run(engine.rollout([enc("q one"), enc("q two")], 2, seed=0, hook=hook, group_size=5))
    assert [len(g) for g in groups] == [5, 5]
    for g in groups:
        uids = {t.uid: t for t in g}
        assert [t.origin for t in g[:2]] == ["root", "root"]
        for t in g[2:]:
            parent = uids[t.parent]
            assert t.origin == "fork"
            assert t.completion_ids[: t.branch_pos] == parent.completion_ids[: t.branch_pos]
            assert t.loss_mask[: t.branch_pos] == parent.loss_mask[: t.branch_pos]
            assert same(t.logprobs[: t.branch_pos], parent.logprobs[: t.branch_pos])
            prefix_calls = [c for c in parent.tool_calls if c.end <= t.branch_pos]
            assert t.tool_calls[: len(prefix_calls)] == prefix_calls and prefix_calls
            assert t.branch_pos == prefix_calls[-1].end  # forks start right after a result
        assert all(t.finish_reason == "eos" and t.num_calls == 3 for t in g)
    assert all(pos == length and size <= target == 5 for pos, length, size, target in seen)
    m = engine.metrics()
    assert m["rollout/forks"] == 6 and m["rollout/refills"] == 0


def test_refill_from_bare_prompt(make_engine, tiny_tokenizer, enc):  # noqa: F811
    engine, policy = make_engine(lambda ctx, rng: enc("no tools") + [tiny_tokenizer.eos_token_id])
    groups = engine.run(engine.rollout([enc("q")], 1, seed=0, hook=lambda ctx: 5, group_size=3))
    assert [t.origin for t in groups[0]] == ["root", "refill", "refill"]
    assert all(t.parent is None for t in groups[0])
    assert len({t.seed for t in groups[0]}) == 3
    assert engine.metrics()["rollout/refills"] == 2


def _expected_window(lps: list[float], k: int, window: int, vocab: int) -> float:
    # ScriptedPolicy's top logprobs at a token with logprob l: {sampled: l, k others: l-1, ..., l-k}
    total = 0.0
    for x in lps[:window]:
        total += sum(-math.exp(x - j) * (x - j) for j in range(k + 1))
    return total / math.log(vocab)


def test_hook_entropies_faithful_mode(make_engine, tiny_tokenizer, enc):  # noqa: F811
    seen = []

    def hook(ctx):
        seen.append(ctx)
        return 0

    tool = ScriptedTool("python", lambda q: "r")
    engine, _ = make_engine(_call_turns(tiny_tokenizer, enc, 2), {"python": tool}, entropy_topk=2, entropy_window=3)
    prompt = enc("q")
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0, hook=hook))
    P, V = len(prompt), len(tiny_tokenizer)
    first = enc("<python>0</python>")
    root = _expected_window([lp(P + i) for i in range(len(first))], 2, 3, V)
    assert seen[0].root_entropy == pytest.approx(root, rel=1e-9)
    assert seen[0].segment_entropy == pytest.approx(root, rel=1e-9)
    start2 = traj.tool_calls[0].end
    second = _expected_window([lp(P + start2 + i) for i in range(3)], 2, 3, V)
    assert seen[1].segment_entropy == pytest.approx(second, rel=1e-9)
    assert seen[1].root_entropy == pytest.approx(root, rel=1e-9) and seen[1].lookahead_entropy is None
    assert traj.entropies is not None and math.isnan(traj.entropies[start2 - 1])


def test_hook_lookahead_mode_forks_before_the_lookahead_tokens(make_engine, tiny_tokenizer, enc):  # noqa: F811
    eos = tiny_tokenizer.eos_token_id
    t0, t1 = enc("<python>0</python>"), enc(" the of a is the of a is") + [eos]
    seen = []

    def hook(ctx):
        seen.append(ctx)
        return 1

    tool = ScriptedTool("python", lambda q: "r")
    engine, policy = make_engine(by_results(tiny_tokenizer, [t0, t1]), {"python": tool}, hook_mode="lookahead",
                                 entropy_window=4, entropy_topk=2)  # fmt: skip
    prompt = enc("q")
    [[parent, fork]] = engine.run(engine.rollout([prompt], 1, seed=0, hook=hook, group_size=2))
    pos = parent.tool_calls[0].end
    assert seen[0].position == pos and fork.branch_pos == pos and fork.parent == parent.uid
    assert parent.completion_ids[pos:] == t1 and fork.completion_ids[pos:] == t1  # both sampled after pos
    assert [p.max_tokens for ctx, p in policy.requests if len(ctx) == len(prompt) + pos] == [4, 512 - pos]
    look = _expected_window([lp(len(prompt) + pos + i) for i in range(4)], 2, 4, len(tiny_tokenizer))
    assert seen[0].lookahead_entropy == pytest.approx(look, rel=1e-9)
