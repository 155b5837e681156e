"""ComfyUI nodes of rdna_flash_attn: per-model and per-VAE attention routing, and the global switch."""

from .core import core_or_reason
from .definitions import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from .global_switch import (
    disable_global,
    enable_from_environment,
    enable_global,
    global_enabled,
)

core_or_reason()  # import the core now, while ComfyUI starts: a broken install is reported there, once
enable_from_environment()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "disable_global", "enable_global", "global_enabled"]
