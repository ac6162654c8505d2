"""2-process LoRA run through one fake vLLM server with LoRA on, for tests/trainer/test_lora_ddp.py:
`torchrun --nproc_per_node 2 ddp_lora.py MODEL OUT PORT`.

Rank 0 serves the fake (bench/fake_vllm.py, `max_lora_rank=8`). Both ranks train 2 steps with the adapter-only
sync; each records the adapter name it holds after every sync; rank 0 writes both records and the server's
events and request models to OUT/result.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch.distributed as dist  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from appo_trl.config import APPOConfig  # noqa: E402
from appo_trl.trainer.trainer import APPOTrainer  # noqa: E402
from bench.fake_vllm import FakeVLLMServer, ScriptedPolicy  # noqa: E402
from tests.trainer.test_trainer import CPU, RewardSpy, dataset  # noqa: E402


def main(model_path, out, port):
    rank = int(os.environ["RANK"])
    tok = AutoTokenizer.from_pretrained(model_path)
    answer = tok.encode("<answer> 4 </answer>", add_special_tokens=False) + [tok.eos_token_id]
    server = None
    if rank == 0:
        server = FakeVLLMServer(ScriptedPolicy(tok, lambda ctx, rng: answer[:1] * rng.randint(0, 8) + answer), tok,
                                max_lora_rank=8)  # fmt: skip
        server.port = int(port)
        server.start()
    args = APPOConfig(output_dir=out, **{**CPU, "max_steps": 2}, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=f"http://127.0.0.1:{port}", num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=16, vllm_importance_sampling_correction=False,
                      vllm_sync_adapter="always")  # fmt: skip
    trainer = APPOTrainer(model=model_path, reward_funcs=[RewardSpy()], args=args, train_dataset=dataset(),
                          processing_class=tok,
                          peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))  # fmt: skip
    sync = trainer.vllm_generation
    names = []
    orig = sync.sync_weights

    def record():
        orig()
        names.append(sync.adapters.request_model())

    sync.sync_weights = record
    trainer.train()
    mine = {"rank": rank, "route": trainer.vllm_server.weight_sync, "prefix": sync.adapters.prefix, "names": names}
    records = [None, None]
    dist.all_gather_object(records, mine)
    trainer.rollout_engine.close()
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"records": records, "events": server.events,
                       "models": [b["model"] for b in server.bodies]}, f)  # fmt: skip
        server.stop()
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
