"""Whether the kernels can run on the WebUI's device, and the one console line that says so.

Everything the answer rests on is checked without launching anything: the manifest and code object
(sha256), the device's policy verdict and its kernel library. Any failure is a reason, never an
exception: a broken install must cost the speed-up, not the WebUI's start.
"""

from __future__ import annotations

import logging

import torch

from rdna_flash_attn import settings
from rdna_flash_attn.config import LOGGER_NAME
from rdna_flash_attn.dispatch import router
from rdna_flash_attn.runtime import artifacts, device as devices

log = logging.getLogger(LOGGER_NAME)
PREFIX = "RDNA Flash Attention"

_explained: set[str] = set()


def reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device`, or None when they can."""
    if settings.disable:
        return "disabled (RDNA_FA_DISABLE=1)"
    try:
        artifacts.load_manifest()
        refusal = router.device_refusal(device)
        if refusal:
            return refusal
        info = devices.describe(device)
        if info.is_amd and info.gfx_target:
            for artifact in artifacts.amd_artifacts(info.gfx_target):  # v5, and v4 where it ships
                artifact.read_verified()
    except artifacts.ArtifactError as error:
        return str(error)
    except Exception as error:  # an unforeseen failure still only switches the extension off
        return f"could not check the GPU ({type(error).__name__}: {error})"
    return None


def say_once(line: str, level: int) -> None:
    """`line` on the console at `level`, the first time it is said in this process."""
    if line not in _explained:
        _explained.add(line)
        log.log(level, "%s", line)


def explain_once(host: str, device: torch.device, why: str | None) -> None:
    """One console line per distinct status: a warning when off (users need to see why), INFO when on."""
    line = f"{PREFIX} ({host}): " + (f"not active: {why}" if why else f"ready on {device}")
    say_once(line, logging.WARNING if why else logging.INFO)


def status_text(why: str | None) -> str:
    """Short status for the Settings section."""
    return f"not active: {why}" if why else "kernels available"
