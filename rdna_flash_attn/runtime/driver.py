"""ctypes bindings to the GPU runtime already in the process: the HIP runtime (ROCm PyTorch, or the
one ZLUDA loaded) for AMD code objects, the CUDA driver for the NVIDIA emulation builds.

Nothing here loads a second copy of a runtime: HIP is only taken if it is already mapped, so the
kernels share torch's device memory, streams and contexts.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from functools import lru_cache


class DriverError(RuntimeError):
    pass


_WINDOWS_HIP_NAMES = ("amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll")
# HIP keeps these stream handles with the same meaning as CUDA's; anything else ZLUDA must translate.
_ZLUDA_PASS_THROUGH_STREAMS = (0, 1, 2)
_ZLUDA_KIND_STREAM = 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _loaded_hip_library() -> ctypes.CDLL | None:
    if sys.platform == "win32":
        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        kernel32.GetModuleHandleW.restype = ctypes.c_void_p
        kernel32.GetModuleHandleW.argtypes = [ctypes.c_wchar_p]
        for name in _WINDOWS_HIP_NAMES:
            handle = kernel32.GetModuleHandleW(name)
            if handle:
                return ctypes.CDLL(name, handle=handle)
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libamdhip64.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            # RTLD_NOLOAD: only a library that is already there; never a second copy.
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None


class _ZludaResult(ctypes.Structure):
    _fields_ = [("return_code", ctypes.c_int), ("value", ctypes.c_ulonglong)]


def _zluda_stream_translator():
    """ZLUDA's zluda_get_hip_object from its nvcuda, or None outside ZLUDA."""
    try:
        if sys.platform == "win32":
            kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
            kernel32.GetModuleHandleW.restype = ctypes.c_void_p
            handle = kernel32.GetModuleHandleW("nvcuda.dll")
            library = ctypes.CDLL("nvcuda.dll", handle=handle) if handle else None
        else:
            library = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        function = library.zluda_get_hip_object if library is not None else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.restype = _ZludaResult
        function.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return function


class HipDriver:
    """The HIP module API of the runtime in this process."""

    kind = "hip"

    def __init__(self, library: ctypes.CDLL, zluda: bool):
        self._lib = library
        self._zluda_translate = _zluda_stream_translator() if zluda else None
        if zluda and self._zluda_translate is None:
            raise DriverError("ZLUDA detected but its nvcuda library exports no zluda_get_hip_object")
        lib = library
        lib.hipGetErrorString.restype = ctypes.c_char_p
        lib.hipGetErrorString.argtypes = [ctypes.c_int]
        lib.hipModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.hipModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.hipModuleLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.hipGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.hipSetDevice.argtypes = [ctypes.c_int]
        lib.hipRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise DriverError(f"{what} failed: {self._lib.hipGetErrorString(code).decode(errors='replace')} ({code})")

    def runtime_version(self) -> str:
        version = ctypes.c_int()
        self._check(self._lib.hipRuntimeGetVersion(ctypes.byref(version)), "hipRuntimeGetVersion")
        major, minor, patch = version.value // 10_000_000, version.value // 100_000 % 100, version.value % 100_000
        return f"{major}.{minor}.{patch}"

    def device_arch(self, ordinal: int) -> str | None:
        """The gfx target of a device. hipDeviceProp_t's layout changed between HIP versions, so the
        target is read by its form ("gfx" + hex digits) from a buffer larger than any layout."""
        props = ctypes.create_string_buffer(16384)
        function = getattr(self._lib, "hipGetDevicePropertiesR0600", None) or self._lib.hipGetDeviceProperties
        function.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._check(function(props, ordinal), "hipGetDeviceProperties")
        match = re.search(rb"gfx[0-9a-f]{3,4}", props.raw)
        return match.group().decode() if match else None

    def load_module(self, image: bytes, ordinal: int) -> ctypes.c_void_p:
        previous = ctypes.c_int()
        self._check(self._lib.hipGetDevice(ctypes.byref(previous)), "hipGetDevice")
        module = ctypes.c_void_p()
        try:
            self._check(self._lib.hipSetDevice(ordinal), "hipSetDevice")
            self._check(self._lib.hipModuleLoadData(ctypes.byref(module), image), "hipModuleLoadData")
        finally:
            self._lib.hipSetDevice(previous.value)
        return module

    def get_function(self, module: ctypes.c_void_p, name: str, dynamic_shared_bytes: int) -> ctypes.c_void_p:
        function = ctypes.c_void_p()
        self._check(self._lib.hipModuleGetFunction(ctypes.byref(function), module, name.encode()), name)
        return function

    def native_stream(self, torch_stream_handle: int) -> int:
        if self._zluda_translate is None or torch_stream_handle in _ZLUDA_PASS_THROUGH_STREAMS:
            return torch_stream_handle
        result = self._zluda_translate(torch_stream_handle, _ZLUDA_KIND_STREAM)
        if result.return_code != 0:
            raise DriverError(f"zluda_get_hip_object failed for stream {torch_stream_handle:#x} ({result.return_code})")
        return result.value

    def launch(self, function, grid, block, shared_bytes: int, stream: int, params) -> None:
        self._check(self._lib.hipModuleLaunchKernel(function, *grid, *block, shared_bytes, stream, params, None),
                    "hipModuleLaunchKernel")


class CudaDriver:
    """The CUDA driver API, for the NVIDIA emulation builds."""

    kind = "cuda"

    def __init__(self):
        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        lib = self._lib = ctypes.CDLL(name)
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            message = ctypes.c_char_p()
            self._lib.cuGetErrorString(code, ctypes.byref(message))
            raise DriverError(f"{what} failed: {(message.value or b'?').decode(errors='replace')} ({code})")

    def runtime_version(self) -> str:
        version = ctypes.c_int()
        self._check(self._lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        return f"{version.value // 1000}.{version.value % 1000 // 10}"

    def load_module(self, image: bytes, ordinal: int) -> ctypes.c_void_p:
        import torch

        # torch's runtime calls make the device's primary context current on this thread.
        with torch.cuda.device(ordinal):
            torch.cuda.current_stream().synchronize()
            context = ctypes.c_void_p()
            self._check(self._lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
            if not context.value:
                raise DriverError("no CUDA context is current after torch initialised the device")
            module = ctypes.c_void_p()
            self._check(self._lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        return module

    def get_function(self, module: ctypes.c_void_p, name: str, dynamic_shared_bytes: int) -> ctypes.c_void_p:
        function = ctypes.c_void_p()
        self._check(self._lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), name)
        self._check(self._lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 dynamic_shared_bytes), f"{name}: dynamic shared memory")
        return function

    def native_stream(self, torch_stream_handle: int) -> int:
        return torch_stream_handle

    def launch(self, function, grid, block, shared_bytes: int, stream: int, params) -> None:
        self._check(self._lib.cuLaunchKernel(function, *grid, *block, shared_bytes, stream, params, None),
                    "cuLaunchKernel")


@lru_cache(maxsize=None)
def hip_driver(zluda: bool) -> HipDriver | None:
    library = _loaded_hip_library()
    return HipDriver(library, zluda) if library is not None else None


@lru_cache(maxsize=None)
def cuda_driver() -> CudaDriver:
    return CudaDriver()
