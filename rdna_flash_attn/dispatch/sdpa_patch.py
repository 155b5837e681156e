"""Process-wide override of `torch.nn.functional.scaled_dot_product_attention` with the dispatcher.

Reaches code that looks the function up at call time (SD.Next, kohya sd-scripts `--sdpa`, diffusers'
AttnProcessor2_0); code that bound the name at import keeps torch's own. Calls the kernels do not take
go to the function that was replaced, so a host's own SDPA wrapper keeps serving them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch.nn.functional as F

from ..config import LOGGER_NAME
from . import router

log = logging.getLogger(LOGGER_NAME)

_replaced = None  # the exact object we replaced, while the patch is on


def sdpa_patch_enabled() -> bool:
    return _replaced is not None


def enable_sdpa_patch() -> None:
    """Point torch's SDPA at the dispatcher; a no-op when already on."""
    global _replaced
    if _replaced is None:
        _replaced = F.scaled_dot_product_attention
        router.use_fallback(_replaced)
        F.scaled_dot_product_attention = router.scaled_dot_product_attention


def disable_sdpa_patch() -> None:
    """Put back the exact object enable_sdpa_patch() replaced; a no-op when off."""
    global _replaced
    if _replaced is None:
        return
    if F.scaled_dot_product_attention is router.scaled_dot_product_attention:
        F.scaled_dot_product_attention = _replaced
    else:
        # Someone wrapped or replaced it after us: restoring would silently drop their patch.
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
