"""Tree attention for any Hugging Face causal LM, registered through transformers' `AttentionInterface`.

`install_tree_attention(model)` switches the model's `config._attn_implementation` from its base implementation
(`sdpa`, `eager`, `flash_attention_2`, ...) to `appo_tree:<base>`, a wrapper registered in transformers'
`AttentionInterface` and `AttentionMaskInterface`:

- a forward *without* the tree keyword arguments (generation in-process, evaluation, anything that is not the
  trainer's tree forward) is handed to the base implementation and its mask builder unchanged;
- a forward *with* a `tree_layout` keyword argument (an `appo_trl.tree.kernels.TreeLayout`, built once
  per trie per forward from `appo_trl.tree.forward.pack_rows`' layout) attends over the prefix tree: the packed
  token at position `q` sees exactly the tokens on its root-to-`q` path, which are the tokens its own row saw
  before it, at the same positions (position ids are depths in the tree).

The switch is permanent on purpose: activation checkpointing recomputes a layer's forward during the backward, after
any context manager around the loss forward has exited, and it must recompute the same tree attention (the
checkpointing bug of AReaL #889). The layout travels in the forward's keyword arguments, which the recomputation
sees again (and reuses what the layout built: no second block mask); the mask builder needs no tree state because
the mask is built outside the checkpointed layers. The implementation name is not written to `config.json`.

Kernels, in this order, each one skipped behind one log line per process and reason:
1. CUDA, fp16/bf16, no attention dropout: PyTorch's built-in varlen FlashAttention (`torch.nn.attention.varlen`),
   over TRL's `tree_kv_index` layout (each segment's queries against its gathered root-to-segment path, causal
   aligned bottom-right). Its causal convention is checked once per device and dtype on a small trie, forward and
   backward (`appo_trl.tree.kernels.varlen_probe`); a disagreement or an error skips it.
2. CUDA, fp16/bf16: the `flash_attn` package's `flash_attn_varlen_func` over the same layout.
3. CUDA: PyTorch's FlexAttention with an ancestor block mask (a token sees the tokens before it in its own segment
   and in the segments on its root path), built once per trie, compiled once with dynamic shapes. If it raises,
   the next kernel serves from then on; an out-of-memory error is raised, not hidden. No attention dropout.
4. CPU, and the fallback everywhere: one call of the base `sdpa`/eager maths per tree segment over its gathered
   path, with a bottom-right causal mask. Memory is the sum over segments of segment x path.
Nothing is downloaded at run time (TRL's own `tree_attention` fetches a FlashAttention-3 kernel from the Hub).
The CPU tests drive the CUDA dispatch with `_on_gpu` patched; `tests/trainer/test_tree_gpu.py` runs every kernel
on a GPU.

Sliding windows (per layer, from the layer's call): a token sees its ancestors fewer than `window` deep above it,
in every kernel (the varlen kernels' left window counts path positions, which are depths: a path is contiguous in
depth). Attention soft-capping follows the base: FlexAttention's `score_mod`, flash_attn's `softcap`, eager maths
on the segment path; PyTorch's varlen kernel has none and is skipped for such a layer. Attention sinks (GPT-OSS's
`s_aux`) run on the per-segment eager maths. Not supported (an error): `output_attentions` in a tree forward.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from appo_trl.tree.kernels import (
    TreeLayout,
    eager_attention,
    flash_varlen_attention,
    flex_attention,
    segment_attention,
    torch_varlen_attention,
    torch_varlen_params,
    varlen_probe,
)

logger = logging.getLogger(__name__)

PREFIX = "appo_tree:"


def _base_attention(base: str):
    if base in (None, "eager"):
        return eager_attention
    return AttentionInterface._global_mapping[base]


def _segment_attention(base, module, query, key, value, layout: TreeLayout, scaling, dropout, window, softcap,
                       s_aux=None):  # fmt: skip
    fn = eager_attention if base in (None, "eager") else _base_attention("sdpa")
    return segment_attention(fn, module, query, key, value, layout, scaling, dropout, window, softcap, s_aux)


@functools.cache
def _torch_varlen():
    """PyTorch's built-in varlen FlashAttention (`torch.nn.attention.varlen`, torch >= 2.10) and its keywords."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn, torch_varlen_params(varlen_attn)


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch: the next kernel serves
        return None
    return flash_attn_varlen_func


