"""Exact FlashAttention-2 for AMD RDNA3/RDNA4 GPUs, with PyTorch SDPA as the fallback for every call
the kernels do not support.

    import rdna_flash_attn as rfa
    out = rfa.scaled_dot_product_attention(q, k, v)     # drop-in for torch's SDPA
    with rfa.patch_sdpa(): ...                          # or: route torch's SDPA itself, process-wide
    print(rfa.explain(q, k, v), rfa.stats())            # why, and how often

Importing touches no GPU: devices are probed on their first attention call. Importing does not import
torch either when torch is not imported yet (`python -m rdna_flash_attn --help` then starts in a
fraction of a second): the names below then load, all at once, on the first use of any of them. Where
torch is already imported (every host: ComfyUI, the WebUIs, trainers, diffusers) they load at import,
so a broken install fails there, as it always did.

The package is built in layers, each a subpackage whose modules import only their own layer and
those below it (tests/test_layers.py checks it):

    tools         the CLI (doctor, selftest, bench, rebuild)
    integrations  the trainer launcher and .pth hook, the diffusers processor, flash-attn's API
    dispatch      per call: the kernels or SDPA, and why; the first-use self-test; the SDPA override
    ops           the kernels as torch ops: argument checks, launches, autograd and custom ops
    runtime       the code objects: kernel table, manifest, files, devices, loading and launching

config (settings, logger) and version sit below them all, environment (the one reader of the RDNA_FA_*
variables) below those; this module is the public API on top. The repository's lab (rdna_fa_lab: the
CPU interpreter of the code objects, the host harnesses, the static report and estimates) builds on
this package and is not installed with it.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from .config import Settings, settings
from .version import __version__

if TYPE_CHECKING:  # what _load_api binds, spelled out for type checkers and tests/import_graph.py
    from .dispatch.router import (attention_or_reason, explain, precision, reset_stats, scaled_dot_product_attention,
                                  stats)
    from .dispatch.sdpa_patch import disable_sdpa_patch, enable_sdpa_patch, patch_sdpa, sdpa_patch_enabled
    from .integrations.aten_attention import serve_aten_attention, stop_serving_aten_attention
    from .integrations.diffusers_attention import install_attention_processor, restore_attention_processors
    from .integrations.flash_attn_interface import flash_attn_func

# Public name -> the module that defines it (tests/test_api.py checks this against the block above).
_API = {
    "attention_or_reason": "dispatch.router",
    "explain": "dispatch.router",
    "precision": "dispatch.router",
    "reset_stats": "dispatch.router",
    "scaled_dot_product_attention": "dispatch.router",
    "stats": "dispatch.router",
    "disable_sdpa_patch": "dispatch.sdpa_patch",
    "enable_sdpa_patch": "dispatch.sdpa_patch",
    "patch_sdpa": "dispatch.sdpa_patch",
    "sdpa_patch_enabled": "dispatch.sdpa_patch",
    "serve_aten_attention": "integrations.aten_attention",
    "stop_serving_aten_attention": "integrations.aten_attention",
    "install_attention_processor": "integrations.diffusers_attention",
    "restore_attention_processors": "integrations.diffusers_attention",
    "flash_attn_func": "integrations.flash_attn_interface",
}
_SUBPACKAGES = ("dispatch", "integrations", "ops", "runtime", "tools")


def _load_api() -> None:
    """Binds every name of _API here (importing torch and the layers under them)."""
    for name, module in _API.items():
        globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)


def __getattr__(name: str):
    """The API's names, loaded on first use; a subpackage by its name, as after `import rdna_flash_attn.x`."""
    if name in _API:
        _load_api()
        return globals()[name]
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


if "torch" in sys.modules:
    _load_api()

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
    "serve_aten_attention",
    "scaled_dot_product_attention",
    "sdpa_patch_enabled",
    "settings",
    "stats",
    "stop_serving_aten_attention",
]
