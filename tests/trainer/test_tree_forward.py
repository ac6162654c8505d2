"""The tree forward is exact: against the row-by-row forward (float32, CPU, 1e-5) for logps, entropies and every
parameter's gradient, on tiny Qwen2, Qwen3 and Llama models, with SDPA and eager attention.

Cases (each is a batch in TRL's layout: left-padded prompts, right-padded completions):
- `first`: a group whose rows diverge at the first completion token (the prompt-to-first-completion transition:
  the last prompt token predicts a different token per row; a stored-once prompt that scores only one of them is
  the NeMo Automodel trap);
- `tool`: rows that share a completion prefix through a tool-result span and diverge right after it (ARPO's branch
  point at a tool-result boundary);
- `last`: rows that differ only in their last token (the leaf; AReaL #1308 scored an extra logprob there);
- `identical`: identical rows; `disjoint`: rows that share nothing; `mixed`: all of them and two prompt lengths.
Plus gradient checkpointing (reentrant and not: AReaL #889), LoRA, a token budget that splits the batch, the
packer's own bookkeeping (no label on a leaf, first completion token scored, each score read where its token is
the label), and the GPU kernels' dispatch driven on CPU: the FlexAttention forward, and the fallbacks to the
per-segment path with one log line.

The peer bugs of issue 22, each put into the code once and caught by (the tests that failed):
- NeMo Automodel's trap, the first completion token after a stored-once prompt left unsupervised (the packer
  trains from one token after the prompt): every `test_tree_forward_matches_rowwise[*-first]` case, which
  diverges at that token, and `test_packer_scores_every_completion_token_and_no_leaf`; every other exactness
  case fails too, since each has a first completion token;
- AReaL #1308, an extra logprob at the last node of a trie (each row's last score read from the packed position
  after its source, the leaf or the next row): the `[*-last]` exactness cases, whose rows differ only in their
  last token (and every other exactness case), and `test_packer_scores_every_completion_token_and_no_leaf` (a
  label that is not the scored token);
- wrong entropies through a FlexAttention path (the ancestor block mask letting a segment see a sibling, i.e.
  plain causal over the packed order): `test_flex_attention_forward_matches_rowwise` on every case with
  siblings (all but `identical`); the per-segment path's tests cannot see it, and on CPU only this test runs
  FlexAttention;
- AReaL #889, block masks that break activation checkpointing (tree attention only inside the
  `tree_forward_active` context, which the backward's recomputation runs outside of):
  `test_gradient_checkpointing[False]` and `[True]`.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import appo_trl.tree.attention as ta
from appo_trl.tree.attention import install_tree_attention
from appo_trl.tree.forward import pack_rows, tree_logps_and_entropies

TOL = 1e-5
P = [1, 2, 3, 4, 5, 6]  # a prompt
TOOL = [30, 31, 32]  # a tool-result span (masked in the loss, shared in the forward)
CASES = {
    "first": [(P, [7, 8, 9, 10]), (P, [11, 8, 9]), (P, [12, 13, 14, 15, 16])],
    "tool": [(P, [7, 8, *TOOL, 9, 10]), (P, [7, 8, *TOOL, 17, 18, 19]), (P, [7, 8, *TOOL, 9, 20])],
    "last": [(P, [7, 8, 9, 10]), (P, [7, 8, 9, 11]), (P, [7, 8, 9, 12])],
    "identical": [(P, [7, 8, 9, 10])] * 3,
    "disjoint": [([1, 2, 3], [4, 5, 6]), ([9, 8], [7, 6, 5, 4]), ([40, 41, 42, 43], [44])],
    "mixed": [
        (P, [7, 8, *TOOL, 9, 10]),
        (P, [7, 8, *TOOL, 9, 10]),
        (P, [11, 8]),
        ([5, 6], [7, 8, 9, 10, 11, 12, 13, 14]),
        ([5, 6], [7, 8, 9, 10, 11, 12, 13, 15]),
        ([44, 45, 46], [1]),
    ],
}


def tiny(arch: str, attn: str = "sdpa", seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from trl.trainer.utils import add_fused_lm_head

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn)  # fmt: skip
    config, cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls(config(**common)).float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def batch(rows):
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, width_p - len(p) : width_p], mask[i, width_p - len(p) : width_p] = torch.tensor(p), 1
        ids[i, width_p : width_p + len(c)], mask[i, width_p : width_p + len(c)] = torch.tensor(c), 1
    return ids, mask, width_c


def rowwise(model, ids, mask, c):
    """TRL's row-by-row body of `_get_per_token_logps_and_entropies`."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-c] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -c:], out.entropy[:, -c:]


