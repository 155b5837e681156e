// The opt-in 8-bit forward ("8-bit QK+PV", inference only): gfx12, whose WMMA runs 8-bit operands at
// twice the 16-bit rate. S^T = K Q^T on the int8 WMMA (exact int32 sums), O^T += V^T P^T on the fp8
// (OCP e4m3) one with float32 sums; the online softmax between them is the 16-bit forward's (fa_fwd.h).
//
// Q is read in 16 bits and quantized here, once per workgroup: int8, one scale per query row (quant8.h's
// rounding), the softmax scale and log2(e) folded in. K and V arrive quantized by one pass on the GPU
// (kernels/quant8.h), in buffers of this kernel's layout: head dim zero-padded to D_PAD, keys zero-padded
// to whole tiles, so no load of a key tile is predicated or clamped.
// - K smoothed (its per-channel mean over the keys subtracted: that moves every score of a row by the
//   same amount, which softmax ignores) as int8, one scale per 16 keys (one WMMA fragment: a wave-uniform
//   multiplier per fragment);
// - V smoothed as e4m3 with one scale per channel, stored transposed (a row per channel, the A operand
//   of O^T += V^T P^T). The mean comes back after the division by the row sum: P's rows then sum to one.
// P is relative to the running maximum, at most 1: it is scaled by 448 (e4m3's largest value) before
// its rounding to fp8, which the row sum (of the unrounded values) carries too, so it cancels.
#pragma once
#include "quant8.h"

namespace rdna {

// Kernel argument block; mirrored by rdna_flash_attn/ops/launch_args.py (Fwd8Args).
struct Fwd8Args {
  const u16* q;  // 16-bit, strided
  i64 q_stride_b, q_stride_h, q_stride_s;
  const u32* k8;         // (batch, kv_heads, k_rows, D_PAD) int8
  const float* k_scale;  // (batch, kv_heads, k_rows / 16)
  const u32* vt8;        // (batch, kv_heads, D_PAD, k_rows) e4m3
  const float* v_scale;  // (batch, kv_heads, D_PAD)
  const float* v_mean;   // (batch, kv_heads, D_PAD)
  u16* o;
  i64 o_stride_b, o_stride_h, o_stride_s;
  int heads, kv_heads, seqlen_q, seqlen_k, k_rows, head_dim;
  float scale_log2;  // softmax scale x log2(e)
};

constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448)
// S's accumulators start from these bits instead of zero: the int32 sum s (|s| < 2^22) then lands in
// the mantissa of the float32 1.5 x 2^23 + s, exactly, and one subtraction of 1.5 x 2^23 gives s as a
// float32, exactly: an add the dual-issue (VOPD) pairs, where the conversion v_cvt_f32_i32 has no pair.
constexpr int kSumBiasBits = 0x4b400000;
constexpr float kSumBias = 12582912.f;  // 1.5 x 2^23, the float32 those bits encode

// LDS in 32-bit words; rdna_flash_attn/runtime/variants.py (Fwd8Variant) computes the same size.
template <int D_PAD, int WAVES, int BLOCK_N>
struct Fwd8Shape {
  static constexpr int kBlockM = kFrag * WAVES;
  static constexpr int kThreads = 32 * WAVES;
  static constexpr int kPadWords = 4;  // 16 bytes: keeps 16-byte alignment and spreads rows over banks
  static constexpr int kRowWords = D_PAD / 4 + kPadWords;   // Q and K rows, one byte per value
  static constexpr int kVtRowWords = BLOCK_N / 4 + kPadWords;  // V^T rows (one per channel)
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kBlockM * kRowWords;
  static constexpr int kVtOffset = kKOffset + BLOCK_N * kRowWords;
  static constexpr int kLdsWords = kVtOffset + D_PAD * kVtRowWords;
  static_assert(4 * kLdsWords <= 65536, "LDS over 64 KiB");
  static_assert(D_PAD % kFrag == 0 && BLOCK_N % kFrag == 0, "tile shape");
  static_assert(127 * 127 * D_PAD < (1 << 22), "S's int32 sums must stay below 2^22 (kSumBias)");
};

// One 8-bit operand fragment from an LDS tile of byte rows: lane row (l % 16), its run of 8 k values.
template <int ROW_WORDS>
RDNA_DEV Isa::Operand8 load_operand8(const u32* tile, int col0, int lane) {
  return *reinterpret_cast<const Isa::Operand8*>(tile + (lane & 15) * ROW_WORDS + (col0 + Isa::operand_k0(lane)) / 4);
}

