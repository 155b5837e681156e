"""Routing of SDPA calls: the kernels where a call is supported, PyTorch SDPA everywhere else.

Every attention call of a diffusion model passes through `scaled_dot_product_attention`, so the
decision reads only tensor metadata and settings attributes, and caches what it learns per device.
Each decision is a short human reason; each distinct fallback reason is logged once (INFO) and every
call is counted (`stats()`).

Malformed calls are never judged here: anything unusual falls back, so SDPA itself raises its own
exception for it, and no kernel is ever launched on input SDPA would reject.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

import torch

from . import device as _device
from . import autograd, ops, selftest
from .config import LOGGER_NAME, settings

log = logging.getLogger(LOGGER_NAME)

# torch's own SDPA, not whatever `torch.nn.functional.scaled_dot_product_attention` names now: once
# patch_sdpa() points that name at us, falling back through it would recurse.
torch_sdpa = torch._C._nn.scaled_dot_product_attention
_fallback_sdpa = torch_sdpa  # where unsupported calls go; see use_fallback()

RDNA_TARGET_PREFIXES = ("gfx11", "gfx12")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
AUTOCAST_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what autocast converts
FP32_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4

    def _autocast_dtype(device_type: str) -> torch.dtype | None:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

else:  # older torch (ZLUDA hosts run 2.2 - 2.7): only CUDA-device autocast, which is all that runs kernels

    def _autocast_dtype(device_type: str) -> torch.dtype | None:
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


class KernelCall(NamedTuple):
    """A call the kernels will run: inputs already in the kernel dtype."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_causal: bool
    scale: float | None
    out_dtype: torch.dtype  # what SDPA would have returned
    backward: bool  # autograd needs the differentiable op


# --- per-device verdicts, cached: devices do not change during a process ---------------------------

_device_refusals: dict[tuple[torch.device, bool], str | None] = {}
_selftest_refusals: dict[torch.device, str | None] = {}


