"""Forge: routes `backend.attention.attention_function` (UNet, Flux, Chroma...) and
`attention_function_single_head_spatial` (VAE) to the kernels, and SD3.5's own attention function
(`backend.nn.mmditx.attention`, which calls PyTorch's SDPA itself).

Forge's model modules bind both names at import (`from backend.attention import attention_function`),
so every loaded module holding Forge's function under that name is rebound to a routing function,
and the same modules get it back on unload. `backend.attention` itself is left alone: Forge's memory
estimate (`KModel.memory_required`) compares `backend.attention.attention_function` with its
SDPA/xformers functions (anything else makes it reserve about 2.6 times the memory), so Forge's
built-in extensions that look the function up there at call time (IP-Adapter, SAG, reference-only,
StyleAlign) keep Forge's attention. Modules imported later (a model type's first load) are picked
up on the next model load.
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

rebinding = Rebinding(ATTENTION_MODULE, ROUTES)
sd35_rebinding = Rebinding(SD35_MODULE, {
    "attention": functools.partial(routed_attention_function, fallback_name="Forge's SD3.5 attention")}, rebind_home=True)


def rebind() -> None:
    rebinding.apply()
    if SD35_MODULE in sys.modules:  # Forge imports it with the first SD3.5 model
        sd35_rebinding.apply()


def restore() -> None:
    rebinding.restore()
    sd35_rebinding.restore()


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
