"""`appo env`: versions of the stack and which optional back-ends import, for bug reports (like `trl env`)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import sys

PACKAGES = ["appo-trl", "trl", "transformers", "torch", "accelerate", "peft", "datasets", "math-verify",
            "wandb", "bm25s", "httpx", "fastapi", "uvicorn"]  # fmt: skip
OPTIONAL = {"vllm": "vllm", "deepspeed": "deepspeed", "liger-kernel": "liger_kernel"}


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # any import failure is the answer we want to report
        return f"not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"
    return f"importable ({getattr(mod, '__version__', _version(module))})"


def collect() -> dict[str, str]:
    info = {"Platform": platform.platform(), "Python": sys.version.split()[0]}
    info |= {name: _version(name) for name in PACKAGES}
    try:
        import torch

        cuda = torch.cuda.is_available()
        info["CUDA available"] = f"{cuda}" + (
            f" ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})" if cuda else ""
        )
    except Exception as exc:
        info["CUDA available"] = f"unknown ({exc})"
    info |= {f"{name} (optional)": _importable(module) for name, module in OPTIONAL.items()}
    return info


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: appo env\n\nPrint the versions of the appo-trl stack and which optional back-ends import.")
        return 0
    info = collect()
    width = max(map(len, info))
    print("\nCopy-paste the following information when reporting an issue:\n")
    for key, value in info.items():
        print(f"- {key:<{width}} : {value}")
    print()
    return 0
