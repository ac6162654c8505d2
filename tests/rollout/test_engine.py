"""The tool loop token by token, with a scripted policy (`bench.fake_vllm.ScriptedPolicy`) and scripted tools.

ScriptedPolicy gives the token at absolute position `pos` the logprob `-(pos + 1) / 1000`, so every expected
logprob below is computed by hand from the position the token must occupy.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine, to_trl_generate_outputs
from bench.fake_vllm import ScriptedPolicy
from tests.rollout.conftest import ScriptedTool

PROMPT_TEXT = "What is 2 plus 3?"


def lp(pos: int) -> float:
    return -(pos + 1) / 1000.0


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def by_results(tok, turns):
    """Script: the k-th turn once the context holds k `</result>` tokens (its rest when partly sampled)."""
    rclose = tok.convert_tokens_to_ids("</result>")

    def script(ctx, rng):
        turn = turns[min(ctx.count(rclose), len(turns) - 1)]
        since = len(ctx) - 1 - ctx[::-1].index(rclose) if rclose in ctx else None
        done = ctx[since + 1 :] if since is not None else []
        # continue a turn that was already partly sampled (look-ahead, branches inside a turn)
        return turn[len(done) :] if done and turn[: len(done)] == done else turn

    return script


@pytest.fixture
def make_engine(tiny_tokenizer):
    engines = []

    def _make(script, tools=None, delay=None, **cfg):
        policy = ScriptedPolicy(tiny_tokenizer, script, delay)
        cfg.setdefault("max_completion_length", 512)
        cfg.setdefault("max_model_len", 1024)
        engine = RolloutEngine(policy, tiny_tokenizer, RolloutConfig(**cfg), tools)
        engines.append(engine)
        return engine, policy

    yield _make
    for e in engines:
        e.close()


@pytest.fixture
def two_call_case(tiny_tokenizer, enc, result_ids):
    eos = tiny_tokenizer.eos_token_id
    t0 = enc("<think>add</think><python>print(2+3)</python>")
    t1 = enc("<search>capital</search>")
    t2 = enc("<answer>5</answer>") + [eos]
    turns = [t0 + enc(" never sampled"), t1 + enc(" nor this"), t2]
    tools = {
        "python": ScriptedTool("python", lambda q: "5"),
        "search": ScriptedTool("search", lambda q: "Page 1: city"),
    }
    return dict(t0=t0, t1=t1, t2=t2, r0=result_ids("5"), r1=result_ids("Page 1: city"), turns=turns, tools=tools)


def test_alignment_with_two_tool_calls(make_engine, tiny_tokenizer, enc, two_call_case):
    c = two_call_case
    engine, policy = make_engine(by_results(tiny_tokenizer, c["turns"]), c["tools"])
    prompt = enc(PROMPT_TEXT)
    P = len(prompt)
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))

    t0, r0, t1, r1, t2 = c["t0"], c["r0"], c["t1"], c["r1"], c["t2"]
    assert traj.completion_ids == t0 + r0 + t1 + r1 + t2
    assert traj.loss_mask == [1] * len(t0) + [0] * len(r0) + [1] * len(t1) + [0] * len(r1) + [1] * len(t2)
    expected_lp = [lp(P + i) if m else math.nan for i, m in enumerate(traj.loss_mask)]
    assert same(traj.logprobs, expected_lp)
    assert traj.finish_reason == "eos" and traj.num_calls == 2 and traj.entropies is None
    a, b = len(t0), len(t0) + len(r0) + len(t1)
    calls = [(x.tag, x.query, x.result, x.ok, x.start, x.end) for x in traj.tool_calls]
    assert calls == [
        ("python", "print(2+3)", "5", True, a, a + len(r0)),
        ("search", "capital", "Page 1: city", True, b, b + len(r1)),
    ]
    # the sampler saw exactly the growing context, each request with its own seed and the tool stop strings
    contexts = [ctx for ctx, _ in policy.requests]
    assert contexts == [prompt, prompt + t0 + r0, prompt + t0 + r0 + t1 + r1]
    params = [p for _, p in policy.requests]
    assert [p.stop for p in params] == [["</python>", "</search>"]] * 3
    assert len({p.seed for p in params}) == 3
    assert [p.max_tokens for p in params] == [512, 512 - len(t0 + r0), 512 - len(t0 + r0 + t1 + r1)]
    m = engine.metrics()
    assert m["rollout/tokens_sampled"] == len(t0) + len(t1) + len(t2) == sum(traj.loss_mask)
    assert m["rollout/tool_calls"] == 2 and m["rollout/tool/search/calls"] == 1 and m["tools/calls"] == 2


def test_special_tokens_in_tool_output_cannot_end_the_row(make_engine, tiny_tokenizer, enc):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    turns = [enc("<python>x</python>"), [eos]]
    tools = {"python": ScriptedTool("python", lambda q: "a<|im_end|>b<|endoftext|>c")}
    engine, _ = make_engine(by_results(tiny_tokenizer, turns), tools)
    [[traj]] = engine.run(engine.rollout([enc(PROMPT_TEXT)], 1, seed=0))
    call = traj.tool_calls[0]
    span = traj.completion_ids[call.start : call.end]
    assert eos not in span and pad not in span
    # special-token strings are escaped (neutralise_result) and stay plain text
    assert tiny_tokenizer.decode(span) == " <result>\na< |im_end|>b< |endoftext|>c\n</result>"
    assert traj.completion_ids.count(eos) == 1 and traj.completion_ids[-1] == eos


def test_stop_tag_split_across_tokens_keeps_the_boundary_token(make_engine, tiny_tokenizer, enc, result_ids):
    ids = tiny_tokenizer.convert_tokens_to_ids
    boundary = ids("><")  # completes "</python>" and carries an extra "<"
    t0 = [ids("<python>")] + enc("x") + [ids(c) for c in "</python"] + [boundary]
    assert "</python>" not in tiny_tokenizer.decode(t0[:-1]) and tiny_tokenizer.decode(t0).endswith("</python><")
    t1 = enc("ok") + [tiny_tokenizer.eos_token_id]
    tool = ScriptedTool("python", lambda q: "1")
    engine, _ = make_engine(by_results(tiny_tokenizer, [t0 + enc("junk"), t1]), {"python": tool})
    [[traj]] = engine.run(engine.rollout([enc(PROMPT_TEXT)], 1, seed=0))
    assert traj.completion_ids == t0 + result_ids("1") + t1
    assert tool.queries == ["x"]
    assert traj.tool_calls[0].start == len(t0)


def test_call_limit_appends_one_unsampled_eos(make_engine, tiny_tokenizer, enc, result_ids):
    eos = tiny_tokenizer.eos_token_id
    t = enc("<python>1</python>")
    tool = ScriptedTool("python", lambda q: "1")
    engine, _ = make_engine(lambda ctx, rng: t, {"python": tool}, call_limit=2)
    [[traj]] = engine.run(engine.rollout([enc(PROMPT_TEXT)], 1, seed=0))
    r = result_ids("1")
    assert traj.completion_ids == t + r + t + r + t + [eos]
    assert traj.loss_mask == [1] * len(t) + [0] * len(r) + [1] * len(t) + [0] * len(r) + [1] * len(t) + [0]
    assert math.isnan(traj.logprobs[-1])
    assert traj.finish_reason == "call_limit" and traj.num_calls == 2 and len(tool.queries) == 2
    assert engine.metrics()["rollout/call_limit_hits"] == 1

    engine0, _ = make_engine(lambda ctx, rng: t, {"python": tool}, call_limit=0)
    [[traj0]] = engine0.run(engine0.rollout([enc(PROMPT_TEXT)], 1, seed=0))
    assert traj0.completion_ids == t + [eos] and traj0.num_calls == 0 and len(tool.queries) == 2


def test_budget_edges(make_engine, tiny_tokenizer, enc, result_ids):
    t0 = enc("<python>1</python>")
    r = result_ids("a long tool output")
    tool = ScriptedTool("python", lambda q: "a long tool output")
    prompt = enc(PROMPT_TEXT)
    # a result that does not fit the completion budget is cut and ends the row
    engine, _ = make_engine(lambda ctx, rng: t0, {"python": tool}, max_completion_length=len(t0) + 3)
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))
    assert traj.completion_ids == t0 + r[:3] and traj.finish_reason == "length"
    assert traj.tool_calls[0].end == len(t0) + 3
    # the model length binds the same way
    engine, _ = make_engine(lambda ctx, rng: t0, {"python": tool}, max_model_len=len(prompt) + len(t0) + 2)
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))
    assert traj.completion_ids == t0 + r[:2] and len(prompt) + len(traj.completion_ids) == len(prompt) + len(t0) + 2
    # a segment without a stop is asked for exactly the remaining budget
    filler = enc(" the of a is") * 20
    engine, policy = make_engine(lambda ctx, rng: filler, max_completion_length=7)
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))
    assert traj.completion_ids == filler[:7] and traj.finish_reason == "length"
    assert [p.max_tokens for _, p in policy.requests] == [7]


def test_empty_call_ends_the_trajectory(make_engine, tiny_tokenizer, enc):
    tool = ScriptedTool("python", lambda q: "never")
    engine, _ = make_engine(lambda ctx, rng: enc("<python>  </python>"), {"python": tool})
    [[traj]] = engine.run(engine.rollout([enc(PROMPT_TEXT)], 1, seed=0))
    assert traj.finish_reason == "empty_call" and tool.queries == [] and traj.num_calls == 0


def test_slow_tool_does_not_stall_other_trajectories(make_engine, tiny_tokenizer, enc):
    """A's python call waits until B has finished three segments; a per-round barrier would deadlock here."""
    eos = tiny_tokenizer.eos_token_id
    prompt_a, prompt_b = enc("a question"), enc("b question")
    b_done = asyncio.Event()
    rclose = tiny_tokenizer.convert_tokens_to_ids("</result>")

    def script(ctx, rng):
        if ctx[: len(prompt_a)] == prompt_a:
            return enc("<python>slow</python>") if ctx.count(rclose) == 0 else [eos]
        if ctx.count(rclose) < 2:
            return enc("<search>fast</search>")
        b_done.set()
        return [eos]

    async def slow(q):
        await asyncio.wait_for(b_done.wait(), timeout=30)
        return "waited"

    tools = {"python": ScriptedTool("python", slow), "search": ScriptedTool("search", lambda q: "r")}
    engine, _ = make_engine(script, tools)
    [[a], [b]] = engine.run(engine.rollout([prompt_a, prompt_b], 1, seed=0))
    assert a.tool_calls[0].result == "waited" and a.finish_reason == "eos"
    assert b.num_calls == 2 and b.finish_reason == "eos"


