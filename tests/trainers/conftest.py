"""Fixtures of the trainer tests: child processes that see this checkout and none of the caller's
rdna_flash_attn settings, and the folder of the training scripts they run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _import_hf_libraries_without_torchvision_stand_ins() -> None:
    """tests/comfyui stands in for torchvision (not installed here) with bare modules that importlib
    reports as installed. diffusers and transformers record at import whether torchvision is there;
    imported while the stand-ins are visible, they would use it and fail. Import them once with the
    stand-ins hidden, so they record it as absent, as it is."""
    stand_ins = {name: module for name, module in sys.modules.items()
                 if name.split(".")[0] == "torchvision" and getattr(module, "__file__", None) is None}
    for name in stand_ins:
        del sys.modules[name]
    try:
        import diffusers.utils.import_utils  # noqa: F401
        import transformers.utils.import_utils  # noqa: F401
    finally:
        sys.modules.update(stand_ins)


_import_hf_libraries_without_torchvision_stand_ins()


@pytest.fixture
def child_env(tmp_path) -> dict[str, str]:
    """Environment for a child Python: this checkout importable, no RDNA_FA_* variables except a
    private self-test cache, one thread per op (CI has 2 cores)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDNA_FA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["RDNA_FA_CACHE_DIR"] = str(tmp_path / "child_cache")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_child(command: list[str], env: dict[str, str], cwd: Path = REPO_ROOT, timeout: float = 300):
    """Run `command` (from the repository root unless told); the CompletedProcess, text output captured."""
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
