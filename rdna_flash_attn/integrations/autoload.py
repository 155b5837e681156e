"""Opt-in SDPA override for any Python program: what the `rdna_flash_attn_autoload.pth` hook calls.

The hook (run by `site` at every interpreter start) calls install(): it waits for the program's own
`import torch` and, if RDNA_FA_PATCH_SDPA=1 is in the environment at that moment, routes
`torch.nn.functional.scaled_dot_product_attention` through the dispatcher right after torch has
finished importing. The variable is read then, not at start, so a program that sets it before its
`import torch` (ai-toolkit loads its .env file first) gets the override too. Nothing is imported
early, so the program's import order (ZLUDA set-up, environment tweaks before `import torch`) stays its
own; a Python program that never imports torch pays the reading of this file and one finder on
sys.meta_path that answers every import with a name comparison.

RDNA_FA_ATEN_OPS=1, read at the same moment, has the kernels serve torch's flash attention aten ops as
well (integrations/aten_attention.py).

With RDNA_FA_FLASH_ATTN=1 at interpreter start, install() also puts rdna_flash_attn's stand-in for
Dao-AILab's flash-attn (the flash_attn_shim folder beside this file: flash-attn 2.8.3's Python API on
the dispatcher) first on sys.path, so that `import flash_attn` finds it, unless a real flash-attn is
importable: that one is always used instead.

Interpreter start must never fail because of this: every error is logged once and swallowed. The
hook loads this file by its path, without importing the package (whose `__init__` imports torch), so
nothing here may import torch or the package at module level; the variables are read by the package's
environment.py, loaded by its path too (standard library only).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

if __package__:  # imported as rdna_flash_attn.integrations.autoload
    from .. import environment
else:  # loaded by its path from the .pth hook
    _ENVIRONMENT_SPEC = importlib.util.spec_from_file_location(
        "rdna_flash_attn_environment",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "environment.py"))
    environment = importlib.util.module_from_spec(_ENVIRONMENT_SPEC)
    _ENVIRONMENT_SPEC.loader.exec_module(environment)

ENV_VAR = "RDNA_FA_PATCH_SDPA"
FLASH_ATTN_ENV_VAR = "RDNA_FA_FLASH_ATTN"
ATEN_OPS_ENV_VAR = "RDNA_FA_ATEN_OPS"
# The folder that goes on sys.path: it holds the `flash_attn` package and its 2.8.3 metadata.
FLASH_ATTN_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flash_attn_shim")

log = logging.getLogger(environment.LOGGER_NAME)


def requested(environ=None) -> bool:
    """Whether the environment asks for the override (RDNA_FA_PATCH_SDPA=1)."""
    return environment.read_bool(os.environ if environ is None else environ, ENV_VAR)


def flash_attn_requested(environ=None) -> bool:
    """Whether the environment asks for the flash-attn stand-in (RDNA_FA_FLASH_ATTN=1)."""
    return environment.read_bool(os.environ if environ is None else environ, FLASH_ATTN_ENV_VAR)


def aten_ops_requested(environ=None) -> bool:
    """Whether the environment asks for torch's flash attention ops on the kernels (RDNA_FA_ATEN_OPS=1)."""
    return environment.read_bool(os.environ if environ is None else environ, ATEN_OPS_ENV_VAR)


def _same_folder(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def real_flash_attn() -> str | None:
    """Where `import flash_attn` finds a flash-attn other than the stand-in, or None."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [os.path.dirname(spec.origin or "")])
    if folders and all(_same_folder(os.path.dirname(folder), FLASH_ATTN_SHIM_DIR) for folder in folders):
        return None
    return spec.origin or folders[0]


def provide_flash_attn(environ=None, position: int = 0) -> str | None:
    """When RDNA_FA_FLASH_ATTN asks for it, put the stand-in's folder on sys.path at `position` (at
    interpreter start 0, before which Python then puts the program's own folder), unless a real
    flash-attn is importable: then that one stays, and where it lies is returned. Never raises."""
    if not flash_attn_requested(environ):
        return None
    try:
        real = real_flash_attn()
        if real is not None:
            log.info("%s is set, but flash-attn is installed (%s): it is used, not rdna_flash_attn's stand-in",
                     FLASH_ATTN_ENV_VAR, real)
            return real
        if not any(_same_folder(entry or os.curdir, FLASH_ATTN_SHIM_DIR) for entry in sys.path):
            sys.path.insert(position, FLASH_ATTN_SHIM_DIR)
    except Exception as exc:  # never into interpreter start
        log.warning("%s is set but the flash-attn stand-in could not be put on sys.path: %s: %s",
                    FLASH_ATTN_ENV_VAR, type(exc).__name__, exc)
    return None


def _enable_now() -> None:
    try:
        from rdna_flash_attn.dispatch import sdpa_patch

        sdpa_patch.enable_sdpa_patch()
    except Exception as exc:  # never into the host's `import torch`
        log.warning("%s is set but the SDPA override could not be installed: %s: %s", ENV_VAR, type(exc).__name__, exc)


def _serve_aten_now() -> None:
    try:
        from rdna_flash_attn.integrations import aten_attention

        aten_attention.serve_if_requested()
    except Exception as exc:  # never into the host's `import torch`
        log.warning("%s is set but torch's flash attention ops could not be served: %s: %s", ATEN_OPS_ENV_VAR,
                    type(exc).__name__, exc)


def _after_torch() -> None:
    """What the environment asks for once torch is imported."""
    if requested():
        _enable_now()
    if aten_ops_requested():
        _serve_aten_now()


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is about to be imported, wraps the real loader so that the
    override is installed as soon as torch's own module code has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot, and the lookup below must not find us again
        if not (requested() or aten_ops_requested()):
            return None
        try:
            spec = importlib.util.find_spec("torch")
        except Exception as exc:
            log.warning("%s: could not look up torch: %s: %s", ENV_VAR, type(exc).__name__, exc)
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec_module = spec.loader.exec_module

        def exec_module(module):
            real_exec_module(module)
            _after_torch()

        try:
            spec.loader.exec_module = exec_module  # this spec's loader only: a fresh object per lookup
        except Exception as exc:
            log.warning("%s: could not hook torch's import: %s: %s", ENV_VAR, type(exc).__name__, exc)
        return spec


def install() -> None:
    """Put the flash-attn stand-in on sys.path if RDNA_FA_FLASH_ATTN asks for it; install the override
    (RDNA_FA_PATCH_SDPA) and serve torch's flash attention ops (RDNA_FA_ATEN_OPS) now if torch is already
    imported and the environment asks for them, else decide right after torch's import. Never raises."""
    provide_flash_attn()
    try:
        if "torch" in sys.modules:
            _after_torch()
        elif not any(type(finder).__name__ == _AfterTorchImport.__name__ for finder in sys.meta_path):
            # By name, not isinstance: the hook's copy of this module and the package's are two modules.
            sys.meta_path.insert(0, _AfterTorchImport())
    except Exception as exc:
        log.warning("%s is set but the hook failed: %s: %s", ENV_VAR, type(exc).__name__, exc)
