"""Exact FlashAttention-2 for AMD RDNA3/RDNA4 GPUs, with PyTorch SDPA as the fallback for every call
the kernels do not support.

    import rdna_flash_attn as rfa
    out = rfa.scaled_dot_product_attention(q, k, v)     # drop-in for torch's SDPA
    with rfa.patch_sdpa(): ...                          # or: route torch's SDPA itself, process-wide
    print(rfa.explain(q, k, v), rfa.stats())            # why, and how often

Importing touches no GPU: devices are probed on their first attention call.
"""

__version__ = "0.1.0"

from .config import Settings, settings
from .dispatch import attention_or_reason, explain, reset_stats, scaled_dot_product_attention, stats
from .flash_attn_interface import flash_attn_func
from .sdpa_patch import disable_sdpa_patch, enable_sdpa_patch, patch_sdpa, sdpa_patch_enabled

__all__ = [
    "Settings",
    "__version__",
    "attention_or_reason",
    "disable_sdpa_patch",
    "enable_sdpa_patch",
    "explain",
    "flash_attn_func",
    "patch_sdpa",
    "reset_stats",
    "scaled_dot_product_attention",
    "sdpa_patch_enabled",
    "settings",
    "stats",
]
