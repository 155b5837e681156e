"""Our own code in a routed attention call must never fail the WebUI's generation: a failure in it
is logged once (per place and error type) and the call runs on the host's fallback instead."""

from __future__ import annotations

import logging

from rdna_flash_attn.config import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

_reported: set[tuple[str, str]] = set()


def report_failure(where: str, error: Exception) -> None:
    """Log `error` raised while trying the kernels in `where`, once per (where, error type)."""
    key = (where, type(error).__name__)
    if key in _reported:
        return
    _reported.add(key)
    log.warning(
        "RDNA Flash Attention: %s failed (%s: %s); running the fallback", where, key[1], error, exc_info=error
    )
