"""Floor 8: the trainer. The trainer half of TRL's config/trainer pair and what only the training loop uses.

- `trainer`: `APPOTrainer(GRPOTrainer)`, the override points of TRL's trainer (the config is `appo_trl.config`, the
  strategies it runs `appo_trl.strategies`, floors 7 and 6);
- `rounds`: the round runner (strategies, engine, seeds, background rounds) and the typed `Round` it fills;
- `loss`: the policy-loss step for the loss modes TRL does not have;
- `weight_sync`: the vLLM servers set up around TRL's `__init__`; one round after the weight sync;
- `trl_seams`: every write into TRL's private attributes, each naming its seam and TRL version;
- `sharded`: the full weights gathered once per generation round under ZeRO-3 / FSDP2 (in-process sampling);
- `checkpoints`: atomic checkpoint saves (a staging folder, then one rename) and `resume_from_checkpoint`
  resolution (the newest complete checkpoint; broken ones are named and skipped);
- `rows`: tensor helpers over TRL's generation-batch dict;
- `trl_compat`: TRL's constructor on `APPOTrainer` (default config, a plain `GRPOConfig`, `rollout_func`).

Imports the floors below it (`config`, `strategies`, `tools`, `rollout`, `vllm`, `algorithms`, `rewards`, `configs`,
`data`, `reporting`, `trl_rules`); never `evaluation`, `stages`, `synthetic` or `cli`. Nothing is imported here;
the public names are `from appo_trl import APPOConfig, APPOTrainer`.
"""
