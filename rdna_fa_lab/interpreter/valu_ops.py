"""What each vector ALU operation computes, on typed numpy arrays over the 32 lanes.

Each entry: (source types, destination type, function). Types: f32, f16 (computed in f32, rounded
to f16 on write), i32, u32, i16, u16, u64. The encoding-specific part (operands, modifiers, EXEC,
VOPD pairing) lives in vector.py. Transcendentals are computed exactly (v_exp_f32 is 2^x,
v_log_f32 is log2 x, v_rcp_f32 is 1/x, all correctly rounded): the hardware is within 1 ulp of
these, so results can differ from a GPU's in the last bit.
"""

from __future__ import annotations

import numpy as np

from . import floats

_U32, _U64 = np.uint64(0xFFFFFFFF), np.uint64


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _bfe_u(value, offset, width):
    offset, width = offset & 31, width & 31
    field = (value >> offset) & ((np.uint64(1) << width) - np.uint64(1))
    return np.where(width == 0, np.uint64(0), field)


def _bfe_i(value, offset, width):
    offset, width = (offset & 31).astype(np.int64), (width & 31).astype(np.int64)
    shifted = (value.astype(np.int64) << (32 - offset - width)) & 0xFFFFFFFF
    signed = np.where(shifted >= 2**31, shifted - 2**32, shifted)
    return np.where(width == 0, 0, signed >> np.maximum(32 - width, 0))


