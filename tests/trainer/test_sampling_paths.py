"""The sampling path, resolved once: which path serves which constructor, and `REFUSALS` as the one source of every
refusal of a path (each refused before the model loads, with the table's own line)."""

from __future__ import annotations

import pytest

from appo_trl.config import APPOConfig
from appo_trl.strategies import STRATEGIES, RolloutStrategy
from appo_trl.strategies.arpo import ARPOStrategy
from appo_trl.trainer.sampling_paths import PATHS, REFUSALS, Given, refusal, resolve_path
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, RewardSpy

MISSING = "/nonexistent/model-that-must-not-load"  # a refusal must come before the model loads
GROUP = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1)


class Sampler:  # the members of appo_trl.sampling.Sampler, nothing else
    replays_branches, config = False, None

    async def rollout(self, prompts, n, *, seed, hook=None, group_size=None, route_seed=None): ...

    async def branch_many(self, requests, *, seed, resample=True): ...

    def run(self, coro): ...


SAMPLER = Sampler()


def my_agent(row, base_url, model):
    return 0.0


class Env:
    def reset(self, **kwargs):
        return None


def rollout_func(prompts, trainer):
    return {}


# (path, setting) -> (config fields, APPOTrainer keywords) that ask that path for that setting
CASES = {
    ("agent", "tools"): ({}, dict(agent=my_agent, tools=[len])),
    ("agent", "rollout_func"): ({}, dict(agent=my_agent, rollout_func=rollout_func)),
    ("agent", "environment_factory"): ({}, dict(agent=my_agent, environment_factory=Env)),
    ("agent", "branching_without_replay"): (dict(rollout_strategy="arpo", initial_rollouts=2), dict(agent=my_agent)),
    ("trl", "branching"): (dict(rollout_strategy="arpo"), dict(rollout_func=rollout_func)),
    ("trl", "tools"): (dict(tools=["python"]), dict(rollout_func=rollout_func)),
    ("trl", "environment_factory"): ({}, dict(rollout_func=rollout_func, environment_factory=Env)),
    ("trl", "rollout_engine"): ({}, dict(rollout_func=rollout_func, rollout_engine=object())),
    ("trl", "max_staleness"): (dict(max_staleness=1), dict(rollout_func=rollout_func)),
    ("trl", "dump_rollouts"): (dict(dump_rollouts=1), {}),
    ("environments", "tool_format_tags"): (dict(tool_format="tags"), dict(environment_factory=Env)),
}


def build(tmp_path, key):
    fields, kwargs = CASES[key]
    args = APPOConfig(output_dir=str(tmp_path), **CPU, **{**GROUP, **fields})
    return lambda: APPOTrainer(MISSING, reward_funcs=RewardSpy(), args=args, **kwargs)


@pytest.fixture
def no_replay(monkeypatch):
    monkeypatch.setattr(ARPOStrategy, "branches_by_replay", False)  # a strategy that cannot branch an agent's runs


def test_every_refusal_has_a_case():
    assert set(CASES) == set(REFUSALS)
    assert {path for path, _ in REFUSALS} <= set(PATHS)


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: "-".join(k))
def test_each_refusal_is_the_tables_line_before_the_model_loads(tmp_path, key, no_replay):
    fields, kwargs = CASES[key]
    args = APPOConfig(output_dir=str(tmp_path), **CPU, **{**GROUP, **fields})
    expected = REFUSALS[key].format(agent="'my_agent'", setting=key[1], strategy=args.rollout_strategy, n=4)
    with pytest.raises(ValueError) as err:
        build(tmp_path, key)()
    assert str(err.value) == expected


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: "-".join(k))
def test_the_table_is_the_single_source_of_refusals(tmp_path, key, no_replay, monkeypatch):
    """Rewording a row of `REFUSALS` rewords what the trainer says: no other copy of the check decides first."""
    monkeypatch.setitem(REFUSALS, key, "refused by row {setting}")
    with pytest.raises(ValueError, match=f"^refused by row {key[1]}$"):
        build(tmp_path, key)()


@pytest.mark.parametrize(
    "fields, given, path",
    [
        ({}, {}, "trl"),  # grpo, no tools, in-process, synchronous: TRL's own sampler
        ({}, dict(rollout_func=rollout_func), "trl"),
        (dict(rollout_strategy="arpo"), {}, "tool_loop"),  # branching needs the engine
        ({}, dict(tools=True), "tool_loop"),
        (dict(max_staleness=1), {}, "tool_loop"),  # background rounds run on the engine
        ({}, dict(rollout_engine=SAMPLER), "tool_loop"),
        ({}, dict(environment_factory=Env), "environments"),
        (dict(rollout_strategy="appo", initial_rollouts=2), dict(environment_factory=Env), "environments"),
        (dict(max_staleness=1), dict(environment_factory=Env), "environments"),  # own instances in the background
        ({}, dict(agent=my_agent), "agent"),
        (dict(rollout_strategy="appo", initial_rollouts=2, max_staleness=1), dict(agent=my_agent), "agent"),
    ],
)
def test_one_path_per_constructor(tmp_path, fields, given, path):
    args = APPOConfig(output_dir=str(tmp_path), **CPU, **{**GROUP, **fields})
    g = Given(args, **given)
    assert resolve_path(g).name == path and refusal(path, g) is None


def test_strategies_take_the_engine_as_an_argument():
    """No strategy holds an engine of its own (nor a slot a path would overwrite): the path hands it to `generate`."""
    import inspect

    for cls in (RolloutStrategy, *STRATEGIES.values()):
        assert not hasattr(cls, "engine") and not hasattr(cls, "engine_override"), cls
        assert "engine" in inspect.signature(cls.generate).parameters, cls


def test_a_rollout_engine_that_is_not_a_sampler_is_one_line(tmp_path):
    class NoReplayFlag(Sampler):
        replays_branches = property(lambda self: (_ for _ in ()).throw(AttributeError))

    args = APPOConfig(output_dir=str(tmp_path), **CPU, **GROUP)
    with pytest.raises(ValueError, match=r"^rollout_engine=object lacks replays_branches, config, rollout, "
                                         r"branch_many, run of the Sampler protocol"):  # fmt: skip
        resolve_path(Given(args, rollout_engine=object()))
    with pytest.raises(ValueError, match=r"^rollout_engine=NoReplayFlag lacks replays_branches of"):
        resolve_path(Given(args, rollout_engine=NoReplayFlag()))
    from appo_trl.rollout import RolloutEngine
    from appo_trl.sampling import Sampler as Protocol
    from appo_trl.sampling import missing_members
    from appo_trl.trainer.agents import AgentEngine

    for cls in (RolloutEngine, AgentEngine):  # every engine of ours speaks it (class members; config: per instance)
        assert [m for m in missing_members(cls, Protocol) if m != "config"] == [], cls
