// Platform layer for real AMD GPUs: clang -x hip with -nogpuinc, so every primitive is a builtin
// and no HIP or ROCm header is needed to build.
#pragma once

#define RDNA_DEV __attribute__((device)) __attribute__((always_inline)) inline
#define RDNA_KERNEL(threads) \
  extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(threads, threads))) void
// Static LDS, so the code object's metadata states exactly what each variant uses.
#define RDNA_LDS_ARRAY(type, name, count) __attribute__((shared)) __attribute__((aligned(16))) type name[count]

namespace rdna {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));
typedef float v2f __attribute__((ext_vector_type(2)));
typedef float v8f __attribute__((ext_vector_type(8)));
typedef _Float16 v16h __attribute__((ext_vector_type(16)));
typedef short v16s __attribute__((ext_vector_type(16)));
typedef _Float16 v8h __attribute__((ext_vector_type(8)));
typedef short v8s __attribute__((ext_vector_type(8)));

struct f16 {};
struct bf16 {};

RDNA_DEV int thread_id() { return __builtin_amdgcn_workitem_id_x(); }
RDNA_DEV int block_id_x() { return __builtin_amdgcn_workgroup_id_x(); }
RDNA_DEV int block_id_y() { return __builtin_amdgcn_workgroup_id_y(); }
RDNA_DEV int block_id_z() { return __builtin_amdgcn_workgroup_id_z(); }
RDNA_DEV int lane_id() { return __builtin_amdgcn_workitem_id_x() & 31; }

RDNA_DEV void block_barrier() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// A wave executes in lockstep, so ordering LDS between its own lanes needs only the compiler's word.
RDNA_DEV void wave_barrier() { __builtin_amdgcn_wave_barrier(); }
// Memory operations are not moved across it by the compiler; no instruction is emitted.
RDNA_DEV void compiler_fence() { __asm__ volatile("" ::: "memory"); }

// v unchanged, as a value that clang must take to change here (no instruction is emitted). A per-lane
// load offset that is the same on every key tile would otherwise have its zero extension hoisted out of
// the loop, and each load inside become a 64-bit add (two VALU) instead of the load's scalar-base form.
// It stays where it is written because HIP's inline asm is convergent (no pass hoists it out of a loop);
// for per-lane values only ("v": a uniform value would be moved into a VGPR).
RDNA_DEV u32 loop_variant(u32 v) {
  __asm__("" : "+v"(v));
  return v;
}

// v, the same in every lane of the wave (e.g. thread_id() / 32), as the scalar value clang cannot tell
// it is: addresses built from it keep the global load's scalar-base form.
RDNA_DEV int wave_uniform(int v) { return __builtin_amdgcn_readfirstlane(v); }

// Whether `p` holds in any lane of the wave; every lane must call it.
RDNA_DEV bool any_lane(bool p) { return __builtin_amdgcn_ballot_w32(p) != 0u; }

RDNA_DEV u32x4 zero_u32x4() { return u32x4{0u, 0u, 0u, 0u}; }
RDNA_DEV v8f zero_v8f() { return v8f{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}; }
// Zeros that clang must keep in VGPRs: it cannot re-create an asm result where it is used, as it does a
// constant. Distinct asm text per element, so that the eight are not merged into one register.
template <int I>
RDNA_DEV float held_zero() {
  float z;
  __asm__("v_mov_b32 %0, 0 ; held zero %1" : "=v"(z) : "n"(I));
  return z;
}
RDNA_DEV v8f held_zero_v8f() {
  return v8f{held_zero<0>(), held_zero<1>(), held_zero<2>(), held_zero<3>(), held_zero<4>(), held_zero<5>(),
             held_zero<6>(), held_zero<7>()};
}

