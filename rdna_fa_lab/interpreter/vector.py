"""VALU instructions by encoding: VOP1, VOP2, VOPC, VOP3, VOP3SD, VOPD (dual issue) and the VOP3P
forms the kernels use (v_fma_mix*, v_wmma_* in matrix.py).

Operands are read into raw lane arrays, source modifiers applied (abs, neg on floats; opsel or the
VGPR field's bit 7 selecting a 16-bit half), the operation from valu_ops computed, and the result
written under EXEC.
"""

from __future__ import annotations

import numpy as np

from . import floats
from .errors import InterpreterError
from .valu_ops import COMPARES, OPS, WIDTHS, dot2, to_raw, to_typed
from .wave import EXEC_LO, NULL, VCC_LO, VGPR_BASE, Wave, lanes_mask, mask_lanes, scalar_reader, vector_reader

_SIGN = {16: 0x8000, 32: 0x80000000, 64: 1 << 63}
_TYPE_SUFFIXES = ("f32", "f16", "bf16", "i32", "u32", "i16", "u16", "u64", "i64", "f64", "b32", "b16", "b64")


def base_name(name: str) -> str:
    """v_add_f32_e32 -> add_f32; v_dual_mul_f32 -> mul_f32."""
    name = name[2:] if name.startswith("v_") else name
    name = name[5:] if name.startswith("dual_") else name
    for suffix in ("_e32", "_e64"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _modified(read, width: int, negate: bool, absolute: bool):
    """Apply abs then neg (the ISA's order) to a float operand's bits."""
    if not negate and not absolute:
        return read
    sign = np.uint64(_SIGN[width]) if width == 64 else np.uint32(_SIGN[width])

    def modified(wave):
        raw = read(wave)
        if absolute:
            raw = raw & ~sign
        if negate:
            raw = raw ^ sign
        return raw
    return modified


def _sixteen_bit_field(offset: int) -> tuple[int, bool]:
    """A VOP1/VOP2/VOPC VGPR field naming a 16-bit operand: bit 7 picks the high half of
    v0-v127 (RDNA3/4 ISA, "16-bit VGPRs")."""
    if offset >= VGPR_BASE:
        index = offset - VGPR_BASE
        return VGPR_BASE + (index & 0x7F), bool(index & 0x80)
    return offset, False


class _Operands:
    """Readers for an instruction's sources and its typed destination writer."""

    def __init__(self, d, ctx, source_fields, types, modifiers=True):
        inst = d.inst
        encoding = d.encoding.split("_LIT")[0]
        short_form = encoding in ("VOP1", "VOP2", "VOPC")
        neg = getattr(inst, "neg", 0) if modifiers else 0
        absolute = getattr(inst, "abs", 0) if modifiers else 0
        opsel = getattr(inst, "opsel", 0) if modifiers else 0
        if getattr(inst, "omod", 0) or getattr(inst, "clmp", 0):
            raise InterpreterError("output modifiers (omod, clamp) are not supported", ctx.kernel, d.offset, d.name)
        self.readers = []
        for i, (field, kind) in enumerate(zip(source_fields, types)):
            offset = getattr(inst, field).offset
            width = WIDTHS[kind]
            is_float = kind[0] in "fb" and kind != "b32"
            high = False
            if width == 16:
                if short_form:
                    offset, high = _sixteen_bit_field(offset)
                else:
                    high = bool(opsel >> i & 1)
            read = vector_reader(offset, d.literal, width, is_float, high)
            if (neg >> i & 1 or absolute >> i & 1) and not is_float:
                raise InterpreterError(f"neg/abs on integer operand {field}", ctx.kernel, d.offset, d.name)
            self.readers.append(_modified(read, width, bool(neg >> i & 1), bool(absolute >> i & 1)))
        self.opsel_destination_high = bool(opsel >> 3 & 1)
        self.short_form = short_form

    def read(self, wave):
        return [read(wave) for read in self.readers]


def vector_writer(offset: int, kind: str, high_from_opsel: bool, short_form: bool):
    """Write a raw result under EXEC: 16-bit results keep the other half of the register."""
    width = WIDTHS[kind]
    if offset < VGPR_BASE:
        raise InterpreterError(f"vector destination {offset} is not a VGPR")
    index = offset - VGPR_BASE
    if width == 16:
        high = high_from_opsel
        if short_form:
            index, high = index & 0x7F, bool(index & 0x80)
        keep, shift = (np.uint32(0x0000FFFF), np.uint32(16)) if high else (np.uint32(0xFFFF0000), np.uint32(0))

        def write16(wave: Wave, raw, lanes=None):
            merged = (wave.vgpr[index] & keep) | ((raw.astype(np.uint32) & np.uint32(0xFFFF)) << shift)
            wave.write_vgpr(index, merged, lanes)
        return write16
    if width == 64:
        def write64(wave: Wave, raw, lanes=None):
            raw = raw.astype(np.uint64)
            wave.write_vgpr(index, (raw & np.uint64(0xFFFFFFFF)).astype(np.uint32), lanes)
            wave.write_vgpr(index + 1, (raw >> np.uint64(32)).astype(np.uint32), lanes)
        return write64

    def write32(wave: Wave, raw, lanes=None):
        wave.write_vgpr(index, raw, lanes)
    return write32


def _source_fields(d) -> list[str]:
    inst = d.inst
    names = [f for f, _ in inst._fields]
    sources = ["src0"]
    sources.append("vsrc1" if "vsrc1" in names else "src1")
    sources.append("src2")
    return sources


def _split_compare(name: str):
    """cmp_gt_u32 / cmpx_lt_f32 -> (writes exec, condition, type) or None."""
    parts = name.split("_")
    if len(parts) != 3 or parts[0] not in ("cmp", "cmpx") or parts[1] not in COMPARES:
        return None
    kind = parts[2].replace("b32", "u32")
    return parts[0] == "cmpx", COMPARES[parts[1]], kind


def _mask_writer(offset: int):
    if offset == NULL:
        return lambda wave, mask: None
    if offset >= 128:
        raise InterpreterError(f"lane-mask destination {offset} is not an SGPR")
    def write(wave, mask):
        wave.sgpr[offset] = mask
    return write


def compile_vector(d, ctx):
    encoding = d.encoding.split("_LIT")[0]
    if encoding == "VOP1_SDST":  # v_readfirstlane_b32 writes an SGPR
        encoding = "VOP1"
    if encoding in ("VOP1", "VOP2", "VOPC", "VOP3", "VOP3_SDST", "VOP3SD"):
        return _compile_vop(d, ctx, encoding)
    if encoding == "VOPD":
        return _compile_vopd(d, ctx)
    if encoding == "VOP3P" and "fma_mix" in d.name:
        return _compile_fma_mix(d, ctx)
    if encoding == "VOP3P" and d.name in _PACKED_F16:
        return _compile_packed_f16(d, ctx)
    if encoding == "VOP3P" and d.name in ("v_dot2_f32_f16", "v_dot2_f32_bf16"):
        return _compile_dot2(d, ctx)
    return None


def _refuse_inline_float(d, ctx, offset: int):
    """A dot2 source holding two packed halves: how an inline float constant (1.0, 0.5, ...) is
    packed there is not modelled, so it is an error rather than a guess."""
    if 240 <= offset <= 248:
        raise InterpreterError("a dot2 source that is an inline float constant is not supported",
                               ctx.kernel, d.offset, d.name)


def _compile_dot2(d, ctx):
    """v_dot2_f32_{f16,bf16} (VOP3P): D = S2 (f32) + S0.lo*S1.lo + S0.hi*S1.hi. Only the plain form
    the kernels use: each half from its own half (opsel 0, opsel_hi all set), no neg, no clamp, no
    inline float constant for the packed sources (its packing is not modelled)."""
    inst = d.inst
    opsel_hi = inst.opsel_hi | inst.opsel_hi2 << 2
    if inst.clmp or inst.opsel or opsel_hi != 0b111 or inst.neg or inst.neg_hi:
        raise InterpreterError("dot2 with opsel, neg or clamp modifiers is not supported", ctx.kernel, d.offset, d.name)
    for field in ("src0", "src1"):
        _refuse_inline_float(d, ctx, getattr(inst, field).offset)
    halves = d.name.rsplit("_", 1)[1]
    read_a, read_b = (vector_reader(getattr(inst, f).offset, d.literal, 32, False) for f in ("src0", "src1"))
    read_accumulator = vector_reader(inst.src2.offset, d.literal, 32, True)
    write = vector_writer(inst.vdst.offset, "f32", False, False)

    def run(wave: Wave):
        accumulator = to_typed(read_accumulator(wave), "f32")
        write(wave, to_raw(dot2(read_a(wave), read_b(wave), accumulator, halves), "f32"))
    return run


# Packed f16 pairs (VOP3P): name -> (sources, function on f64 arrays, exact before one rounding).
_PACKED_F16 = {
    "v_pk_add_f16": (2, lambda a, b: a + b),
    "v_pk_mul_f16": (2, lambda a, b: a * b),
    "v_pk_fma_f16": (3, floats.fma),
    "v_pk_max_f16": (2, np.fmax), "v_pk_min_f16": (2, np.fmin),
    "v_pk_max_num_f16": (2, np.fmax), "v_pk_min_num_f16": (2, np.fmin),
}


def _compile_packed_f16(d, ctx):
    """Two f16 lanes per register: the low result from the halves opsel names, the high one from
    the halves opsel_hi names; neg / neg_hi negate the low / high inputs. Sums and products of f16
    are exact in f64, so rounding once to f16 is the correct rounding."""
    inst = d.inst
    if inst.clmp:
        raise InterpreterError("clamp is not supported", ctx.kernel, d.offset, d.name)
    count, function = _PACKED_F16[d.name]
    opsel, opsel_hi = inst.opsel, inst.opsel_hi | inst.opsel_hi2 << 2
    readers = [vector_reader(getattr(inst, f).offset, d.literal, 32, True) for f in ("src0", "src1", "src2")[:count]]
    index = inst.vdst.offset - VGPR_BASE

    def half(raw, high: bool, negate: bool):
        bits = (raw >> np.uint32(16)) if high else raw
        values = floats.f16_from_bits(bits).astype(np.float64)
        return -values if negate else values

    def run(wave: Wave):
        sources = [read(wave) for read in readers]
        low = function(*(half(raw, bool(opsel >> i & 1), bool(inst.neg >> i & 1)) for i, raw in enumerate(sources)))
        high = function(*(half(raw, bool(opsel_hi >> i & 1), bool(inst.neg_hi >> i & 1)) for i, raw in enumerate(sources)))
        with np.errstate(all="ignore"):
            wave.write_vgpr(index, floats.f16_bits(low) | floats.f16_bits(high) << np.uint32(16))
    return run


def _compile_vop(d, ctx, encoding):
    name = base_name(d.name)
    inst = d.inst
    fields = _source_fields(d)
    compare = _split_compare(name)
    if compare is not None:
        writes_exec, condition, kind = compare
        if kind not in WIDTHS:
            return None
        operands = _Operands(d, ctx, fields[:2], (kind, kind))
        write_mask = (lambda wave, mask: wave.sgpr.__setitem__(EXEC_LO, mask)) if writes_exec else (
            _mask_writer(VCC_LO if encoding == "VOPC" else inst.vdst.offset))

        def run_compare(wave: Wave):
            a, b = operands.read(wave)
            with np.errstate(invalid="ignore"):
                result = condition(to_typed(a, kind), to_typed(b, kind)) & wave.exec_lanes()
            write_mask(wave, lanes_mask(result))
        return run_compare
    if name == "readfirstlane_b32":
        read = vector_reader(inst.src0.offset, d.literal, 32, False)
        destination = inst.vdst.offset - VGPR_BASE if inst.vdst.offset >= VGPR_BASE else inst.vdst.offset

        def run_readfirstlane(wave: Wave):
            exec_mask = wave.sgpr[EXEC_LO]
            lane = (exec_mask & -exec_mask).bit_length() - 1 if exec_mask else 0
            wave.sgpr[destination] = int(read(wave)[lane])
        return run_readfirstlane
    if name == "permlanex16_b32":
        return _compile_permlanex16(d, ctx)
    if name in ("cndmask_b32", "add_co_ci_u32", "sub_co_ci_u32", "subrev_co_ci_u32", "add_co_u32", "sub_co_u32",
                "subrev_co_u32", "mad_u64_u32", "mad_co_u64_u32", "mad_co_i64_i32", "div_scale_f32", "div_fmas_f32", "fmac_f32",
                "fmamk_f32", "fmaak_f32", "dot2acc_f32_f16", "cvt_pk_fp8_f32"):
        return _compile_special(d, ctx, encoding, name, fields)
    if name not in OPS:
        return None
    types, out_kind, function = OPS[name]
    operands = _Operands(d, ctx, fields[: len(types)], types)
    write = vector_writer(inst.vdst.offset, out_kind, operands.opsel_destination_high, operands.short_form)

    def run(wave: Wave):
        sources = [to_typed(raw, kind) for raw, kind in zip(operands.read(wave), types)]
        write(wave, to_raw(function(*sources), out_kind))
    return run


def _carry_bits(mask_value: int) -> np.ndarray:
    return mask_lanes(mask_value).astype(np.uint64)


def _compile_special(d, ctx, encoding, name, fields):
    inst = d.inst
    short = encoding in ("VOP1", "VOP2")
    if name == "dot2acc_f32_f16":  # D = D + S0.lo*S1.lo + S0.hi*S1.hi; the packed sources as raw bits
        if getattr(inst, "opsel", 0) or getattr(inst, "neg", 0) or getattr(inst, "abs", 0):
            raise InterpreterError("dot2acc with source modifiers is not supported", ctx.kernel, d.offset, d.name)
        _refuse_inline_float(d, ctx, inst.src0.offset)
        operands = _Operands(d, ctx, fields[:2], ("u32", "u32"))
        read_accumulator = vector_reader(inst.vdst.offset, None, 32, True)
        write = vector_writer(inst.vdst.offset, "f32", False, short)

        def run_dot2acc(wave: Wave):
            a, b = operands.read(wave)
            write(wave, to_raw(dot2(a, b, to_typed(read_accumulator(wave), "f32"), "f16"), "f32"))
        return run_dot2acc
    if name in ("fmac_f32", "fmamk_f32", "fmaak_f32"):
        operands = _Operands(d, ctx, fields[:2], ("f32", "f32"))
        destination = inst.vdst.offset
        read_accumulator = vector_reader(destination, None, 32, True)
        write = vector_writer(destination, "f32", False, short)
        literal = np.float32(np.uint32(d.literal or 0).view(np.float32))

        def run_fmac(wave: Wave):
            a, b = (to_typed(raw, "f32") for raw in operands.read(wave))
            if name == "fmamk_f32":  # d = s0 * K + s1
                result = floats.fma_f32(a, literal, b)
            elif name == "fmaak_f32":  # d = s0 * s1 + K
                result = floats.fma_f32(a, b, literal)
            else:
                result = floats.fma_f32(a, b, to_typed(read_accumulator(wave), "f32"))
            write(wave, to_raw(result, "f32"))
        return run_fmac
    if name == "cndmask_b32":
        operands = _Operands(d, ctx, fields[:2], ("f32", "f32") if not short else ("u32", "u32"))
        read_mask = (lambda wave: wave.sgpr[VCC_LO]) if short else scalar_reader(inst.src2.offset, d.literal, 1)
        write = vector_writer(inst.vdst.offset, "u32", False, short)

        def run_cndmask(wave: Wave):
            a, b = operands.read(wave)
            write(wave, np.where(mask_lanes(read_mask(wave)), b, a))
        return run_cndmask
    if name in ("add_co_u32", "sub_co_u32", "subrev_co_u32", "add_co_ci_u32", "sub_co_ci_u32", "subrev_co_ci_u32"):
        operands = _Operands(d, ctx, fields[:2], ("u32", "u32"))
        with_carry_in = "_ci_" in name
        read_carry = (lambda wave: wave.sgpr[VCC_LO]) if short else (
            scalar_reader(inst.src2.offset, d.literal, 1) if with_carry_in else (lambda wave: 0))
        write_carry = _mask_writer(VCC_LO if short else inst.sdst.offset)
        write = vector_writer(inst.vdst.offset, "u32", False, short)
        subtract, reverse = name.startswith(("sub", "subrev")), name.startswith("subrev")

        def run_carry(wave: Wave):
            a, b = (raw.astype(np.int64) for raw in operands.read(wave))
            if reverse:
                a, b = b, a
            carry_in = _carry_bits(read_carry(wave)).astype(np.int64) if with_carry_in else 0
            total = a - b - carry_in if subtract else a + b + carry_in
            carry_out = (total < 0) if subtract else (total > 0xFFFFFFFF)
            lanes = wave.exec_lanes()
            write(wave, total & 0xFFFFFFFF)
            write_carry(wave, lanes_mask(carry_out & lanes))
        return run_carry
    if name in ("mad_u64_u32", "mad_co_u64_u32"):
        operands = _Operands(d, ctx, fields[:3], ("u32", "u32", "u64"), modifiers=False)
        write = vector_writer(inst.vdst.offset, "u64", False, False)
        write_carry = _mask_writer(inst.sdst.offset)

        def run_mad64(wave: Wave):
            a, b, c = operands.read(wave)
            product = a.astype(np.uint64) * b.astype(np.uint64)
            total = product + c
            write(wave, total)
            write_carry(wave, lanes_mask((total < product) & wave.exec_lanes()))
        return run_mad64
    if name == "mad_co_i64_i32":  # signed 32 x 32 + 64 bits as a 65-bit sum: D the low 64, the carry bit 64
        operands = _Operands(d, ctx, fields[:3], ("i32", "i32", "u64"), modifiers=False)
        write = vector_writer(inst.vdst.offset, "u64", False, False)
        write_carry = _mask_writer(inst.sdst.offset)

        def run_mad_i64(wave: Wave):
            a, b, c = operands.read(wave)
            product = to_typed(a, "i32").astype(np.int64) * to_typed(b, "i32").astype(np.int64)
            addend = c.astype(np.uint64).view(np.int64)
            total = product.view(np.uint64) + addend.view(np.uint64)  # wraps, as the 64-bit adder does
            signed = total.view(np.int64)
            overflow = (np.sign(product) == np.sign(addend)) & (np.sign(signed) != np.sign(product)) & (product != 0)
            negative = (signed < 0) ^ overflow  # the exact sum's sign: bit 64 of the sign-extended sum
            write(wave, total)
            write_carry(wave, lanes_mask(negative & wave.exec_lanes()))
        return run_mad_i64
    if name == "cvt_pk_fp8_f32":  # two f32 to e4m3 in one 16-bit half of the destination (OPSEL[3]), the other kept
        if getattr(inst, "neg", 0) or getattr(inst, "abs", 0) or getattr(inst, "clmp", 0):
            raise InterpreterError("v_cvt_pk_fp8_f32 with modifiers is not supported", ctx.kernel, d.offset, d.name)
        read_a, read_b = (vector_reader(getattr(inst, f).offset, d.literal, 32, True) for f in fields[:2])
        destination = inst.vdst.offset
        read_old = vector_reader(destination, None, 32, False)
        write = vector_writer(destination, "u32", False, False)
        high = bool(getattr(inst, "opsel", 0) >> 3 & 1)

        def run_cvt_pk_fp8(wave: Wave):
            pair = floats.e4m3_bits(to_typed(read_a(wave), "f32")) | floats.e4m3_bits(to_typed(read_b(wave), "f32")) << 8
            old = read_old(wave).astype(np.uint32)
            write(wave, (old & np.uint32(0xFFFF)) | (pair << 16) if high else (old & np.uint32(0xFFFF0000)) | pair)
        return run_cvt_pk_fp8
    if name == "div_scale_f32":
        operands = _Operands(d, ctx, fields[:3], ("f32", "f32", "f32"))
        write = vector_writer(inst.vdst.offset, "f32", False, False)
        write_vcc = _mask_writer(inst.sdst.offset)

        def run_div_scale(wave: Wave):
            s0, s1, s2 = (to_typed(raw, "f32") for raw in operands.read(wave))
            result, vcc = _div_scale(s0, s1, s2)
            write(wave, to_raw(result, "f32"))
            write_vcc(wave, lanes_mask(vcc & wave.exec_lanes()))
        return run_div_scale
    if name == "div_fmas_f32":
        operands = _Operands(d, ctx, fields[:3], ("f32", "f32", "f32"))
        write = vector_writer(inst.vdst.offset, "f32", False, False)

        def run_div_fmas(wave: Wave):
            s0, s1, s2 = (to_typed(raw, "f32") for raw in operands.read(wave))
            exact = floats.fma(s0, s1, s2)
            scaled = np.where(mask_lanes(wave.sgpr[VCC_LO]), exact * 2.0**32, exact)
            with np.errstate(over="ignore"):
                write(wave, to_raw(scaled.astype(np.float32), "f32"))
        return run_div_fmas
    return None


def _div_scale(s0, s1, s2):
    """v_div_scale_f32 (S1 = denominator, S2 = numerator): pre-scales an operand of a division so
    that the reciprocal iteration neither overflows nor loses denormals; VCC says the quotient needs
    scaling back by div_fmas."""
    result = s0.astype(np.float64)
    vcc = np.zeros(s0.shape, bool)
    exp1, exp2 = floats.exponent_f32(s1), floats.exponent_f32(s2)
    tiny = np.finfo(np.float32).tiny
    with np.errstate(all="ignore"):
        reciprocal = 1.0 / s1.astype(np.float64)
        quotient = (s2 / s1).astype(np.float32)
    s1_denormal = (s1 != 0) & (np.abs(s1) < tiny)
    reciprocal_denormal = (reciprocal != 0) & (np.abs(reciprocal) < np.finfo(np.float64).tiny)
    quotient_denormal = (quotient != 0) & (np.abs(quotient) < tiny)
    zero = (s1 == 0) | (s2 == 0)
    near_max = ~zero & (exp2 - exp1 >= 96)
    rest = ~zero & ~near_max
    case_s1_denormal = rest & s1_denormal
    rest &= ~s1_denormal
    case_both = rest & reciprocal_denormal & quotient_denormal
    rest &= ~case_both
    case_reciprocal = rest & reciprocal_denormal
    rest &= ~case_reciprocal
    case_quotient = rest & quotient_denormal
    rest &= ~case_quotient
    case_tiny_numerator = rest & (exp2 <= 23)
    up, down = result * 2.0**64, result * 2.0**-64
    result = np.where(zero, np.nan, result)
    result = np.where((near_max | case_both) & (s0 == s1), up, result)
    result = np.where(case_s1_denormal | case_tiny_numerator, up, result)
    result = np.where(case_reciprocal, down, result)
    result = np.where(case_quotient & (s0 == s2), up, result)
    vcc = near_max | case_both | case_quotient
    with np.errstate(over="ignore"):
        return result.astype(np.float32), vcc


def _compile_permlanex16(d, ctx):
    """Each lane reads lane (other half-row)*16 + select from S0; selects come from the 64-bit
    {S2, S1}, four bits per lane of a row. Only active lanes are written. Source lanes are read whether
    active or not, as fetch-inactive (op_sel[0]) does; without it an active lane reading an inactive
    one would keep its "old" value, which is not modelled: such a read is refused."""
    inst = d.inst
    if inst.opsel & 0b10:
        raise InterpreterError("permlanex16 bound-control bit is not supported", ctx.kernel, d.offset, d.name)
    fetch_inactive = bool(inst.opsel & 0b01)
    source = inst.src0.offset - VGPR_BASE
    read_low, read_high = scalar_reader(inst.src1.offset, d.literal, 1), scalar_reader(inst.src2.offset, d.literal, 1)
    destination = inst.vdst.offset - VGPR_BASE
    lane = np.arange(32)
    other_row = (1 - lane // 16) * 16

    def run(wave: Wave):
        selects = read_low(wave) | read_high(wave) << 32
        index = np.array([(selects >> (4 * (i % 16))) & 0xF for i in range(32)]) + other_row
        active = wave.exec_lanes()
        if not fetch_inactive and not active[index[active]].all():
            raise InterpreterError("permlanex16 without fetch-inactive reads an inactive lane", ctx.kernel, d.offset,
                                   d.name)
        wave.write_vgpr(destination, wave.vgpr[source][index].copy())
    return run


def _compile_fma_mix(d, ctx):
    """v_fma_mix{lo,hi}_f16: each source is f32, or the f16 half opsel names (opsel_hi set);
    one fused multiply-add rounded once to f16, written to one half of the destination."""
    inst = d.inst
    if inst.clmp:
        raise InterpreterError("clamp is not supported", ctx.kernel, d.offset, d.name)
    opsel, opsel_hi = inst.opsel, inst.opsel_hi | inst.opsel_hi2 << 2
    readers = []
    for i, field in enumerate(("src0", "src1", "src2")):
        offset = getattr(inst, field).offset
        is_f16 = bool(opsel_hi >> i & 1)
        width = 16 if is_f16 else 32
        read = vector_reader(offset, d.literal, width, True, bool(opsel >> i & 1))
        read = _modified(read, width, bool(inst.neg >> i & 1), bool(inst.neg_hi >> i & 1))
        readers.append((read, "f16" if is_f16 else "f32"))
    kind = "f16"
    if d.name.endswith("mix_f32"):
        return None
    write = vector_writer(inst.vdst.offset, kind, d.name.endswith("mixhi_f16"), False)

    def run(wave: Wave):
        a, b, c = (to_typed(read(wave), k) for read, k in readers)
        with np.errstate(all="ignore"):
            write(wave, floats.f16_bits(floats.fma(a, b, c)))
    return run


def _compile_vopd(d, ctx):
    """Two VALU ops issued together: both read their sources before either writes."""
    inst = d.inst
    halves = []
    for op_field, dst_field, src0_field, src1_field in (("opx", "vdstx", "srcx0", "vsrcx1"), ("opy", "vdsty", "srcy0", "vsrcy1")):
        name = base_name(getattr(inst, op_field).name.lower())
        destination = getattr(inst, dst_field).offset
        read0 = vector_reader(getattr(inst, src0_field).offset, d.literal, 32, True)
        read1 = vector_reader(getattr(inst, src1_field).offset, d.literal, 32, True)
        write = vector_writer(destination, "u32", False, False)
        if name == "dot2acc_f32_f16":
            _refuse_inline_float(d, ctx, getattr(inst, src0_field).offset)
        halves.append((_vopd_function(name, destination, d, ctx), read0, read1, write))

    def run(wave: Wave):
        results = [(function(wave, read0(wave), read1(wave)), write) for function, read0, read1, write in halves]
        for result, write in results:
            write(wave, result)
    return run


def _vopd_function(name, destination, d, ctx):
    literal = np.uint32(d.literal or 0).view(np.float32)
    index = destination - VGPR_BASE
    f32 = lambda raw: raw.view(np.float32)  # noqa: E731
    if name == "mov_b32":
        return lambda wave, a, b: a.copy()
    if name == "cndmask_b32":
        return lambda wave, a, b: np.where(mask_lanes(wave.sgpr[VCC_LO]), b, a)
    if name == "fmac_f32":
        return lambda wave, a, b: to_raw(floats.fma_f32(f32(a), f32(b), f32(wave.vgpr[index])), "f32")
    if name == "fmamk_f32":
        return lambda wave, a, b: to_raw(floats.fma_f32(f32(a), literal, f32(b)), "f32")
    if name == "fmaak_f32":
        return lambda wave, a, b: to_raw(floats.fma_f32(f32(a), f32(b), literal), "f32")
    if name == "dot2acc_f32_f16":
        return lambda wave, a, b: to_raw(dot2(a, b, f32(wave.vgpr[index]), "f16"), "f32")
    if name not in OPS:
        raise InterpreterError(f"unknown VOPD operation v_dual_{name}", ctx.kernel, d.offset, d.name)
    types, out_kind, function = OPS[name]
    if len(types) == 1:
        return lambda wave, a, b: to_raw(function(to_typed(a, types[0])), out_kind)
    return lambda wave, a, b: to_raw(function(to_typed(a, types[0]), to_typed(b, types[1])), out_kind)