@functools.cache
def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None
    return create_block_mask, torch.compile(flex_attention, dynamic=True)


@functools.cache
def _say_fallback(what: str, using: str = "the per-segment SDPA path") -> None:
    logger.warning("tree attention: %s; using %s.", what, using)


@functools.cache
def _say(level: int, line: str) -> None:
    logger.log(level, "tree attention: %s", line)


_FAILED: set[str] = set()  # GPU kernels that raised once in this process: not tried again
_PROBED: dict = {}  # (device, dtype) -> why PyTorch's varlen kernel does not serve there (None: it serves)
HALF = (torch.float16, torch.bfloat16)


def _on_gpu(query: torch.Tensor) -> bool:
    """Whether the CUDA kernels are tried (the CPU tests drive the CUDA dispatch by patching this)."""
    return query.is_cuda


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _torch_varlen_serves(query, dropout) -> bool:
    """Whether PyTorch's varlen FlashAttention serves this call; one log line per reason it does not."""
    varlen = _torch_varlen()
    if varlen is None:
        _say(logging.INFO, f"PyTorch {torch.__version__} has no torch.nn.attention.varlen; trying the next kernel.")
        return False
    if query.dtype not in HALF:
        _say(logging.INFO, f"PyTorch's varlen FlashAttention takes fp16/bf16, not {query.dtype}; trying the next.")
        return False
    if dropout:
        _say(logging.WARNING, "PyTorch's varlen FlashAttention has no attention dropout; trying the next kernel.")
        return False
    return probe_torch_varlen(query.device, query.dtype, query.size(-1))


def probe_torch_varlen(device, dtype, head_dim: int = 64) -> bool:
    """Check PyTorch's varlen kernel once per device and dtype (`varlen_probe`); whether it serves there. Run by
    `prepare_kernels` before a tree forward, outside the decoder layers: a check inside a layer would run under
    activation checkpointing's saved-tensor hooks, or under `no_grad` (it needs a backward)."""
    varlen = _torch_varlen()
    key = (str(device), dtype)
    if varlen is None or dtype not in HALF:
        return False
    if key not in _PROBED:
        attend = lambda m, q, k, v, layout, s: torch_varlen_attention(varlen, m, q, k, v, layout, s)  # noqa: E731
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(torch.device(device).type, enabled=False),
        ):
            _PROBED[key] = varlen_probe(attend, device, dtype, head_dim)
        if _PROBED[key] is not None:
            _say(logging.WARNING, f"PyTorch's varlen FlashAttention failed its check ({_PROBED[key]}); trying next.")
        else:
            _say(logging.INFO, "using PyTorch's varlen FlashAttention (bottom-right causal, checked).")
    return _PROBED[key] is None


def prepare_kernels(model, device) -> None:
    """Before a tree forward on CUDA, in its autocast context: the one-time checks of the kernels it will try."""
    device = torch.device(device)
    if device.type != "cuda" or _torch_varlen() is None:
        return
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    else:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or 64
    probe_torch_varlen(device, dtype, head_dim if head_dim % 8 == 0 and head_dim <= 256 else 64)


