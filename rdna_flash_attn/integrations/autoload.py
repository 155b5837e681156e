"""Opt-in SDPA override for any Python program: what the `rdna_flash_attn_autoload.pth` hook calls.

The hook (run by `site` at every interpreter start) calls install(): it waits for the program's own
`import torch` and, if RDNA_FA_PATCH_SDPA=1 is in the environment at that moment, routes
`torch.nn.functional.scaled_dot_product_attention` through the dispatcher right after torch has
finished importing. The variable is read then, not at start, so a program that sets it before its
`import torch` (ai-toolkit loads its .env file first) gets the override too. Nothing is imported
early, so the program's import order (ZLUDA set-up, environment tweaks before `import torch`) stays its
own; a Python program that never imports torch pays the reading of this file and one finder on
sys.meta_path that answers every import with a name comparison.

Interpreter start must never fail because of this: every error is logged once and swallowed. The
hook loads this file by its path, without importing the package (whose `__init__` imports torch), so
nothing here may import torch or the package at module level.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

ENV_VAR = "RDNA_FA_PATCH_SDPA"
LOGGER_NAME = "rdna_flash_attn"  # the same as config.LOGGER_NAME; config imports torch, this must not

log = logging.getLogger(LOGGER_NAME)

_TRUE_WORDS = ("1", "true", "yes", "on")


def requested(environ=None) -> bool:
    """Whether the environment asks for the override (RDNA_FA_PATCH_SDPA=1/true/yes/on)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_VAR, "").strip().lower() in _TRUE_WORDS


def _enable_now() -> None:
    try:
        from rdna_flash_attn.dispatch import sdpa_patch

        sdpa_patch.enable_sdpa_patch()
    except Exception as exc:  # never into the host's `import torch`
        log.warning("%s is set but the SDPA override could not be installed: %s: %s", ENV_VAR, type(exc).__name__, exc)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is about to be imported, wraps the real loader so that the
    override is installed as soon as torch's own module code has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot, and the lookup below must not find us again
        if not requested():
            return None
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        except Exception as exc:
            log.warning("%s: could not look up torch: %s: %s", ENV_VAR, type(exc).__name__, exc)
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec_module = spec.loader.exec_module

        def exec_module(module):
            real_exec_module(module)
            _enable_now()

        try:
            spec.loader.exec_module = exec_module  # this spec's loader only: a fresh object per lookup
        except Exception as exc:
            log.warning("%s: could not hook torch's import: %s: %s", ENV_VAR, type(exc).__name__, exc)
        return spec


def install() -> None:
    """Install the override now if torch is already imported and RDNA_FA_PATCH_SDPA asks for it, else
    decide right after torch's import. Never raises."""
    try:
        if "torch" in sys.modules:
            if requested():
                _enable_now()
        elif not any(type(finder).__name__ == _AfterTorchImport.__name__ for finder in sys.meta_path):
            # By name, not isinstance: the hook's copy of this module and the package's are two modules.
            sys.meta_path.insert(0, _AfterTorchImport())
    except Exception as exc:
        log.warning("%s is set but the hook failed: %s: %s", ENV_VAR, type(exc).__name__, exc)
