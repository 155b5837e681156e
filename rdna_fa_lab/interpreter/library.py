"""InterpretedLibrary: the launch interface of runtime.loader.KernelLibrary, running the AMD code
object on the CPU. ops.attention.flash_attention_forward/backward use it unchanged on CPU tensors
inside runtime.loader.explicit_library(library)."""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from rdna_flash_attn.runtime import artifacts
from .dispatch import Dispatch, kernarg_segment
from .errors import InterpreterError
from .executor import CompiledKernel
from .memory import Region, host_bytes
from .program import CodeObjectImage
from .trace import KernelTrace

log = logging.getLogger(__name__)


def tensor_region(index: int, t: torch.Tensor) -> Region:
    """The bytes a tensor addresses, from its first element to its last."""
    if t.device.type != "cpu":
        raise InterpreterError(f"launch buffer {index} is on {t.device}; the interpreter runs on CPU tensors")
    if t.numel() == 0:
        return Region(f"buffer {index} (empty)", t.data_ptr(), host_bytes(t.data_ptr(), 0), True)
    span = (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()
    name = f"buffer {index} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return Region(name, t.data_ptr(), host_bytes(t.data_ptr(), span), True)


class InterpretedLibrary:
    """One AMD code object, interpreted. `device_type` is where its launches run: the CPU."""

    device_type = "cpu"
    runtime_version = None  # no HIP runtime loads it (KernelLibrary's attribute, for ops.attention.artifact_info)

    def __init__(self, artifact: artifacts.Artifact):
        if artifact.emulated:
            raise InterpreterError(f"{artifact.target} is an NVIDIA emulation build, not an AMD code object")
        self.artifact = artifact
        self.image = CodeObjectImage(artifact.read_verified())
        self._kernels: dict[str, CompiledKernel] = {}
        self.traces: dict[str, KernelTrace] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_target(cls, target: str, code_object_version: int | None = None) -> "InterpretedLibrary":
        """The shipped code object of `target`, sha256-verified: version 5 unless asked (a real launch
        loads version 4 where the HIP runtime predates version 5, on the targets that ship both)."""
        if code_object_version is None:
            return cls(artifacts.prebuilt_artifact(target))
        return cls(artifacts.prebuilt_artifact(target, code_object_version))

    @property
    def target(self) -> str:
        return self.image.target

    def kernel(self, symbol: str) -> CompiledKernel:
        kernel = self._kernels.get(symbol)
        if kernel is None:
            kernel = self._kernels[symbol] = CompiledKernel(self.image.program(symbol))
            if kernel.unsupported:
                names = sorted({d.name for d in kernel.unsupported})
                log.info("%s: %d instructions the interpreter cannot run (an error if reached): %s",
                         symbol, len(kernel.unsupported), ", ".join(names))
        return kernel

    def launcher(self, variant, grid: tuple[int, int, int], device: torch.device):
        """launch(args, buffers) for one variant and grid, as KernelLibrary.launcher."""
        return lambda args, buffers: self.launch(variant, grid, args, buffers)

    def launch(self, variant, grid: tuple[int, int, int], args, buffers: tuple[torch.Tensor, ...]) -> None:
        """Runs `variant` over `grid` workgroups of variant.threads threads, with the argument block
        `args` (a ctypes structure) as the explicit kernel arguments, as a real launch would."""
        with self._lock:
            kernel = self.kernel(variant.symbol)
            program = kernel.program
            block = (variant.threads, 1, 1)
            explicit = ctypes.string_at(ctypes.addressof(args), ctypes.sizeof(args))
            segment = kernarg_segment(program, explicit, grid, block)
            # AMD LDS is static: the launch allocates the descriptor's group segment and no more
            # (KernelLibrary passes 0 dynamic bytes for a code object).
            lds_bytes = program.descriptor.group_segment_fixed_size
            regions = [tensor_region(i, t) for i, t in enumerate(buffers) if t is not None]  # None: no mask or cu_seqlens
            trace = self.traces.setdefault(variant.symbol, KernelTrace(variant.symbol))
            Dispatch(kernel, grid, block, lds_bytes, segment, regions, trace).run()