// The wave's 16 query rows as int8 codes in LDS rows ROW_WORDS words apart (a row's 16-bit values
// split between lanes r and r + 16, half the head dim each; zeros past head_dim and past seqlen_q) and
// the lane's row scale times |softmax scale x log2(e)|, returned. The scale maps the row's largest
// |value| to 127: 1 for a row of zeros, NaN for a row with a NaN (quant8.h's scale_for). A negative
// softmax scale negates the codes (symmetric, so exactly): every key fragment's step stays >= 0, which
// taking a fragment's maximum over its raw sums needs (fwd8_body).
template <class DT, int D_PAD, int ROW_WORDS>
RDNA_DEV float quantize_q_rows(const Fwd8Args& a, const u16* q_row, bool real_row, u32* wave_q, int lane) {
  constexpr int kHalf = D_PAD / 2;
  const DT dt{};
  const int col0 = (lane >> 4) * kHalf;
  u32x4 raw[kHalf / 8];  // every load issued before the first use: one memory round trip
  #pragma unroll
  for (int p = 0; p < kHalf / 8; ++p) {
    raw[p] = zero_u32x4();
    if (real_row && col0 + p * 8 < a.head_dim) raw[p] = load16(q_row + col0 + p * 8);
  }
  float x[kHalf];
  #pragma unroll
  for (int p = 0; p < kHalf / 8; ++p) convert8(dt, raw[p], &x[8 * p]);
  Magnitude m = largest_magnitude<kHalf>(x);
  m.amax = max_f32(m.amax, other_half(m.amax));
  m.nan |= other_half(m.nan ? 1.f : 0.f) != 0.f;
  const float scale = scale_for(m.amax, m.nan, kInt8Max);
  const float signed_scale = a.scale_log2 < 0.f ? -scale : scale;
  u32* const codes = wave_q + (lane & 15) * ROW_WORDS + col0 / 4;
  #pragma unroll
  for (int w = 0; w < kHalf / 4; ++w) codes[w] = int8_codes(&x[4 * w], signed_scale);
  return signed_scale * a.scale_log2;
}

// Copies ROWS rows of BYTES bytes (a whole number of 16-byte pieces), starting `tile_bytes` past `src`,
// from global rows `stride` words apart into LDS rows LDS_ROW words apart. Every load is issued before
// the first store: one memory round trip. Loads take the head's uniform `src` plus a 32-bit byte offset
// per lane (load16_at) that includes the tile's: computed inside the key loop, the offset keeps the
// loads in their scalar-base form there (one hoisted out of the loop cost two 64-bit adds per load).
// The dispatch keeps a head's codes below 2^31 bytes.
template <int ROWS, int BYTES, int LDS_ROW, int THREADS>
RDNA_DEV void copy_byte_rows(u32* dst, const u32* src, u32 tile_bytes, int stride, int tid) {
  constexpr int kPieces = BYTES / 16;
  constexpr int kTotal = ROWS * kPieces;
  constexpr int kLoads = (kTotal + THREADS - 1) / THREADS;
  u32x4 val[kLoads];
  #pragma unroll
  for (int n = 0; n < kLoads; ++n) {
    const int i = tid + n * THREADS, r = i / kPieces;
    val[n] = zero_u32x4();
    if (kTotal % THREADS == 0 || i < kTotal)
      val[n] = load16_at(reinterpret_cast<const u16*>(src), tile_bytes + u32(r * stride + i % kPieces * 4) * 4u);
  }
  #pragma unroll
  for (int n = 0; n < kLoads; ++n) {
    const int i = tid + n * THREADS;
    if (kTotal % THREADS == 0 || i < kTotal)
      store16(reinterpret_cast<u16*>(dst + i / kPieces * LDS_ROW + i % kPieces * 4), val[n]);
  }
}

