"""The CPU as an RDNA GPU to the dispatcher (runtime.loader.stand_in), for host-path tests and
measurements without one: CPU tensors are routed to the kernels, each launch is recorded, and the shipped
code object runs it on the ISA interpreter (or, for timing the host alone, nothing runs it).

    with stand_in_gpu("gfx1100") as gpu:
        out = rdna_flash_attn.scaled_dot_product_attention(q, k, v)
    print(gpu.launches[0][0])  # the kernel's symbol
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from unittest import mock

import torch

from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import selftest
from rdna_flash_attn.runtime import artifacts, loader
from rdna_flash_attn.runtime.device import DeviceInfo

from .interpreter import InterpretedLibrary


class StandInGpu:
    """A loaded library for the CPU "device": a device description for the self-test's verdict, and each
    launch recorded (kernel symbol, grid, a copy of the argument block, buffers) before the interpreter
    runs it; with interpret=False nothing runs it (outputs stay as allocated)."""

    device_type = "cpu"
    runtime_version = None

    def __init__(self, target: str, interpret: bool = True):
        self.interpreted = InterpretedLibrary.for_target(target) if interpret else None
        self.artifact = artifacts.prebuilt_artifact(target)
        self.device_info = DeviceInfo("cpu", f"stand-in {target}", None, target, None)
        self.launches: list[tuple[str, tuple[int, int, int], object, tuple]] = []

    def launcher(self, variant, grid, device):
        """launch(args, buffers), as runtime.loader.KernelLibrary.launcher: the lookups made once, so that a
        launch adds one Python function to a call (run_launch), as a real one does."""
        return functools.partial(self.run_launch, variant.symbol, tuple(grid), variant)

    def launch(self, variant, grid, args, buffers) -> None:
        """As KernelLibrary.launch."""
        self.run_launch(variant.symbol, tuple(grid), variant, args, buffers)

    def run_launch(self, symbol: str, grid: tuple[int, int, int], variant, args, buffers) -> None:
        """One launch: recorded, then run by the interpreter where there is one."""
        self.launches.append((symbol, grid, type(args).from_buffer_copy(args), tuple(buffers)))
        if self.interpreted is not None:
            self.interpreted.launch(variant, grid, args, buffers)


@contextlib.contextmanager
def stand_in_gpu(target: str, interpret: bool = True):
    """Within the block the CPU is an RDNA GPU of `target` to the dispatcher (settings.force past the
    policy that keeps CPU tensors off the kernels), its self-tests (exact and 8-bit) recorded as passed
    in a private cache folder rather than run on the interpreter, which would take minutes."""
    saved = (settings.force, settings.cache_dir)
    gpu = StandInGpu(target, interpret)
    with tempfile.TemporaryDirectory(prefix="rdna_fa_stand_in_") as cache, loader.stand_in(gpu):
        settings.force, settings.cache_dir = True, cache
        try:
            with mock.patch.object(selftest, "run_checks", return_value=[]), \
                    mock.patch.object(selftest, "eight_bit_checks", return_value=[]):
                for test in ("exact", "8-bit"):
                    selftest.run(torch.device("cpu"), gpu, test)
            yield gpu
        finally:
            settings.force, settings.cache_dir = saved
