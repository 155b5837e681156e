"""The RDNA_FA_* environment variables, all read one way: surrounding spaces ignored, empty as unset,
and a value that is not understood logged once (per variable and value) with the value used instead.

Standard library only, and nothing runs at import: the .pth hook (integrations/autoload.py) loads
this file by its path at interpreter start, without the package (whose `__init__` imports torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

LOGGER_NAME = "rdna_flash_attn"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

log = logging.getLogger(LOGGER_NAME)
_warned: set[tuple[str, str]] = set()


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected 1 or 0 ({'/'.join(TRUE_WORDS[1:])} or {'/'.join(FALSE_WORDS[1:])})")


def read(environ: Mapping[str, str], variable: str, parse: Callable[[str], object], default: object) -> object:
    """`parse` of the variable's value, or `default` when it is unset or empty, or when `parse` raises
    ValueError: that is logged, once per variable and value, naming the value used instead."""
    text = environ.get(variable, "").strip()
    if not text:
        return default
    try:
        return parse(text)
    except ValueError as error:
        if (variable, text) not in _warned:
            _warned.add((variable, text))
            spelled = ("1" if default else "0") if isinstance(default, bool) else default
            instead = "leaving it unset" if default is None else f"using {spelled} instead"
            log.warning("ignoring %s=%r: %s; %s", variable, text, error, instead)
        return default


def read_bool(environ: Mapping[str, str], variable: str, default: bool = False) -> bool:
    return read(environ, variable, parse_bool, default)