def _guarded(name, fn, *args):
    """`fn(*args)`, or `None` with one log line when it raises (then `name` is not tried again in this process);
    an out-of-memory error is raised."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        _FAILED.add(name)
        _say(logging.WARNING, f"{name} failed ({_first_line(exc)}); trying the next kernel from now on.")
        return None


def _torch_varlen_takes(window, softcap) -> bool:
    """Whether PyTorch's varlen kernel takes this layer's sliding window and soft-capping (one log line if not)."""
    if softcap:
        _say(logging.INFO, "PyTorch's varlen FlashAttention has no soft-capping; trying the next kernel for it.")
        return False
    if window and "window_size" not in _torch_varlen()[1]:
        _say(logging.INFO, "this PyTorch's varlen FlashAttention has no window_size; trying the next kernel.")
        return False
    return True


def _cuda_attention(module, query, key, value, layout, scaling, dropout, window=None, softcap=None):
    """PyTorch's varlen FlashAttention, else flash_attn's varlen, else FlexAttention; `None` when none serves (the
    caller runs the segment path)."""
    if "torch_varlen" not in _FAILED and _torch_varlen_serves(query, dropout) and _torch_varlen_takes(window, softcap):
        out = _guarded("torch_varlen", torch_varlen_attention, _torch_varlen(), module, query, key, value, layout,
                       scaling, window)  # fmt: skip
        if out is not None:
            return out
    flash = None if "flash_attn" in _FAILED else _flash_varlen()
    if flash is not None and query.dtype in HALF:
        out = _guarded("flash_attn", flash_varlen_attention, flash, module, query, key, value, layout, scaling,
                       dropout, window, softcap)  # fmt: skip
        if out is not None:
            return out
    elif flash is not None:
        _say(logging.INFO, f"flash_attn takes fp16/bf16, not {query.dtype}; trying the next kernel.")
    if "flex" in _FAILED:
        return None
    flex = _flex()
    if flex is None:
        _say_fallback("neither flash_attn nor FlexAttention is available on this GPU")
        return None
    if dropout:
        _say_fallback("flash_attn is not installed and FlexAttention has no attention dropout")
        return None
    try:
        out = flex_attention(flex, module, query, key, value, layout, scaling, window, softcap)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # compilation (first call) or the kernel failed: the segment path serves from now on
        _FAILED.add("flex")
        _say_fallback(f"flash_attn is not installed and FlexAttention failed ({_first_line(exc)})")
        return None
    _say_fallback("flash_attn is not installed", "FlexAttention with an ancestor block mask")
    return out


def tree_attention(base: str):
    """The `AttentionInterface` function of `appo_tree:<base>`. A layer's sliding window and soft-capping come
    from its call (per layer: Gemma 2 alternates windowed and full layers); soft-capping is applied exactly where
    the base applies it (transformers' SDPA ignores it, its eager and flash paths apply it)."""
    base_fn = _base_attention(base)
    ignores_softcap = base == "sdpa"

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layout = kwargs.get("tree_layout")
        if layout is None:
            return base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if kwargs.get("output_attentions"):
            raise ValueError("tree_forward: output_attentions is not supported in a tree forward.")
        window, softcap = layer_window(module, kwargs), (None if ignores_softcap else kwargs.get("softcap"))
        s_aux = kwargs.get("s_aux")  # GPT-OSS's attention sinks: the segment path's eager maths only
        dropout = dropout if module.training else 0.0
        if _on_gpu(query) and s_aux is not None:
            _say_fallback("attention sinks (GPT-OSS) run on the eager maths only", "the per-segment eager path")
        elif _on_gpu(query):
            out = _cuda_attention(module, query, key, value, layout, scaling, dropout, window, softcap)
            if out is not None:
                return out
        return _segment_attention(base, module, query, key, value, layout, scaling, dropout, window, softcap, s_aux)

    return attention


def layer_window(module, kwargs) -> int | None:
    """A layer's sliding window (tokens, counted in depth), from its call or its module; `None` when it has none."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return int(window) if window else None


def tree_mask(base: str):
    """The `AttentionMaskInterface` function of `appo_tree:<base>`: the base's mask, or none in a tree forward."""
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base or "eager")

    def mask(*args, **kwargs):
        if getattr(_STATE, "active", False) or base_mask is None:
            return None
        return base_mask(*args, **kwargs)

    return mask


_STATE = threading.local()  # per thread: an in-process sampler thread keeps its masks during a tree forward


class tree_forward_active:
    """Context: masks built inside are `None` (the tree attention needs none; masks are built outside the
    checkpointed layers, so the recomputation in the backward does not need this flag)."""

    def __enter__(self):
        self._prev = getattr(_STATE, "active", False)
        _STATE.active = True

    def __exit__(self, *exc):
        _STATE.active = self._prev


def register(base: str) -> str:
    name = PREFIX + (base or "eager")
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, tree_attention(base))
        AttentionMaskInterface.register(name, tree_mask(base))
    return name


def install_tree_attention(model) -> str:
    """Switch `model` (a `PreTrainedModel`, or a PEFT / DDP wrapper of one) to tree attention; idempotent."""
    config = model.config
    current = config._attn_implementation
    if current and current.startswith(PREFIX):
        return current
    if current and current.startswith("paged|"):
        raise ValueError(f"tree_forward: attention {current!r} (paged) cannot run a tree forward.")
    name = register(current)
    config._attn_implementation = name
    return name
