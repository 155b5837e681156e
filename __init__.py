"""ComfyUI entry point of rdna_flash_attn: the nodes in `nodes/`.

Importing never raises into ComfyUI: whatever fails leaves no nodes and one log line, and the
nodes themselves pass models through unchanged (with the reason logged) when the kernels cannot
run. The core package is imported under its own name `rdna_flash_attn` (see nodes/core.py).
"""

import logging

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except Exception:  # a broken install must not stop ComfyUI
    logging.getLogger("rdna_flash_attn").exception("the RDNA Flash Attention nodes could not be loaded")
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
