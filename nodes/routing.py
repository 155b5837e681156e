"""ComfyUI's attention call forms, routed to the kernels, with the caller's own backend as fallback.

Every ComfyUI attention backend has the signature
`fn(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)`:
q, k, v are (B, L, H*D), or (B, H, L, D) with skip_reshape; the result is (B, L, H*D), or
(B, H, L, D) with skip_output_reshape. Keywords the kernels do not need (transformer_options,
ComfyUI's own marker) travel on to the fallback; a keyword this node does not know, set to a value
other than None or False, could change the result (a future causal or varlen option), so such a
call runs on the fallback. Any error in this module's own code also sends the call to the fallback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from .core import core_or_reason

log = logging.getLogger("rdna_flash_attn")
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

BACKEND_PARAMETERS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
REQUIRED_PARAMETERS = frozenset(BACKEND_PARAMETERS[:4])
FALLBACK_ORIGINAL = "original backend"
FALLBACK_PYTORCH = "pytorch attention"
FALLBACK_CHOICES = (FALLBACK_ORIGINAL, FALLBACK_PYTORCH)
CALL_FORM_UNKNOWN = "ComfyUI attention call form not recognised"
# Keywords besides BACKEND_PARAMETERS that ComfyUI passes: the override's (wrap_attn's marker and the
# model's options, which do not change the result) and the ones kernel_attention honours.
EXACT = "exact"
KNOWN_KEYWORDS = frozenset({"transformer_options", "_inside_attn_wrapper", "scale", "enable_gqa", "low_precision_attention"})


@dataclass(frozen=True)
class RoutingOptions:
    """What one node (or the global switch) asked for."""

    training: bool = True  # run training (backward) calls on the kernels too
    fallback: str = FALLBACK_ORIGINAL  # where unsupported calls go
    precision: str = EXACT  # "8bit-qkpv": inference calls in 8-bit attention on RDNA4 (rdna_flash_attn.precision)


_logged: set[str] = set()
comfy_fallbacks: dict[str, int] = {}  # reasons decided here, before the dispatcher sees the call
comfy_exact_not_8bit: dict[str, int] = {}  # calls of an 8-bit node that ran on the exact kernels, by reason


@contextlib.contextmanager
def context_value(variable: ContextVar, value):
    """`variable` holds `value` within the block (in this thread or task)."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def log_once(message: str, level: int = logging.INFO, exc_info: BaseException | None = None) -> None:
    """Log `message` the first time it is logged with the logger enabled for `level` (as the
    dispatcher does: a reason met before logging was turned on is shown once it is)."""
    if message in _logged or not log.isEnabledFor(level):
        return
    _logged.add(message)
    log.log(level, "%s", message, exc_info=exc_info)


def refuse(reason: str, fallback_name: str = "ComfyUI's attention") -> str:
    comfy_fallbacks[reason] = comfy_fallbacks.get(reason, 0) + 1
    log_once(f"not using the kernels: {reason} ({fallback_name} runs these calls)")
    return reason


def routing_failed(error: Exception) -> str:
    """The reason for a call whose routing raised: counted, logged once with its traceback."""
    reason = f"error in the node's routing code ({type(error).__name__})"  # by type: messages carry shapes
    comfy_fallbacks[reason] = comfy_fallbacks.get(reason, 0) + 1
    log_once(f"not using the kernels: {reason}; running ComfyUI's attention", logging.WARNING, error)
    return reason


def bind_call(args: tuple, kwargs: dict) -> tuple[dict, dict] | None:
    """(backend parameters by name, other keyword arguments), or None for a call form not known."""
    if len(args) > len(BACKEND_PARAMETERS):
        return None
    named = dict(zip(BACKEND_PARAMETERS, args))
    extra = {}
    for key, value in kwargs.items():
        if key in BACKEND_PARAMETERS:
            if key in named:
                return None
            named[key] = value
        else:
            extra[key] = value
    if not REQUIRED_PARAMETERS <= named.keys():
        return None
    return named, extra


def unknown_keyword(extra: dict) -> str | None:
    """The first keyword not in KNOWN_KEYWORDS whose value is not None or False, if any."""
    for key, value in extra.items():
        if key not in KNOWN_KEYWORDS and value is not None and value is not False:
            return key
    return None


def _in_training(needs_grad: bool) -> bool:
    """Whether a call trains: it needs gradients, or ComfyUI's LoRA training node says so."""
    try:
        from comfy import model_management  # the LoRA training node sets in_training
    except ImportError:
        return needs_grad
    return needs_grad or bool(getattr(model_management, "in_training", False))