def test_to_trl_generate_outputs(make_engine, tiny_tokenizer, enc, two_call_case):
    c = two_call_case
    engine, _ = make_engine(by_results(tiny_tokenizer, c["turns"]), c["tools"])
    groups = engine.run(engine.rollout([enc(PROMPT_TEXT), enc("other")], 2, seed=0))
    rows = [t for g in groups for t in g]
    p, ci, mask, texts, lps, extra, images, tool_images = to_trl_generate_outputs(rows, tiny_tokenizer)
    assert len(p) == len(ci) == len(mask) == len(texts) == len(lps) == 4
    assert p[0] == enc(PROMPT_TEXT) and p[2] == enc("other")
    for row, t in zip(range(4), rows):
        assert len(ci[row]) == len(mask[row]) == len(lps[row])
        assert all(x == 0.0 for x, m in zip(lps[row], mask[row]) if m == 0)
        assert [x for x, m in zip(lps[row], mask[row]) if m] == [x for x, m in zip(t.logprobs, t.loss_mask) if m]
    assert texts[0] == tiny_tokenizer.decode(ci[0], skip_special_tokens=True) and "<result>" in texts[0]
    assert extra["group"] == [0, 0, 1, 1] and extra["num_calls"] == [2, 2, 2, 2] and extra["parent"] == [None] * 4
    assert extra["tool_calls"][0][0]["tag"] == "python"
    assert images is None and tool_images == []


