"""Per-VAE routing of the VAE's single-head spatial attention to the kernels.

ComfyUI's VAE attention blocks (AttnBlock and its video and audio relatives) call
`self.optimized_attention(q, k, v)` on (B, C, *spatial) tensors, one head of dim C (512 for the
SD/SDXL/Flux VAEs), and the per-model override does not reach them. A VAE object has no clone and
its first_stage_model is shared by every copy, so each attention module gets a router that runs the
module's original function unless a patched VAE copy is decoding or encoding at that moment (a
context variable says which); an error in this routing runs the original function too. The VAE
given to the node is never changed; the routers go again when the last patched copy of a
first_stage_model is garbage-collected.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import weakref
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .core import core_or_reason
from .routing import context_value, log_once, refuse, routing_failed

log = logging.getLogger("rdna_flash_attn")

PRECISION_BF16 = "bf16"
PRECISION_FP16 = "fp16 if in range"
PRECISION_KEEP = "keep fp32"
PRECISION_CHOICES = (PRECISION_BF16, PRECISION_FP16, PRECISION_KEEP)
PSNR_FIRST = "first decode"
PSNR_EVERY = "every decode"
PSNR_OFF = "off"
PSNR_CHOICES = (PSNR_FIRST, PSNR_EVERY, PSNR_OFF)

VAE_FALLBACK = "the VAE's own attention"
FP16_SAFE_MAX = 32768.0  # inputs up to this magnitude fit float16 with headroom; larger go to bfloat16
ROUTED_METHODS = ("decode", "decode_tiled", "encode", "encode_tiled")


@dataclass
class VaeRouting:
    """One patched VAE copy's choices and what its decodes measured."""

    precision: str = PRECISION_BF16
    psnr_check: str = PSNR_FIRST
    reference: bool = False  # True while the float32 reference decode runs on the original attention
    kernel_calls: int = 0  # attention calls the kernels ran
    decodes: int = 0  # decodes whose attention ran on the kernels
    last_psnr: float | None = None


_active: ContextVar[VaeRouting | None] = ContextVar("rdna_flash_attn_vae", default=None)


def _run_dtype(tensors, precision: str) -> torch.dtype | None:
    """The 16-bit type to run float32 VAE attention in, or None to hand float32 to the dispatcher."""
    if any(t.dtype != torch.float32 for t in tensors) or precision == PRECISION_KEEP:
        return None
    if precision == PRECISION_FP16 and max(float(t.abs().amax()) for t in tensors) <= FP16_SAFE_MAX:
        return torch.float16
    return torch.bfloat16


def vae_kernel_attention(q, k, v, precision: str) -> torch.Tensor | str:
    """Single-head attention over the spatial positions of (B, C, *spatial) q, k, v on the kernels,
    or the reason it falls back."""
    core = core_or_reason()
    if isinstance(core, str):
        return core
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in tensors) or q.shape != k.shape or q.shape != v.shape:
        return refuse("VAE attention inputs are not three equal (batch, channels, ...) tensors", VAE_FALLBACK)
    run_dtype = _run_dtype(tensors, precision) or q.dtype
    batch, channels = q.shape[:2]
    # (B, C, N) -> (B, 1, N, C), copied once into the run type with unit stride over the channels
    # (`.to` returns the strided view itself when the VAE already runs in that type: .contiguous() copies then).
    q4, k4, v4 = (
        t.reshape(batch, channels, -1).transpose(1, 2).to(run_dtype, memory_format=torch.contiguous_format)
        .contiguous().unsqueeze(1)
        for t in tensors
    )
    out = core.attention_or_reason(q4, k4, v4, fallback_name=VAE_FALLBACK)
    if isinstance(out, str):
        return out
    return out.squeeze(1).transpose(1, 2).reshape(q.shape).to(q.dtype)


