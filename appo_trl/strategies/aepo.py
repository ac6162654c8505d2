"""`aepo`: ARPO's loop with the consecutive-branch penalty, an optional dynamic initial budget and, by default,
entropy-balanced clipping (`loss_mode: entropy_balanced`) and the entropy-aware advantage."""

from __future__ import annotations

import math

from appo_trl.strategies.arpo import ARPOStrategy
from appo_trl.strategies.base import register_strategy


@register_strategy
class AEPOStrategy(ARPOStrategy):
    """AEPO: ARPO's loop with the consecutive-branch penalty and an optional dynamic initial budget.

    `dynamic_rollouts_source="probe"` (reference): one extra full rollout per prompt measures H_root and the
    mean segment entropy H_tool, then is discarded. `"reuse"`: the same first rollout is kept as a group member
    (no extra sampling) and the remaining roots and branches fill the other n − 1 slots.
    """

    name = "aepo"
    default_loss_mode = "entropy_balanced"
    options = ("dynamic_rollouts", "entropy_balanced_advantage")
    card_title = "AEPO (Agentic Entropy-Balanced Policy Optimization, arXiv 2510.14545)"
    paper = {
        "name": "AEPO",
        "title": "Agentic Entropy-Balanced Policy Optimization",
        "id": "2510.14545",
        "citation": "@article{aepo2025,\n"
        "    title        = {{Agentic Entropy-Balanced Policy Optimization}},\n"
        "    year         = 2025,\n"
        "    eprint       = {arXiv:2510.14545},\n"
        "}",
    }
    penalty = True

    @classmethod
    def needs_sampler_entropies(cls, args) -> bool:
        return bool(args.dynamic_rollouts)  # the budget reads H_root / H_tool of a first rollout

    @classmethod
    def validate(cls, config) -> None:
        super().validate(config)
        if config.entropy_balanced_advantage is None:  # `rollout_strategy: aepo` alone is AEPO
            config.entropy_balanced_advantage = True

    def initial_counts(self, prompt_ids, n, seed, engine):
        a = self.args
        if not a.dynamic_rollouts:
            return super().initial_counts(prompt_ids, n, seed, engine)
        from appo_trl.algorithms.arpo import aepo_initial_rollouts
        from appo_trl.rollout.text import window_entropy

        # other samples than the group's (seed + 7919), on the same replica as the group (routing keys from `seed`)
        probes = engine.run(engine.rollout(prompt_ids, 1, seed=seed + 7919, route_seed=seed))
        cfg = engine.config
        norm = math.log(len(self.policy.processing_class_tokenizer)) if cfg.entropy_normalize else 1.0
        window, replays = self.entropy_window(engine), engine.replays_branches
        counts, kept = [], []
        for (probe,) in probes:
            ents = probe.entropies or []
            # the calls of one chat turn share `end`; an agent's run records no calls: its results end at its fork points
            ends = [p.position for p in window.fork_points(probe)] if replays else {c.end for c in probe.tool_calls}
            starts = [0] + sorted(ends)
            seg = [
                window_entropy(ents[s:], cfg.entropy_window, cfg.entropy_reduce, norm) for s in starts if s < len(ents)
            ]
            h_tool = sum(seg) / len(seg) if seg else math.nan
            h_root = window.root(probe)
            if math.isnan(h_root) or math.isnan(h_tool):  # no entropies recorded: the configured budget
                k = a.initial_rollouts
            else:
                k = int(aepo_initial_rollouts(h_root, h_tool, n))
            if a.dynamic_rollouts_source == "reuse" and n > 1:
                counts.append(min(max(k - 1, 1), n - 1))
                kept.append([probe])
            else:
                counts.append(min(max(k, 1), n))
                kept.append([])
        return counts, kept
