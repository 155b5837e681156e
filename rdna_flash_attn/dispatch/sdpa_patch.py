"""Process-wide override of `torch.nn.functional.scaled_dot_product_attention` with the dispatcher.

Reaches code that looks the function up at call time (SD.Next, kohya sd-scripts `--sdpa`, diffusers'
AttnProcessor2_0); code that bound the name at import keeps torch's own. Calls the kernels do not take
go to the function that was replaced, so a host's own SDPA wrapper keeps serving them. A host that puts
its own function back (SD.Next does at every model load) is answered by enabling the patch again: it
then wraps the host's new function.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch.nn.functional as F

from ..config import LOGGER_NAME
from . import router

log = logging.getLogger(LOGGER_NAME)

_replaced = None  # the exact object we last replaced, until disable_sdpa_patch()
_MAX_WRAPPER_DEPTH = 32


def sdpa_patch_enabled() -> bool:
    """Whether torch's SDPA is the dispatcher now (a host may have put its own function back since)."""
    return F.scaled_dot_product_attention is router.scaled_dot_product_attention


def _reaches(function, target) -> bool:
    """Whether `function` is `target` or wraps it (functools.wraps' __wrapped__ chain)."""
    for _ in range(_MAX_WRAPPER_DEPTH):
        if function is target:
            return True
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return False
    return False


def enable_sdpa_patch() -> None:
    """Point torch's SDPA at the dispatcher, whose fallback is the function found there; a no-op when
    it is the dispatcher already."""
    global _replaced
    current = F.scaled_dot_product_attention
    if current is router.scaled_dot_product_attention:
        return
    _replaced = current
    # A host wrapper that itself falls back to the dispatcher (it wrapped our patch) would loop.
    router.use_fallback(None if _reaches(current, router.scaled_dot_product_attention) else current)
    F.scaled_dot_product_attention = router.scaled_dot_product_attention


def disable_sdpa_patch() -> None:
    """Put back the exact object enable_sdpa_patch() replaced; a no-op when off. Where a host has put
    another function in place since, that one stays."""
    global _replaced
    if _replaced is None:
        return
    if F.scaled_dot_product_attention is router.scaled_dot_product_attention:
        F.scaled_dot_product_attention = _replaced
    else:
        # Someone wrapped or replaced it after us: restoring would silently drop their function.
        log.warning("torch.nn.functional.scaled_dot_product_attention was replaced after patch_sdpa(); leaving it")
    router.use_fallback(None)
    _replaced = None


@contextlib.contextmanager
def patch_sdpa() -> Iterator[None]:
    """`with patch_sdpa():` the patch is on inside; leaving restores the state found on entry,
    so nested uses and an explicit enable_sdpa_patch() outside are kept."""
    was_enabled = sdpa_patch_enabled()
    enable_sdpa_patch()
    try:
        yield
    finally:
        if not was_enabled:
            disable_sdpa_patch()