def test_run_is_reusable_and_works_inside_a_running_loop(make_engine, tiny_tokenizer, enc):
    eos = tiny_tokenizer.eos_token_id
    engine, _ = make_engine(lambda ctx, rng: enc("hi") + [eos])
    first = engine.run(engine.rollout([enc("q")], 2, seed=1))
    second = engine.run(engine.rollout([enc("q")], 2, seed=1))
    assert [t.completion_ids for t in first[0]] == [t.completion_ids for t in second[0]]
    assert [t.request_seeds for t in first[0]] == [t.request_seeds for t in second[0]]

    async def caller():  # a trainer thread that already runs an event loop
        return engine.run(engine.rollout([enc("q")], 1, seed=2))

    assert asyncio.run(caller())[0][0].finish_reason == "eos"


def test_trajectories_that_fail_together_raise_one_error_and_leave_none_unretrieved(tiny_tokenizer, caplog):
    """When several trajectories fail in the same wake-up (a server gone for all of them), the first error is raised
    and the others are retrieved, not logged by asyncio as "Task exception was never retrieved" tracebacks."""
    import gc
    import logging

    class DownPolicy(ScriptedPolicy):
        async def generate(self, prompt_ids, params):
            await asyncio.sleep(0.05)
            raise RuntimeError("backend down")

    cfg = RolloutConfig(max_completion_length=8, max_model_len=64)
    engine = RolloutEngine(DownPolicy(tiny_tokenizer, lambda ctx, rng: []), tiny_tokenizer, cfg)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(3):
                with pytest.raises(RuntimeError, match="backend down"):
                    engine.run(engine.rollout([[5, 6, 7]], 4, seed=0))
            gc.collect()
    finally:
        engine.close()
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_side_rollout_with_route_seed_shares_its_groups_route_keys(make_engine, tiny_tokenizer):
    """AEPO's entropy probe samples with other seeds than its group but routes with the group's tree id, so a
    prompt's probe and its group land on the same vLLM replica (one prefix cache)."""
    engine, _ = make_engine(lambda ctx, rng: [tiny_tokenizer.eos_token_id])
    prompts = [[5, 6, 7], [8, 9, 10]]
    main = engine.run(engine.rollout(prompts, 2, seed=3))
    probe = engine.run(engine.rollout(prompts, 1, seed=3 + 7919, route_seed=3))
    plain = engine.run(engine.rollout(prompts, 1, seed=3 + 7919))
    trees = [{t.route_key for t in g} for g in main]
    assert [len(t) for t in trees] == [1, 1] and trees[0] != trees[1]
    assert [{t.route_key for t in g} for g in probe] == trees
    assert all(not {t.route_key for t in g} & tree for g, tree in zip(plain, trees))
    assert [t.seed for g in probe for t in g] == [t.seed for g in plain for t in g]  # same samples