RDNA_DEV float exp2_approx(float x) { return __builtin_amdgcn_exp2f(x); }
RDNA_DEV float log2_approx(float x) { return __builtin_amdgcn_logf(x); }
RDNA_DEV float max_f32(float a, float b) { return __builtin_fmaxf(a, b); }
RDNA_DEV float min_f32(float a, float b) { return __builtin_fminf(a, b); }
RDNA_DEV float fma_f32(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// a * b rounded to float32, never contracted into a later addition's fma.
RDNA_DEV float mul_rounded_f32(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
RDNA_DEV float abs_f32(float x) { return __builtin_fabsf(x); }
RDNA_DEV float round_even(float x) { return __builtin_rintf(x); }  // to the nearest integer, ties to even
RDNA_DEV float as_f32(u32 x) { return __builtin_bit_cast(float, x); }
RDNA_DEV u32 as_u32(float x) { return __builtin_bit_cast(u32, x); }

RDNA_DEV u16 to_bits(f16, float x) { return __builtin_bit_cast(u16, (_Float16)x); }
RDNA_DEV float from_bits(f16, u16 x) { return (float)__builtin_bit_cast(_Float16, x); }

// v_permlanex16_b32: lane i of one 16-lane row reads lane sel(i) of the other row. The kernels call it
// with the whole wave active, where fetch-inactive (read the source lane even if inactive) changes
// nothing; with it the instruction never falls back to its "old" value, so clang sets none first (a
// v_mov per call). Without it, that v_mov is back and register allocation differs (fa_bwd.h).
template <bool FETCH_INACTIVE = true>
RDNA_DEV u32 permlanex16(u32 src, u32 sel_lo, u32 sel_hi) {
  return __builtin_amdgcn_permlanex16(0u, src, sel_lo, sel_hi, FETCH_INACTIVE, /*bound_ctrl=*/false);
}

template <int N>
RDNA_DEV auto as_vector_f16(const u32 (&w)[N]) {
  if constexpr (N == 8) return __builtin_bit_cast(v16h, w);
  else return __builtin_bit_cast(v8h, w);
}
template <int N>
RDNA_DEV auto as_vector_s16(const u32 (&w)[N]) {
  if constexpr (N == 8) return __builtin_bit_cast(v16s, w);
  else return __builtin_bit_cast(v8s, w);
}

// The low (high) 16-bit halves of lo and hi as one word, lo's first: one v_perm_b32.
RDNA_DEV u32 pack_low_halves(u32 lo, u32 hi) { return __builtin_amdgcn_perm(hi, lo, 0x05040100u); }
RDNA_DEV u32 pack_high_halves(u32 lo, u32 hi) { return __builtin_amdgcn_perm(hi, lo, 0x07060302u); }

typedef _Float16 v2h __attribute__((ext_vector_type(2)));
typedef __bf16 v2bf __attribute__((ext_vector_type(2)));

// 1.0 in an SGPR that clang cannot fold away. With clang 19, which builds every shipped object, the move
// is written in the asm: with clang writing it (`float one = 1.f; asm("" : "+s"(one))`) the forward key
// loops came out slower, gfx1201 f16 d80 by 1.5 % (static estimate). Newer LLVM inserts waits for gfx12's SGPR
// read hazards in a pass that does not look into asm text (AMDGPUWaitSGPRHazards), so a rebuild with a
// newer clang lets clang write the move, where that pass sees it.
RDNA_DEV float unfoldable_one() {
#if __clang_major__ <= 19
  float one;
  __asm__("s_mov_b32 %0, 1.0" : "=s"(one));
#else
  float one = 1.f;
  __asm__("" : "+s"(one));
#endif
  return one;
}

// Two values rounded to f16 (nearest even) as one packed word: two v_cvt_f16_f32 and a v_pack_b32_f16.
RDNA_DEV u32 pack_rounded(f16, float lo, float hi) { return __builtin_bit_cast(u32, v2h{(_Float16)lo, (_Float16)hi}); }
// Two probabilities rounded to f16, packed (lo first), each as p * 1 rounded once: clang selects one
// v_fma_mix{lo,hi}_f16 for that (its + 0 turns -0 into +0: not for signed values), where a plain conversion
// takes two v_cvt_f16_f32 and a v_pack_b32_f16 per pair. The 1 is unfoldable_one(). The mix itself is not
// inline asm: LLVM's hazard recognizer does not look into asm (gfx110x must wait before a VALU reads a
// v_exp_f32 result), and it does look at what it selects.
RDNA_DEV u32 pack_probabilities(f16, float lo, float hi) {
  const float one = unfoldable_one();
  return __builtin_bit_cast(u32, v2h{(_Float16)(lo * one), (_Float16)(hi * one)});
}

// x in a register of its own, bit for bit: x * unfoldable_one() (f32 denormals are preserved). Two
// multiplications pair as one dual issue (VOPD) only if their multipliers lie in different register banks
// (register number mod 4): O's rescale by one factor in one register took one issue per product.
RDNA_DEV float unmerged_copy(float x) { return x * unfoldable_one(); }

// x twice, in adjacent registers (the 64-bit operand of an empty asm), which never share a bank, bit for
// bit: for an instance where the allocator put unmerged_copy's register in x's bank.
RDNA_DEV v2f adjacent_copies(float x) {
  v2f pair = {x, x};
  __asm__("" : "+v"(pair));
  return pair;
}

// acc + both 16-bit values of a packed word, in one v_dot2 against (1, 1): the products are exact.
RDNA_DEV float add_pair(f16, u32 pair, float acc) {
  return __builtin_amdgcn_fdot2(__builtin_bit_cast(v2h, pair), v2h{1.0f16, 1.0f16}, acc, false);
}
RDNA_DEV float add_pair(bf16, u32 pair, float acc) {
  return __builtin_amdgcn_fdot2_f32_bf16(__builtin_bit_cast(v2bf, pair), __builtin_bit_cast(v2bf, 0x3f803f80u), acc,
                                         false);
}

#if defined(__GFX11__)
RDNA_DEV v8f wmma_gfx11(f16, const u32 (&a)[8], const u32 (&b)[8], v8f c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(as_vector_f16(a), as_vector_f16(b), c);
}
RDNA_DEV v8f wmma_gfx11(bf16, const u32 (&a)[8], const u32 (&b)[8], v8f c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(as_vector_s16(a), as_vector_s16(b), c);
}
#endif
#if defined(__GFX12__)
RDNA_DEV v8f wmma_gfx12(f16, const u32 (&a)[4], const u32 (&b)[4], v8f c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(as_vector_f16(a), as_vector_f16(b), c);
}
RDNA_DEV v8f wmma_gfx12(bf16, const u32 (&a)[4], const u32 (&b)[4], v8f c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(as_vector_s16(a), as_vector_s16(b), c);
}

typedef int v2i __attribute__((ext_vector_type(2)));
typedef int v8i __attribute__((ext_vector_type(8)));
RDNA_DEV v8i zero_v8i() { return v8i{0, 0, 0, 0, 0, 0, 0, 0}; }

// Signed int8 operands, exact int32 sums (no clamp).
RDNA_DEV v8i wmma_gfx12_i8(const u32 (&a)[2], const u32 (&b)[2], v8i c) {
  return __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32_gfx12(true, __builtin_bit_cast(v2i, a), true,
                                                         __builtin_bit_cast(v2i, b), c, false);
}
// OCP e4m3 operands, float32 sums.
RDNA_DEV v8f wmma_gfx12_fp8(const u32 (&a)[2], const u32 (&b)[2], v8f c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_fp8_fp8_w32_gfx12(__builtin_bit_cast(v2i, a), __builtin_bit_cast(v2i, b),
                                                              c);
}
// Four values as e4m3 (nearest even), a first in the low byte: two v_cvt_pk_fp8_f32, the second
// writing the high half of the first's result.
RDNA_DEV u32 pack_fp8x4(float a, float b, float c, float d) {
  const int low = __builtin_amdgcn_cvt_pk_fp8_f32(a, b, 0, false);
  return u32(__builtin_amdgcn_cvt_pk_fp8_f32(c, d, low, true));
}
#endif

}  // namespace rdna
