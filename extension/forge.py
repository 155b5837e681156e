"""Forge: routes `backend.attention.attention_function` (UNet, Flux, Chroma...) and
`attention_function_single_head_spatial` (VAE) to the kernels.

Forge's model modules bind both names at import (`from backend.attention import attention_function`),
so every loaded module holding Forge's function under that name is rebound to a routing function,
and the same modules get it back on unload. `backend.attention` itself is left alone: Forge's memory
estimate (`KModel.memory_required`) compares `backend.attention.attention_function` with its
SDPA/xformers functions, and the kernels need no more memory than those. Modules imported later
(a model type's first load) are picked up on the next model load.
"""

from __future__ import annotations

import importlib
import sys

import torch

import rdna_flash_attn

from . import availability, guard, options
from .options import toggles

ATTENTION_MODULE = "backend.attention"


def routed_attention_function(original):
    """Forge's `attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False)`:
    q, k, v (B, N, H*D), or (B, H, N, D) with skip_reshape; returns (B, N, H*D). The kernels
    accumulate in float32, which is what an `attn_precision` of float32 asks for."""

    def on_kernels(q, k, v, heads, skip_reshape):
        if skip_reshape:
            q4, k4, v4 = q, k, v
        else:
            q4, k4, v4 = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = rdna_flash_attn.attention_or_reason(q4, k4, v4, fallback_name="Forge's attention_function")
        return out.transpose(1, 2).flatten(2) if isinstance(out, torch.Tensor) else None

    def attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, **kwargs):
        if mask is None and not kwargs and toggles.unet and _routable(q, k, v, heads, skip_reshape):
            try:
                out = on_kernels(q, k, v, heads, skip_reshape)
            except Exception as error:
                guard.report_failure("attention_function", error)
                out = None
            if out is not None:
                return out
        return original(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape, **kwargs)

    attention_function.rdna_original = original
    return attention_function


def _routable(q, k, v, heads, skip_reshape) -> bool:
    """Shapes the reshape below handles; anything else goes to Forge's function unchanged, which
    then raises its own error for malformed input."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if skip_reshape:
        return all(t.dim() == 4 for t in tensors)
    return isinstance(heads, int) and heads > 0 and all(t.dim() == 3 and t.shape[-1] % heads == 0 for t in tensors)


def routed_single_head_spatial(original):
    """Forge's `attention_function_single_head_spatial(q, k, v)`: (B, C, H, W) each, one head of C
    channels (the VAE's mid-block); returns (B, C, H, W)."""

    def on_kernels(q, k, v):
        b, c, h, w = q.shape
        q4, k4, v4 = (t.reshape(b, 1, c, h * w).transpose(2, 3).contiguous() for t in (q, k, v))
        out = rdna_flash_attn.attention_or_reason(q4, k4, v4, fallback_name="Forge's VAE attention")
        return out.transpose(2, 3).reshape(b, c, h, w) if isinstance(out, torch.Tensor) else None

    def attention_function_single_head_spatial(q, k, v):
        if toggles.vae:
            try:
                out = on_kernels(q, k, v)
            except Exception as error:
                guard.report_failure("attention_function_single_head_spatial", error)
                out = None
            if out is not None:
                return out
        return original(q, k, v)

    attention_function_single_head_spatial.rdna_original = original
    return attention_function_single_head_spatial


ROUTES = {
    "attention_function": routed_attention_function,
    "attention_function_single_head_spatial": routed_single_head_spatial,
}


def _global(module, name: str):
    try:
        return vars(module).get(name)
    except Exception:  # sys.modules may hold odd objects (lazy loaders, None)
        return None


class Rebinding:
    """Which module globals hold a routing function instead of Forge's, so they can be put back."""

    def __init__(self):
        self.bound: list[tuple[object, str, object, object]] = []  # (module, name, original, ours)
        self._routes: dict[str, object] = {}  # name -> our routing function for Forge's current one

    def apply(self) -> None:
        """Rebind every loaded module (but backend.attention) holding Forge's function. Safe to repeat:
        modules already rebound no longer hold it."""
        attention = importlib.import_module(ATTENTION_MODULE)
        for name, make in ROUTES.items():
            original = getattr(attention, name)
            ours = self._routes.get(name)
            if ours is None or ours.rdna_original is not original:
                ours = self._routes[name] = make(original)
            for module in list(sys.modules.values()):
                if module is attention or _global(module, name) is not original:
                    continue
                setattr(module, name, ours)
                self.bound.append((module, name, original, ours))

    def restore(self) -> None:
        for module, name, original, ours in self.bound:
            if _global(module, name) is ours:  # leave a later patch by someone else in place
                setattr(module, name, original)
        self.bound.clear()


rebinding = Rebinding()


def webui_device() -> torch.device:
    from backend import memory_management

    return memory_management.get_torch_device()


def setup() -> None:
    from modules import script_callbacks, shared

    device = webui_device()
    why = availability.reason(device)
    availability.explain_once("Forge", device, why)
    script_callbacks.on_ui_settings(lambda: options.register(shared, availability.status_text(why)))
    if why:
        return
    rebinding.apply()
    script_callbacks.on_model_loaded(lambda sd_model: rebinding.apply())
    script_callbacks.on_script_unloaded(rebinding.restore)
