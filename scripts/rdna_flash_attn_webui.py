"""SD-WebUI entry point (A1111, Forge, reForge, Forge Classic and SD.Next load every scripts/*.py of an
extension).

Loads this repository's `rdna_flash_attn` and `extension/` packages from their folders without
putting the repository root on sys.path (its top-level names would shadow the WebUI's), then hands
over to `extension.entry.setup()`. Never raises into the WebUI.
"""

import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (("rdna_flash_attn", "rdna_flash_attn"), ("rdna_flash_attn_extension", "extension"))


def _load(name: str, folder: str):
    """The package `name` from ROOT/folder, or the one already loaded under that name."""
    if name in sys.modules:
        return sys.modules[name]
    directory = ROOT / folder
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


try:
    for _name, _folder in PACKAGES:
        _load(_name, _folder)
    importlib.import_module("rdna_flash_attn_extension.entry").setup()
except Exception as _error:  # e.g. an incomplete download: the WebUI starts without the extension
    logging.getLogger("rdna_flash_attn").warning(
        "RDNA Flash Attention: not loaded (%s: %s)", type(_error).__name__, _error
    )