class AttentionRouter:
    """Stands in for one attention module's `optimized_attention`; the original runs unless a
    patched VAE copy is active."""

    def __init__(self, original):
        self.original = original

    def __call__(self, q, k, v, *args, **kwargs):
        routing = _active.get()
        if routing is None or routing.reference or args or kwargs:  # extra arguments: a form not known
            return self.original(q, k, v, *args, **kwargs)
        try:
            out = vae_kernel_attention(q, k, v, routing.precision)
        except Exception as error:  # noqa: BLE001  (a fault of ours must cost the speed-up, never the decode)
            out = routing_failed(error)
        if isinstance(out, torch.Tensor):
            routing.kernel_calls += 1
            return out
        return self.original(q, k, v)


_patched_copies: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def attention_modules(first_stage_model: torch.nn.Module):
    return [m for m in first_stage_model.modules() if callable(getattr(m, "optimized_attention", None))]


def install_routers(first_stage_model: torch.nn.Module) -> int:
    modules = attention_modules(first_stage_model)
    for module in modules:
        if not isinstance(module.optimized_attention, AttentionRouter):
            module.optimized_attention = AttentionRouter(module.optimized_attention)
    return len(modules)


def restore_originals(first_stage_model: torch.nn.Module) -> None:
    for module in attention_modules(first_stage_model):
        if isinstance(module.optimized_attention, AttentionRouter):
            module.optimized_attention = module.optimized_attention.original


def _release(first_stage_model_ref) -> None:
    first_stage_model = first_stage_model_ref()
    if first_stage_model is None:
        return
    _patched_copies[first_stage_model] -= 1
    if _patched_copies[first_stage_model] == 0:
        del _patched_copies[first_stage_model]
        restore_originals(first_stage_model)



def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two images with values in [0, 1]."""
    mse = float((image.detach().float() - reference.detach().float()).square().mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _routed_method(vae, name: str, routing: VaeRouting):
    unbound = getattr(type(vae), name)

    @functools.wraps(unbound)
    def method(*args, **kwargs):
        kernel_calls = routing.kernel_calls
        with context_value(_active, routing):
            result = unbound(vae, *args, **kwargs)
        if name != "decode" or routing.psnr_check == PSNR_OFF:
            return result
        if routing.kernel_calls == kernel_calls:  # nothing to compare: the reason was logged as it fell back
            log_once("RDNA Flash Attention VAE: the decode's attention did not run on the kernels, so there is "
                     "no PSNR check (and no second decode)")
            return result
        routing.decodes += 1
        if routing.psnr_check == PSNR_FIRST and routing.decodes > 1:
            return result
        routing.reference = True
        try:
            with context_value(_active, routing):
                reference = unbound(vae, *args, **kwargs)
        finally:
            routing.reference = False
        routing.last_psnr = psnr(result, reference)
        log.info(
            "RDNA Flash Attention VAE (%s): decoded image PSNR %.1f dB against the VAE's own attention "
            "(above ~45 dB the difference is invisible)", routing.precision, routing.last_psnr
        )
        return result

    return method


def patch_vae(vae, precision: str = PRECISION_BF16, psnr_check: str = PSNR_FIRST):
    """A copy of ComfyUI `vae` whose attention runs on the kernels; `vae` itself is unchanged."""
    first_stage_model = getattr(vae, "first_stage_model", None)
    if first_stage_model is None:
        log.info("RDNA Flash Attention VAE: this VAE has no first_stage_model; passed through unchanged")
        return vae
    if install_routers(first_stage_model) == 0:
        log.info("RDNA Flash Attention VAE: %s has no attention blocks; passed through unchanged",
                 type(first_stage_model).__name__)
        return vae
    patched = copy.copy(vae)
    routing = VaeRouting(precision=precision, psnr_check=psnr_check)
    patched.rdna_flash_attn_routing = routing
    for name in ROUTED_METHODS:
        if hasattr(type(vae), name):
            setattr(patched, name, _routed_method(patched, name, routing))
    _patched_copies[first_stage_model] = _patched_copies.get(first_stage_model, 0) + 1
    weakref.finalize(patched, _release, weakref.ref(first_stage_model))
    return patched
