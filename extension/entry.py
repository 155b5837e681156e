"""The extension's start: find the WebUI, apply the saved settings, hand over to its adapter.

Runs each time the WebUI loads the extension's scripts (start, and "Reload UI", which drops every
callback first), so each run registers its callbacks again; the console line stays once per process.
"""

from __future__ import annotations

import importlib
import logging

from . import host, options
from .availability import PREFIX

log = logging.getLogger("rdna_flash_attn")

_said_no_host = False


def setup() -> str | None:
    """Set the extension up for the running WebUI; returns its adapter's name ("a1111", "forge", "reforge",
    "sdnext"), or None where there is none. Never raises."""
    global _said_no_host
    try:
        name = host.detect()
        if name is None:
            if not _said_no_host:
                _said_no_host = True
                log.warning("%s: no supported WebUI found (%s); not active", PREFIX, host.SUPPORTED)
            return None
        from modules import shared

        options.sync_from(shared.opts)
        importlib.import_module(f"{__package__}.{name}").setup()
        return name
    except Exception as error:  # the WebUI must start whatever goes wrong here
        log.warning("%s: not active, setup failed (%s: %s)", PREFIX, type(error).__name__, error)
        return None
