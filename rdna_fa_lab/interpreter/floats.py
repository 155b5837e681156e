"""Floating-point helpers with the hardware's rounding, vectorised over lanes.

Every conversion to a narrower format rounds to nearest even, as the VALU does by default. A fused
multiply-add is computed exactly: the f64 product of two f32 (or f16) values is exact, the sum is
rounded to odd in f64 (so that one more rounding to f32/f16 is correct, not double-rounded).
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64


def f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bits32(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def f16_from_bits(bits: np.ndarray) -> np.ndarray:
    """16-bit patterns (in any unsigned array) as float32."""
    return (np.asarray(bits) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)


def bf16_from_bits(bits: np.ndarray) -> np.ndarray:
    return ((np.asarray(bits, dtype=np.uint32) & 0xFFFF) << 16).view(np.float32)


def f16_bits(values: np.ndarray) -> np.ndarray:
    """Round (f32 or f64) values to f16, nearest even; the 16-bit patterns as uint32."""
    with np.errstate(over="ignore"):  # beyond the f16 range is infinity, as on the hardware
        return np.asarray(values).astype(np.float16).view(np.uint16).astype(np.uint32)


def f16_bits_toward_zero(values: np.ndarray) -> np.ndarray:
    """Round f32 values to f16 toward zero (v_cvt_pk_rtz_f16_f32): nearest even, then one step back
    towards zero wherever that went past the value (overflow lands on the largest finite f16)."""
    values = np.asarray(values, dtype=np.float32)
    bits = f16_bits(values)
    nearest = f16_from_bits(bits).astype(np.float64)
    past = np.isfinite(values) & (np.abs(nearest) > np.abs(values.astype(np.float64)))
    return np.where(past, bits - 1, bits).astype(np.uint32)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round f32 values to bf16, nearest even (NaN stays a quiet NaN)."""
    bits = bits32(values).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    return np.where(nan, (bits >> 16).astype(np.uint32) | 0x40, rounded & 0xFFFF)


def round_to_odd_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b in f64 rounded to odd: exact enough that rounding the result again to f32 or f16 gives
    the correctly rounded sum."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        total = a + b
        b_virtual = total - a
        error = (a - (total - b_virtual)) + (b - b_virtual)
    inexact = (error != 0) & np.isfinite(total)
    bits = total.view(_U64)
    even = (bits & _U64(1)) == 0
    # Move one ulp towards the error (away from zero when the error has the sum's sign).
    toward_error = np.where(np.signbit(error) == np.signbit(total), _U64(1), _U64(0xFFFFFFFFFFFFFFFF))  # +1 / -1
    adjusted = np.where(inexact & even, bits + toward_error, bits)
    return adjusted.view(np.float64)


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Fused a*b + c of f32 inputs (or narrower), as an f64 array rounded to odd: cast to the
    destination format for the single correct rounding."""
    with np.errstate(over="ignore", invalid="ignore"):
        product = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    return round_to_odd_sum(product, c)


def fma_f32(a, b, c) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return fma(a, b, c).astype(np.float32)


def exponent_f32(values: np.ndarray) -> np.ndarray:
    """The biased exponent field of f32 values."""
    return ((bits32(values) >> 23) & 0xFF).astype(np.int32)


def e4m3_from_bits(bits: np.ndarray) -> np.ndarray:
    """OCP e4m3 (gfx12's fp8, torch.float8_e4m3fn) bytes as float32: bias 7, no infinities, S.1111.111 NaN."""
    bits = np.asarray(bits).astype(np.int64) & 0xFF
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    magnitude = np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -9),
                         np.ldexp((8 + mantissa).astype(np.float64), exponent - 10))
    value = np.where(bits & 0x80, -magnitude, magnitude)
    return np.where((exponent == 15) & (mantissa == 7), np.nan, value).astype(np.float32)


def e4m3_bits(values: np.ndarray) -> np.ndarray:
    """f32 values to OCP e4m3 as v_cvt_pk_fp8_f32 converts them: nearest even, subnormals kept; without
    MODE.FP16_OVFL, magnitudes above 464 (where nearest even would leave 448) and infinities become NaN
    (0x7f with the sign), and a NaN 0xff. Bytes as uint32."""
    x = np.asarray(values, dtype=np.float32).astype(np.float64)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint32)
    a = np.abs(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        _, exponent = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))
        step = np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)  # spacing of e4m3 values at a's binade
        rounded = np.round(a / step) * step  # numpy rounds halves to even
        _, r_exponent = np.frexp(np.where(rounded > 0, rounded, 1.0))
        normal = rounded >= 2.0**-6
        code = np.where(normal, ((r_exponent - 1 + 7) << 3) + (np.where(normal, rounded, 1.0)
                                                               / np.ldexp(1.0, r_exponent - 1) * 8 - 8).astype(np.int64),
                        (rounded / 2.0**-9).astype(np.int64))
    code = np.where(a > 464.0, 0x7F, code).astype(np.uint32) | sign
    return np.where(np.isnan(x), np.uint32(0xFF), code)
