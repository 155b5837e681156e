"""The plan of one attention call: every check the dispatcher makes, made at the entry, once per call
signature, into a frozen AttentionPlan (what the kernels run: the cast to make, the forward's launch
with its mask view, whether gradients need the backward kernels, the 8-bit decision), or a Refusal with
the one-line reason the call falls back. The router runs a plan; nothing below it checks again.

The checks read only tensor metadata and settings attributes, so a model's repeated calls pay one
dictionary lookup: the plan is cached per call signature (everything it reads: settings, devices,
dtypes, shapes, strides, storage alignment, the other arguments, autocast and grad mode). While
torch.compile traces, the same checks run on the traced tensors' metadata, and dynamo's guards on what
they read (settings included) re-trace when one of them changes; the per-device verdicts then come
from cached facts or, the first time, from a call run eagerly at trace time.

Malformed calls are never judged here: anything unusual is refused, so the fallback (SDPA) raises its
own exception for it, and no kernel is ever launched on input SDPA would reject.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from ..config import settings
from ..ops import attention, autograd, plans, quantized
from ..ops.plans import Refusal
from ..runtime import variants
from . import state as verdicts
from .state import state

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
AUTOCAST_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what autocast converts
FP32_CAST_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})
TRAINING_OFF = "gradients needed and RDNA_FA_TRAINING=0"

if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4

    def autocast_dtype(device_type: str) -> torch.dtype | None:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

else:  # older torch (ZLUDA hosts run 2.2 - 2.7): only CUDA-device autocast, which is all that runs kernels

    def autocast_dtype(device_type: str) -> torch.dtype | None:
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """A dense call the kernels take, decided: q, k and v are cast to `run_dtype` (None: run as given),
    `kernel` launches the forward on them (its mask view included), the output goes back in `out_dtype`."""

    kernel: plans.ForwardPlan
    run_dtype: torch.dtype | None
    out_dtype: torch.dtype  # what SDPA would have returned
    backward: bool  # autograd needs the differentiable op, which runs the backward kernels too
    symbols: tuple[str, ...]  # of the exact kernels the call launches, the forward first
    launcher: Callable | None = None  # the forward's prepared launch (attention.forward_launcher), eager calls
    eight_bit: quantized.QuantizedPlan | None = None  # 8-bit attention (its launches prepared where they can be)
    exact_reason: str | None = None  # why a call asked to run in 8 bits runs exact


@dataclass(frozen=True)
class VarlenAttentionPlan:
    """A packed variable-length batch the kernels take, decided."""

    kernel: plans.VarlenPlan
    backward: bool
    symbols: tuple[str, ...]  # of the kernels the call launches, the forward first


def call_kernels(dtype: torch.dtype, head_dim: int, masked: bool, backward: bool) -> tuple[str, ...]:
    """Symbols of the exact kernels a call launches, the forward first: the class of calls a failure
    turns off, since a kernel that fails once fails for every call it runs."""
    name = plans.DTYPE_NAMES[dtype]
    symbols = (variants.fwd_variant(name, head_dim, masked).symbol,)
    if backward:
        symbols += tuple(variants.bwd_variant(kind, name, head_dim, masked).symbol for kind in ("dq", "dkdv"))
    return symbols


def current_precision() -> str:
    return state.precision.get() or settings.precision


# --- per-device verdicts, as constants of a graph being traced -------------------------------------


def constant_while_tracing(function):
    """Marks `function` as torch.compiler.assume_constant_result does: while torch.compile traces,
    a call runs for real and its result is a constant of the graph. Its arguments must be values the
    traced code read (so dynamo guards on them). The marker is set here directly because the public
    helper imports torch._dynamo, which would double this package's import time."""
    function._dynamo_marked_constant = True
    return function


@constant_while_tracing
def _device_refusal(device: torch.device, force: bool, generation: int) -> str | None:
    return verdicts.device_refusal(device)


@constant_while_tracing
def _tested_refusal(device: torch.device, symbols: tuple[str, ...], generation: int) -> str | None:
    """The device's self-test (run now, outside any graph, at its first ask), then the kernels it turned off."""
    return verdicts.selftest_refusal(device) or verdicts.failed_kernel(device, symbols)


# --- dense calls ---------------------------------------------------------------------------------------


