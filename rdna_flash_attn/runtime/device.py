"""What a torch device is: ROCm, ZLUDA, NVIDIA CUDA or CPU, and for AMD its gfx target.

ZLUDA runs CUDA builds of PyTorch on AMD GPUs; it is recognised by the device name it reports
(" [ZLUDA]" suffix), never by compute capability or HIP_PATH, and its gfx target and HIP version come
from the HIP runtime ZLUDA loaded.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..config import LOGGER_NAME
from . import driver

log = logging.getLogger(LOGGER_NAME)

ZLUDA_SUFFIX = " [ZLUDA]"


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # "rocm" | "zluda" | "cuda" | "cpu" | "other"
    name: str
    index: int | None
    gfx_target: str | None  # e.g. "gfx1100"; None when not AMD or unknown
    runtime_version: str | None  # HIP or CUDA version string

    @property
    def is_amd(self) -> bool:
        return self.backend in ("rocm", "zluda")


def _gfx_from_arch_name(arch: str | None) -> str | None:
    match = re.match(r"gfx[0-9a-f]+", arch or "")
    return match.group() if match else None


def _describe_cuda_device(index: int) -> DeviceInfo:
    name = torch.cuda.get_device_name(index)
    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", None)
        return DeviceInfo("rocm", name, index, _gfx_from_arch_name(arch), str(torch.version.hip))
    if name.endswith(ZLUDA_SUFFIX):
        hip = _hip_or_none(zluda=True)
        target = _ask(hip, "device_arch", index) if hip else None
        version = _ask(hip, "runtime_version") if hip else None
        return DeviceInfo("zluda", name, index, target, version)
    return DeviceInfo("cuda", name, index, None, torch.version.cuda)


def _hip_or_none(zluda: bool):
    try:
        return driver.hip_driver(zluda)
    except driver.DriverError as error:
        log.warning("HIP runtime unusable: %s", error)
        return None


def _ask(hip, method: str, *args):
    try:
        return getattr(hip, method)(*args)
    except driver.DriverError as error:
        log.warning("HIP runtime query %s failed: %s", method, error)
        return None


@lru_cache(maxsize=None)
def _describe(device_type: str, index: int | None) -> DeviceInfo:
    if device_type == "cpu":
        return DeviceInfo("cpu", "cpu", None, None, None)
    if device_type != "cuda":
        return DeviceInfo("other", device_type, index, None, None)
    try:
        return _describe_cuda_device(index)
    except (RuntimeError, AssertionError) as error:  # a broken or missing driver must not escape
        log.warning("could not query cuda device %s: %s", index, error)
        return DeviceInfo("other", f"cuda:{index}", index, None, None)


def describe(device: torch.device | str) -> DeviceInfo:
    """Cached per device; never raises."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        try:
            index = torch.cuda.current_device()
        except (RuntimeError, AssertionError) as error:  # no usable GPU: describe it, do not raise
            log.debug("no current cuda device: %s", error)
            return DeviceInfo("other", "cuda", None, None, None)
    return _describe(device.type, index)


def device_guard(device: torch.device):
    """Makes `device` current for a launch, and costs nothing when it already is (the usual case)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
