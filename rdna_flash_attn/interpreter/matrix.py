"""v_wmma_f32_16x16x16_{f16,bf16}: D = A x B + C on one 16x16x16 tile per wave.

Fragment layouts (lane l, /work/shared/DESIGN.md section 3; kernels/isa/gfx11.h, gfx12.h):
- gfx11: A holds row l%16, k = 0..15 in 8 VGPRs (two 16-bit values each); B column l%16 likewise;
  lanes 16-31 must hold the same A and B as lanes 0-15 (checked: a kernel that breaks the rule
  gets an error, not a guess). C/D: VGPR s of lane l is D[2s + l/16][l%16].
- gfx12: A holds row l%16, k = 8*(l/16) + s in 4 VGPRs; B column l%16 likewise;
  D: VGPR s of lane l is D[8*(l/16) + s][l%16].
Products of 16-bit values are exact; the sum is formed in f64 and rounded once to f32. The
hardware's f32 accumulation order is not documented, so a GPU may differ in the last bits.
"""

from __future__ import annotations

import numpy as np

from . import floats
from .errors import InterpreterError
from .wave import VGPR_BASE, Wave

_ALL_LANES = 0xFFFFFFFF
_LANE = np.arange(32)


def _halves(registers: np.ndarray) -> np.ndarray:
    """(regs, 32) uint32 -> (32, 2*regs) 16-bit patterns, value 2j and 2j+1 from register j."""
    low = registers & np.uint32(0xFFFF)
    high = registers >> np.uint32(16)
    return np.stack([low, high], axis=-1).transpose(1, 0, 2).reshape(32, -1)


def compile_matrix(d, ctx):
    name = d.name
    if not name.startswith("v_wmma_f32_16x16x16_"):
        return None
    element = name.removeprefix("v_wmma_f32_16x16x16_")
    if element not in ("f16", "bf16"):
        return None
    to_float = floats.f16_from_bits if element == "f16" else floats.bf16_from_bits
    inst = d.inst
    if inst.neg or inst.neg_hi or inst.clmp or inst.opsel:
        raise InterpreterError("WMMA operand modifiers are not supported", ctx.kernel, d.offset, name)
    gfx12 = ctx.arch == "rdna4"
    a_reg, b_reg = inst.src0.offset - VGPR_BASE, inst.src1.offset - VGPR_BASE
    c_offset, d_reg = inst.src2.offset, inst.vdst.offset - VGPR_BASE
    if a_reg < 0 or b_reg < 0 or d_reg < 0:
        raise InterpreterError("WMMA A, B and D must be VGPRs", ctx.kernel, d.offset, name)
    if c_offset < VGPR_BASE and c_offset != 128:
        raise InterpreterError(f"WMMA C operand encoding {c_offset} is neither VGPRs nor 0", ctx.kernel, d.offset, name)
    ab_regs = 4 if gfx12 else 8
    row, half = _LANE % 16, _LANE // 16

    def run(wave: Wave):
        if wave.sgpr[126] != _ALL_LANES:
            raise InterpreterError(f"WMMA with EXEC 0x{wave.sgpr[126]:08x} (it needs all lanes)", ctx.kernel, d.offset, name)
        a_bits = _halves(wave.vgpr[a_reg : a_reg + ab_regs])  # (lane, value)
        b_bits = _halves(wave.vgpr[b_reg : b_reg + ab_regs])
        if c_offset >= VGPR_BASE:
            c_regs = wave.vgpr[c_offset - VGPR_BASE : c_offset - VGPR_BASE + 8].view(np.float32)
        else:
            c_regs = np.zeros((8, 32), np.float32)
        a = np.zeros((16, 16))
        b = np.zeros((16, 16))
        c = np.zeros((16, 16))
        if gfx12:
            k = 8 * half[:, None] + np.arange(8)[None, :]
            a[row[:, None], k] = to_float(a_bits)
            b[k, row[:, None]] = to_float(b_bits)
            d_rows = 8 * half[None, :] + np.arange(8)[:, None]  # (s, lane)
        else:
            for operand, bits in (("A", a_bits), ("B", b_bits)):
                if not np.array_equal(bits[:16], bits[16:]):
                    lane, value = np.argwhere(bits[:16] != bits[16:])[0]
                    raise InterpreterError(
                        f"gfx11 WMMA operand {operand} differs between the half-waves: lane {lane} value {value} is "
                        f"0x{bits[lane, value]:04x}, lane {lane + 16} has 0x{bits[lane + 16, value]:04x}",
                        ctx.kernel, d.offset, name)
            a[:, :] = to_float(a_bits[:16])
            b[:, :] = to_float(b_bits[:16]).T
            d_rows = 2 * np.arange(8)[:, None] + half[None, :]
        d_cols = np.broadcast_to(row[None, :], d_rows.shape)
        c[d_rows, d_cols] = c_regs
        result = (a @ b + c).astype(np.float32)
        wave.vgpr[d_reg : d_reg + 8] = result[d_rows, d_cols].view(np.uint32)
    return run
