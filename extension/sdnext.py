"""SD.Next: its diffusers pipelines call `torch.nn.functional.scaled_dot_product_attention` at call
time, so the dispatcher's guarded SDPA override reaches their attention (UNet/transformer and VAE
alike: there the "UNet" setting switches the override, and the "VAE" setting has no separate effect).
Calls the kernels do not support run on the SDPA function SD.Next installed (its sliced, Triton or
Sage attention, or PyTorch's).

SD.Next's `devices.set_sdpa_params()` puts back the SDPA it saved at start-up and stacks its own
wrappers on it, at every model load, VAE change, Control run and attention setting change; that would
drop the override. So the extension wraps `set_sdpa_params` to install the override again on top of
whatever it installed, and installs it again at each model load and before each job as well.
"""

from __future__ import annotations

import functools

import torch

import rdna_flash_attn

from . import availability, guard, options
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


def _sync_after(set_sdpa_params):
    """SD.Next's `set_sdpa_params`, followed by the override on top of the SDPA it installed."""

    @functools.wraps(set_sdpa_params)
    def set_sdpa_params_then_ours(*args, **kwargs):
        result = set_sdpa_params(*args, **kwargs)
        try:
            sync_patch()
        except Exception as error:  # SD.Next's model load must go on whatever fails here
            guard.report_failure("re-installing the SDPA override after set_sdpa_params", error)
        return result

    set_sdpa_params_then_ours.rdna_original = set_sdpa_params
    return set_sdpa_params_then_ours


def hook_sdpa_resets() -> None:
    from modules import devices

    current = getattr(devices, "set_sdpa_params", None)
    if current is not None and not hasattr(current, "rdna_original"):
        devices.set_sdpa_params = _sync_after(current)


def unhook_sdpa_resets() -> None:
    from modules import devices

    current = getattr(devices, "set_sdpa_params", None)
    if hasattr(current, "rdna_original"):
        devices.set_sdpa_params = current.rdna_original
    rdna_flash_attn.disable_sdpa_patch()


def status_text(why: str | None) -> str:
    """The settings page's status: whether the kernels can run, and whether torch's SDPA is routed
    through them at this moment."""
    if why is not None or not toggles.unet:
        return availability.status_text(why)
    if rdna_flash_attn.sdpa_patch_enabled():
        return "kernels available; torch's scaled_dot_product_attention is routed through them"
    return ("kernels available, but another function has replaced torch's scaled_dot_product_attention "
            "since: restart SD.Next to route it through them again")


def setup() -> None:
    global _available
    from modules import script_callbacks, shared

    device = webui_device()
    why = availability.reason(device)
    availability.explain_once("SD.Next", device, why)
    _available = why is None
    options.subscribe(sync_patch)
    hook_sdpa_resets()
    sync_patch()
    script_callbacks.on_model_loaded(lambda sd_model: sync_patch())
    if hasattr(script_callbacks, "on_before_process"):  # before each job
        script_callbacks.on_before_process(lambda p: sync_patch())
    script_callbacks.on_ui_settings(lambda: options.register(shared, status_text(why)))
    script_callbacks.on_script_unloaded(unhook_sdpa_resets)
