"""One kernel dispatch on the CPU: the kernarg segment as the HIP runtime builds it, the initial
register state of every wave as the hardware sets it from the kernel descriptor, and the workgroups
run one after another, their waves round-robin between barriers."""

from __future__ import annotations

import struct

import numpy as np

from .errors import InterpreterError
from .executor import CompiledKernel
from .memory import AddressSpace, LocalDataShare, Region
from .program import USER_SGPR_LAYOUT, KernelProgram
from .trace import KernelTrace
from .wave import EXEC_LO, LANES, Wave

# Code object v5 hidden arguments the runtime fills (AMDGPUUsage "Code Object V5 Metadata").
_HIDDEN_BLOCK_COUNT = {"hidden_block_count_x": 0, "hidden_block_count_y": 1, "hidden_block_count_z": 2}
_HIDDEN_GROUP_SIZE = {"hidden_group_size_x": 0, "hidden_group_size_y": 1, "hidden_group_size_z": 2}
_HIDDEN_REMAINDER = {"hidden_remainder_x": 0, "hidden_remainder_y": 1, "hidden_remainder_z": 2}
_DISPATCH_PACKET_BYTES = 64
IEEE_FLOAT_MODE = 0xF0  # COMPUTE_PGM_RSRC1 FLOAT_MODE: nearest-even rounding, no denormal flushing
TTMP7, TTMP9 = 108 + 7, 108 + 9  # operand encodings of the trap temporaries


def kernarg_segment(program: KernelProgram, explicit: bytes, grid: tuple[int, int, int],
                    block: tuple[int, int, int]) -> bytearray:
    """The kernarg bytes: the launcher's argument block where the metadata's explicit arguments
    lie (its size must match theirs exactly), hidden arguments as the HIP runtime fills them."""
    segment = bytearray(program.kernarg_size)
    explicit_end = 0
    for arg in program.args:
        kind, offset, size = arg[".value_kind"], arg[".offset"], arg[".size"]
        if not kind.startswith("hidden_"):
            explicit_end = max(explicit_end, offset + size)
        elif kind in _HIDDEN_BLOCK_COUNT:
            struct.pack_into("<I", segment, offset, grid[_HIDDEN_BLOCK_COUNT[kind]])
        elif kind in _HIDDEN_GROUP_SIZE:
            struct.pack_into("<H", segment, offset, block[_HIDDEN_GROUP_SIZE[kind]])
        elif kind in _HIDDEN_REMAINDER:
            struct.pack_into("<H", segment, offset, 0)  # whole workgroups: HIP launches grid x block
        elif kind == "hidden_grid_dims":
            struct.pack_into("<H", segment, offset, 1 + (grid[1] > 1 or grid[2] > 1) + (grid[2] > 1))
        # hidden_global_offset_*, and the pointers the kernels never need (printf, hostcall, heap,
        # queue): zero, as a runtime without those features passes them.
    if len(explicit) != explicit_end:
        raise InterpreterError(f"the launcher's argument block is {len(explicit)} bytes, the kernel's explicit "
                               f"arguments span {explicit_end} (kernel-argument ABI mismatch)", program.name)
    segment[: len(explicit)] = explicit
    return segment


def _dispatch_packet(grid, block) -> bytearray:
    """An hsa_kernel_dispatch_packet_t for kernels that read their dispatch pointer."""
    packet = bytearray(_DISPATCH_PACKET_BYTES)
    dims = 1 + (grid[1] > 1 or grid[2] > 1) + (grid[2] > 1)
    struct.pack_into("<HH3H2x3I", packet, 0, 0, dims, *block, *(g * b for g, b in zip(grid, block)))
    return packet


