"""Floor 6: the trainer. TRL's config/trainer pair and what only the training loop uses.

- `config/`: `APPOConfig(GRPOConfig)` and `APPOScriptArguments` (fields and their validation only);
- `trainer`: `APPOTrainer(GRPOTrainer)`, the override points of TRL's trainer;
- `rounds`: the round runner (strategies, engine, seeds, background rounds) and the typed `Round` it fills;
- `strategies/`: how one generation round turns prompts into groups of n rows, one module per strategy (grpo /
  arpo / aepo / appo) and a registry; each class declares the facts the rest of the trainer asks of it;
- `loss`: the policy-loss step for the loss modes TRL does not have;
- `weight_sync`: the vLLM servers set up around TRL's `__init__`; one round after the weight sync;
- `trl_seams`: every write into TRL's private attributes, each naming its seam and TRL version;
- `sharded`: the full weights gathered once per generation round under ZeRO-3 / FSDP2 (in-process sampling);
- `checkpoints`: atomic checkpoint saves (a staging folder, then one rename) and `resume_from_checkpoint`
  resolution (the newest complete checkpoint; broken ones are named and skipped);
- `rows`: tensor helpers over TRL's generation-batch dict;
- `trl_compat`: TRL's constructor on `APPOTrainer` (default config, a plain `GRPOConfig`, `rollout_func`).

Imports the floors below it (`tools`, `rollout`, `vllm`, `algorithms`, `rewards`, `configs`, `data`, `reporting`);
never `evaluation`, `stages`, `synthetic` or `cli`. Nothing is imported here, so `appo_trl.trainer.config`
loads without the trainer; the public names are `from appo_trl import APPOConfig, APPOTrainer`.
"""
