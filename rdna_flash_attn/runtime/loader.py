"""Loads the right code object for a device once and launches its kernels on torch's current stream."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from typing import Callable

import torch

from .. import environment
from ..config import LOGGER_NAME
from . import artifacts, device as devices, driver
from .build_facts import CODE_OBJECT_VERSION, LEGACY_CODE_OBJECT_VERSION

log = logging.getLogger(LOGGER_NAME)


class KernelUnavailable(RuntimeError):
    """The kernels cannot run on this device; the message says why."""


DEFAULT_EMULATED_LAYER = "gfx11"
# HIP 6.0 is the first release whose compiler emits code object v5 by default; older runtimes get v4
# first (what they emit themselves), and v5 only if v4 is refused. See docs/hip_runtimes.md.
FIRST_HIP_PREFERRING_V5 = (6, 0)
# The first HIP release whose runtime knows a target (ROCm/clr rocclr/device/device.cpp's ISA table):
# an older runtime refuses its code objects whatever their version. gfx1152 came after rocm-6.2.2.
FIRST_HIP_KNOWING_TARGET = {"gfx1150": (6, 0), "gfx1151": (6, 0), "gfx1152": (6, 3), "gfx1200": (6, 2),
                            "gfx1201": (6, 2)}


def hip_version_tuple(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a HIP runtime version string such as "6.2.41512", None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def code_object_preference(runtime_version: str | None) -> tuple[int, ...]:
    """The code object versions to try on a HIP runtime, first choice first."""
    version = hip_version_tuple(runtime_version)
    if version is not None and version < FIRST_HIP_PREFERRING_V5:
        return (LEGACY_CODE_OBJECT_VERSION, CODE_OBJECT_VERSION)
    return (CODE_OBJECT_VERSION, LEGACY_CODE_OBJECT_VERSION)


def _layer_name(text: str) -> str:
    layer = text.lower()
    if layer not in artifacts.EMULATED_LAYERS:
        raise ValueError(f"expected {' or '.join(artifacts.EMULATED_LAYERS)}")
    return layer


def emulated_layer() -> str:
    """Which AMD layer an NVIDIA device emulates (RDNA_FA_EMULATE=gfx11|gfx12)."""
    return environment.read(os.environ, "RDNA_FA_EMULATE", _layer_name, DEFAULT_EMULATED_LAYER)


class KernelLibrary:
    """One loaded code object on one device, with that device's description (what the self-test's
    verdict is keyed on)."""

    def __init__(self, gpu_driver, artifact: artifacts.Artifact, device_info: devices.DeviceInfo,
                 runtime_version: str | None = None):
        self.driver = gpu_driver
        self.artifact = artifact
        self.device_info = device_info
        self.runtime_version = runtime_version  # the HIP runtime's, for doctor; None for the emulation
        self._module = gpu_driver.load_module(artifact.read_verified(), device_info.index)
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()

    def _dynamic_lds(self, variant) -> int:
        """The emulation's LDS is dynamic; on AMD it is static and a launch adds none."""
        return variant.lds_bytes(self.artifact.target) if self.artifact.emulated else 0

    def function(self, variant) -> object:
        function = self._functions.get(variant.symbol)
        if function is None:
            with self._lock:
                function = self.driver.get_function(self._module, variant.symbol, self._dynamic_lds(variant))
                self._functions[variant.symbol] = function
        return function

    def launch(self, variant, grid: tuple[int, int, int], args, buffers: tuple[torch.Tensor, ...]) -> None:
        """Runs `variant` on the current stream of the buffers' device; `buffers` are the tensors the
        argument block points into (an interpreted library checks every access against them)."""
        self.launcher(variant, grid, buffers[0].device)(args, buffers)

    def launcher(self, variant, grid: tuple[int, int, int], device: torch.device):
        """launch(args, buffers): `variant` over `grid` on the current stream of `device`, with the
        kernel, block and stream lookup resolved once, for a caller that launches the same grid often."""
        function = self.function(variant)
        block, lds, index, gpu_driver = (variant.threads, 1, 1), self._dynamic_lds(variant), device.index, self.driver

        def launch(args, buffers: tuple[torch.Tensor, ...]) -> None:
            params = _OneParam(ctypes.addressof(args))
            if index == current_device():
                gpu_driver.launch(function, grid, block, lds, gpu_driver.native_stream(current_stream(index)), params)
                return
            with torch.cuda.device(index):
                gpu_driver.launch(function, grid, block, lds, gpu_driver.native_stream(current_stream(index)), params)

        return launch


def _current_stream_object_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# torch's raw handle of a device's current stream (what its own compiled code asks for), without
# building a Stream object per call; builds that lack the binding take the Stream's handle.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream_object_handle)
# The current device without torch.cuda's lazy-initialisation check: a library exists only on an
# initialised device.
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_OneParam = ctypes.c_void_p * 1  # the kernels take one argument: a pointer to their argument block


_libraries: dict[tuple, KernelLibrary] = {}
_failures: dict[tuple, str] = {}
_lock = threading.Lock()
_forget_listeners: list[Callable[[], None]] = []


def on_forget(listener: Callable[[], None]) -> None:
    """Call `listener` whenever forget_libraries() drops the loaded libraries: the hook through which
    the layers above drop what they decided on them (the dispatcher's verdicts and routes)."""
    _forget_listeners.append(listener)