def _settings_or_type_refusal(*types: type) -> Refusal | None:
    """The first checks of every plan: the kernels turned off, and tensors that are not plain ones."""
    if settings.disable:
        return Refusal("disabled (RDNA_FA_DISABLE / settings.disable)")
    if any(t is not torch.Tensor for t in types):
        return Refusal("query, key and value are not all plain torch.Tensor objects")
    return None


def _kernel_dtypes(device_type: str, dtypes: tuple[torch.dtype, ...]
                   ) -> tuple[torch.dtype | None, torch.dtype] | Refusal:
    """(dtype to cast the inputs to first, or None for no cast; dtype to return), or a refusal. Casts
    mirror what SDPA would do under autocast, or what the user opted into for float32."""
    autocast_to = autocast_dtype(device_type)
    if autocast_to is not None and all(d in AUTOCAST_CAST_DTYPES for d in dtypes):
        # SDPA is an autocast op: it would compute in, and return, the autocast dtype.
        if autocast_to not in KERNEL_DTYPES:
            return Refusal(f"autocast to {autocast_to}")
        return autocast_to, autocast_to
    if dtypes == (torch.float32,) * 3:
        if settings.fp32_cast == "off":
            return Refusal("float32 inputs (RDNA_FA_FP32_CAST=bf16 runs them on the kernels in bfloat16)")
        return FP32_CAST_DTYPES[settings.fp32_cast], torch.float32
    return None, dtypes[0]  # as given: plans.plan_forward judges the dtypes


def plan_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                   *, bottom_right: bool = False, backward: bool = False) -> AttentionPlan | Refusal:
    """The plan for these SDPA arguments, or why the call falls back (`bottom_right`: flash-attn's causal
    alignment, for its own callers; `backward`: the call's backward kernels are wanted though autograd
    would not ask, for callers that run them on their own). Eager calls of a signature decided before pay
    one lookup; calls of a graph being compiled are decided while it is traced (dynamo's guards do the
    caching)."""
    if plans.is_compiling():
        return _new_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right, True,
                         backward)
    signature = None
    if (attn_mask is None and type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and type(is_causal) is bool and type(enable_gqa) is bool and type(dropout_p) in (float, int)
            and (scale is None or type(scale) in (float, int))):
        try:
            device = query.device
            signature = (settings.disable, settings.force, settings.training, settings.fp32_cast, current_precision(),
                         device, key.device, value.device, query.dtype, key.dtype, value.dtype,
                         query.layout, key.layout, value.layout, query.shape, key.shape, value.shape,
                         query.stride(), key.stride(), value.stride(),
                         query.data_ptr() & 15, key.data_ptr() & 15, value.data_ptr() & 15,
                         dropout_p, is_causal, scale, enable_gqa, bottom_right, backward, autocast_dtype(device.type),
                         torch.is_grad_enabled(), query.requires_grad, key.requires_grad, value.requires_grad)
        except (RuntimeError, NotImplementedError):  # tensors without strides or storage: decided every time
            signature = None
    if signature is None:  # masks, tensor subclasses, odd argument types: decided every time
        return _new_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right, False,
                         backward)
    plan = state.plans.get(signature)
    if plan is None:
        generation = state.generation
        plan = _new_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right, False,
                         backward)
        state.remember(signature, plan, generation)
    return plan


