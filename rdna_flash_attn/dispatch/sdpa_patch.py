"""Process-wide override of `torch.nn.functional.scaled_dot_product_attention` with the dispatcher.

Reaches code that looks the function up at call time (SD.Next, kohya sd-scripts `--sdpa`, diffusers'
AttnProcessor2_0); code that bound the name at import keeps torch's own. Calls the kernels do not take
go to the function that was replaced, so a host's own SDPA wrapper keeps serving them. A host that puts
its own function back (SD.Next does at every model load) is answered by enabling the patch again: it
then wraps the host's new function.

The patch is on while anyone wants it: an explicit enable_sdpa_patch() (until disable_sdpa_patch()) or
any open `patch_sdpa()` scope, counted across threads, so scopes that close out of order (two threads
running diffusers layers) never switch it off under each other.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch.nn.functional as F

from ..config import LOGGER_NAME
from . import router
from .state import state

log = logging.getLogger(LOGGER_NAME)

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


def _install() -> None:
    current = F.scaled_dot_product_attention
    if current is router.scaled_dot_product_attention:
        return
    state.patch.replaced = current
    # A host wrapper that itself falls back to the dispatcher (it wrapped our patch) would loop.
    router.use_fallback(None if _reaches(current, router.scaled_dot_product_attention) else current)
    F.scaled_dot_product_attention = router.scaled_dot_product_attention


def _uninstall() -> None:
    patch = state.patch
    if patch.replaced is None:
        return
    if F.scaled_dot_product_attention is router.scaled_dot_product_attention:
        F.scaled_dot_product_attention = patch.replaced
    else:
        # Someone wrapped or replaced it after us: restoring would silently drop their function.
        log.warning("torch.nn.functional.scaled_dot_product_attention was replaced after patch_sdpa(); leaving it")
    router.use_fallback(None)
    patch.replaced = None


def enable_sdpa_patch() -> None:
    """Point torch's SDPA at the dispatcher, whose fallback is the function found there, until
    disable_sdpa_patch(); a no-op when it is the dispatcher already."""
    with state.patch.lock:
        state.patch.enabled_explicitly = True
        _install()


def disable_sdpa_patch() -> None:
    """Put back the exact object the patch replaced; a no-op when off. Where a host has put another
    function in place since, that one stays. Switches the patch off inside open patch_sdpa() scopes too."""
    with state.patch.lock:
        state.patch.enabled_explicitly = False
        _uninstall()


@contextlib.contextmanager
def patch_sdpa() -> Iterator[None]:
    """`with patch_sdpa():` the patch is on inside; it goes off when the last open scope closes,
    unless enable_sdpa_patch() asked for it to stay."""
    patch = state.patch
    with patch.lock:
        patch.open_scopes += 1
        _install()
    try:
        yield
    finally:
        with patch.lock:
            patch.open_scopes -= 1
            if patch.open_scopes == 0 and not patch.enabled_explicitly:
                _uninstall()
