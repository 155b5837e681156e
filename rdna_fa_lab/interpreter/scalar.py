"""SALU and program-control instructions: SOP1, SOP2, SOPC, SOPK, SOPP.

Each op is a function of plain ints returning (result, new SCC or None); operands are read and
results written by closures compiled once per instruction.
"""

from __future__ import annotations

import struct

from .errors import InterpreterError
from .wave import EXEC_LO, NULL, VCC_LO, Wave, scalar_reader

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1


def _s32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x & 0x80000000 else x


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def _f32_bits(value: float) -> int:
    """A Python float rounded to f32 (nearest even), as its bits."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _cvt_u32(value: float) -> int:
    """Float to u32 as v_cvt_u32_f32 and s_cvt_u32_f32: truncated, clamped to [0, 2^32 - 1], NaN to 0."""
    if value != value:
        return 0
    return int(min(max(value, 0.0), float(M32)))


def _s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def _add_i32(a, b):
    r = _s32(a) + _s32(b)
    return r & M32, int(r != _s32(r))


def _sub_i32(a, b):
    r = _s32(a) - _s32(b)
    return r & M32, int(r != _s32(r))


def _bfe(a, b, signed, bits=32):
    """s_bfe_[iu](32|64): the field of `a` at offset b[4:0] (b[5:0] for 64 bits), b[22:16] bits wide."""
    offset, width = b & (bits - 1), (b >> 16) & 0x7F
    if width == 0:
        return 0, 0
    field = (a >> offset) & ((1 << width) - 1)
    if signed and field >> (width - 1) & 1:
        field -= 1 << width
    return field & (M32 if bits == 32 else M64), int(field != 0)


# SOP2 / SOPC style: (a, b, scc) -> (result, scc or None)
_BINARY = {
    "s_add_u32": lambda a, b, c: ((a + b) & M32, int(a + b > M32)),
    "s_sub_u32": lambda a, b, c: ((a - b) & M32, int(b > a)),
    "s_addc_u32": lambda a, b, c: ((a + b + c) & M32, int(a + b + c > M32)),
    "s_subb_u32": lambda a, b, c: ((a - b - c) & M32, int(b + c > a)),
    "s_add_i32": lambda a, b, c: _add_i32(a, b),
    "s_sub_i32": lambda a, b, c: _sub_i32(a, b),
    "s_add_co_i32": lambda a, b, c: _add_i32(a, b),  # gfx12 names
    "s_sub_co_i32": lambda a, b, c: _sub_i32(a, b),
    "s_add_co_u32": lambda a, b, c: ((a + b) & M32, int(a + b > M32)),
    "s_sub_co_u32": lambda a, b, c: ((a - b) & M32, int(b > a)),
    "s_add_co_ci_u32": lambda a, b, c: ((a + b + c) & M32, int(a + b + c > M32)),
    "s_add_nc_u64": lambda a, b, c: ((a + b) & M64, None),
    "s_sub_nc_u64": lambda a, b, c: ((a - b) & M64, None),
    "s_mul_u64": lambda a, b, c: ((a * b) & M64, None),
    "s_mul_i32": lambda a, b, c: ((_s32(a) * _s32(b)) & M32, None),
    "s_mul_hi_u32": lambda a, b, c: ((a * b) >> 32, None),
    "s_mul_hi_i32": lambda a, b, c: (((_s32(a) * _s32(b)) >> 32) & M32, None),
    "s_lshl_b32": lambda a, b, c: ((a << (b & 31)) & M32, int((a << (b & 31)) & M32 != 0)),
    "s_lshr_b32": lambda a, b, c: (a >> (b & 31), int(a >> (b & 31) != 0)),
    "s_ashr_i32": lambda a, b, c: ((_s32(a) >> (b & 31)) & M32, int(_s32(a) >> (b & 31) != 0)),
    "s_lshl_b64": lambda a, b, c: ((a << (b & 63)) & M64, int((a << (b & 63)) & M64 != 0)),
    "s_lshr_b64": lambda a, b, c: (a >> (b & 63), int(a >> (b & 63) != 0)),
    "s_ashr_i64": lambda a, b, c: ((_s64(a) >> (b & 63)) & M64, int(_s64(a) >> (b & 63) != 0)),
    "s_min_i32": lambda a, b, c: (a if _s32(a) < _s32(b) else b, int(_s32(a) < _s32(b))),
    "s_max_i32": lambda a, b, c: (a if _s32(a) > _s32(b) else b, int(_s32(a) > _s32(b))),
    "s_min_u32": lambda a, b, c: (min(a, b), int(a < b)),
    "s_max_u32": lambda a, b, c: (max(a, b), int(a > b)),
    "s_cselect_b32": lambda a, b, c: (a if c else b, None),
    "s_cselect_b64": lambda a, b, c: (a if c else b, None),
    "s_bfe_u32": lambda a, b, c: _bfe(a, b, False),
    "s_bfe_i32": lambda a, b, c: _bfe(a, b, True),
    "s_bfe_u64": lambda a, b, c: _bfe(a, b, False, 64),
    "s_bfe_i64": lambda a, b, c: _bfe(a, b, True, 64),
    "s_bfm_b32": lambda a, b, c: ((((1 << (a & 31)) - 1) << (b & 31)) & M32, None),
    "s_pack_ll_b32_b16": lambda a, b, c: ((a & 0xFFFF) | (b & 0xFFFF) << 16, None),
    "s_pack_lh_b32_b16": lambda a, b, c: ((a & 0xFFFF) | (b & 0xFFFF0000), None),
    "s_pack_hh_b32_b16": lambda a, b, c: (a >> 16 | (b & 0xFFFF0000), None),
    "s_lshl1_add_u32": lambda a, b, c: (((a << 1) + b) & M32, int((a << 1) + b > M32)),
    "s_lshl2_add_u32": lambda a, b, c: (((a << 2) + b) & M32, int((a << 2) + b > M32)),
    "s_lshl3_add_u32": lambda a, b, c: (((a << 3) + b) & M32, int((a << 3) + b > M32)),
    "s_lshl4_add_u32": lambda a, b, c: (((a << 4) + b) & M32, int((a << 4) + b > M32)),
    "s_absdiff_i32": lambda a, b, c: (abs(_s32(a) - _s32(b)) & M32, int(a != b)),
    # gfx12's scalar float multiply (the compiler's integer division): exact in a Python float, rounded once.
    "s_mul_f32": lambda a, b, c: (_f32_bits(_f32(a) * _f32(b)), None),
}
for _width, _mask in (("b32", M32), ("b64", M64)):
    _BINARY.update({
        f"s_and_{_width}": lambda a, b, c: (a & b, int(a & b != 0)),
        f"s_or_{_width}": lambda a, b, c: (a | b, int(a | b != 0)),
        f"s_xor_{_width}": lambda a, b, c: (a ^ b, int(a ^ b != 0)),
        f"s_nand_{_width}": lambda a, b, c, m=_mask: (~(a & b) & m, int(~(a & b) & m != 0)),
        f"s_nor_{_width}": lambda a, b, c, m=_mask: (~(a | b) & m, int(~(a | b) & m != 0)),
        f"s_xnor_{_width}": lambda a, b, c, m=_mask: (~(a ^ b) & m, int(~(a ^ b) & m != 0)),
        f"s_and_not1_{_width}": lambda a, b, c, m=_mask: (a & ~b & m, int(a & ~b & m != 0)),
        f"s_or_not1_{_width}": lambda a, b, c, m=_mask: ((a | ~b) & m, int((a | ~b) & m != 0)),
    })

_COMPARE = {
    "eq": lambda a, b: a == b, "lg": lambda a, b: a != b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
}

# gfx12 float compares (s_cmp_nlt_f32): the N* forms are true on unordered inputs.
_FLOAT_COMPARE = {
    "lt": lambda a, b: a < b, "eq": lambda a, b: a == b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "lg": lambda a, b: a < b or a > b, "ge": lambda a, b: a >= b, "o": lambda a, b: a == a and b == b,
    "u": lambda a, b: a != a or b != b, "nge": lambda a, b: not a >= b, "nlg": lambda a, b: not (a < b or a > b),
    "ngt": lambda a, b: not a > b, "nle": lambda a, b: not a <= b, "neq": lambda a, b: not a == b,
    "nlt": lambda a, b: not a < b,
}

# SOP1: a -> (result, scc or None)
_UNARY = {
    "s_mov_b32": lambda a: (a, None),
    "s_mov_b64": lambda a: (a, None),
    "s_not_b32": lambda a: (~a & M32, int(~a & M32 != 0)),
    "s_not_b64": lambda a: (~a & M64, int(~a & M64 != 0)),
    "s_sext_i32_i8": lambda a: ((a & 0xFF) - ((a & 0x80) << 1) & M32, None),
    "s_sext_i32_i16": lambda a: ((a & 0xFFFF) - ((a & 0x8000) << 1) & M32, None),
    "s_abs_i32": lambda a: (abs(_s32(a)) & M32, int(a != 0)),
    "s_brev_b32": lambda a: (int(f"{a:032b}"[::-1], 2), None),
    "s_bcnt1_i32_b32": lambda a: (bin(a).count("1"), int(a != 0)),
    "s_bcnt1_i32_b64": lambda a: (bin(a).count("1"), int(a != 0)),
    "s_ctz_i32_b32": lambda a: ((a & -a).bit_length() - 1 & M32 if a else M32, None),
    "s_clz_i32_u32": lambda a: (32 - a.bit_length() if a else M32, None),
    "s_cvt_f32_u32": lambda a: (_f32_bits(float(a)), None),  # exact in a Python float, rounded once to f32
    "s_cvt_f32_i32": lambda a: (_f32_bits(float(_s32(a))), None),
    "s_cvt_u32_f32": lambda a: (_cvt_u32(_f32(a)), None),
}

# Saveexec: exec, source -> new exec (the old exec goes to the destination; SCC = new exec != 0).
_SAVEEXEC = {
    "and": lambda e, s: s & e, "or": lambda e, s: s | e, "xor": lambda e, s: s ^ e,
    "nand": lambda e, s: ~(s & e), "nor": lambda e, s: ~(s | e), "xnor": lambda e, s: ~(s ^ e),
    "and_not0": lambda e, s: ~s & e, "or_not0": lambda e, s: ~s | e,
    "and_not1": lambda e, s: s & ~e, "or_not1": lambda e, s: s | ~e,
}

# The counter waits (s_waitcnt, s_wait_*cnt) are waits.py's. s_delay_alu, s_waitcnt_depctr and
# s_wait_alu are not checked: gfx11/gfx12 hardware interlocks ALU dependencies itself, and
# s_delay_alu only says where to stall early (a performance hint; a missing one costs time, not
# correctness). The depctr counters that do matter (VA_VDST, VM_VSRC) exist only in gfx12's expert
# scheduling mode, which the kernels do not enable.
_NO_EFFECT_SOPP = {
    "s_nop", "s_waitcnt_depctr", "s_delay_alu", "s_clause", "s_set_inst_prefetch_distance", "s_wait_alu", "s_sleep",
    "s_icache_inv", "s_sendmsg", "s_ttracedata",
}
_BRANCHES = {
    "s_branch": lambda w: True,
    "s_cbranch_scc0": lambda w: w.scc == 0,
    "s_cbranch_scc1": lambda w: w.scc == 1,
    "s_cbranch_vccz": lambda w: w.sgpr[VCC_LO] == 0,
    "s_cbranch_vccnz": lambda w: w.sgpr[VCC_LO] != 0,
    "s_cbranch_execz": lambda w: w.sgpr[EXEC_LO] == 0,
    "s_cbranch_execnz": lambda w: w.sgpr[EXEC_LO] != 0,
}
# s_sendmsg ids the kernels may send: MSG_DEALLOC_VGPRS (3) at the end of a wave; anything else
# would change state the interpreter does not model.
_HARMLESS_MESSAGES = {3}


def scalar_writer(offset: int, regs: int):
    if offset == NULL:
        return lambda wave, value: None
    if offset >= 128:
        raise InterpreterError(f"scalar destination encoding {offset} is not writable")
    if regs == 1:
        def write(wave: Wave, value: int) -> None:
            wave.sgpr[offset] = value & M32
    else:
        def write(wave: Wave, value: int) -> None:
            wave.sgpr[offset] = value & M32
            wave.sgpr[offset + 1] = (value >> 32) & M32
    return write


def compile_scalar(d, ctx):
    """A closure for one SOP1/SOP2/SOPC/SOPK/SOPP instruction, or None if it is not one."""
    name, inst, encoding = d.name, d.inst, d.encoding.split("_LIT")[0]
    literal = d.literal
    if encoding == "SOP2":
        if name not in _BINARY:
            return None
        op = _BINARY[name]
        wide = 2 if name.endswith(("64",)) else 1
        read_a = scalar_reader(inst.ssrc0.offset, literal, wide)
        read_b = scalar_reader(inst.ssrc1.offset, literal, 1 if name.startswith(("s_lshl_b64", "s_lshr_b64", "s_ashr_i64")) else wide)
        write = scalar_writer(inst.sdst.offset, wide)

        def run(wave: Wave):
            result, scc = op(read_a(wave), read_b(wave), wave.scc)
            write(wave, result)
            if scc is not None:
                wave.scc = scc
        return run
    if encoding == "SOPC":
        parts = name.split("_")  # s_cmp_eq_u32
        if len(parts) == 4 and parts[1] == "cmp" and parts[3] == "f32" and parts[2] in _FLOAT_COMPARE:
            float_compare = _FLOAT_COMPARE[parts[2]]
            read_a = scalar_reader(inst.ssrc0.offset, literal, 1, is_float=True)
            read_b = scalar_reader(inst.ssrc1.offset, literal, 1, is_float=True)

            def run_float(wave: Wave):
                wave.scc = int(float_compare(_f32(read_a(wave)), _f32(read_b(wave))))
            return run_float
        if len(parts) != 4 or parts[1] != "cmp" or parts[2] not in _COMPARE:
            return None
        compare, signed, wide = _COMPARE[parts[2]], parts[3][0] == "i", 2 if parts[3].endswith("64") else 1
        read_a = scalar_reader(inst.ssrc0.offset, literal, wide)
        read_b = scalar_reader(inst.ssrc1.offset, literal, wide)
        convert = (_s32 if wide == 1 else _s64) if signed else (lambda x: x)

        def run(wave: Wave):
            wave.scc = int(compare(convert(read_a(wave)), convert(read_b(wave))))
        return run
    if encoding == "SOPK":
        simm = inst.simm16
        simm_signed = simm - 0x10000 if simm & 0x8000 else simm
        parts = name.split("_")
        if name == "s_movk_i32":
            write = scalar_writer(inst.sdst.offset, 1)
            return lambda wave: write(wave, simm_signed & M32)
        if parts[1] == "cmpk" and parts[2] in _COMPARE:
            compare, signed = _COMPARE[parts[2]], parts[3][0] == "i"
            read = scalar_reader(inst.sdst.offset, None, 1)
            constant = simm_signed if signed else simm
            convert = _s32 if signed else (lambda x: x)

            def run(wave: Wave):
                wave.scc = int(compare(convert(read(wave)), constant))
            return run
        if name == "s_addk_i32" or name == "s_addk_co_i32":
            read = scalar_reader(inst.sdst.offset, None, 1)
            write = scalar_writer(inst.sdst.offset, 1)

            def run(wave: Wave):
                result, wave.scc = _add_i32(read(wave), simm_signed)
                write(wave, result)
            return run
        if name == "s_mulk_i32":
            read = scalar_reader(inst.sdst.offset, None, 1)
            write = scalar_writer(inst.sdst.offset, 1)
            return lambda wave: write(wave, _s32(read(wave)) * simm_signed)
        return None
    if encoding == "SOP1":
        if name == "s_barrier_signal":  # gfx12; -1 (encoding 193) names the workgroup barrier
            if inst.ssrc0.offset != 193:
                return None

            def signal(wave: Wave):
                wave.barrier_signalled = True
            return signal
        wide = 2 if name.endswith("64") else 1
        if "saveexec" in name:
            kind = name[2:].rsplit("_saveexec", 1)[0]
            if kind not in _SAVEEXEC or wide != 1:
                return None
            update = _SAVEEXEC[kind]
            read = scalar_reader(inst.ssrc0.offset, literal, 1)
            write = scalar_writer(inst.sdst.offset, 1)

            def run(wave: Wave):
                source, old = read(wave), wave.sgpr[EXEC_LO]
                new = update(old, source) & M32
                write(wave, old)
                wave.sgpr[EXEC_LO] = new
                wave.scc = int(new != 0)
            return run
        if name not in _UNARY:
            return None
        op = _UNARY[name]
        read = scalar_reader(inst.ssrc0.offset, literal, 2 if name in ("s_mov_b64", "s_not_b64", "s_bcnt1_i32_b64") else 1)
        write = scalar_writer(inst.sdst.offset, wide if name != "s_bcnt1_i32_b64" else 1)

        def run(wave: Wave):
            result, scc = op(read(wave))
            write(wave, result)
            if scc is not None:
                wave.scc = scc
        return run
    if encoding == "SOPP":
        return _compile_program_control(d, ctx)
    return None


def _compile_program_control(d, ctx):
    name, simm = d.name, d.inst.simm16
    if name in _BRANCHES:
        taken = _BRANCHES[name]
        target = d.offset + 4 + 4 * (simm - 0x10000 if simm & 0x8000 else simm)
        return lambda wave: target if taken(wave) else None
    if name == "s_sendmsg" and simm & 0xFF not in _HARMLESS_MESSAGES:
        return None
    if name in _NO_EFFECT_SOPP:
        return lambda wave: None
    if name == "s_endpgm":
        def end(wave: Wave):
            wave.ended = True
        return end
    if name == "s_barrier":  # gfx11: signal and wait
        def barrier(wave: Wave):
            wave.at_barrier = True
        return barrier
    if name == "s_barrier_wait":
        def wait(wave: Wave):
            if not wave.barrier_signalled:
                raise InterpreterError("s_barrier_wait without s_barrier_signal", ctx.kernel, d.offset, name)
            wave.barrier_signalled = False
            wave.at_barrier = True
        return wait
    return None