// T: the instance's traits, generated from rdna_flash_attn/runtime/tuning.py.
template <class DT, class T>
RDNA_DEV void fwd8_body(const Fwd8Args& a, u32* lds) {
  constexpr int D_PAD = T::kHeadDim, BLOCK_N = T::kBlockN;
  using Shape = Fwd8Shape<D_PAD, T::kWaves, BLOCK_N>;
  constexpr int kKeyFrags = BLOCK_N / kFrag;
  constexpr int kDimFrags = D_PAD / kFrag;
  constexpr int kWordsPerRow = D_PAD / 4;
  // T::kSkipsRescale: a tile where no row of the wave meets a new maximum skips rescaling O (a
  // multiplication by exactly 1), as fa_fwd.h's.
  const DT dt{};
  const float kNegInf = -__builtin_inff();

  const int tid = thread_id();
  const int lane = lane_id();
  const int wave = tid >> 5;
  const i64 head = block_id_y(), batch = block_id_z();
  const i64 kv_head = head / (a.heads / a.kv_heads);
  const int q0 = block_id_x() * Shape::kBlockM;
  const i64 kv = batch * a.kv_heads + kv_head;

  u32* const k_lds = lds + Shape::kKOffset;
  u32* const vt_lds = lds + Shape::kVtOffset;
  u32* const wave_q = lds + Shape::kQOffset + wave * kFrag * Shape::kRowWords;
  const int query = q0 + wave * kFrag + (lane & 15);
  const float q_scale = quantize_q_rows<DT, D_PAD, Shape::kRowWords>(
      a, a.q + batch * a.q_stride_b + head * a.q_stride_h + i64(query) * a.q_stride_s, query < a.seqlen_q, wave_q,
      lane);
  const u32* const k8 = a.k8 + kv * a.k_rows * kWordsPerRow;
  const u32* const vt8 = a.vt8 + kv * D_PAD * (a.k_rows / 4);
  const float* const k_scale = a.k_scale + kv * (a.k_rows / kFrag);

  v8f o_acc[kDimFrags];
  #pragma unroll
  for (int f = 0; f < kDimFrags; ++f) o_acc[f] = zero_v8f();
  float row_max = kNegInf, row_sum = 0.f;
  v8i biased_zero = zero_v8i();
  #pragma unroll
  for (int e = 0; e < 8; ++e) biased_zero[e] = kSumBiasBits;

  // One key tile; MASKED (the last tile, when it reaches past seqlen_k): scores are masked per key.
  auto tile_step = [&](auto masked_flag, int key0) {
    constexpr bool MASKED = decltype(masked_flag)::value;
    block_barrier();  // every wave is done with the previous tile
    copy_byte_rows<BLOCK_N, D_PAD, Shape::kRowWords, Shape::kThreads>(k_lds, k8, u32(key0) * D_PAD, kWordsPerRow, tid);
    copy_byte_rows<D_PAD, BLOCK_N, Shape::kVtRowWords, Shape::kThreads>(vt_lds, vt8, u32(key0), a.k_rows / 4, tid);
    block_barrier();

    // The first head-dim step's products start from the biased zero (kSumBias), which every fragment
    // shares as its C operand (clang re-creates it from SGPRs with a few moves per tile).
    v8i s_acc[kKeyFrags];
    {
      const Isa::Operand8 q_op = load_operand8<Shape::kRowWords>(wave_q, 0, lane);
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) {
        s_acc[j] = biased_zero;
        Isa::mma_i8(s_acc[j], load_operand8<Shape::kRowWords>(k_lds + j * kFrag * Shape::kRowWords, 0, lane), q_op);
      }
    }
    #pragma unroll 2
    for (int d = 1; d < kDimFrags; ++d) {
      const Isa::Operand8 q_op = load_operand8<Shape::kRowWords>(wave_q, d * kFrag, lane);
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j)
        Isa::mma_i8(s_acc[j], load_operand8<Shape::kRowWords>(k_lds + j * kFrag * Shape::kRowWords, d * kFrag, lane),
                    q_op);
    }

    // Scores in log2 units are the int32 sums (exact in float32) times both scales, one step (>= 0) per
    // key fragment: a fragment's maximum is taken over its sums, then scaled (rounding keeps the order,
    // so this is the maximum of the scaled scores).
    float sums[kKeyFrags][8], step[kKeyFrags];
    float tile_max = kNegInf;
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      step[j] = q_scale * k_scale[key0 / kFrag + j];
      float top = kNegInf;
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        sums[j][e] = as_f32(u32(s_acc[j][e])) - kSumBias;
        if (MASKED && key0 + j * kFrag + Isa::acc_key(lane, e) >= a.seqlen_k) sums[j][e] = kNegInf;
        top = max_f32(top, sums[j][e]);
      }
      tile_max = max_f32(tile_max, top * step[j]);
    }
    tile_max = max_f32(tile_max, other_half(tile_max));
    auto scale_output = [&](float rescale) {  // as fa_fwd.h's: odd accumulators from a second register
      const float twin = unmerged_copy(rescale);
      #pragma unroll
      for (int f = 0; f < kDimFrags; ++f)
        #pragma unroll
        for (int e = 0; e < 8; ++e) o_acc[f][e] *= e & 1 ? twin : rescale;
    };
    float rescale = 1.f;
    if (!T::kSkipsRescale || any_lane(tile_max > row_max)) {  // wave-uniform
      const float new_max = max_f32(row_max, tile_max);  // finite: every tile has a key below seqlen_k
      rescale = exp2_approx(row_max - new_max);
      row_max = new_max;
      if constexpr (T::kSkipsRescale) scale_output(rescale);
    }
    // P = exp2(s - bias) <= 448, or the conversion turns values above 464 into NaN. Each exponent is one
    // fma of the unrounded product, which can exceed the rounded maximum by half an ulp (more than
    // log2(464 / 448) from |row_max| near 2^20): the bias is taken from at least one ulp above it. bias
    // rounds to float32 too: one float32 step up (a per-row test) keeps top - bias <= log2(448).
    const float top = fma_f32(abs_f32(row_max), 0x1p-23f, row_max);
    float bias = top - kLog2Fp8Max;
    if (top - bias > kLog2Fp8Max) bias = as_f32(as_u32(bias) + (bias >= 0.f ? 1u : 0xffffffffu));

    Isa::Operand8 p_op[kKeyFrags];
    float half_sums[2] = {0.f, 0.f};  // two chains, which the dual-issue (VOPD) adds can pair
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      float p[8];
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        p[e] = exp2_approx(fma_f32(sums[j][e], step[j], -bias));
        if (MASKED && sums[j][e] == kNegInf) p[e] = 0.f;  // not exp2(-inf x 0) = NaN where a step underflows
        half_sums[e & 1] += p[e];
      }
      p_op[j] = Isa::keys_to_operand8(pack_fp8x4(p[0], p[1], p[2], p[3]), pack_fp8x4(p[4], p[5], p[6], p[7]));
    }
    row_sum = row_sum * rescale + (half_sums[0] + half_sums[1]);
    if constexpr (!T::kSkipsRescale) scale_output(rescale);

    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j)
      #pragma unroll
      for (int f = 0; f < kDimFrags; ++f)
        Isa::mma_fp8(o_acc[f], load_operand8<Shape::kVtRowWords>(vt_lds + f * kFrag * Shape::kVtRowWords, j * kFrag, lane),
                     p_op[j]);
  };
  const int whole_tiles = a.seqlen_k / BLOCK_N;
  for (int tile = 0; tile < whole_tiles; ++tile) tile_step(Flag<false>{}, tile * BLOCK_N);
  if (whole_tiles * BLOCK_N < a.seqlen_k) tile_step(Flag<true>{}, whole_tiles * BLOCK_N);

  // O = acc x V's scale / row sum + V's mean. A lane holds 8 consecutive channels of its query per
  // fragment (Isa::acc_row), written as one 16-byte piece.
  const float inv_total = 1.f / (row_sum + other_half(row_sum));
  u16* const o = a.o + batch * a.o_stride_b + head * a.o_stride_h + i64(query) * a.o_stride_s;
  const float* const v_scale = a.v_scale + kv * D_PAD;
  const float* const v_mean = a.v_mean + kv * D_PAD;
  #pragma unroll
  for (int f = 0; f < kDimFrags; ++f) {
    const int col = f * kFrag + Isa::acc_row(lane, 0);
    u16 bits[8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) bits[e] = to_bits(dt, fma_f32(o_acc[f][e], v_scale[col + e] * inv_total, v_mean[col + e]));
    u32x4 run;
    #pragma unroll
    for (int w = 0; w < 4; ++w) run[w] = pack_u16x2(bits[2 * w], bits[2 * w + 1]);
    if (query < a.seqlen_q && col < a.head_dim) store16(o + col, run);
  }
}

}  // namespace rdna