def _perm(s0, s1, selector):
    """v_perm_b32: byte select from {s0, s1} (bytes 0-3 from s1, 4-7 from s0)."""
    combined = (s0.astype(np.uint64) << np.uint64(32)) | s1.astype(np.uint64)
    result = np.zeros_like(s0, dtype=np.uint64)
    for byte in range(4):
        select = (selector >> np.uint64(8 * byte)) & np.uint64(0xFF)
        chosen = (combined >> (np.minimum(select, np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        chosen = np.where(select >= 13, np.uint64(0xFF), np.where(select == 12, np.uint64(0), chosen))
        if np.any((select >= 8) & (select < 12)):
            raise ValueError("v_perm_b32 sign-replicating selectors (8-11) are not supported")
        result |= chosen << np.uint64(8 * byte)
    return result


def dot2(a_bits, b_bits, accumulator, halves):
    """v_dot2*_f32_{f16,bf16}: accumulator + a.lo*b.lo + a.hi*b.hi, in the order of AMD's pseudocode
    (tmp += lo product; tmp += hi product; tmp is f32). A product of two f16 or two bf16 values is
    exact in f64 (and in f32 for f16), so each step is one correctly rounded f32 fused add: two
    roundings in all. The hardware may keep more precision between the two adds; then results differ
    in the last bit of f32."""
    decode = floats.f16_from_bits if halves == "f16" else floats.bf16_from_bits
    a_bits, b_bits = np.asarray(a_bits, dtype=np.uint32), np.asarray(b_bits, dtype=np.uint32)
    low = floats.fma_f32(decode(a_bits), decode(b_bits), accumulator)
    return floats.fma_f32(decode(a_bits >> np.uint32(16)), decode(b_bits >> np.uint32(16)), low)


def _max3(a, b, c):
    return np.fmax(np.fmax(a, b), c)


def _min3(a, b, c):
    return np.fmin(np.fmin(a, b), c)


def _maxmin(a, b, c):
    return np.fmin(np.fmax(a, b), c)


def _minmax(a, b, c):
    return np.fmax(np.fmin(a, b), c)


def _med3(a, b, c):
    return np.fmax(np.fmin(a, b), np.fmin(np.fmax(a, b), c))


def _exact(function):
    """A transcendental computed in f64 and rounded once to f32."""
    def compute(x):
        with np.errstate(all="ignore"):
            return function(_f64(x)).astype(np.float32)
    return compute


def _i24(x):
    x = x.astype(np.int64) & 0xFFFFFF
    return np.where(x >= 2**23, x - 2**24, x)


def _u24(x):
    return x.astype(np.uint64) & np.uint64(0xFFFFFF)


def _bit_reversed(x):
    """Bit i of each 32-bit value moved to bit 31 - i (the compiler builds 0x7fffffff as bfrev of -2)."""
    x = x.astype(np.uint64)
    out = np.zeros_like(x)
    for i in range(32):
        out |= ((x >> np.uint64(i)) & np.uint64(1)) << np.uint64(31 - i)
    return out


def _div_fixup(quotient, denominator, numerator):
    """v_div_fixup_f32 (S0 = quotient estimate, S1 = denominator, S2 = numerator): special cases
    of numerator / denominator, otherwise the estimate with the quotient's sign."""
    q, d, n = _f64(quotient), _f64(denominator), _f64(numerator)
    sign_negative = np.signbit(d) ^ np.signbit(n)
    result = np.where(sign_negative, -np.abs(q), np.abs(q))
    result = np.where((np.abs(d) == np.inf) | (n == 0), np.where(sign_negative, -0.0, 0.0), result)
    result = np.where((d == 0) | (np.abs(n) == np.inf), np.where(sign_negative, -np.inf, np.inf), result)
    result = np.where(((d == 0) & (n == 0)) | ((np.abs(d) == np.inf) & (np.abs(n) == np.inf)), np.nan, result)
    result = np.where(np.isnan(d), d, result)
    result = np.where(np.isnan(n), n, result)
    return result.astype(np.float32)


F2, F3, U2, U3, I2 = ("f32", "f32"), ("f32", "f32", "f32"), ("u32", "u32"), ("u32", "u32", "u32"), ("i32", "i32")

OPS = {
    # f32 arithmetic (numpy float32: IEEE, round to nearest even)
    "add_f32": (F2, "f32", lambda a, b: a + b),
    "sub_f32": (F2, "f32", lambda a, b: a - b),
    "subrev_f32": (F2, "f32", lambda a, b: b - a),
    "mul_f32": (F2, "f32", lambda a, b: a * b),
    "min_f32": (F2, "f32", np.fmin), "max_f32": (F2, "f32", np.fmax),
    "min_num_f32": (F2, "f32", np.fmin), "max_num_f32": (F2, "f32", np.fmax),
    "fma_f32": (F3, "f32", floats.fma_f32),
    "div_fixup_f32": (F3, "f32", _div_fixup),
    "max3_f32": (F3, "f32", _max3), "min3_f32": (F3, "f32", _min3), "med3_f32": (F3, "f32", _med3),
    "max3_num_f32": (F3, "f32", _max3), "min3_num_f32": (F3, "f32", _min3), "med3_num_f32": (F3, "f32", _med3),
    "maxmin_f32": (F3, "f32", _maxmin), "minmax_f32": (F3, "f32", _minmax),
    "maxmin_num_f32": (F3, "f32", _maxmin), "minmax_num_f32": (F3, "f32", _minmax),
    "exp_f32": (("f32",), "f32", _exact(np.exp2)),
    "log_f32": (("f32",), "f32", _exact(np.log2)),
    "rcp_f32": (("f32",), "f32", _exact(lambda x: 1.0 / x)),
    # The reciprocal of the compiler's integer division (the kernels' head / kv_group): v_rcp_f32's
    # value; its flag only changes which exceptions are signalled.
    "rcp_iflag_f32": (("f32",), "f32", _exact(lambda x: 1.0 / x)),
    "rsq_f32": (("f32",), "f32", _exact(lambda x: 1.0 / np.sqrt(x))),
    "sqrt_f32": (("f32",), "f32", _exact(np.sqrt)),
    "ldexp_f32": (("f32", "i32"), "f32", lambda a, e: np.ldexp(_f64(a), np.clip(e, -1000, 1000)).astype(np.float32)),
    "cvt_f32_f16": (("f16",), "f32", lambda a: a),
    "cvt_f16_f32": (("f32",), "f16", lambda a: a),
    "cvt_f32_i32": (("i32",), "f32", lambda a: a.astype(np.float32)),
    "rndne_f32": (("f32",), "f32", np.rint),  # to the nearest integer, ties to even
    "cvt_f32_u32": (("u32",), "f32", lambda a: a.astype(np.float32)),
    "cvt_i32_f32": (("f32",), "i32", lambda a: np.clip(np.nan_to_num(np.trunc(a)), -2**31, 2**31 - 1).astype(np.int64)),
    "cvt_u32_f32": (("f32",), "u32", lambda a: np.clip(np.nan_to_num(np.trunc(a)), 0, 2**32 - 1).astype(np.int64)),
    "cvt_pk_bf16_f32": (F2, "u32", lambda a, b: floats.bf16_bits(a) | floats.bf16_bits(b) << 16),
    "cvt_pk_rtz_f16_f32": (F2, "u32", lambda a, b: floats.f16_bits_toward_zero(a) | floats.f16_bits_toward_zero(b) << 16),
    "pack_b32_f16": (("u16", "u16"), "u32", lambda a, b: a | b << np.uint64(16)),
    # 32-bit integer
    "mov_b32": (("u32",), "u32", lambda a: a),
    "not_b32": (("u32",), "u32", lambda a: ~a),
    "bfrev_b32": (("u32",), "u32", _bit_reversed),
    "add_nc_u32": (U2, "u32", lambda a, b: a + b),
    "sub_nc_u32": (U2, "u32", lambda a, b: a - b),
    "subrev_nc_u32": (U2, "u32", lambda a, b: b - a),
    "add_nc_i32": (I2, "i32", lambda a, b: a + b),
    "sub_nc_i32": (I2, "i32", lambda a, b: a - b),
    "and_b32": (U2, "u32", lambda a, b: a & b),
    "or_b32": (U2, "u32", lambda a, b: a | b),
    "xor_b32": (U2, "u32", lambda a, b: a ^ b),
    "xnor_b32": (U2, "u32", lambda a, b: ~(a ^ b)),
    "lshlrev_b32": (U2, "u32", lambda a, b: b << (a & np.uint64(31))),
    "lshrrev_b32": (U2, "u32", lambda a, b: b >> (a & np.uint64(31))),
    "ashrrev_i32": (("u32", "i32"), "i32", lambda a, b: b >> (a & 31).astype(np.int64)),
    "lshlrev_b64": (("u32", "u64"), "u64", lambda a, b: b << (a & np.uint64(63))),
    "lshrrev_b64": (("u32", "u64"), "u64", lambda a, b: b >> (a & np.uint64(63))),
    "mul_lo_u32": (U2, "u32", lambda a, b: a * b),
    "mul_hi_u32": (U2, "u32", lambda a, b: (a * b) >> np.uint64(32)),
    "mul_hi_i32": (I2, "i32", lambda a, b: (a * b) >> 32),
    "mul_u32_u24": (U2, "u32", lambda a, b: _u24(a) * _u24(b)),
    "mul_i32_i24": (U2, "i32", lambda a, b: _i24(a) * _i24(b)),
    "mad_u32_u24": (U3, "u32", lambda a, b, c: _u24(a) * _u24(b) + c),
    "mad_i32_i24": (("u32", "u32", "i32"), "i32", lambda a, b, c: _i24(a) * _i24(b) + c),
    "add3_u32": (U3, "u32", lambda a, b, c: a + b + c),
    "xad_u32": (U3, "u32", lambda a, b, c: (a ^ b) + c),
    "and_or_b32": (U3, "u32", lambda a, b, c: (a & b) | c),
    "or3_b32": (U3, "u32", lambda a, b, c: a | b | c),
    "xor3_b32": (U3, "u32", lambda a, b, c: a ^ b ^ c),
    "lshl_or_b32": (U3, "u32", lambda a, b, c: (a << (b & np.uint64(31))) | c),
    "lshl_add_u32": (U3, "u32", lambda a, b, c: (a << (b & np.uint64(31))) + c),
    "add_lshl_u32": (U3, "u32", lambda a, b, c: (a + b) << (c & np.uint64(31))),
    "bfe_u32": (U3, "u32", _bfe_u),
    "bfe_i32": (U3, "i32", _bfe_i),
    "bfi_b32": (U3, "u32", lambda a, b, c: (a & b) | (~a & c)),
    "perm_b32": (U3, "u32", _perm),
    "alignbit_b32": (U3, "u32", lambda a, b, c: ((a << np.uint64(32) | b) >> (c & np.uint64(31)))),
    "min_i32": (I2, "i32", np.minimum), "max_i32": (I2, "i32", np.maximum),
    "min_u32": (U2, "u32", np.minimum), "max_u32": (U2, "u32", np.maximum),
    "bcnt_u32_b32": (U2, "u32", lambda a, b: np.array([bin(int(x)).count("1") for x in a], np.uint64) + b),
    # 16-bit integer (the low half of the register, or the half opsel names)
    "add_nc_u16": (("u16", "u16"), "u16", lambda a, b: a + b),
    "sub_nc_u16": (("u16", "u16"), "u16", lambda a, b: a - b),
    "mul_lo_u16": (("u16", "u16"), "u16", lambda a, b: a * b),
    "lshlrev_b16": (("u16", "u16"), "u16", lambda a, b: b << (a & np.uint64(15))),
    "lshrrev_b16": (("u16", "u16"), "u16", lambda a, b: b >> (a & np.uint64(15))),
    "mov_b16": (("u16",), "u16", lambda a: a),
}



# Compares: name part -> function of (a, b) on typed arrays (NaN rules of the ISA: the N* forms
# and neq are true on unordered inputs).
COMPARES = {
    "f": lambda a, b: np.zeros(a.shape, bool), "t": lambda a, b: np.ones(a.shape, bool),
    "lt": np.less, "eq": np.equal, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "lg": lambda a, b: (a < b) | (a > b), "ne": np.not_equal, "neq": lambda a, b: ~(a == b),
    "o": lambda a, b: ~(np.isnan(a) | np.isnan(b)), "u": lambda a, b: np.isnan(a) | np.isnan(b),
    "nge": lambda a, b: ~(a >= b), "nlg": lambda a, b: ~((a < b) | (a > b)), "ngt": lambda a, b: ~(a > b),
    "nle": lambda a, b: ~(a <= b), "nlt": lambda a, b: ~(a < b),
}


def to_typed(raw: np.ndarray, kind: str) -> np.ndarray:
    """Raw register bits (uint32, or uint64 for 64-bit operands) as the operand's type."""
    if kind == "f32":
        return raw.astype(np.uint32, copy=False).view(np.float32)
    if kind == "f16":
        return floats.f16_from_bits(raw)
    if kind == "bf16":
        return floats.bf16_from_bits(raw)
    if kind == "i32":
        return raw.astype(np.uint32, copy=False).view(np.int32).astype(np.int64)
    if kind in ("u32", "u16"):
        return raw.astype(np.uint64)
    if kind == "i16":
        return (raw.astype(np.int64) & 0xFFFF) - ((raw.astype(np.int64) & 0x8000) << 1)
    if kind == "u64":
        return raw.astype(np.uint64, copy=False)
    if kind == "i64":
        return raw.astype(np.uint64, copy=False).view(np.int64)
    if kind == "f64":
        return raw.astype(np.uint64, copy=False).view(np.float64)
    raise ValueError(kind)


def to_raw(value: np.ndarray, kind: str) -> np.ndarray:
    """A typed result as register bits: uint32 (16-bit results in the low half) or uint64."""
    if kind == "f32":
        return np.asarray(value, dtype=np.float32).view(np.uint32)
    if kind == "f16":
        return floats.f16_bits(value)
    if kind in ("u32", "i32"):
        return (np.asarray(value).astype(np.int64, copy=False) & 0xFFFFFFFF).astype(np.uint32)
    if kind in ("u16", "i16"):
        return (np.asarray(value).astype(np.int64, copy=False) & 0xFFFF).astype(np.uint32)
    if kind == "u64":
        return np.asarray(value).astype(np.uint64)
    raise ValueError(kind)


WIDTHS = {"f32": 32, "f16": 16, "bf16": 16, "i32": 32, "u32": 32, "i16": 16, "u16": 16, "u64": 64, "i64": 64, "f64": 64}
