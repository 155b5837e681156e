"""Forge: routes `backend.attention.attention_function` (UNet, Flux, Chroma...) and
`attention_function_single_head_spatial` (VAE) to the kernels, and SD3.5's own attention function
(`backend.nn.mmditx.attention`, which calls PyTorch's SDPA itself).

Forge's model modules bind both names at import (`from backend.attention import attention_function`),
so every loaded module holding Forge's function under that name is rebound to a routing function,
`backend.attention` itself too (Forge's built-in extensions look the function up there at call time:
IP-Adapter, SAG, reference-only, StyleAlign), and the same modules get it back on unload. Forge's
memory estimate (`KModel.memory_required`) compares `backend.attention.attention_function` with its
SDPA/xformers functions (anything else makes it reserve more memory, at float32 size), so it is
evaluated with Forge's own function in that place: the kernels need no more memory than SDPA. Modules
imported later (a model type's first load) are picked up on the next model load.
"""

from __future__ import annotations

import functools
import sys

import torch

from . import availability, options
from .attention_functions import Rebinding, routed_attention_function, routed_single_head_spatial

ATTENTION_MODULE = "backend.attention"
ROUTES = {
    "attention_function": routed_attention_function,
    "attention_function_single_head_spatial": routed_single_head_spatial,
}


SD35_MODULE = "backend.nn.mmditx"  # SD3.5: its blocks call the module's own `attention`, PyTorch SDPA inside

rebinding = Rebinding(ATTENTION_MODULE, ROUTES, rebind_home=True)
sd35_rebinding = Rebinding(SD35_MODULE, {
    "attention": functools.partial(routed_attention_function, fallback_name="Forge's SD3.5 attention")}, rebind_home=True)


MODEL_MODULE, MODEL_CLASS = "backend.modules.k_model", "KModel"


def _estimated_with_forges_function(found):
    """KModel.memory_required as Forge computes it with its own attention function at
    backend.attention.attention_function (put there for the call, ours back after it)."""

    @functools.wraps(found)
    def memory_required(self, *args, **kwargs):
        attention = sys.modules[ATTENTION_MODULE]
        ours = attention.attention_function
        attention.attention_function = getattr(ours, "rdna_original", ours)
        try:
            return found(self, *args, **kwargs)
        finally:
            attention.attention_function = ours

    memory_required.rdna_original = found
    return memory_required


def _model_class():
    """KModel once Forge imported it (at its first model load, whose callback rebinds again)."""
    return getattr(sys.modules.get(MODEL_MODULE), MODEL_CLASS, None)


def rebind() -> None:
    rebinding.apply()
    if SD35_MODULE in sys.modules:  # Forge imports it with the first SD3.5 model
        sd35_rebinding.apply()
    model_class = _model_class()
    found = getattr(model_class, "memory_required", None)
    if callable(found) and not hasattr(found, "rdna_original"):
        model_class.memory_required = _estimated_with_forges_function(found)


def restore() -> None:
    rebinding.restore()
    sd35_rebinding.restore()
    model_class = _model_class()
    ours = getattr(model_class, "memory_required", None)
    if hasattr(ours, "rdna_original"):
        model_class.memory_required = ours.rdna_original


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
    rebind()
    script_callbacks.on_model_loaded(lambda sd_model: rebind())
    script_callbacks.on_script_unloaded(restore)
