"""Loads the right code object for a device once and launches its kernels on torch's current stream."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import artifacts, device as devices, driver


class KernelUnavailable(RuntimeError):
    """The kernels cannot run on this device; the message says why."""


DEFAULT_EMULATED_LAYER = "gfx11"


def emulated_layer() -> str:
    """Which AMD layer an NVIDIA device emulates (RDNA_FA_EMULATE=gfx11|gfx12)."""
    return os.environ.get("RDNA_FA_EMULATE", DEFAULT_EMULATED_LAYER)


class KernelLibrary:
    """One loaded code object on one device."""

    def __init__(self, gpu_driver, artifact: artifacts.Artifact, ordinal: int):
        self.driver = gpu_driver
        self.artifact = artifact
        self.ordinal = ordinal
        self._module = gpu_driver.load_module(artifact.read_verified(), ordinal)
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()

    def _dynamic_lds(self, variant) -> int:
        """The emulation's LDS is dynamic; on AMD it is static and a launch adds none."""
        return variant.lds_bytes if self.artifact.emulated else 0

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


def _open_library(info: devices.DeviceInfo, layer: str) -> KernelLibrary:
    if info.backend in ("rocm", "zluda"):
        if info.gfx_target is None:
            raise KernelUnavailable(f"could not read the GPU target of {info.name}")
        hip = driver.hip_driver(info.backend == "zluda")
        if hip is None:
            raise KernelUnavailable("no HIP runtime is loaded in this process")
        return KernelLibrary(hip, artifacts.amd_artifact(info.gfx_target), info.index)
    if info.backend == "cuda":
        return KernelLibrary(driver.cuda_driver(), artifacts.emulated_artifact(layer), info.index)
    raise KernelUnavailable(f"{info.backend} device {info.name}: the kernels need an AMD GPU (or NVIDIA emulation)")


def library_for(device: torch.device) -> KernelLibrary:
    """The loaded library for a device; raises KernelUnavailable with the reason, remembered."""
    info = devices.describe(device)
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
