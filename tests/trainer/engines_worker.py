"""One `accelerate launch` of tests/trainer/test_engines.py: the four tiny recipes, 2 steps each, on one engine.

`accelerate launch --config_file accelerate_configs/<engine>.yaml --num_processes 2 engines_worker.py MODEL OUT
[TREE_TOKEN_BUDGET]`

For each of grpo, arpo, aepo and appo (sequentially, a fresh trainer each) the worker parses the tiny recipe as
`appo train` does (the launch's checks included), trains 2 steps with the in-process sampler and saves
checkpoint-2 and the final model under OUT/<strategy>. A reward that varies within every group (a checksum of the
text) makes the parameters move. In `UNEVEN` strategies every token ends rank 1's segments at once: its rollouts
end after one token without a tool call and APPO finds no branch candidate there, so rank 1 runs far fewer
sampler forwards than rank 0; a collective inside the round would hang. With a small TREE_TOKEN_BUDGET the tree
forward packs rank 0's 16-token rows into several tries and rank 1's one-token rows into one: every trainer
forward (loss, old-logp, selection) is recorded per rank as (tries, padding forwards, agreed), so the test sees
that the ranks' tries differed and that, under sharded parameters, the ranks still ran the same number of forwards
(APPO's selection forward runs inside the round on full weights: no agreement there).

Under ZeRO-3 every parameter is partitioned (`shard_every_zero3_param`); a launch with accelerate_configs/fsdp.yaml
runs accelerate's FSDP2 plugin on CPU (`force_fsdp_on_cpu`), after checking that each rank's preflight refuses it.

Then the full parameters are gathered on every rank (ZeRO-3: `GatheredParameters`, FSDP2: `full_tensor`) and
compared across ranks; rank 0 writes OUT/<strategy>/final.pt and OUT/result.json. Each rank writes its pid to
OUT/pids/ and dumps every thread's stack on SIGUSR1 (the test sends it on timeout) and on its own watchdog.
"""

import faulthandler
import json
import os
import signal
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

STRATEGIES = ("grpo", "arpo", "aepo", "appo")
UNEVEN = ("grpo", "appo")  # rank 1 ends every segment after one token
WATCHDOG_S = float(os.environ.get("ENGINES_WATCHDOG_S", "480"))


