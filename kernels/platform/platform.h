// Picks the platform layer: real AMD hardware (clang -x hip) or its NVIDIA emulation (nvcc), and adds
// what is the same on both.
#pragma once

#if defined(__AMDGCN__)
#include "amdgcn.h"
#elif defined(__CUDACC__)
#include "cuda_emu.h"
#else
#error "build for an AMD target (clang -x hip) or for NVIDIA emulation (nvcc -DRDNA_EMULATE=11|12)"
#endif

namespace rdna {

// Whether a kernel's 16-bit type DT is fp16 (else bf16), for choices made at compile time.
template <class DT> constexpr bool kIsF16 = false;
template <> constexpr bool kIsF16<f16> = true;

// Round to nearest even, NaN kept quiet: the same bits on every target, and no dependence on the
// compiler's bf16 support.
RDNA_DEV float from_bits(bf16, u16 x) { return as_f32(u32(x) << 16); }

// x as the nearest 16-bit value, back in float: x - round_to(dt, x) is what 16 bits lose.
template <class DT>
RDNA_DEV float round_to(DT dt, float x) { return from_bits(dt, to_bits(dt, x)); }

// A probability as the matrix unit will see it. The row sum adds up these rounded values, so the
// weights applied to V sum to exactly the normaliser: the rounding error then scales with how far
// each value row is from the output rather than with the values themselves. Probabilities come
// from exp2, finite or a quiet NaN that the rounding add keeps a NaN, so no NaN test is needed.
RDNA_DEV float round_probability(bf16, float x) {
  const u32 u = as_u32(x);
  return as_f32((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}
RDNA_DEV float round_probability(f16 dt, float x) { return round_to(dt, x); }

// The 16-bit pattern of a value round_probability produced: exact, so bf16 just drops the low half.
RDNA_DEV u16 probability_bits(bf16, float rounded) { return u16(as_u32(rounded) >> 16); }
RDNA_DEV u16 probability_bits(f16 dt, float rounded) { return to_bits(dt, rounded); }

// Two probabilities rounded to bf16, packed (lo first): to nearest, ties away from zero (one add
// each; round_probability's ties-to-even costs two more ops per value). The forward sums these same
// packed values for its normaliser, so the rule does not bias the output, and exp2's results are
// exact ties about once in 2^16 values. exp2's NaN (0x7fc00000) stays a NaN; only payloads from
// 0x7fff8000 up would carry into the sign.
RDNA_DEV u32 pack_rounded(bf16, float lo, float hi) {
  return pack_high_halves(as_u32(lo) + 0x8000u, as_u32(hi) + 0x8000u);
}
// pack_rounded for probabilities (>= 0): f16 has a cheaper form on AMD (amdgcn.h).
RDNA_DEV u32 pack_probabilities(bf16 dt, float lo, float hi) { return pack_rounded(dt, lo, hi); }

RDNA_DEV u16 to_bits(bf16, float x) {
  const u32 u = as_u32(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return u16((u >> 16) | 0x40u);
  return u16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// What x's 16-bit rounding (to_bits) loses, rounded to 16 bits in turn. bf16 without to_bits' NaN
// test, whose per-value masks crowd the scalar registers: a NaN x belongs to a NaN output, whose
// gradients are NaN whatever its remainder holds.
RDNA_DEV u16 remainder_bits(bf16 dt, float x) {
  return probability_bits(dt, round_probability(dt, x - round_probability(dt, x)));
}
RDNA_DEV u16 remainder_bits(f16 dt, float x) { return to_bits(dt, x - round_to(dt, x)); }

RDNA_DEV int min_int(int a, int b) { return a < b ? a : b; }

RDNA_DEV u32 pack_u16x2(u16 lo, u16 hi) { return u32(lo) | (u32(hi) << 16); }

}  // namespace rdna
