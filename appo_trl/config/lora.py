"""`APPOConfig.vllm_sync_adapter`: its help and the check only the config can make (the adapter-only sync itself is
`appo_trl.vllm.lora`; what needs `use_peft` is `appo_trl.configs.preflight.check_peft`)."""

from __future__ import annotations

from appo_trl.config.script import _vllm

SYNC_ADAPTER_HELP = _vllm(
    "LoRA runs (use_peft) in vllm_mode=server: what each weight sync sends. `auto` (default): only the adapter when "
    "every server was started with `--enable-lora --max-lora-rank R` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
    "(saved to vllm_weight_sync_dir, POST /v1/load_lora_adapter under a new name per policy version; requests name "
    "their round's version), else the merged full weights, said in one line at start-up. `always`: the adapter "
    "only, or the run stops at start-up naming why. `never`: the merged full weights. See appo_trl.vllm.lora."
)


def check_sync_adapter(cfg, fail) -> None:
    """`vllm_sync_adapter=always` needs a vLLM server to send the adapter to."""
    if cfg.vllm_sync_adapter != "always":
        return
    if not cfg.use_vllm:
        fail("vllm_sync_adapter=always sends the adapter to a vLLM server, but use_vllm is false; set use_vllm: true "
             "(vllm_mode: server), or vllm_sync_adapter: auto.")  # fmt: skip
    if cfg.vllm_mode != "server":
        fail(f"vllm_sync_adapter=always loads the adapter into a vLLM server; vllm_mode={cfg.vllm_mode} syncs the "
             "merged weights in process. Use vllm_mode: server, or vllm_sync_adapter: auto.")  # fmt: skip