def _heads_view(t: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """(B, L, H*D), or (B, L, H, D) as SD3's and Wan-Animate's code pass k or v, -> a (B, H, L, D)
    view; None for anything else."""
    if t.dim() == 4 and t.shape[-1] == head_dim:
        return t.transpose(1, 2)
    if t.dim() != 3 or t.shape[-1] % head_dim:
        return None
    return torch.unflatten(t, -1, (-1, head_dim)).transpose(1, 2)


def _sdpa_mask(mask):
    """A ComfyUI backend's mask as SDPA's: ComfyUI reads a 3-D mask as (batch, queries, keys), where
    SDPA would read its first dimension as heads (2-D and 4-D ones mean the same to both)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 3:
        return mask[:, None]
    return mask


NO_LOW_PRECISION = ("ComfyUI marks these calls low_precision_attention=False (where Sage-style attention breaks the "
                    "model)")


def ran_exact(reason: str) -> None:
    """Counts, and logs once, a call the node's 8-bit option did not apply to."""
    comfy_exact_not_8bit[reason] = comfy_exact_not_8bit.get(reason, 0) + 1
    log_once(f"not using 8-bit attention: {reason} (the exact kernels run these calls)")


def kernel_attention(named: dict, extra: dict, options: RoutingOptions) -> torch.Tensor | str:
    """The kernels' result for one ComfyUI backend call, or the reason it falls back."""
    core = core_or_reason()
    if isinstance(core, str):
        return core
    q, k, v, heads = named["q"], named["k"], named["v"], named["heads"]
    # what runs the calls the kernels do not take, for the console line that says so
    fallback = "ComfyUI's PyTorch attention" if options.fallback == FALLBACK_PYTORCH else "ComfyUI's attention"
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(heads, int)):
        return refuse("ComfyUI attention call with non-tensor q, k, v or non-integer heads", fallback)
    keyword = unknown_keyword(extra)
    if keyword is not None:
        return refuse(f"ComfyUI attention keyword {keyword!r} is not known to this node", fallback)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _in_training(needs_grad) and not options.training:
        return refuse("training (gradients or ComfyUI's in_training) and the node's use_for_training is off", fallback)
    if extra.get("low_precision_attention", True) is False and torch.float32 in (q.dtype, k.dtype, v.dtype):
        # The caller asked for no reduced precision: float32 inputs must not be cast to 16 bits.
        return refuse("low_precision_attention=False with float32 inputs", fallback)
    if named.get("skip_reshape", False):
        q4, k4, v4 = q, k, v
    else:
        if q.dim() != 3 or heads <= 0 or q.shape[-1] % heads:
            return refuse("q is not (batch, tokens, heads * head dim)", fallback)
        head_dim = q.shape[-1] // heads
        q4, k4, v4 = _heads_view(q, head_dim), _heads_view(k, head_dim), _heads_view(v, head_dim)
        if k4 is None or v4 is None:
            return refuse("k or v is neither (batch, tokens, heads * head dim) nor (batch, tokens, heads, head dim)",
                          fallback)
    mask = named.get("mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        # ComfyUI's backends disagree on bool masks (its basic attention reads them as key padding);
        # its models pass additive ones.
        return refuse("bool mask in a ComfyUI attention call (ComfyUI's backends read them in different ways)",
                      fallback)
    # attn_precision=torch.float32 (SD2.x) asks for softmax in float32: the kernels accumulate and
    # normalise in float32 whatever their input type, so it needs no fallback.
    # The node's precision for its calls, exact where ComfyUI asks for no reduced precision; graphs being
    # compiled run exact (dynamo cannot trace the override).
    choice = EXACT if extra.get("low_precision_attention", True) is False else options.precision
    precision = contextlib.nullcontext() if _is_compiling() else core.precision(choice)
    with precision:
        out = core.attention_or_reason(
            q4, k4, v4, attn_mask=_sdpa_mask(mask), scale=extra.get("scale"),
            enable_gqa=extra.get("enable_gqa", False), fallback_name=fallback,
        )
    if isinstance(out, str):
        return out
    if choice != options.precision:
        ran_exact(NO_LOW_PRECISION)
    if named.get("skip_output_reshape", False):
        return out
    return out.transpose(1, 2).flatten(2)


SDPA_PARAMETERS = ("attn_mask", "dropout_p", "is_causal")


def sdpa_call_attention(q, k, v, args: tuple, kwargs: dict, options: RoutingOptions) -> torch.Tensor | str:
    """The kernels' result for a call in SDPA's form (`torch.nn.functional.scaled_dot_product_attention(q,
    k, v, *args, **kwargs)`, as ComfyUI's comfy.ops wrapper takes it), or the reason it falls back."""
    core = core_or_reason()
    if isinstance(core, str):
        return core
    if len(args) > len(SDPA_PARAMETERS) or set(kwargs) - {*SDPA_PARAMETERS, "scale", "enable_gqa"}:
        return refuse("SDPA call form not recognised")
    named = {**dict(zip(SDPA_PARAMETERS, args)), **kwargs}
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _in_training(needs_grad) and not options.training:
        return refuse("training (gradients or ComfyUI's in_training) and the node's use_for_training is off")
    precision = contextlib.nullcontext() if _is_compiling() else core.precision(options.precision)
    with precision:
        return core.attention_or_reason(
            q, k, v, attn_mask=named.get("attn_mask"), dropout_p=named.get("dropout_p", 0.0),
            is_causal=named.get("is_causal", False), scale=named.get("scale"),
            enable_gqa=named.get("enable_gqa", False), fallback_name="ComfyUI's SDPA",
        )

def _pytorch_backend(func: Callable) -> Callable:
    """ComfyUI's PyTorch SDPA backend (registered by name from 2025-09, a module function before)."""
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return func
    if hasattr(attention, "get_attention_function"):
        return attention.get_attention_function("pytorch", default=func)
    return getattr(attention, "attention_pytorch", func)


def _fallback_for(func: Callable, bound: tuple | None, options: RoutingOptions) -> Callable:
    """The backend for a call the kernels do not take: a call form not known stays on `func`."""
    if bound is None or options.fallback != FALLBACK_PYTORCH:
        return func
    return _pytorch_backend(func)


def routed_backend(func: Callable, options: RoutingOptions) -> Callable:
    """`func` (a ComfyUI attention backend) with supported calls running on the kernels."""

    def backend(*args: Any, **kwargs: Any):
        try:
            bound = bind_call(args, kwargs)
            out = refuse(CALL_FORM_UNKNOWN) if bound is None else kernel_attention(*bound, options)
            if isinstance(out, torch.Tensor):
                return out
            fallback = _fallback_for(func, bound, options)
        except Exception as error:  # noqa: BLE001  (a fault of ours must cost the speed-up, never the sampling)
            routing_failed(error)
            fallback = func
        return fallback(*args, **kwargs)

    return backend
