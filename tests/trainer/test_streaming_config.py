"""`rollout_stream` and its fields (appo_trl/config/stream.py): each setting the producer cannot honour is
one line before the model loads."""

from __future__ import annotations

import pytest

from appo_trl.config.appo import APPOConfig

STREAM = dict(rollout_stream=True, max_staleness=1, use_vllm=True, vllm_mode="server")


def cfg(**kw):
    return APPOConfig(output_dir="/tmp/appo-stream47-cfg", report_to=[], **kw)


def test_defaults_are_off_and_a_streaming_config_builds():
    c = cfg()
    assert (c.rollout_stream, c.inflight_update, c.stream_overprovision) == (False, "keep", 0.0)
    c = cfg(**STREAM, inflight_update="abort", stream_overprovision=0.5)
    assert c.rollout_stream and c.inflight_update == "abort" and c.stream_overprovision == 0.5
    assert (
        cfg(**STREAM, rollout_strategy="arpo").rollout_stream and cfg(**{**STREAM, "use_vllm": False}).rollout_stream
    )


@pytest.mark.parametrize(
    "kw, line",
    [
        (dict(rollout_stream=True), "needs max_staleness >= 1"),
        (dict(STREAM, vllm_mode="colocate"), "vllm_mode=colocate: the weights update in flight on the vLLM server"),
        (dict(STREAM, rollout_strategy="appo"), "rollout_strategy=appo: its branch selection is a forward"),
        (dict(STREAM, vllm_weight_sync="nccl"), "needs the disk route"),
        (dict(STREAM, stream_overprovision=-0.5), "stream_overprovision=-0.5 must be >= 0"),
        (dict(inflight_update="abort"), "settings of rollout_stream: true"),
        (dict(stream_overprovision=1.0), "settings of rollout_stream: true"),
    ],
)
def test_what_cannot_be_honoured_is_one_line(kw, line):
    with pytest.raises(ValueError, match=line):
        cfg(**kw)


def test_grpo_configs_fields_keep_their_positions():
    """A base dataclass's fields come first: the streaming fields after GRPOConfig's, so `APPOConfig("out")` sets
    output_dir as `GRPOConfig("out")` does (TRL's example scripts and users pass it positionally)."""
    from dataclasses import fields

    from trl import GRPOConfig

    from appo_trl import APPOConfig

    grpo = [f.name for f in fields(GRPOConfig)]
    assert [f.name for f in fields(APPOConfig)][: len(grpo)] == grpo
    assert APPOConfig("out").output_dir == "out" and APPOConfig("out").rollout_stream is False