def _new_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, bottom_right: bool,
              tracing: bool, backward_wanted: bool) -> AttentionPlan | Refusal:
    refusal = _settings_or_type_refusal(type(query), type(key), type(value))
    if refusal:
        return refusal
    if any(t.is_nested or t.layout is not torch.strided for t in (query, key, value)):
        return Refusal("nested or sparse tensors")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return Refusal("inputs are not 4-D (batch, heads, tokens, head dim)")
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return Refusal("dropout_p is not 0")
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return Refusal("is_causal or enable_gqa is not a bool")
    if is_causal and attn_mask is not None:
        return Refusal("attn_mask and is_causal both given")  # SDPA raises its own error for these
    if query.shape[1] != key.shape[1] and not enable_gqa:
        return Refusal("key/value heads differ from query heads and enable_gqa is False")
    if scale is not None and type(scale) not in (float, int):
        return Refusal("scale is not a Python number")
    if key.shape[2] != value.shape[2]:
        return Refusal("key and value have different lengths")
    if tracing and not autograd.HAS_CUSTOM_OP:
        return Refusal("traced by torch.compile, which needs torch >= 2.4 for the kernels' custom op")
    device = query.device
    refusal = _device_refusal(device, settings.force, state.generation)
    if refusal:
        return Refusal(refusal)
    dtypes = _kernel_dtypes(device.type, (query.dtype, key.dtype, value.dtype))
    if isinstance(dtypes, Refusal):
        return dtypes
    run_dtype, out_dtype = dtypes
    backward = backward_wanted or autograd.needs_gradients(query, key, value)
    if backward and not settings.training:
        return Refusal(TRAINING_OFF)
    scale = None if scale is None else float(scale)
    kernel = plans.plan_forward(query, key, value, is_causal, scale, attn_mask, backward=backward,
                                bottom_right=bottom_right, dtype=run_dtype)
    if isinstance(kernel, Refusal):
        return kernel
    symbols = call_kernels(kernel.dtype, kernel.head_dim, kernel.mask is not None, backward)
    refusal = _tested_refusal(device, symbols, state.generation)
    if refusal:
        return Refusal(refusal)
    if tracing:  # the custom op, which holds the exact kernels: a graph keeps no 8-bit attention
        return AttentionPlan(kernel, run_dtype, out_dtype, backward, symbols)
    launcher = None if backward else _launcher_or_none(kernel, device)
    if current_precision() == "exact":
        return AttentionPlan(kernel, run_dtype, out_dtype, backward, symbols, launcher)
    eight_bit = (Refusal("gradients needed (8-bit attention is for inference)") if backward
                 else _eight_bit_plan(query, key, value, is_causal, attn_mask, scale, run_dtype))
    if isinstance(eight_bit, Refusal):
        return AttentionPlan(kernel, run_dtype, out_dtype, backward, symbols, launcher, exact_reason=eight_bit.reason)
    return AttentionPlan(kernel, run_dtype, out_dtype, backward, symbols, launcher, eight_bit)


def _launcher_or_none(kernel: plans.ForwardPlan, device: torch.device):
    """The forward's prepared launch; None where it cannot be prepared now: each launch then prepares
    its own, and a failure there is the router's to handle (counted, the kernel turned off)."""
    try:
        return attention.forward_launcher(kernel, device)
    except Exception:  # noqa: BLE001  (met again, and handled, at the launch)
        return None


def _eight_bit_plan(query, key, value, is_causal, attn_mask, scale, run_dtype):
    refusal = verdicts.eight_bit_refusal(query.device)
    if refusal:
        return Refusal(refusal)
    plan = quantized.plan_quantized(query, key, value, is_causal, attn_mask, scale, run_dtype)
    if isinstance(plan, Refusal):
        return plan
    try:
        return quantized.prepare_launches(plan, query, key)
    except Exception:  # noqa: BLE001  (met again, and handled, at the launch, as _launcher_or_none's)
        return plan


# --- packed variable-length batches ------------------------------------------------------------------


def plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                scale: float | None = None) -> VarlenAttentionPlan | Refusal:
    """The plan of a packed variable-length batch (flash-attn's varlen layout, causal aligned
    bottom-right per entry), or why the kernels cannot take it. Unsound offsets or lengths raise
    ValueError first (attention.check_cu_seqlens), whether or not the kernels would take the call: they
    are the caller's error, which its fallback would otherwise get silently wrong."""
    covered = attention.check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    refusal = _settings_or_type_refusal(type(q), type(k), type(v))
    if refusal:
        return refusal
    if plans.is_compiling():
        return Refusal("packed variable-length batches are not traced by torch.compile")
    refusal = verdicts.device_refusal(q.device)
    if refusal:
        return Refusal(refusal)
    backward = autograd.needs_gradients(q, k, v)
    if backward and not settings.training:
        return Refusal(TRAINING_OFF)
    kernel = plans.plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                               covered)
    if isinstance(kernel, Refusal):
        return kernel
    symbols = call_kernels(q.dtype, q.shape[-1], False, backward)
    refusal = verdicts.selftest_refusal(q.device) or verdicts.failed_kernel(q.device, symbols)
    if refusal:
        return Refusal(refusal)
    return VarlenAttentionPlan(kernel, backward, symbols)
