"""Exact FlashAttention-2 for AMD RDNA3/RDNA4 GPUs, with PyTorch SDPA as the fallback for every call
the kernels do not support.

    import rdna_flash_attn as rfa
    out = rfa.scaled_dot_product_attention(q, k, v)     # drop-in for torch's SDPA
    with rfa.patch_sdpa(): ...                          # or: route torch's SDPA itself, process-wide
    print(rfa.explain(q, k, v), rfa.stats())            # why, and how often

Importing touches no GPU: devices are probed on their first attention call.

The package is built in layers, each a subpackage whose modules import only their own layer and
those below it (tests/test_layers.py checks it):

    tools         the CLI (doctor, selftest, bench, rebuild, report)
    integrations  the trainer launcher and .pth hook, the diffusers processor, flash-attn's API
    dispatch      per call: the kernels or SDPA, and why; the first-use self-test; the SDPA override
    ops           the kernels as torch ops: argument checks, launches, autograd and custom ops
    runtime       the code objects: kernel table, manifest, files, devices, loading and launching
    interpreter   the shipped code objects run on the CPU, instruction by instruction (beside ops)

config (settings, logger) and version sit below them all, environment (the one reader of the RDNA_FA_*
variables) below those; this module is the public API on top.
"""

from .config import Settings, settings
from .dispatch.router import attention_or_reason, explain, precision, reset_stats, scaled_dot_product_attention, stats
from .dispatch.sdpa_patch import disable_sdpa_patch, enable_sdpa_patch, patch_sdpa, sdpa_patch_enabled
from .integrations.diffusers_attention import install_attention_processor, restore_attention_processors
from .integrations.flash_attn_interface import flash_attn_func
from .version import __version__

__all__ = [
    "Settings",
    "__version__",
    "attention_or_reason",
    "disable_sdpa_patch",
    "enable_sdpa_patch",
    "explain",
    "flash_attn_func",
    "install_attention_processor",
    "patch_sdpa",
    "precision",
    "reset_stats",
    "restore_attention_processors",
    "scaled_dot_product_attention",
    "sdpa_patch_enabled",
    "settings",
    "stats",
]