class Dispatch:
    def __init__(self, kernel: CompiledKernel, grid, block, lds_bytes: int, kernarg: bytearray,
                 buffers: list[Region], trace: KernelTrace):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.lds_bytes = lds_bytes
        self.trace = trace
        program = kernel.program
        self._kernarg = np.frombuffer(kernarg, np.uint8).copy()
        self._packet = np.frombuffer(_dispatch_packet(grid, block), np.uint8).copy()
        readonly = [Region("kernarg segment", self._kernarg.ctypes.data, self._kernarg, False),
                    Region("dispatch packet", self._packet.ctypes.data, self._packet, False)]
        context = kernel.context
        context.global_memory = AddressSpace(buffers)
        context.scalar_memory = AddressSpace(readonly + buffers)
        descriptor = program.descriptor
        if descriptor.private_segment_enabled or program.metadata.get(".private_segment_fixed_size", 0):
            raise InterpreterError("kernels using scratch memory are not supported", program.name)
        if descriptor.float_mode != IEEE_FLOAT_MODE:
            raise InterpreterError(f"float mode 0x{descriptor.float_mode:02x} in the kernel descriptor: the interpreter "
                                   "computes with round-to-nearest-even and denormals kept (0xf0)", program.name)
        threads = block[0] * block[1] * block[2]
        if threads > program.metadata.get(".max_flat_workgroup_size", 1024):
            raise InterpreterError(f"block of {threads} threads exceeds the kernel's maximum", program.name)
        self.waves_per_group = -(-threads // LANES)

    def run(self) -> None:
        gx, gy, gz = self.grid
        for z in range(gz):
            for y in range(gy):
                for x in range(gx):
                    self._run_workgroup((x, y, z))

    def _initial_wave(self, index: int, group_id) -> Wave:
        program = self.kernel.program
        descriptor = program.descriptor
        wave = Wave(program.metadata.get(".vgpr_count", 256), index)
        sgpr = 0
        for name, bit, size in USER_SGPR_LAYOUT:
            if not descriptor.property_enabled(bit):
                continue
            if name == "kernarg_segment_ptr":
                value = self._kernarg.ctypes.data
            elif name == "dispatch_ptr":
                value = self._packet.ctypes.data
            else:
                raise InterpreterError(f"the kernel asks for user SGPR {name}, which the interpreter does not provide",
                                       program.name)
            for i in range(size):
                wave.sgpr[sgpr + i] = (value >> (32 * i)) & 0xFFFFFFFF
            sgpr += size
        sgpr = descriptor.user_sgpr_count
        for axis in range(3):
            if descriptor.workgroup_id_enabled(axis):
                wave.sgpr[sgpr] = group_id[axis]
                sgpr += 1
        if program.arch == "rdna4":
            # gfx12 "architected SGPRs": the workgroup ids are also in TTMP9 (x) and TTMP7
            # (y in bits 0-15, z in 16-31), which is where clang-19's gfx12 code reads them.
            wave.sgpr[TTMP9] = group_id[0]
            wave.sgpr[TTMP7] = group_id[1] | group_id[2] << 16
        if descriptor.workgroup_info_enabled:
            raise InterpreterError("workgroup info SGPR is not provided", program.name)
        threads = self.block[0] * self.block[1] * self.block[2]
        thread = np.arange(index * LANES, (index + 1) * LANES)
        tid_x = thread % self.block[0]
        tid_y = thread // self.block[0] % self.block[1]
        tid_z = thread // (self.block[0] * self.block[1])
        # gfx11/gfx12 pack the work-item ids into v0: x in bits 0-9, y 10-19, z 20-29.
        wave.vgpr[0] = (tid_x | tid_y << 10 | tid_z << 20).astype(np.uint32)
        wave.sgpr[EXEC_LO] = int(sum(1 << lane for lane in range(LANES) if index * LANES + lane < threads))
        return wave

    def _run_workgroup(self, group_id) -> None:
        context = self.kernel.context
        context.lds = LocalDataShare(self.lds_bytes)
        waves = [self._initial_wave(i, group_id) for i in range(self.waves_per_group)]
        hits: dict[int, int] = {}
        while True:
            running = [w for w in waves if not w.ended]
            if not running:
                break
            for wave in running:
                if not wave.at_barrier:
                    self.kernel.run_wave(wave, hits)
            still = [w for w in waves if not w.ended]
            if still and all(w.at_barrier for w in still):
                context.lds.epoch += 1
                for w in still:
                    w.at_barrier = False
        self.trace.add(hits, self.kernel.instructions)
        self.trace.waves += len(waves)
        self.trace.workgroups += 1
