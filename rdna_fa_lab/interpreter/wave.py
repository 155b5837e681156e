"""The state of one wave32 wave, and operand access compiled once per instruction.

SGPRs live in a Python list indexed by the operand encoding (s0-s105, VCC 106/107, M0 125, EXEC
126/127), so scalar code runs on plain ints; VGPRs are a (registers, 32) uint32 array, so every
vector instruction is a handful of numpy operations over the 32 lanes.
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from .errors import InterpreterError

LANES = 32
VCC_LO, NULL, M0, EXEC_LO = 106, 124, 125, 126
VCCZ, EXECZ, SCC, LITERAL = 251, 252, 253, 255
VGPR_BASE = 256
POISON = 0x7FFF7FFF
LANE_IDS = np.arange(LANES, dtype=np.uint32)
_LANE_BITS = np.uint32(1) << LANE_IDS

# Inline float constants (operand encodings 240-248) in each width.
_INLINE_FLOATS = (0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0)
_INV_2PI = {16: 0x3118, 32: 0x3E22F983, 64: 0x3FC45F306DC9C882}


def _float_bits(value: float, width: int) -> int:
    if width == 16:
        return int(np.array(value, np.float16).view(np.uint16))
    if width == 64:
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    return struct.unpack("<I", struct.pack("<f", value))[0]


def inline_constant(offset: int, width: int, is_float: bool) -> int:
    """The value of an inline-constant operand encoding, as raw bits of `width`."""
    mask = (1 << width) - 1
    if 128 <= offset <= 192:
        return offset - 128
    if 193 <= offset <= 208:
        return (-(offset - 192)) & mask
    if 240 <= offset <= 247:
        # A float constant given to an integer operand is its f32 pattern (ISA "Inline Constants").
        return _float_bits(_INLINE_FLOATS[offset - 240], width if is_float else 32) & mask
    if offset == 248:
        return _INV_2PI[width if is_float else 32] & mask
    raise InterpreterError(f"operand encoding {offset} is not an inline constant")


def mask_lanes(mask: int) -> np.ndarray:
    """A 32-bit lane mask as a bool array over the lanes."""
    return (np.uint32(mask) & _LANE_BITS) != 0


def lanes_mask(lanes: np.ndarray) -> int:
    """A bool array over the lanes as a 32-bit lane mask."""
    return int(np.bitwise_or.reduce(np.where(lanes, _LANE_BITS, np.uint32(0))))


class Wave:
    def __init__(self, vgpr_count: int, wave_id: int):
        # Registers the hardware does not initialise start as NaN patterns (f32 and both f16
        # halves), so reading one before writing it shows in the results.
        self.sgpr = [POISON] * 128
        self.sgpr[NULL] = 0
        self.vgpr = np.full((max(vgpr_count, 1), LANES), POISON, dtype=np.uint32)
        self.scc = 0
        self.pc = 0
        self.wave_id = wave_id
        self.ended = False
        self.at_barrier = False
        self.barrier_signalled = False  # gfx12: s_barrier_signal seen, s_barrier_wait pending
        self._exec_value = -1
        self._exec_lanes = None
        # Memory operations in flight (waits.py): counter name -> operations oldest first, and the
        # registers they have yet to write as one bit mask (VGPR i: bit i, SGPR j: bit 256 + j).
        self.outstanding: dict[str, list] = {}
        self.poison = 0
        self.issued = 0

    @property
    def exec_mask(self) -> int:
        return self.sgpr[EXEC_LO]

    def exec_lanes(self) -> np.ndarray:
        value = self.sgpr[EXEC_LO]
        if value != self._exec_value:
            self._exec_value, self._exec_lanes = value, mask_lanes(value)
        return self._exec_lanes

    @property
    def vcc(self) -> int:
        return self.sgpr[VCC_LO]

    def write_vgpr(self, index: int, values: np.ndarray, lanes: np.ndarray | None = None) -> None:
        np.copyto(self.vgpr[index], values.astype(np.uint32, copy=False), where=self.exec_lanes() if lanes is None else lanes)


def scalar_reader(offset: int, literal: int | None, regs: int, is_float: bool = False) -> Callable[[Wave], int]:
    """A function reading a scalar operand (1 or 2 dwords) as an unsigned int."""
    width = 32 * regs
    if offset < 128:
        if regs == 1:
            return lambda wave: wave.sgpr[offset]
        return lambda wave: wave.sgpr[offset] | wave.sgpr[offset + 1] << 32 if offset != NULL else 0
    if offset == SCC:
        return lambda wave: wave.scc
    if offset == VCCZ:
        return lambda wave: int(wave.sgpr[VCC_LO] == 0)
    if offset == EXECZ:
        return lambda wave: int(wave.sgpr[EXEC_LO] == 0)
    if offset == LITERAL:
        if literal is None:
            raise InterpreterError("literal operand without a literal")
        value = literal
        if regs == 2 and not is_float and literal & 0x80000000:
            value = literal | 0xFFFFFFFF00000000  # a 64-bit integer literal is sign-extended
        elif regs == 2 and is_float:
            value = literal << 32  # a 64-bit float literal is the high dword
        return lambda wave: value
    value = inline_constant(offset, width, is_float)
    return lambda wave: value


def vector_reader(offset: int, literal: int | None, width: int, is_float: bool,
                  high_half: bool = False) -> Callable[[Wave], np.ndarray]:
    """A function reading a vector operand over the lanes: uint32 for 16/32-bit, uint64 for 64-bit.
    A 16-bit operand comes back in the low half, taken from the register's high half if asked."""
    if offset >= VGPR_BASE:
        index = offset - VGPR_BASE
        if width == 64:
            return lambda wave: wave.vgpr[index].astype(np.uint64) | wave.vgpr[index + 1].astype(np.uint64) << np.uint64(32)
        if width == 16:
            shift = np.uint32(16 if high_half else 0)
            return lambda wave: (wave.vgpr[index] >> shift) & np.uint32(0xFFFF)
        return lambda wave: wave.vgpr[index]
    regs = 2 if width == 64 else 1
    read = scalar_reader(offset, literal, regs, is_float)
    if width == 16 and (offset < 128 or offset == LITERAL):
        shift = 16 if high_half else 0
        read_scalar = read
        read = lambda wave: (read_scalar(wave) >> shift) & 0xFFFF  # noqa: E731
    elif width == 16 and 240 <= offset <= 248:
        constant = inline_constant(offset, 16, is_float)
        read = lambda wave: constant  # noqa: E731
    dtype = np.uint64 if width == 64 else np.uint32
    return lambda wave: np.full(LANES, read(wave), dtype=dtype)
