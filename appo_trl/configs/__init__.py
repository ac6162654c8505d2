"""Floor 3: recipes and start-up. Everything between a YAML file or a command line and a loaded model.

- `recipes`: flat YAML recipes parsed into a stage's dataclasses, `--key value` overrides, the
  `accelerate launch` relaunch;
- `paths`: recipe-relative input paths and the recipes shipped inside the wheel;
- `arguments`: dash-style flags and the grouped `--help`;
- `reference`: the `reference: arpo | aepo | appo` presets (data only);
- `preflight`: the start-up checks that run before the model loads;
- `plan`: the start-up plan (reward columns, tool specs, tool folders, `tool_config`, the built tools), resolved
  once and handed to the trainer;
- `errors`: `ConfigError` and its subclasses, printed as one line with exit code 2.

Imports `tools`, `rewards` (the plan resolves them by name) and `vllm` (preflight checks the servers) and
nothing above this floor: never `data`,
`reporting`, `trainer`, `evaluation`, `stages`, `synthetic` or `cli`. Heavy libraries (torch, transformers,
trl) are imported inside functions only, so `appo --help` stays instant.
"""
