// Platform layer for NVIDIA GPUs: a model of the RDNA wave32 hardware that the kernel body and the
// ISA headers run on unchanged. A CUDA warp plays a wave32. The WMMA and cross-lane instructions are
// re-implemented from the register layouts in DESIGN.md section 3, independently of the ISA
// headers, so a layout mistake in an ISA header shows up as a wrong result, not as a matching one.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define RDNA_DEV __device__ __forceinline__
#define RDNA_KERNEL(threads) extern "C" __global__ void __launch_bounds__(threads)
// Dynamic shared memory: variants above 48 KiB cannot be static on NVIDIA. The launcher passes
// the variant's LDS size, which is what the AMD build declares statically.
#define RDNA_LDS_ARRAY(type, name, count) extern __shared__ __align__(16) type name[]

#ifndef RDNA_EMULATE
#error "RDNA_EMULATE must be 11 or 12 for an NVIDIA build"
#endif
#if RDNA_EMULATE == 11
#define __GFX11__ 1
#elif RDNA_EMULATE == 12
#define __GFX12__ 1
#else
#error "RDNA_EMULATE must be 11 or 12"
#endif

namespace rdna {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
struct __align__(16) u32x4 {
  u32 e[4];
  RDNA_DEV u32& operator[](int i) { return e[i]; }
  RDNA_DEV u32 operator[](int i) const { return e[i]; }
};
struct v2f {
  float e[2];
  RDNA_DEV float operator[](int i) const { return e[i]; }
};
struct v8f {
  float e[8];
  RDNA_DEV float& operator[](int i) { return e[i]; }
  RDNA_DEV float operator[](int i) const { return e[i]; }
};

struct f16 {};
struct bf16 {};

RDNA_DEV int thread_id() { return threadIdx.x; }
RDNA_DEV int block_id_x() { return blockIdx.x; }
RDNA_DEV int block_id_y() { return blockIdx.y; }
RDNA_DEV int block_id_z() { return blockIdx.z; }
RDNA_DEV int lane_id() { return threadIdx.x & 31; }
RDNA_DEV void block_barrier() { __syncthreads(); }
// A warp's lanes may run apart (independent thread scheduling); a wave's never do.
RDNA_DEV void wave_barrier() { __syncwarp(); }
// Memory operations are not moved across it by the compiler; no instruction is emitted.
RDNA_DEV void compiler_fence() { asm volatile("" ::: "memory"); }

// A warp's value is its wave's: nothing to make scalar.
RDNA_DEV int wave_uniform(int v) { return v; }

// Whether `p` holds in any lane of the wave; every lane must call it.
RDNA_DEV bool any_lane(bool p) { return __any_sync(0xffffffffu, p); }

RDNA_DEV u32x4 zero_u32x4() { return u32x4{{0u, 0u, 0u, 0u}}; }
RDNA_DEV v8f zero_v8f() { return v8f{{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}}; }
// The same zeros: register allocation is the RDNA compiler's concern (amdgcn.h).
RDNA_DEV v8f held_zero_v8f() { return zero_v8f(); }

// Register allocation and instruction selection are the RDNA compiler's concern (amdgcn.h).
RDNA_DEV u32 loop_variant(u32 v) { return v; }
RDNA_DEV float unmerged_copy(float x) { return x; }
RDNA_DEV v2f adjacent_copies(float x) { return v2f{{x, x}}; }

RDNA_DEV float exp2_approx(float x) { return exp2f(x); }
RDNA_DEV float log2_approx(float x) { return log2f(x); }
RDNA_DEV float max_f32(float a, float b) { return fmaxf(a, b); }
RDNA_DEV float min_f32(float a, float b) { return fminf(a, b); }
RDNA_DEV float fma_f32(float a, float b, float c) { return fmaf(a, b, c); }
RDNA_DEV float mul_rounded_f32(float a, float b) { return __fmul_rn(a, b); }  // never contracted
RDNA_DEV float abs_f32(float x) { return fabsf(x); }
RDNA_DEV float round_even(float x) { return rintf(x); }  // to the nearest integer, ties to even
RDNA_DEV float as_f32(u32 x) { return __uint_as_float(x); }
RDNA_DEV u32 as_u32(float x) { return __float_as_uint(x); }

RDNA_DEV u16 to_bits(f16, float x) { return __half_as_ushort(__float2half_rn(x)); }

RDNA_DEV float from_bits(f16, u16 x) { return __half2float(__ushort_as_half(x)); }

// v_permlanex16_b32 as the ISA defines it: lane i of row r reads lane sel[i % 16] of row 1 - r,
// where sel is the 64-bit selector sel_hi:sel_lo in nibbles. The whole warp takes part, as the whole
// wave does in the kernels, where FETCH_INACTIVE changes nothing.
template <bool FETCH_INACTIVE = true>
RDNA_DEV u32 permlanex16(u32 src, u32 sel_lo, u32 sel_hi) {
  const int lane = lane_id();
  const int i = lane & 15;
  const u32 sel = i < 8 ? (sel_lo >> (4 * i)) & 15u : (sel_hi >> (4 * (i - 8))) & 15u;
  const int source = (lane < 16 ? 16 : 0) + int(sel);
  return __shfl_sync(0xffffffffu, src, source);
}

RDNA_DEV u32 pack_low_halves(u32 lo, u32 hi) { return (lo & 0xffffu) | (hi << 16); }
RDNA_DEV u32 pack_high_halves(u32 lo, u32 hi) { return (lo >> 16) | (hi & 0xffff0000u); }

RDNA_DEV u32 pack_rounded(f16, float lo, float hi) {
  return u32(to_bits(f16{}, lo)) | (u32(to_bits(f16{}, hi)) << 16);
}
RDNA_DEV u32 pack_probabilities(f16 dt, float lo, float hi) { return pack_rounded(dt, lo, hi); }
RDNA_DEV float add_pair(f16, u32 pair, float acc) {
  return acc + (from_bits(f16{}, u16(pair)) + from_bits(f16{}, u16(pair >> 16)));
}
RDNA_DEV float add_pair(bf16, u32 pair, float acc) {
  return acc + (__uint_as_float(pair << 16) + __uint_as_float(pair & 0xffff0000u));
}

// The 16-bit element e of an operand held as packed words (low half first, as in a VGPR).
template <int W>
RDNA_DEV u16 element(const u32 (&w)[W], int e) {
  return u16(w[e >> 1] >> (16 * (e & 1)));
}

// Word j of the operand held by another lane.
template <int W>
RDNA_DEV u32 word_of_lane(const u32 (&w)[W], int j, int source_lane) {
  return __shfl_sync(0xffffffffu, w[j], source_lane);
}

// gfx11 requires lanes 16-31 to hold the same A and B as lanes 0-15; real hardware reads only one
// half, so breaking the rule gives silently wrong results there. Here it stops the kernel.
template <int W>
RDNA_DEV void check_gfx11_duplication(const u32 (&w)[W]) {
  bool same = true;
  for (int j = 0; j < W; ++j) same &= (__shfl_xor_sync(0xffffffffu, w[j], 16) == w[j]);
  if (!__all_sync(0xffffffffu, same)) __trap();
}

// Operands by value: the emulated instructions are called out of line (once per dtype), which keeps
// nvcc's compile time and code size sane; passing them by value keeps them in registers.
template <int W>
struct Words {
  u32 w[W];
};

// gfx11 WMMA 16x16x16: A row m is lane m (k = element 0..15), B column n is lane n, D[2s + l/16][l % 16].
template <class DT>
__device__ __noinline__ v8f emulate_wmma_gfx11(DT dt, Words<8> a_words, Words<8> b_words, v8f c) {
  const u32(&a)[8] = a_words.w;
  const u32(&b)[8] = b_words.w;
  check_gfx11_duplication(a);
  check_gfx11_duplication(b);
  const int lane = lane_id();
  float bcol[16];
  for (int k = 0; k < 16; ++k) bcol[k] = from_bits(dt, element(b, k));
  for (int s = 0; s < 8; ++s) {
    const int row = 2 * s + (lane >> 4);
    u32 arow[8];
    for (int j = 0; j < 8; ++j) arow[j] = word_of_lane(a, j, row);
    float acc = c[s];
    for (int k = 0; k < 16; ++k) acc = fmaf(from_bits(dt, element(arow, k)), bcol[k], acc);
    c[s] = acc;
  }
  return c;
}

// gfx12 WMMA 16x16x16: A row m, k = 8*(l/16) + s sits in lane m + 16*(k/8) element k%8; B likewise
// by column; D[8*(l/16) + s][l % 16].
template <class DT>
__device__ __noinline__ v8f emulate_wmma_gfx12(DT dt, Words<4> a_words, Words<4> b_words, v8f c) {
  const u32(&a)[4] = a_words.w;
  const u32(&b)[4] = b_words.w;
  const int lane = lane_id();
  const int column = lane & 15;
  float bcol[16];
  for (int half = 0; half < 2; ++half) {
    u32 bw[4];
    for (int j = 0; j < 4; ++j) bw[j] = word_of_lane(b, j, column + 16 * half);
    for (int e = 0; e < 8; ++e) bcol[8 * half + e] = from_bits(dt, element(bw, e));
  }
  for (int s = 0; s < 8; ++s) {
    const int row = 8 * (lane >> 4) + s;
    float acc = c[s];
    for (int half = 0; half < 2; ++half) {
      u32 aw[4];
      for (int j = 0; j < 4; ++j) aw[j] = word_of_lane(a, j, row + 16 * half);
      for (int e = 0; e < 8; ++e) acc = fmaf(from_bits(dt, element(aw, e)), bcol[8 * half + e], acc);
    }
    c[s] = acc;
  }
  return c;
}

#if RDNA_EMULATE == 12
struct v8i {
  int e[8];
  RDNA_DEV int& operator[](int i) { return e[i]; }
  RDNA_DEV int operator[](int i) const { return e[i]; }
};
RDNA_DEV v8i zero_v8i() { return v8i{{0, 0, 0, 0, 0, 0, 0, 0}}; }

// Byte e of an 8-bit operand held as packed words (low byte first, as in a VGPR).
RDNA_DEV u32 byte_of(const u32 (&w)[2], int e) { return (w[e >> 2] >> (8 * (e & 3))) & 0xffu; }

// OCP e4m3 (torch.float8_e4m3fn): bias 7, no infinities, S.1111.111 is NaN; exact in float32.
RDNA_DEV float e4m3_value(u32 bits) {
  const float sign = (bits & 0x80u) ? -1.f : 1.f;
  const int exponent = int(bits >> 3) & 15, mantissa = int(bits & 7u);
  if (exponent == 15 && mantissa == 7) return __int_as_float(0x7fc00000);
  if (exponent == 0) return sign * ldexpf(float(mantissa), -9);
  return sign * ldexpf(float(8 + mantissa), exponent - 10);
}
RDNA_DEV float int8_value(u32 bits) { return float(static_cast<signed char>(bits)); }

// gfx12 8-bit WMMA 16x16x16: A row m, k = 8*(l/16) + e sits in lane m + 16*(k/8) byte e; B likewise by
// column; D[8*(l/16) + s][l % 16]. int8: exact int32 sums; e4m3: exact products, float32 sums.
template <bool FP8>
RDNA_DEV float operand8_value(u32 bits) { return FP8 ? e4m3_value(bits) : int8_value(bits); }

template <bool FP8, class ACC>
__device__ __noinline__ ACC emulate_wmma_gfx12_8bit(Words<2> a_words, Words<2> b_words, ACC c) {
  const u32(&a)[2] = a_words.w;
  const u32(&b)[2] = b_words.w;
  const int lane = lane_id();
  const int column = lane & 15;
  float bcol[16];
  for (int half = 0; half < 2; ++half) {
    const u32 bw[2] = {word_of_lane(b, 0, column + 16 * half), word_of_lane(b, 1, column + 16 * half)};
    for (int e = 0; e < 8; ++e) bcol[8 * half + e] = operand8_value<FP8>(byte_of(bw, e));
  }
  for (int s = 0; s < 8; ++s) {
    const int row = 8 * (lane >> 4) + s;
    for (int half = 0; half < 2; ++half) {
      const u32 aw[2] = {word_of_lane(a, 0, row + 16 * half), word_of_lane(a, 1, row + 16 * half)};
      for (int e = 0; e < 8; ++e) {
        const float x = operand8_value<FP8>(byte_of(aw, e));
        if constexpr (FP8) c[s] = fmaf(x, bcol[8 * half + e], c[s]);
        else c[s] += int(x) * int(bcol[8 * half + e]);
      }
    }
  }
  return c;
}

RDNA_DEV v8i wmma_gfx12_i8(const u32 (&a)[2], const u32 (&b)[2], v8i c) {
  return emulate_wmma_gfx12_8bit<false>(Words<2>{{a[0], a[1]}}, Words<2>{{b[0], b[1]}}, c);
}
RDNA_DEV v8f wmma_gfx12_fp8(const u32 (&a)[2], const u32 (&b)[2], v8f c) {
  return emulate_wmma_gfx12_8bit<true>(Words<2>{{a[0], a[1]}}, Words<2>{{b[0], b[1]}}, c);
}
// v_cvt_pk_fp8_f32 twice: nearest even (CUDA's own e4m3 conversion), a in the low byte; no saturation,
// as the instruction without MODE.FP16_OVFL: a value that rounds past 448 becomes NaN.
RDNA_DEV u32 pack_fp8x4(float a, float b, float c, float d) {
  const float x[4] = {a, b, c, d};
  u32 out = 0;
  for (int i = 0; i < 4; ++i) out |= u32(__nv_cvt_float_to_fp8(x[i], __NV_NOSAT, __NV_E4M3)) << (8 * i);
  return out;
}
#endif

template <int W>
RDNA_DEV Words<W> to_words(const u32 (&w)[W]) {
  Words<W> out;
#pragma unroll
  for (int j = 0; j < W; ++j) out.w[j] = w[j];
  return out;
}

// The names and signatures the ISA headers call, as on real hardware.
template <class DT>
RDNA_DEV v8f wmma_gfx11(DT dt, const u32 (&a)[8], const u32 (&b)[8], v8f c) {
  return emulate_wmma_gfx11(dt, to_words(a), to_words(b), c);
}
template <class DT>
RDNA_DEV v8f wmma_gfx12(DT dt, const u32 (&a)[4], const u32 (&b)[4], v8f c) {
  return emulate_wmma_gfx12(dt, to_words(a), to_words(b), c);
}

}  // namespace rdna
