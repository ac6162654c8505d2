"""`SortedTrie` against TRL's `TreeRow`: the same tries and, field by field, the same packs (fixed cases, random rows
with shared prefixes, budgets that split them), at a fraction of the host time."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from appo_trl.tree.forward import pack_rows, row_spans
from appo_trl.tree.trie import SortedTrie
from tests.trainer.test_tree_forward import CASES, batch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.packing import TreeRow

FIELDS = ("input_ids", "position_ids", "shift_labels", "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k",
          "tree_max_seqlens", "token_index")  # fmt: skip


def trl_packs(ids, mask, c, budget):
    """pack_rows' planning with TRL's TreeRow (its original packer): the reference."""
    spans = row_spans(mask)
    tokens = [ids[i, s:e] for i, (s, e) in enumerate(spans)]
    order = sorted((i for i in range(len(spans)) if spans[i][1] > spans[i][0]), key=lambda i: tokens[i].tolist())
    tries = []
    for i in order:
        start, end = spans[i]
        trained = torch.zeros(end - start, dtype=torch.long)
        trained[max(ids.size(1) - c - start, 1) :] = 1
        sample = {"input_ids": tokens[i], "completion_mask": trained, "old_log_probs": torch.zeros(end - start),
                  "advantage": 0.0, "group_id": i}  # fmt: skip
        if not tries or (tries[-1][1] and not tries[-1][0].fits(sample, budget)):
            tries.append((TreeRow(), []))
        tries[-1][0].add(sample)
        tries[-1][1].append(i)
    return [(trie.pack(), len(trie.tokens)) for trie, _ in tries]


def random_rows(rng: random.Random, n: int):
    prompt = [rng.randrange(3, 9) for _ in range(rng.randint(1, 6))]
    rows = []
    for _ in range(n):
        if rows and rng.random() < 0.6:  # fork an earlier row somewhere, or repeat it
            p, c = rows[rng.randrange(len(rows))]
            cut = rng.randint(0, len(c))
            c = c[:cut] + [rng.randrange(3, 9) for _ in range(rng.randint(0 if cut else 1, 5))]
            rows.append((p if rng.random() < 0.8 else [rng.randrange(3, 9)], c or [3]))
        else:
            rows.append((prompt, [rng.randrange(3, 9) for _ in range(rng.randint(1, 8))]))
    return rows


def assert_same(ids, mask, c, budget):
    ours = pack_rows(ids, mask, c, budget)
    ref = trl_packs(ids, mask, c, budget)
    assert len(ours) == len(ref)
    for pack, (packed, unique) in zip(ours, ref):
        assert pack.unique_tokens == unique
        got = {**pack.inputs, "input_ids": pack.inputs["input_ids"][0], "position_ids": pack.inputs["position_ids"][0],
               "shift_labels": pack.inputs["shift_labels"][0], "token_index": pack.source}  # fmt: skip
        for key in FIELDS:
            assert got[key].dtype == packed[key].dtype, key
            assert torch.equal(got[key], packed[key]), key


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("budget", [5, 14, 10_000])
def test_fixed_cases_pack_as_trl_treerow(case, budget):
    assert_same(*batch(CASES[case]), budget)


def test_random_rows_pack_as_trl_treerow():
    rng = random.Random(0)
    for _ in range(150):
        rows = random_rows(rng, rng.randint(1, 9))
        assert_same(*batch(rows), rng.choice([4, 9, 16, 10_000]))


def test_sorted_trie_packs_a_workload_a_group_as_trl_treerow():
    """One ARPO group of 16 x (256 + 512) tokens packs as TRL's per-token trie does (its host time is a figure of
    `bench/tree_forward.py`, `pack_ms`, never asserted here)."""
    from bench.tree_forward import group_rows, trl_layout

    ids, mask, c = trl_layout(group_rows("arpo", 256, 16, 512, 64, 1000, 0))
    assert_same(ids, mask, c, 1 << 20)


def test_row_weights_are_the_rows_through_each_token():
    trie = SortedTrie()
    for row in ([1, 2, 3], [1, 2, 3], [1, 2, 4, 5]):
        ids = torch.tensor(row)
        trie.add(ids, torch.ones_like(ids), trie.shared(ids))
    assert trie.row_weights().tolist() == [3, 2, 2, 1, 1, 1]  # 1 2 3 | 2 4 5: the fork repeats the 2


def test_a_chunked_forward_copies_its_rows_to_the_host_once(monkeypatch):
    """TRL's chunked passes (`batch_size`): the rows come to the host once per forward (a device sync each on a GPU),
    not once per chunk; the packs are already cached, as in every pass after a batch's first."""
    from appo_trl.tree.attention import install_tree_attention
    from appo_trl.tree.forward import PackCache, tree_logps_and_entropies
    from tests.trainer.test_tree_forward import tiny

    model = tiny("qwen3")
    install_tree_attention(model)
    ids, mask, c = batch(CASES["mixed"])
    cache = PackCache()
    run = lambda: tree_logps_and_entropies(model, ids, mask, c, compute_entropy=True, token_budget=10_000,  # noqa: E731
                                           batch_size=2, packs=cache)  # fmt: skip
    with torch.no_grad():
        run()
        copies = []
        cpu = torch.Tensor.cpu
        monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or cpu(self, *a, **k))
        run()
    assert len(copies) == 2  # input_ids and attention_mask, for 3 chunks
