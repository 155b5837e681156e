"""Which WebUI imported the extension: "forge", "reforge" (reForge and Forge Classic), "sdnext", "a1111",
or None."""

from __future__ import annotations

import importlib
import importlib.util
import sys

SUPPORTED = "A1111, Forge, reForge, Forge Classic or SD.Next"  # what the console names when none is found


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect() -> str | None:
    if _importable("modules_forge") and _importable("backend.attention"):
        return "forge"
    if _importable("ldm_patched.ldm.modules.attention"):  # reForge, Forge Classic
        return "reforge"
    shared = sys.modules.get("modules.shared")
    if shared is not None and "vladmandic" in str(getattr(shared, "url", "")):
        return "sdnext"
    if _importable("modules.sd_hijack_optimizations"):
        optimizations = importlib.import_module("modules.sd_hijack_optimizations")
        if hasattr(optimizations, "SdOptimization"):
            return "a1111"
    return None
