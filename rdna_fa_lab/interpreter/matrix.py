"""v_wmma_f32_16x16x16_{f16,bf16}, and gfx12's 8-bit forms: D = A x B + C on one 16x16x16 tile per wave.

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


def _bytes(registers: np.ndarray) -> np.ndarray:
    """(regs, 32) uint32 -> (32, 4*regs) bytes, byte 4j + b from register j."""
    shifts = np.arange(4, dtype=np.uint32) * np.uint32(8)
    return ((registers[:, :, None] >> shifts) & np.uint32(0xFF)).transpose(1, 0, 2).reshape(32, -1)


def _compile_8bit(d, ctx):
    """gfx12 v_wmma_i32_16x16x16_iu8 and v_wmma_f32_16x16x16_fp8_fp8: A holds row l%16, k = 8*(l/16) + byte
    (bytes 0-3 in its first VGPR, 4-7 in its second); B column l%16 likewise; D as the 16-bit gfx12 WMMA's.
    int8: neg_lo bits 0 and 1 say A and B are signed; exact int32 sums, wrapping (no clamp). e4m3: exact
    products, summed in f64 and rounded once to f32 (the hardware's order is not documented)."""
    name, inst = d.name, d.inst
    integer = name == "v_wmma_i32_16x16x16_iu8"
    if ctx.arch != "rdna4":
        raise InterpreterError("8-bit WMMA is modelled for gfx12 only", ctx.kernel, d.offset, name)
    if inst.clmp or inst.opsel or inst.neg_hi or (inst.neg & ~3 if integer else inst.neg):
        raise InterpreterError("WMMA operand modifiers are not supported", ctx.kernel, d.offset, name)
    signed = (bool(inst.neg & 1), bool(inst.neg & 2)) if integer else (False, False)
    a_reg, b_reg = inst.src0.offset - VGPR_BASE, inst.src1.offset - VGPR_BASE
    c_offset, d_reg = inst.src2.offset, inst.vdst.offset - VGPR_BASE
    if a_reg < 0 or b_reg < 0 or d_reg < 0 or (c_offset < VGPR_BASE and c_offset != 128):
        raise InterpreterError("WMMA A, B, D must be VGPRs and C VGPRs or 0", ctx.kernel, d.offset, name)
    row, half = _LANE % 16, _LANE // 16
    k = 8 * half[:, None] + np.arange(8)[None, :]
    d_rows = 8 * half[None, :] + np.arange(8)[:, None]
    d_cols = np.broadcast_to(row[None, :], d_rows.shape)

    def values(bits: np.ndarray, is_signed: bool) -> np.ndarray:
        if integer:
            return (bits.astype(np.int64) - ((bits.astype(np.int64) & 0x80) << 1) if is_signed else bits).astype(np.int64)
        return floats.e4m3_from_bits(bits).astype(np.float64)

    def run(wave: Wave):
        if wave.sgpr[126] != _ALL_LANES:
            raise InterpreterError(f"WMMA with EXEC 0x{wave.sgpr[126]:08x} (it needs all lanes)", ctx.kernel, d.offset, name)
        kind = np.int64 if integer else np.float64
        a, b, c = np.zeros((16, 16), kind), np.zeros((16, 16), kind), np.zeros((16, 16), kind)
        a[row[:, None], k] = values(_bytes(wave.vgpr[a_reg : a_reg + 2]), signed[0])
        b[k, row[:, None]] = values(_bytes(wave.vgpr[b_reg : b_reg + 2]), signed[1])
        if c_offset >= VGPR_BASE:
            c_regs = wave.vgpr[c_offset - VGPR_BASE : c_offset - VGPR_BASE + 8]
            c[d_rows, d_cols] = c_regs.view(np.int32) if integer else c_regs.view(np.float32)
        if integer:
            result = ((a @ b + c) & 0xFFFFFFFF).astype(np.uint32)
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                result = (a @ b + c).astype(np.float32).view(np.uint32)
        wave.vgpr[d_reg : d_reg + 8] = result[d_rows, d_cols]
    return run


def compile_matrix(d, ctx):
    name = d.name
    if name in ("v_wmma_i32_16x16x16_iu8", "v_wmma_f32_16x16x16_fp8_fp8"):
        return _compile_8bit(d, ctx)
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
