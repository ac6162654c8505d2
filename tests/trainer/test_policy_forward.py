"""`PolicyForward` (`appo_trl.strategies.base`): all a strategy sees of the policy, and the trainer implements it."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

from appo_trl.strategies import STRATEGIES, PolicyForward, TokenScores


def _members(protocol) -> set[str]:
    """The names a Protocol declares: its annotated attributes, properties and methods."""
    own = {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return own | set(getattr(protocol, "__annotations__", {}))


def test_the_protocol_names_what_the_strategies_read():
    assert _members(PolicyForward) == {"args", "processing_class_tokenizer", "score_trajectories"}


def test_the_trainer_implements_every_member():
    from appo_trl.trainer.trainer import APPOTrainer

    missing = sorted(n for n in _members(PolicyForward) - {"args"} if not hasattr(APPOTrainer, n))
    assert not missing, f"APPOTrainer lacks PolicyForward's {missing}"
    assert list(inspect.signature(APPOTrainer.score_trajectories).parameters) == ["self", "trajectories"]


def test_the_forward_returns_a_typed_record():
    """`score_trajectories` hands over a frozen `TokenScores` (logps, entropies), on the Protocol and the trainer."""
    from appo_trl.trainer.trainer import APPOTrainer

    assert [f.name for f in dataclasses.fields(TokenScores)] == ["logps", "entropies"]
    for owner in (PolicyForward, APPOTrainer):
        assert typing.get_type_hints(owner.score_trajectories)["return"] is TokenScores, owner
    scores = TokenScores(logps=torch.zeros(1, 2), entropies=torch.ones(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        scores.logps = torch.ones(1, 2)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_reads_the_policy_only_through_the_protocol(name):
    """A strategy built on an object with PolicyForward's members only: it keeps it as `policy`, reads `args`."""

    class Policy:
        args = object()
        processing_class_tokenizer = None

        def score_trajectories(self, trajectories):
            raise AssertionError("not called at construction")

    policy = Policy()
    strategy = STRATEGIES[name](policy)
    assert strategy.policy is policy and strategy.args is policy.args
    assert not hasattr(strategy, "trainer")
