"""The core package `rdna_flash_attn`, imported exactly once under its canonical name.

ComfyUI imports this repository's root `__init__.py` under a name of its own choosing: the folder
path (2024 and later) or the bare folder name (older loaders), which can be `rdna_flash_attn`
itself and then hides the core package of the same name. The core is therefore taken from
`sys.modules` when it is already there (a pip-installed copy another node imported, or ours), and
otherwise loaded from this repository's `rdna_flash_attn/` folder by path, never by a search of
`sys.path` that could find the repository root instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

CORE_NAME = "rdna_flash_attn"
CORE_FOLDER = Path(__file__).resolve().parent.parent / CORE_NAME

log = logging.getLogger(CORE_NAME)


def _is_core(module: ModuleType | None) -> bool:
    return module is not None and hasattr(module, "attention_or_reason") and hasattr(module, "settings")


def _load_from_folder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        CORE_NAME, CORE_FOLDER / "__init__.py", submodule_search_locations=[str(CORE_FOLDER)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[CORE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[CORE_NAME]
        raise
    # Submodules imported before (under a displaced package object) are reused, not executed again;
    # as attributes of this package object too, as `import rdna_flash_attn.x` would have made them.
    for name, submodule in list(sys.modules.items()):
        parent, _, child = name.rpartition(".")
        if parent == CORE_NAME and submodule is not None and not hasattr(module, child):
            setattr(module, child, submodule)
    return module


def load_core() -> ModuleType:
    """The canonical `rdna_flash_attn` module (raises what its import raises)."""
    current = sys.modules.get(CORE_NAME)
    if _is_core(current):
        return current
    # An old ComfyUI loader registered this repository's entry point under the core's name: the
    # loader keeps its own reference to that module, so the name can go to the core. Submodules
    # already imported (rdna_flash_attn.dispatch.router, ...) are reused, not executed again.
    displaced = sys.modules.pop(CORE_NAME, None)
    try:
        if (CORE_FOLDER / "__init__.py").is_file():
            return _load_from_folder()
        return importlib.import_module(CORE_NAME)
    except BaseException:
        if displaced is not None:
            sys.modules.setdefault(CORE_NAME, displaced)
        raise


@functools.cache
def core_or_reason() -> ModuleType | str:
    """load_core(), or why the core cannot be imported (logged once, as the nodes then pass through)."""
    try:
        return load_core()
    except Exception as exc:  # noqa: BLE001  (a broken install must cost the speed-up, never ComfyUI's start)
        reason = f"rdna_flash_attn cannot be imported ({type(exc).__name__}: {exc})"
        log.warning("%s; the RDNA Flash Attention nodes pass models through unchanged", reason)
        return reason