def tree(model, ids, mask, c, budget=10_000):
    install_tree_attention(model)
    logps, ent, _ = tree_logps_and_entropies(
        model, ids, mask, c, compute_entropy=True, token_budget=budget, autocast=contextlib.nullcontext
    )
    return logps, ent


def grads(model, logps, ent, mask_c):
    weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps) * mask_c
    model.zero_grad()
    ((logps * weights).sum() + 0.3 * (ent * weights.flip(0)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_exact(model, rows, budget=10_000, grad=True):
    ids, mask, c = batch(rows)
    mask_c = mask[:, -c:].float()
    lr, er = rowwise(model, ids, mask, c)
    g_row = grads(model, lr, er, mask_c) if grad else {}
    lt, et = tree(model, ids, mask, c, budget)
    g_tree = grads(model, lt, et, mask_c) if grad else {}
    torch.testing.assert_close(lt, lr * mask_c, atol=TOL, rtol=0)
    torch.testing.assert_close(et, er * mask_c, atol=TOL, rtol=0)
    assert set(g_tree) == set(g_row) and g_row
    for name in g_row:
        torch.testing.assert_close(g_tree[name], g_row[name], atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tree_forward_matches_rowwise(arch, case):
    assert_exact(tiny(arch), CASES[case])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tree_forward_eager_attention(arch):
    assert_exact(tiny(arch, attn="eager"), CASES["mixed"])


def test_token_budget_splits_into_several_tries_and_stays_exact():
    ids, mask, c = batch(CASES["mixed"])
    assert len(pack_rows(ids, mask, c, token_budget=14)) > 1
    assert_exact(tiny("qwen3"), CASES["mixed"], budget=14)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = tiny("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    assert_exact(model, CASES["mixed"])


def test_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert_exact(model, CASES["mixed"])


def test_generation_outside_the_tree_forward_is_unchanged():
    model = tiny("qwen3")
    ids, mask, c = batch(CASES["mixed"])
    before = rowwise(model, ids, mask, c)[0]
    install_tree_attention(model)
    assert model.config._attn_implementation == "appo_tree:sdpa"
    torch.testing.assert_close(rowwise(model, ids, mask, c)[0], before, atol=0, rtol=0)


def test_packer_scores_every_completion_token_and_no_leaf():
    """Shared prompt of 6 tokens, 3 rows diverging at the first completion token: the last prompt token is forwarded
    once per distinct first completion token (3 times), every completion token is scored once, leaves predict
    nothing. Unique tokens: 5 shared prompt tokens + 3 x (last prompt token + completion) = 5 + 3 + 4 + 3 + 5 = 20."""
    ids, mask, c = batch(CASES["first"])
    (pack,) = pack_rows(ids, mask, c, token_budget=10_000)
    assert pack.unique_tokens == 20 == pack.inputs["input_ids"].numel()
    assert pack.flat_index.tolist() == [0, 1, 2, 3, c + 0, c + 1, c + 2, 2 * c + 0, 2 * c + 1, 2 * c + 2, 2 * c + 3,
                                        2 * c + 4]  # fmt: skip
    labels = pack.inputs["shift_labels"][0]
    targets = ids[:, -c:].flatten()[pack.flat_index]
    assert labels[pack.source].tolist() == targets.tolist()  # each score is read where its own token is the label
    first_tokens = sorted(labels[pack.source[[0, 4, 7]]].tolist())
    assert first_tokens == [7, 11, 12]  # each first completion token is predicted by its own copy of the prompt end
    # 12 labelled positions of 20: the 8 without a label are the 5 shared prompt tokens that predict prompt tokens
    # and the 3 leaves (each row's last token predicts nothing)
    assert (labels != -100).sum().item() == 12


def test_bad_input_fails_with_one_clear_line(tmp_path):
    from appo_trl.config import APPOConfig
    from appo_trl.tree.forward import row_spans

    with pytest.raises(ValueError, match="tree_token_budget=0 must be >= 1"):
        APPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", tree_token_budget=0)
    with pytest.raises(ValueError, match="row 1's attention mask has a hole"):
        row_spans(torch.tensor([[0, 1, 1], [1, 0, 1]]))
    assert row_spans(torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])) == [(1, 3), (0, 4)]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ta.__name__]


@pytest.mark.parametrize("case", list(CASES))
def test_flex_attention_forward_matches_rowwise(case, cuda_dispatch_on_cpu, monkeypatch, caplog):
    """The GPU path without flash_attn: FlexAttention with the ancestor block mask, driven through the CUDA dispatch
    on CPU (the real compiled `flex_attention`), gives the row-wise logps and entropies within 1e-5. Forward only,
    under `torch.no_grad`: FlexAttention has no backward on CPU (NotImplementedError), so its gradients are not
    tested here. The per-segment path is replaced by a failure, so a silent fallback cannot pass; one log line says
    that flash_attn is missing and FlexAttention serves. This is the test for the peer bug "wrong entropies through
    a FlexAttention path"."""
    flex = ta._flex()
    assert flex is not None, "this torch has no FlexAttention"
    create_block_mask, flex_attention = flex
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_attention(*args, **kwargs)

    def no_fallback(*args, **kwargs):
        raise AssertionError("the per-segment path ran: FlexAttention did not serve")

    monkeypatch.setattr(ta, "_flex", lambda: (create_block_mask, counted))
    monkeypatch.setattr(ta, "_segment_attention", no_fallback)
    model = tiny("qwen3")  # 4 query heads on 2 key/value heads: FlexAttention's GQA
    ids, mask, c = batch(CASES[case])
    mask_c = mask[:, -c:].float()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=ta.__name__):
        lr, er = rowwise(model, ids, mask, c)
        lt, et = tree(model, ids, mask, c)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(lt, lr * mask_c, atol=TOL, rtol=0)
    torch.testing.assert_close(et, er * mask_c, atol=TOL, rtol=0)
    assert _warnings(caplog) == [
        "tree attention: flash_attn is not installed; using FlexAttention with an ancestor block mask."
    ]


