"""SD.Next: its diffusers pipelines call `torch.nn.functional.scaled_dot_product_attention` at call
time, so the dispatcher's guarded SDPA override reaches their attention (UNet/transformer and VAE
alike: there the "UNet" setting switches the override, and the "VAE" setting has no separate effect).
Calls the kernels do not support run on PyTorch's SDPA unchanged.
"""

from __future__ import annotations

import torch

import rdna_flash_attn

from . import availability, options
from .options import toggles

_available = False


def webui_device() -> torch.device:
    from modules import devices

    return getattr(devices, "device", None) or torch.device("cpu")


def sync_patch() -> None:
    """The override is on exactly while the kernels are available and the UNet setting is on."""
    if _available and toggles.unet:
        rdna_flash_attn.enable_sdpa_patch()
    else:
        rdna_flash_attn.disable_sdpa_patch()


def setup() -> None:
    global _available
    from modules import script_callbacks, shared

    device = webui_device()
    why = availability.reason(device)
    availability.explain_once("SD.Next", device, why)
    _available = why is None
    options.subscribe(sync_patch)
    sync_patch()
    script_callbacks.on_ui_settings(lambda: options.register(shared, availability.status_text(why)))
    script_callbacks.on_script_unloaded(rdna_flash_attn.disable_sdpa_patch)