def forget_libraries() -> None:
    """Drop every loaded library and remembered failure, so the next launch loads the code object
    again (after a local rebuild put a new one in place), and tell the on_forget listeners."""
    with _lock:
        _libraries.clear()
        _failures.clear()
    for listener in _forget_listeners:
        listener()


def _open_amd_library(hip, info: devices.DeviceInfo) -> KernelLibrary:
    """Load the target's code object the HIP runtime prefers; a refused one is logged and the next
    version tried. A sha256 mismatch is not a refusal: it is raised at once."""
    try:
        runtime_version = hip.runtime_version()
    except driver.DriverError as error:
        log.warning("could not read the HIP runtime version (%s): trying code object v%d first", error,
                    CODE_OBJECT_VERSION)
        runtime_version = None
    preference = code_object_preference(runtime_version)
    target = info.gfx_target
    candidates = sorted(artifacts.amd_artifacts(target), key=lambda a: preference.index(a.code_object_version))
    refusals = []
    for artifact in candidates:
        try:
            return KernelLibrary(hip, artifact, info, runtime_version)
        except driver.DriverError as error:
            refusals.append(f"v{artifact.code_object_version} ({artifact.path.name}): {error}")
            if artifact is not candidates[-1]:
                log.info("HIP runtime %s refused code object v%d for %s (%s); trying the next version",
                         runtime_version or "(version unknown)", artifact.code_object_version, target, error)
    raise KernelUnavailable(_refusal_reason(target, runtime_version, refusals))


def _refusal_reason(target: str, runtime_version: str | None, refusals: list[str]) -> str:
    reason = f"the HIP runtime {runtime_version or '(version unknown)'} refused the code objects for {target}: "
    reason += "; ".join(refusals)
    needed, found = FIRST_HIP_KNOWING_TARGET.get(target), hip_version_tuple(runtime_version)
    if needed and found and found < needed:
        reason += f" (HIP {needed[0]}.{needed[1]} is the first runtime that knows {target}: update the HIP SDK/ROCm)"
    return reason


def _open_library(info: devices.DeviceInfo, layer: str) -> KernelLibrary:
    if info.backend in ("rocm", "zluda"):
        if info.gfx_target is None:
            raise KernelUnavailable(f"could not read the GPU target of {info.name}")
        hip = driver.hip_driver(info.backend == "zluda")
        if hip is None:
            raise KernelUnavailable("no HIP runtime is loaded in this process")
        return _open_amd_library(hip, info)
    if info.backend == "cuda":
        return KernelLibrary(driver.cuda_driver(), artifacts.emulated_artifact(layer), info)
    raise KernelUnavailable(f"{info.backend} device {info.name}: the kernels need an AMD GPU (or NVIDIA emulation)")


_explicit = threading.local()
_stand_in = None  # see stand_in()


@contextlib.contextmanager
def stand_in(library):
    """Within the block, in every thread, `library` is the loaded library of every device whose
    backend is its `device_type` ("cpu"), and ops accepts that device's tensors: how the coverage
    benchmark counts the dispatcher's routing on a CPU, where no kernel runs, with a stand-in that
    computes what the kernels compute. Loaded libraries, and the decisions made on them, are dropped
    on entry and on exit."""
    global _stand_in
    previous, _stand_in = _stand_in, library
    forget_libraries()
    try:
        yield library
    finally:
        _stand_in = previous
        forget_libraries()


@contextlib.contextmanager
def explicit_library(library):
    """Within the block, launches on `library.device_type` devices (the CPU, for
    interpreter.InterpretedLibrary) go to `library`: ops then accepts tensors of that device.
    Per thread. The dispatcher's verdicts come from loaded_library_for, so it never routes a call
    to an explicit library."""
    previous = getattr(_explicit, "library", None)
    _explicit.library = library
    try:
        yield library
    finally:
        _explicit.library = previous


def explicit_library_for(device: torch.device):
    """The library chosen by explicit_library (or stand_in) for this device's type, or None."""
    for library in (getattr(_explicit, "library", None), _stand_in):
        if library is not None and torch.device(device).type == library.device_type:
            return library
    return None


def library_for(device: torch.device) -> KernelLibrary:
    """The library ops launches on for a device: an explicit one (explicit_library) first, else
    the device's own (loaded_library_for)."""
    explicit = explicit_library_for(device)
    return explicit if explicit is not None else loaded_library_for(device)


def loaded_library_for(device: torch.device) -> KernelLibrary:
    """The device's own loaded library, never an explicit one; raises KernelUnavailable with the
    reason, remembered."""
    return loaded_library(devices.describe(device))


def loaded_library(info: devices.DeviceInfo) -> KernelLibrary:
    """loaded_library_for a device already described."""
    if _stand_in is not None and info.backend == _stand_in.device_type:
        return _stand_in
    layer = emulated_layer() if info.backend == "cuda" else None
    key = (info.backend, info.index, layer)
    library = _libraries.get(key)
    if library is not None:
        return library
    with _lock:
        if key in _failures:
            raise KernelUnavailable(_failures[key])
        if key not in _libraries:
            try:
                _libraries[key] = _open_library(info, layer)
            except (KernelUnavailable, artifacts.ArtifactError, driver.DriverError, OSError) as error:
                _failures[key] = str(error)
                raise KernelUnavailable(str(error)) from None
        return _libraries[key]