def _policy_refusal(info: _device.DeviceInfo) -> str | None:
    """Why policy keeps the kernels off a device, or None; settings.force overrides it."""
    if info.backend in ("rocm", "zluda"):
        if info.gfx_target and info.gfx_target.startswith(RDNA_TARGET_PREFIXES):
            return None
        return f"{info.name}: GPU target {info.gfx_target or 'unknown'} is not RDNA3/RDNA4"
    if info.backend == "cuda":
        return f"{info.name}: NVIDIA GPUs get only a test emulation of the kernels (RDNA_FA_FORCE=1 uses it)"
    if info.backend == "cpu":
        return "CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"
    return f"{info.name} ({info.backend}): the kernels run on AMD RDNA3/RDNA4 GPUs only"


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (policy, then artifact), or None. Cached."""
    key = (device, settings.force)
    if key not in _device_refusals:
        policy = None if settings.force else _policy_refusal(_device.describe(device))
        _device_refusals[key] = policy or ops.availability(device)
    return _device_refusals[key]


def selftest_refusal(device: torch.device) -> str | None:
    """Why the self-test keeps the kernels off `device`, or None. Runs it at the first ask, which
    the dispatcher makes on the first call that would otherwise reach the kernels. Cached."""
    if device not in _selftest_refusals:
        _selftest_refusals[device] = selftest.verdict(device)
    return _selftest_refusals[device]


def forget_devices() -> None:
    """Drop the cached per-device verdicts (after a new self-test, or in tests)."""
    _device_refusals.clear()
    _selftest_refusals.clear()


def _disable_device(device: torch.device, reason: str) -> None:
    for force in (False, True):
        _device_refusals[(device, force)] = reason


# --- the decision -----------------------------------------------------------------------------------


def _kernel_dtypes(query, key, value) -> tuple[torch.dtype | None, torch.dtype] | str:
    """(dtype to cast the inputs to first, or None for no cast; dtype to return), or a reason.
    Casts mirror what SDPA would do under autocast, or what the user opted into for float32."""
    dtypes = (query.dtype, key.dtype, value.dtype)
    autocast_to = _autocast_dtype(query.device.type)
    if autocast_to is not None and all(d in AUTOCAST_CAST_DTYPES for d in dtypes):
        # SDPA is an autocast op: it would compute in, and return, the autocast dtype.
        if autocast_to not in KERNEL_DTYPES:
            return f"autocast to {autocast_to}"
        return autocast_to, autocast_to
    if dtypes == (torch.float32,) * 3:
        if settings.fp32_cast == "off":
            return "float32 inputs (RDNA_FA_FP32_CAST=bf16 runs them on the kernels in bfloat16)"
        return FP32_CAST_DTYPES[settings.fp32_cast], torch.float32
    return None, query.dtype  # as given: ops.forward_refusal judges the dtypes


def plan(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> KernelCall | str:
    """The kernel call for these SDPA arguments, or the reason the call falls back to SDPA."""
    if settings.disable:
        return "disabled (RDNA_FA_DISABLE / settings.disable)"
    tensors = (query, key, value)
    if any(type(t) is not torch.Tensor for t in tensors):
        return "query, key and value are not all plain torch.Tensor objects"
    if any(t.is_nested or t.layout is not torch.strided for t in tensors):
        return "nested or sparse tensors"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs are not 4-D (batch, heads, tokens, head dim)"
    if attn_mask is not None:
        return "attn_mask given (the kernels have no mask support)"
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return "dropout_p is not 0"
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return "is_causal or enable_gqa is not a bool"
    if scale is not None and type(scale) not in (float, int):
        return "scale is not a Python number"
    if key.shape[2] != value.shape[2]:
        return "key and value have different lengths"
    if _is_compiling():
        return "traced by torch.compile"
    refusal = device_refusal(query.device)
    if refusal:
        return refusal
    dtypes = _kernel_dtypes(query, key, value)
    if isinstance(dtypes, str):
        return dtypes
    run_dtype, out_dtype = dtypes
    backward = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if backward and not settings.training:
        return "gradients needed and RDNA_FA_TRAINING=0"
    if run_dtype is not None:
        query, key, value = query.to(run_dtype), key.to(run_dtype), value.to(run_dtype)
    scale = None if scale is None else float(scale)
    refusal = ops.forward_refusal(query, key, value, is_causal, scale) or selftest_refusal(query.device)
    if refusal:
        return refusal
    return KernelCall(query, key, value, is_causal, scale, out_dtype, backward)


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> str:
    """Why a call with these SDPA arguments would or would not run on the kernels (nothing is run,
    apart from the device's first-use self-test)."""
    call = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(call, str):
        return f"falls back to PyTorch SDPA: {call}"
    kind = "causal" if call.is_causal else "non-causal"
    grad = ", forward and backward" if call.backward else ""
    return f"runs on the kernels: {call.query.dtype}, head dim {call.query.shape[-1]}, {kind}{grad}"


# --- counters and once-per-reason logging ---------------------------------------------------------

_kernel_calls = 0
_fallbacks: Counter[str] = Counter()
_logged_reasons: set[str] = set()


def stats() -> dict:
    """Calls per path since the last reset: {"kernel": n, "fallback": n, "fallback_reasons": {reason: n}}."""
    return {"kernel": _kernel_calls, "fallback": sum(_fallbacks.values()), "fallback_reasons": dict(_fallbacks)}


def reset_stats() -> None:
    """Zero the counters (reasons already logged stay logged)."""
    global _kernel_calls
    _kernel_calls = 0
    _fallbacks.clear()


def _note_fallback(reason: str) -> None:
    _fallbacks[reason] += 1
    # Remembered only once shown, so turning INFO on later still shows every reason once.
    if reason not in _logged_reasons and log.isEnabledFor(logging.INFO):
        _logged_reasons.add(reason)
        log.info("not using the kernels: %s", reason)


# --- the entry points ---------------------------------------------------------------------------------


def _launch(call: KernelCall) -> torch.Tensor:
    if call.backward:
        out = autograd.flash_attention(call.query, call.key, call.value, call.is_causal, call.scale)
    else:
        out, _lse = ops.flash_attention_forward(call.query, call.key, call.value, call.is_causal, call.scale)
    return out.to(call.out_dtype)


def attention_or_reason(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False
) -> torch.Tensor | str:
    """The kernels' result for a supported call, else the reason it is not (counted in stats() and
    logged once); the caller then runs its own fallback. For hosts whose fallback is their own
    attention backend rather than PyTorch SDPA."""
    global _kernel_calls
    call = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not isinstance(call, str):
        try:
            out = _launch(call)
        except ops.KernelUnavailable as exc:
            call = str(exc)
        except Exception as exc:  # a kernel-side bug must cost speed, never the host's run
            call = f"the kernels failed ({type(exc).__name__}: {exc}); off for {query.device}"
            log.exception("kernel call failed on %s; the kernels are now off for that device", query.device)
            _disable_device(query.device, call)
        else:
            _kernel_calls += 1
            return out
    _note_fallback(call)
    return call


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False
):
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`: same arguments, results and
    exceptions; supported calls run on the kernels, all others on PyTorch SDPA unchanged."""
    out = attention_or_reason(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if isinstance(out, torch.Tensor):
        return out
    # The caller's own arguments, untouched; enable_gqa only when given, as torch < 2.5 lacks it.
    extra = {} if enable_gqa is False else {"enable_gqa": enable_gqa}
    return _fallback_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)


def use_fallback(function=None) -> None:
    """Send unsupported calls to `function`, or to torch's own SDPA when None. patch_sdpa() passes
    the function it replaced, so a host's own SDPA wrapper (SD.Next's sliced or Triton attention)
    keeps serving every call the kernels do not take."""
    global _fallback_sdpa
    _fallback_sdpa = torch_sdpa if function is None else function