def checksum_reward(completions, **kwargs):
    """A deterministic reward that differs between completions (advantages are non-zero, parameters move)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [(zlib.crc32(t.encode()) % 1000) / 1000.0 for t in texts]


def params_are_sharded(p) -> bool:
    """ZeRO-3: a partition smaller than the parameter, not kept whole (persistent) between forwards; FSDP2: a
    DTensor sharded over the ranks."""
    from torch.distributed.tensor import DTensor

    if hasattr(p, "ds_id"):
        return not p.ds_persist and p.ds_tensor.numel() < p.ds_numel
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


def full_params(trainer) -> dict:
    """Every parameter in full on this rank (a collective under ZeRO-3 and FSDP2: same order on every rank)."""
    import contextlib

    model = trainer.model
    params = dict(model.named_parameters())
    ctx = contextlib.nullcontext()
    if trainer._dist.is_zero3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(params.values()))
    with ctx:
        out = {}
        for name, p in params.items():
            t = p.detach()
            if hasattr(t, "full_tensor"):  # FSDP2 DTensor
                t = t.full_tensor()
            out[name.replace("_fsdp_wrapped_module.", "")] = t.clone().float().cpu()
    return out


def record_tree_forwards() -> list:
    """Wrap the tree forward: append (tries, padding forwards, whether the ranks agreed on the count) of each call
    on this rank to the returned list."""
    from appo_trl.trainer import tree

    calls = []
    inner = getattr(tree.tree_logps_and_entropies, "__wrapped__", tree.tree_logps_and_entropies)  # one wrap only

    def recorded(*args, **kwargs):
        logps, entropies, counts = inner(*args, **kwargs)
        calls.append((counts["tries"], counts["padding_forwards"], kwargs.get("agree_forwards") is not None))
        return logps, entropies, counts

    recorded.__wrapped__ = inner
    tree.tree_logps_and_entropies = recorded
    return calls


def train_one(strategy, model_path, out, rank, tree_budget=None):
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
    from appo_trl.data import load_rl_dataset
    from appo_trl.stages.train import dataclass_types
    from appo_trl.trainer.trainer import APPOTrainer

    run_dir = os.path.join(out, strategy)
    fsdp_error = None
    argv = [
        "--config", str(REPO_ROOT / "recipes" / "tiny" / f"{strategy}.yaml"), "--model_name_or_path", model_path,
        "--output_dir", run_dir, "--max_completion_length", "16", "--tool_call_limit", "1",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    if tree_budget is not None:
        argv += ["--tree_token_budget", str(tree_budget)]
    if FSDP_ON_CPU:  # what a user gets: one line; then the launch check is skipped for the forced engine
        from appo_trl.configs import preflight
        from appo_trl.configs.errors import PreflightError

        try:
            parse_recipe(dataclass_types(), argv)
        except PreflightError as exc:
            fsdp_error = str(exc)
        check, preflight.check_launch_engine = preflight.check_launch_engine, lambda *a, **k: None
        try:
            script_args, training_args, model_args = parse_recipe(dataclass_types(), argv)
        finally:
            preflight.check_launch_engine = check
    else:
        script_args, training_args, model_args = parse_recipe(dataclass_types(), argv)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    trainer = APPOTrainer(
        model=model_path,
        reward_funcs=[checksum_reward],
        args=training_args,
        train_dataset=load_rl_dataset(script_args),
        processing_class=tokenizer,
    )
    forwards = [0]
    trainer.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    uneven = strategy in UNEVEN and rank == 1
    if uneven:
        trainer.rollout_engine.backend.eos_token_ids = set(range(len(tokenizer)))
    tree_calls = record_tree_forwards()
    trainer.train()
    trainer.save_model(run_dir)
    full_size = [(getattr(p, "ds_numel", p.numel()), params_are_sharded(p)) for p in trainer.model.parameters()]
    sharded_frac = sum(n for n, sharded in full_size if sharded) / sum(n for n, _ in full_size)
    params = full_params(trainer)
    names = sorted(params)
    flat = torch.cat([params[k].flatten() for k in names])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    counts = torch.tensor([forwards[0]])
    all_counts = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(all_counts, counts)
    all_tree_calls = [None] * dist.get_world_size()
    dist.all_gather_object(all_tree_calls, tree_calls)
    state = trainer.accelerator.state
    result = {
        "distributed_type": str(state.distributed_type),
        "zero_stage": trainer._dist.zero_stage,
        "fsdp_version": trainer._dist.fsdp_version,
        "identical_across_ranks": all(torch.equal(gathered[0], g) for g in gathered[1:]),
        "forwards": [int(c) for c in all_counts],
        "tree_calls": all_tree_calls,  # per rank: (tries, padding forwards, agreed) of each tree forward
        "uneven": strategy in UNEVEN,
        "steps": trainer.state.global_step,
        "sharded_frac": sharded_frac,  # of the parameters' elements, held in shards after training
        "fsdp_cpu_error": fsdp_error,
    }
    if rank == 0:
        torch.save(params, os.path.join(run_dir, "final.pt"))
    trainer.accelerator.wait_for_everyone()
    del trainer
    return result


FSDP_ON_CPU = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def force_fsdp_on_cpu() -> None:
    """Apply accelerate's FSDP branch of `AcceleratorState` on CPU (a launch with accelerate_configs/fsdp.yaml).

    accelerate sets `distributed_type = FSDP` and keeps the plugin only for GPU backends (`AcceleratorState.__init__`
    tests `distributed_type in [MULTI_GPU, ...]`); on CPU it leaves MULTI_CPU and DDP trains. Here the same two
    assignments run for MULTI_CPU too (mixed precision is `no`, so the plugin's precision setter has nothing to
    do); everything else (the FSDP2 wrap with torch's `fully_shard`, the full state dict at save) is accelerate's
    and transformers' own code, on gloo.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init_with_fsdp


ZERO3 = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"


def shard_every_zero3_param() -> None:
    """ZeRO-3 with `stage3_param_persistence_threshold: 0`: every parameter is partitioned.

    accelerate's config (no DeepSpeed file) leaves the threshold to DeepSpeed's default, 100,000 elements, and
    every parameter of the tiny model is smaller: ZeRO-3 would keep them all whole on every rank, and no forward
    would gather. A real model's large matrices are partitioned; with threshold 0 the tiny one's are too.
    """
    from accelerate.utils import DeepSpeedPlugin

    post_init = DeepSpeedPlugin.__post_init__

    def post_init_sharded(self):
        post_init(self)
        if self.zero_stage == 3:
            self.hf_ds_config.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0

    DeepSpeedPlugin.__post_init__ = post_init_sharded


def watch(out) -> int:
    """Write this rank's pid to OUT/pids/; dump every thread's stack on SIGUSR1 and after WATCHDOG_S."""
    os.makedirs(os.path.join(out, "pids"), exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, "pids", f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's timeout: every rank prints its stack
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # and on its own, should the test's kill not come
    return rank


def main(model_path, out, tree_budget=None):
    import torch.distributed as dist

    rank = watch(out)
    if FSDP_ON_CPU:
        force_fsdp_on_cpu()
    if ZERO3:
        shard_every_zero3_param()
    results = {}
    for strategy in STRATEGIES:
        results[strategy] = train_one(strategy, model_path, out, rank, tree_budget)
        print(f"[engines_worker rank {rank}] {strategy}: {results[strategy]}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


def fsdp2_round(model_path, out):
    """`torchrun --nproc_per_node 2 engines_worker.py fsdp2 MODEL OUT`: the round gather under FSDP2, on CPU.

    accelerate runs FSDP only on GPUs, so the model is sharded with torch's `fully_shard` directly (per decoder
    layer, then the root, as accelerate's FSDP2 wrap does). Inside `full_weights_for_round` rank 0 runs 6 forwards
    and rank 1 one (no collective may happen there); the logits must match an unsharded copy; after the round the
    layers are sharded again and a forward + backward on both ranks works.
    """
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from trl.distributed import DistributedBackend

    from appo_trl.trainer.sharded import full_weights_for_round

    rank = watch(out)
    dist.init_process_group("gloo")
    plain = AutoModelForCausalLM.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = types.SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=types.SimpleNamespace(fsdp_version=2))
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, state=state)
    trainer = types.SimpleNamespace(
        accelerator=accelerator, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        model=model, model_wrapped=model, _dist=DistributedBackend(accelerator),
    )  # fmt: skip
    weight = lambda: model.model.layers[0].mlp.up_proj.weight  # noqa: E731
    ids = torch.tensor([[5, 6, 7, 8]])
    max_diff = 0.0
    with torch.no_grad(), full_weights_for_round(trainer) as held:
        for _ in range(6 if rank == 0 else 1):  # unequal forward counts: no collective may run here
            logits = held(input_ids=ids).logits
            max_diff = max(max_diff, float((logits - plain(input_ids=ids).logits).abs().max()))
        unsharded_inside = not isinstance(weight(), DTensor)
    resharded_after = isinstance(weight(), DTensor)
    loss = model(input_ids=ids, labels=ids).loss  # both ranks: a sharded forward + backward still works
    loss.backward()
    resharded_after_forward = isinstance(weight(), DTensor)
    result = {
        "max_logit_diff": max_diff,
        "unsharded_inside": unsharded_inside,
        "resharded_after": resharded_after,
        "resharded_after_forward": resharded_after_forward,
        "grad": weight().grad is not None,
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(os.path.join(out, "fsdp2.json"), "w") as f:
            json.dump(results, f)
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()  # no rank tears gloo down while its peer still has work in flight (that aborted a rank, 1 in 6)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "fsdp2":
        fsdp2_round(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2], *sys.argv[3:])