@pytest.mark.parametrize("failure", ["raises", "missing"])
def test_gpu_fallback_to_the_segment_path_with_one_log_line(failure, cuda_dispatch_on_cpu, monkeypatch, caplog):
    """No flash_attn, and FlexAttention either raises at its first call (a compilation failure; a stand-in raises)
    or is missing: no error, the per-segment path serves, exact in the forward and every gradient, one log line for
    the whole process, and a FlexAttention that failed is not tried again (two models, several layers)."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("C++ compile error\n(the compiler's long output)")

    monkeypatch.setattr(ta, "_flex", (lambda: (lambda *a, **k: None, broken)) if failure == "raises" else lambda: None)
    with caplog.at_level(logging.WARNING, logger=ta.__name__):
        assert_exact(tiny("qwen3"), CASES["mixed"])
        assert_exact(tiny("llama"), CASES["tool"])
    what = {
        "raises": "flash_attn is not installed and FlexAttention failed (RuntimeError: C++ compile error)",
        "missing": "neither flash_attn nor FlexAttention is available on this GPU",
    }[failure]
    assert _warnings(caplog) == [f"tree attention: {what}; using the per-segment SDPA path."]
    assert len(calls) == (1 if failure == "raises" else 0)


def test_gpu_out_of_memory_in_flex_attention_is_raised(cuda_dispatch_on_cpu, monkeypatch):
    """Out of memory is not a missing kernel: it is raised, not hidden behind the fallback."""

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ta, "_flex", lambda: (lambda *a, **k: None, oom))
    ids, mask, c = batch(CASES["first"])
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        tree(tiny("qwen3"), ids, mask, c)
    assert not ta._FAILED


def test_gpu_attention_dropout_takes_the_segment_path(cuda_dispatch_on_cpu, monkeypatch, caplog):
    """FlexAttention has no attention dropout: a training forward with dropout runs the per-segment path (which
    applies it), with one log line, instead of dropping the dropout silently."""
    calls = []
    monkeypatch.setattr(ta, "_flex", lambda: (lambda *a, **k: None, lambda *a, **k: calls.append(1)))
    model = tiny("qwen3")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    ids, mask, c = batch(CASES["first"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=ta.__name__):
        tree(model, ids, mask, c)
    assert not calls
    assert _warnings(caplog) == [
        "tree attention: flash_attn is not installed and FlexAttention has no attention dropout; "
        "using the per-segment SDPA path."
    ]


def test_padding_forwards_change_nothing_and_join_the_backward():
    """Sharded engines: a rank with fewer tries than its peers runs padding forwards (`agree_forwards`). Logps,
    entropies and every gradient are bit-identical to the run without them, while the model runs 2 more forwards
    and 2 more backwards (ZeRO-3 / FSDP gather parameters in both, so both counts must match the peers')."""
    model = tiny("qwen3")
    install_tree_attention(model)
    ids, mask, c = batch(CASES["mixed"])
    mask_c = mask[:, -c:].float()
    forwards, backwards = [0], [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    model.model.layers[0].register_full_backward_hook(lambda *_: backwards.__setitem__(0, backwards[0] + 1))
    runs = {}
    for extra in (0, 2):
        forwards[0] = backwards[0] = 0
        agree = (lambda n, extra=extra: n + extra) if extra else None
        logps, ent, counts = tree_logps_and_entropies(
            model, ids, mask, c, compute_entropy=True, token_budget=14, agree_forwards=agree
        )
        g = grads(model, logps, ent, mask_c)
        runs[extra] = (logps, ent, g, counts, forwards[0], backwards[0])
    (l0, e0, g0, n0, f0, b0), (l2, e2, g2, n2, f2, b2) = runs[0], runs[2]
    assert n0["tries"] > 1 and n0["padding_forwards"] == 0 and n2["padding_forwards"] == 2
    assert (f0, b0) == (n0["tries"], n0["tries"]) and (f2, b2) == (f0 + 2, b0 + 2)
    assert torch.equal(l2, l0) and torch.equal(e2, e0)
    assert set(g2) == set(g0) and all(torch.equal(g2[k], g0[k]) for k in g0)
    with pytest.raises(RuntimeError, match="1 agreed forwards for"):
        tree_logps_and_entropies(
            model, ids, mask, c, compute_entropy=False, token_budget=14, agree_forwards=lambda n: 1
        )


def test_forward_count_is_agreed_only_while_parameters_are_sharded():
    """DDP / one process: no collective; ZeRO-3 or FSDP: one, except inside a round's full weights."""
    from types import SimpleNamespace

    from appo_trl.trainer.sharded import agree_forward_count

    def trainer(zero3=False, fsdp=False, held=False):
        dist = SimpleNamespace(is_zero3=zero3, is_fsdp=fsdp)
        return SimpleNamespace(_dist=dist, _full_weights_held=held, accelerator=SimpleNamespace(device="cpu"))

    assert agree_forward_count(trainer()) is None
    assert agree_forward_count(trainer(zero3=True, held=True)) is None
    assert agree_forward_count(trainer(fsdp=True, held=True)) is None
    assert callable(agree_forward_count(trainer(zero3=True))) and callable(agree_forward_count(trainer(fsdp=True)))
