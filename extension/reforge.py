"""reForge and Forge Classic: both compute attention through ComfyUI-style functions in `ldm_patched`
and have no optimizer registry (A1111's `SdOptimization` is gone there).

The UNet's `CrossAttention.forward` looks `optimized_attention` / `optimized_attention_masked` up in
`ldm_patched.ldm.modules.attention` at call time, and other modules (SD3, Flux, IP-Adapter, SAG ...)
bound them at import: every module holding one of them, the attention module itself included, gets the
routing function, and the same modules get the host's back on unload. The VAE's attention blocks keep
their attention function per instance (`self.optimized_attention`, from `vae_attention()` when the block is
built): the image VAE's `AttnBlock`, Wan's video VAE `AttentionBlock` and Cosmos' tokenizer
`CausalAttnBlock` alike; each loaded model's blocks get the routing function at its load. Calls the kernels do not take run on the host's
own function with their own arguments. 3-D float masks (Flux's style-model bias, padded prompts) reach
the kernels where the WebUI's function reads them as (batch, queries, keys), as all of today's reForge
backends do; Forge Classic's PyTorch backend does not.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import availability, options
from .attention_functions import Rebinding, routed_attention_function, routed_single_head_spatial

ATTENTION_MODULE = "ldm_patched.ldm.modules.attention"
VAE_ATTENTION_BLOCK = "AttnBlock"
# vae_attention() hands a block one of this module's functions, (q, k, v) -> out, each (B, C, H, W)
VAE_ATTENTION_MODULE = "ldm_patched.ldm.modules.diffusionmodules.model"
CLASSIC_VERSION = "classic"  # modules_forge.forge_version.version on Forge Classic


def fork_name() -> str:
    try:
        from modules_forge import forge_version
    except ImportError:
        return "reForge"
    return "Forge Classic" if getattr(forge_version, "version", "") == CLASSIC_VERSION else "reForge"


_route = functools.partial(routed_attention_function, fallback_name="the WebUI's own attention")
rebinding = Rebinding(ATTENTION_MODULE, {"optimized_attention": _route, "optimized_attention_masked": _route},
                      rebind_home=True)
_vae_blocks: weakref.WeakSet = weakref.WeakSet()  # blocks whose attention function we replaced


def _is_vae_attention(module, found) -> bool:
    """Whether `found`, a block's `optimized_attention`, is the VAE's single-head spatial attention: an
    `AttnBlock`'s, or any block's that took it from `vae_attention()` (the video VAEs' blocks)."""
    if not callable(found) or hasattr(found, "rdna_original"):
        return False
    return type(module).__name__ == VAE_ATTENTION_BLOCK or getattr(found, "__module__", None) == VAE_ATTENTION_MODULE


def route_vae_blocks(model) -> None:
    """Put the routing function on every VAE attention block of `model` that still has its own."""
    if not isinstance(model, torch.nn.Module):
        return
    for module in model.modules():
        found = getattr(module, "optimized_attention", None)
        if not _is_vae_attention(module, found):
            continue
        module.optimized_attention = routed_single_head_spatial(found, fallback_name="the VAE's own attention")
        _vae_blocks.add(module)


def restore() -> None:
    rebinding.restore()
    for module in list(_vae_blocks):
        routed = module.optimized_attention
        if hasattr(routed, "rdna_original"):
            module.optimized_attention = routed.rdna_original
    _vae_blocks.clear()


def on_model_loaded(sd_model) -> None:
    rebinding.apply()  # modules a model type's first load imported
    route_vae_blocks(sd_model)


def webui_device() -> torch.device:
    from modules import devices

    return getattr(devices, "device", None) or torch.device("cpu")


def setup() -> None:
    from modules import script_callbacks, shared

    host = fork_name()
    device = webui_device()
    why = availability.reason(device)
    availability.explain_once(host, device, why)
    script_callbacks.on_ui_settings(lambda: options.register(shared, availability.status_text(why)))
    if why:
        return
    rebinding.apply()
    script_callbacks.on_model_loaded(on_model_loaded)
    script_callbacks.on_script_unloaded(restore)
