"""2-process run through two fake vLLM replicas for tests/trainer/test_replicas_ddp.py:
`torchrun --nproc_per_node 2 ddp_replicas.py MODEL OUT PORT_A PORT_B ROUTER_PORT`.

Rank 0 serves the two fake replicas (bench/fake_vllm.py) on the given ports, kills B after step 1 and starts it
again after step 2. Both ranks train 3 steps with `vllm_server_base_url` listing the pair and a fixed
`vllm_router_port` (a second router on that port could not start). Each rank records its replica view after
every weight sync; rank 0 writes both ranks' records to OUT/result.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy  # noqa: E402
from tests.trainer.test_trainer import RewardSpy, make_trainer  # noqa: E402


def main(model_path, out, port_a, port_b, router_port):
    rank = int(os.environ["RANK"])
    tok = AutoTokenizer.from_pretrained(model_path)
    answer = tok.encode("<answer> 4 </answer>", add_special_tokens=False) + [tok.eos_token_id]
    policy = ScriptedPolicy(tok, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer)
    urls = [f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"]
    servers = {}
    if rank == 0:
        for name, port in (("a", port_a), ("b", port_b)):
            servers[name] = FakeVLLMServer(policy, tok, max_model_len=1024)
            servers[name].port = int(port)
            servers[name].start()

    class KillAndRestartB(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0 and state.global_step == 1:
                servers["b"].kill()
            if rank == 0 and state.global_step == 2:
                servers["b"] = FakeVLLMServer(policy, tok, max_model_len=1024)
                servers["b"].port = int(port_b)
                servers["b"].start()

    trainer = make_trainer(out, tok, model_path, None, RewardSpy(), max_steps=3, use_vllm=True, vllm_mode="server",
                           num_generations=4, per_device_train_batch_size=4, max_completion_length=16,
                           vllm_importance_sampling_correction=False, vllm_server_base_url=urls,
                           vllm_router_port=int(router_port))  # fmt: skip
    trainer.add_callback(KillAndRestartB())
    sync = trainer.vllm_generation
    replicas = sync.replicas
    views = []
    orig = sync.sync_weights

    def record():
        orig()
        views.append(sorted(replicas.up()))

    sync.sync_weights = record
    trainer.train()
    record_ = {
        "rank": rank, "owner": replicas.owner, "router_process": replicas.router_process is not None,
        "monitor": replicas._thread is not None, "base_url": trainer.rollout_engine.backend.base_url,
        "router_url": replicas.router_url, "views": views, "rejoins": replicas.num_rejoins,
        "down_events": replicas.num_down_events,
        "ups": [e["replicas/up"] for e in trainer.state.log_history if "replicas/up" in e],
    }  # fmt: skip
    records = [None, None]
    dist.all_gather_object(records, record_)
    trainer.rollout_engine.close()
    replicas.close()
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"urls": urls, "records": records}, f)
        for s in servers.values():
            s.stop()
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:6])
