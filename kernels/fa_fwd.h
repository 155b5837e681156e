// FlashAttention-2 forward.
//
// Each workgroup owns BLOCK_M = 16 * WAVES queries of one (batch, head) and one chunk of the output
// columns; each wave owns 16 queries. Per tile of BLOCK_N keys a wave computes S^T = K Q^T, so every
// lane holds one query's scores and the row statistics need one exchange between half-waves; then
// O^T += V^T P^T with P^T built in registers from S^T (P never goes through LDS).
#pragma once
#include "sequence.h"

namespace rdna {

// Kernel argument block; mirrored by rdna_flash_attn/ops/launch_args.py (ABI version 5).
struct FwdArgs {
  const u16* q;
  const u16* k;
  const u16* v;
  u16* o;
  float* lse;  // (batch, heads, seqlen_q) float32, natural log
  i64 q_stride_b, q_stride_h, q_stride_s;
  i64 k_stride_b, k_stride_h, k_stride_s;
  i64 v_stride_b, v_stride_h, v_stride_s;
  i64 o_stride_b, o_stride_h, o_stride_s;
  i64 lse_stride_b, lse_stride_h;
  int seqlen_q, seqlen_k, head_dim;  // with cu_seqlens: the longest entry's lengths
  int causal;        // Causal (sequence.h)
  float scale_log2;  // softmax scale * log2(e): scores go straight into exp2
  int q_blocks;
  const void* mask;  // element (b, h, q, k) of an attention mask or bias; null for none
  i64 mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
  const int* cu_seqlens_q;  // packed variable-length batches (sequence.h); null otherwise
  const int* cu_seqlens_k;
  int mask_kind;  // MaskKind (sequence.h)
  int kv_group;   // query heads per key/value head: 1, or more for grouped-query attention
  // Saved for the backward by a training forward (null otherwise), so that its dQ kernel needs one
  // sweep (fa_bwd.h): O's rounding remainder, rounded to 16 bits in turn (o's strides; O + o_low holds
  // O to about twice the dtype's bits, for f16 only where |O| >= 2^-3: smaller remainders lose bits to
  // f16's subnormal range, still 16x closer at 2^-10), and per row the offset the forward subtracted
  // from its base-2 exponents and log2 of its probability sum (lse's layout).
  u16* o_low;
  float* row_offset;
  float* row_log2_sum;
  // Added to the workgroup's grid y (head) and z (batch) indices: a grid takes at most 65535 along each,
  // so larger ones launch in slices (ops/attention.py).
  int head0, batch0;
};

// The LDS layout; rdna_flash_attn/runtime/variants.py computes the same size for the launcher.
// HAS_MASK: one float per key of the tile after V^T, for a key-padding mask staged once per tile. Nothing
// more: eight bytes of flags took d48's masked kernel past its LDS granule, from 6 to 5 waves per SIMD.
template <int D_PAD, int WAVES, int BLOCK_N, int D_CHUNK, bool HAS_MASK = false>
struct FwdShape {
  static constexpr int kBlockM = kFrag * WAVES;
  static constexpr int kThreads = 32 * WAVES;
  static constexpr int kRow = D_PAD + kRowPad;       // Q and K rows
  static constexpr int kVtRow = BLOCK_N + kRowPad;   // V^T rows (one per output column)
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kBlockM * kRow;
  static constexpr int kVtOffset = kKOffset + BLOCK_N * kRow;
  static constexpr int kBiasOffset = kVtOffset + D_CHUNK * kVtRow;  // a multiple of 8: 16-byte aligned
  static constexpr int kLdsElems = kBiasOffset + (HAS_MASK ? 2 * BLOCK_N : 0);
  static_assert(2 * kLdsElems <= 65536, "LDS over 64 KiB");
  static_assert(D_PAD % D_CHUNK == 0 && D_CHUNK % kFrag == 0 && BLOCK_N % kFrag == 0, "tile shape");
  static_assert(BLOCK_N <= kThreads, "one staged bias per thread");
};

// Copies one key tile of K (rows in Isa::key_slot order, see the ISA headers) and of V^T into LDS.
// Every global load of a batch is issued before the first LDS store, so a tile costs one memory
// round trip per batch instead of one per load, and no load or store is predicated: columns at or
// past head_dim are read from the last 8 columns instead (real, finite values) and stored as they
// are. That is harmless: Q's padded columns are zero, so K's never reach a score, and V^T's padded
// rows only reach output columns that are not written. MASKED (the tile reaches past seqlen_k):
// rows past it are read from the last row; their scores are masked, and their V^T values set to
// zero so that a zero probability cannot meet an infinity.
// LOADS: global loads in flight per thread and batch (variants.py's copy_loads, 4 VGPRs each).
// SIXTEEN_BIT_VT: V^T goes to LDS by 16-bit stores (store_transposed_pair), else as pairs of keys packed
// into 32-bit words by one v_perm_b32 each.
template <int ROWS, int D_PAD, int COLS, int K_ROW, int VT_ROW, int THREADS, int LOADS, bool SIXTEEN_BIT_VT>
struct TileCopy {
  static constexpr int kKChunks = D_PAD / 8;
  static constexpr int kKTotal = ROWS * kKChunks;
  static constexpr int kKLoads = (kKTotal + THREADS - 1) / THREADS;
  static constexpr int kVPairs = ROWS / 2;
  static constexpr int kVTotal = kVPairs * (COLS / 8);
  static constexpr int kVUnits = (kVTotal + THREADS - 1) / THREADS;  // two loads each
  static constexpr int kBatches = (kKLoads + 2 * kVUnits + LOADS - 1) / LOADS;
  static constexpr int kKPerBatch = (kKLoads + kBatches - 1) / kBatches;
  static constexpr int kVPerBatch = (kVUnits + kBatches - 1) / kBatches;

  // Whether work item i exists: only a tile that does not divide evenly over the threads asks.
  template <int TOTAL>
  static RDNA_DEV bool exists(int i) { return TOTAL % THREADS == 0 || i < TOTAL; }

  template <bool MASKED>
  static RDNA_DEV void copy(u16* k_lds, u16* vt_lds, const u16* k, i64 k_stride, const u16* v, i64 v_stride, int key0,
                            int seqlen, int col0, int head_dim, int tid) {
    // Unrolled, the batches' hoisted addresses would not fit beside wide O accumulators.
    if constexpr (kBatches <= 2) {
      #pragma unroll
      for (int b = 0; b < kBatches; ++b)
        batch<MASKED>(b, k_lds, vt_lds, k, k_stride, v, v_stride, key0, seqlen, col0, head_dim, tid);
    } else {
      #pragma unroll 1
      for (int b = 0; b < kBatches; ++b)
        batch<MASKED>(b, k_lds, vt_lds, k, k_stride, v, v_stride, key0, seqlen, col0, head_dim, tid);
    }
  }

  template <bool MASKED>
  static RDNA_DEV void batch(int b, u16* k_lds, u16* vt_lds, const u16* k, i64 k_stride, const u16* v, i64 v_stride,
                             int key0, int seqlen, int col0, int head_dim, int tid) {
    // The tile's first rows: uniform, so every load is this base plus a 32-bit byte offset per lane
    // (load16_at; the dispatch keeps sequence strides below 2^23 elements, so 64 rows fit). The offsets
    // are the same on every tile: loop_variant keeps them next to their loads (see amdgcn.h).
    const u16* k_tile = k + i64(key0) * k_stride;
    const u16* v_tile = v + i64(key0) * v_stride;
    u32x4 k_val[kKPerBatch];
    u32x4 v_val[kVPerBatch][2];
    // With a whole number of threads per K row, a thread keeps its column and steps by whole rows:
    // one offset per thread plus a row step per load (one 32-bit add, not a 64-bit one).
    constexpr int kRowStep = THREADS % kKChunks == 0 ? THREADS / kKChunks : 0;
    const int k_col = min_int(tid % kKChunks * 8, head_dim - 8);
    const u32 k_thread = kRowStep && !MASKED ? loop_variant(u32(tid / kKChunks * int(k_stride) + k_col) * 2u) : 0u;
    #pragma unroll
    for (int n = 0; n < kKPerBatch; ++n) {
      const int i = tid + (b * kKPerBatch + n) * THREADS;
      const int r = i / kKChunks, c = i % kKChunks * 8;
      if (b * kKPerBatch + n < kKLoads && exists<kKTotal>(i)) {
        if (MASKED || kRowStep == 0) {
          const int row = MASKED ? min_int(r, seqlen - 1 - key0) : r;
          const u32 offset = u32(row * int(k_stride) + min_int(c, head_dim - 8)) * 2u;
          k_val[n] = load16_at(k_tile, MASKED ? offset : loop_variant(offset));
        } else {
          k_val[n] = load16_at(k_tile, k_thread + u32((b * kKPerBatch + n) * kRowStep * int(k_stride)) * 2u);
        }
      }
    }
    #pragma unroll
    for (int n = 0; n < kVPerBatch; ++n) {
      const int i = tid + (b * kVPerBatch + n) * THREADS;
      const int r = 2 * (i % kVPairs), col = min_int(col0 + i / kVPairs * 8, head_dim - 8);
      if (b * kVPerBatch + n < kVUnits && exists<kVTotal>(i)) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = MASKED ? min_int(r + h, seqlen - 1 - key0) : r + h;
          const u32 offset = u32(row * int(v_stride) + col) * 2u;  // masked: not the same on every tile
          v_val[n][h] = load16_at(v_tile, MASKED ? offset : loop_variant(offset));
          if (MASKED && key0 + r + h >= seqlen) v_val[n][h] = zero_u32x4();
        }
      }
    }
    #pragma unroll
    for (int n = 0; n < kKPerBatch; ++n) {
      const int i = tid + (b * kKPerBatch + n) * THREADS;
      const int r = i / kKChunks, c = i % kKChunks * 8;
      if (b * kKPerBatch + n < kKLoads && exists<kKTotal>(i))
        store16(k_lds + ((r & ~15) + Isa::key_slot(r & 15)) * K_ROW + c, k_val[n]);
    }
    #pragma unroll
    for (int n = 0; n < kVPerBatch; ++n) {
      const int i = tid + (b * kVPerBatch + n) * THREADS;
      const int r = 2 * (i % kVPairs), c = i / kVPairs * 8;
      if (b * kVPerBatch + n < kVUnits && exists<kVTotal>(i)) {
        if constexpr (SIXTEEN_BIT_VT) {
          store_transposed_pair<VT_ROW>(vt_lds + c * VT_ROW + r, v_val[n][0], v_val[n][1]);
        } else {  // load_transposed's packing (tiles.h); one helper for both spilled gfx11's dK/dV kernels
          #pragma unroll
          for (int w = 0; w < 4; ++w) {
            u32* dst = reinterpret_cast<u32*>(vt_lds + (c + 2 * w) * VT_ROW + r);
            dst[0] = pack_low_halves(v_val[n][0][w], v_val[n][1][w]);
            dst[VT_ROW / 2] = pack_high_halves(v_val[n][0][w], v_val[n][1][w]);
          }
        }
      }
    }
  }
};

// bf16 probabilities are computed as p * 2^-shift with 2^shift >= 2 * seqlen_k, so the row sum stays
// <= 1/2 and |O accumulator| <= max |V| (about 3.4e38 at most for bf16, still finite in float32);
// without it a few hundred values near the top of the bf16 range overflow the float32 accumulator.
// O = acc / sum is unchanged (a power of two scales both exactly, barring underflow far below the
// row's largest probability) and the LSE adds the shift back. f16 needs no shift: |V| <= 65504, so
// |acc| <= 65504 * seqlen_k, far from float32's limit.
RDNA_DEV int probability_shift(bf16, int seqlen_k) {
  int shift = 1;
  while ((1 << (shift - 1)) < seqlen_k && shift < 31) ++shift;
  return shift;
}
RDNA_DEV int probability_shift(f16, int) { return 0; }

constexpr float kHugeScore = 0x1p24f;  // in log2 units: a scaled score whose ulp exceeds 1

// How a tile's scores take a mask: kScoreBias, one bias per score, read per lane (any mask); kKeyBias,
// one bias per key, broadcast over queries (a key-padding mask), read once per tile, and a tile whose
// biases are all zero (a padding mask's kept keys: nearly every tile) runs as without a mask.
enum BiasMode : int { kNoBias, kScoreBias, kKeyBias };

// T: the instance's traits, generated from rdna_flash_attn/runtime/tuning.py.
template <class DT, class T>
struct FwdLoop {
  static constexpr int D_PAD = T::kHeadDim, BLOCK_N = T::kBlockN, D_CHUNK = T::kChunk;
  static constexpr bool HAS_MASK = T::kMasked;
  using Shape = FwdShape<D_PAD, T::kWaves, BLOCK_N, D_CHUNK, HAS_MASK>;
  static constexpr int kKeyFrags = BLOCK_N / kFrag;
  static constexpr int kOutFrags = D_CHUNK / kFrag;
  static constexpr int kDimFrags = D_PAD / kFrag;
  // T::kSixteenBitVt: V^T by 16-bit stores (no v_perm_b32 per key pair).
  using Copy =
      TileCopy<BLOCK_N, D_PAD, D_CHUNK, Shape::kRow, Shape::kVtRow, Shape::kThreads, T::kCopyLoads, T::kSixteenBitVt>;
  // T::kSkipsRescale: a tile where no row of the wave meets a new maximum skips rescaling O, a
  // multiplication by exactly 1 (about half the tiles of a long row; the first ones always rescale).
  // T::kRoundsHugeScores: an exponent fused into one fma of the unrounded product exceeds the rounded row
  // maximum by up to half an ulp, and exp2 of that overflows once the maximum nears 2^31: bf16 scores can
  // (Q and K of 3e4 at the default scale), f16 ones cannot where SDPA's own f16 products stay finite. So
  // bf16 tiles whose scaled maximum reaches kHugeScore round their scores first, as SDPA does; below it the
  // excess is under 1/2. T::kRoundsEveryScore: where that branch costs registers, every score is scaled
  // and rounded, one multiply more per score.
  // S's first head-dim steps run ahead of its loop, so that their C operand is a zero constant (inline on
  // gfx12; on gfx11 one zero block kept across tiles) rather than accumulators zeroed every tile: two, so
  // that the loop keeps the parity of kDimFrags (clang unrolls an odd trip count away), or as the traits say.
  template <int BIAS>
  static constexpr int kPeeledScoreSteps = BIAS == kScoreBias ? T::kPeeledScoreStepsScoreBias : T::kPeeledScoreSteps;

  const FwdArgs& a;
  const u16* k;
  const u16* v;
  u16* k_lds;
  u16* vt_lds;
  const u16* wave_q_lds;
  MaskView mask;
  int tid, lane, col0, seqlen_k, mask_row, key_limit;
  float scale;       // softmax scale * log2(e), >= 0: a negative scale was folded into Q
  float prob_shift;  // probability_shift(): subtracted from every exponent
  float* key_biases;  // Shape::kBiasOffset: the tile's key biases (kKeyBias)
  v8f o_acc[kOutFrags];
  float row_max;    // in log2 units, scaled
  float row_sum;    // this lane's share of the rounded probabilities; the partner lane has the rest
  float exact_sum;  // the same before rounding, for the log-sum-exp

  // A fragment's scores scaled and biased: eight biases in flight at a time (a whole tile's at once would
  // spill at d128 on gfx11).
  RDNA_DEV void scale_and_bias(v8f& acc, const float* bias) const {
    #pragma unroll
    for (int s = 0; s < 8; ++s) acc[s] = fma_f32(acc[s], scale, bias[s]);
    compiler_fence();
  }

  // Odd accumulators take the factor from a second register, so that the products can pair as dual issues:
  // a copy, or where the traits say (T::kAdjacentRescaleFactors) the register beside the factor's.
  RDNA_DEV void scale_output(float factor) {
    const v2f factors = T::kAdjacentRescaleFactors ? adjacent_copies(factor) : v2f{factor, unmerged_copy(factor)};
    #pragma unroll
    for (int f = 0; f < kOutFrags; ++f)
      #pragma unroll
      for (int s = 0; s < 8; ++s) o_acc[f][s] *= factors[s & 1];
  }

  // Every key tile: first those every query of the workgroup sees whole, then the rest, masked per key.
  template <int BIAS>
  RDNA_DEV void tiles(int open_tiles, int key_tiles) {
    int t = 0;
    for (; t < open_tiles; ++t) tile<false, BIAS>(t * BLOCK_N);
    for (; t < key_tiles; ++t) tile<true, BIAS>(t * BLOCK_N);
  }

  // One key tile. MASKED: some key of the tile is past seqlen_k or (causal) past a query of this
  // workgroup, so scores are masked per key; every other tile skips the per-score compare. BIAS: see
  // BiasMode. Key biases are read once per tile by the workgroup, into LDS, where every wave finds
  // them instead of each lane reading and converting its own. (Starting the score accumulators at bias / scale would save the additions too, but a row
  // whose keys all carry one huge bias then loses Q.K to the rounding of every product step at that
  // magnitude.)
  template <bool MASKED, int BIAS>
  RDNA_DEV void tile(int key0) {
    const DT dt{};
    const float kNegInf = -__builtin_inff();
    block_barrier();  // every wave is done with the previous tile
    // Issued before the K/V copy, whose loads it then waits for with them: no round trip of its own.
    const bool reads_key = BIAS == kKeyBias && tid < BLOCK_N;
    const u32 bias_bits = reads_key ? mask.bits_at(mask.key_offset(key0 + tid)) : 0u;
    Copy::template copy<MASKED>(k_lds, vt_lds, k, a.k_stride_s, v, a.v_stride_s, key0, seqlen_k, col0, a.head_dim,
                                tid);
    if constexpr (BIAS == kKeyBias) {
      const float key_bias = reads_key ? mask.bias_of_bits(bias_bits) : 0.f;
      if (reads_key) key_biases[tid] = key_bias;
    }
    block_barrier();

    v8f s_acc[kKeyFrags];
    const auto score_step = [&](int d) {
      const Isa::Operand q_op = load_operand<Shape::kRow>(wave_q_lds, d * kFrag, lane);
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j)
        Isa::mma(dt, s_acc[j], load_operand<Shape::kRow>(k_lds + j * kFrag * Shape::kRow, d * kFrag, lane), q_op);
    };
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) s_acc[j] = zero_v8f();
    #pragma unroll
    for (int d = 0; d < kPeeledScoreSteps<BIAS>; ++d) score_step(d);
    // Unrolling this loop fully lets the scheduler hoist every K fragment load at once and run out
    // of VGPRs; two steps in flight hide the LDS latency well enough.
    #pragma unroll 2
    for (int d = kPeeledScoreSteps<BIAS>; d < kDimFrags; ++d) score_step(d);

    // The maximum of the raw scores: scale >= 0, so scaling it gives the maximum of the scaled ones.
    // Biases are added to the scaled scores, and the step's scale is then 1.
    float step_scale = scale;
    if constexpr (BIAS == kScoreBias) {
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) {
        float bias[8];
        mask.biases_log2(mask_row, key0 + j * kFrag + Isa::acc_key(lane, 0), bias);
        scale_and_bias(s_acc[j], bias);
      }
      step_scale = 1.f;
    }
    if constexpr (BIAS == kKeyBias) {
      // Each wave asks the staged biases itself whether the tile has any: a lane reads adjacent ones, in
      // one LDS load.
      constexpr int kBiasesPerLane = BLOCK_N >= 32 ? BLOCK_N / 32 : 1;
      static_assert(BLOCK_N == 16 || BLOCK_N % 32 == 0, "every lane's biases together cover the tile's keys");
      bool biased = false;
      if (BLOCK_N >= 32 || lane < BLOCK_N) {
        #pragma unroll
        for (int i = 0; i < kBiasesPerLane; ++i) biased |= key_biases[lane * kBiasesPerLane + i] != 0.f;
      }
      if (any_lane(biased)) {
        #pragma unroll
        for (int j = 0; j < kKeyFrags; ++j)  // acc_key(lane, s) is acc_key(lane, 0) + s on both ISAs
          scale_and_bias(s_acc[j], key_biases + j * kFrag + Isa::acc_key(lane, 0));
        step_scale = 1.f;
      }
    }
    float tile_max = kNegInf;
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j)
      #pragma unroll
      for (int s = 0; s < 8; ++s) {
        if (MASKED && key0 + j * kFrag + Isa::acc_key(lane, s) >= key_limit) s_acc[j][s] = kNegInf;
        tile_max = max_f32(tile_max, s_acc[j][s]);
      }
    tile_max = max_f32(tile_max, other_half(tile_max));
    const float tile_top = tile_max == kNegInf ? kNegInf : tile_max * step_scale;
    // Scores near their dtype's range (|scaled score| >= 2^24) are scaled and rounded first, as SDPA does
    // (T::kRoundsHugeScores). A row without a key in the tile (-inf) takes the branch too, harmlessly: -inf
    // times the positive scale stays -inf.
    if constexpr (T::kRoundsEveryScore && BIAS != kScoreBias) {
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j)
        #pragma unroll
        for (int s = 0; s < 8; ++s) s_acc[j][s] = mul_rounded_f32(s_acc[j][s], step_scale);
      step_scale = 1.f;
    } else if (T::kRoundsHugeScores && BIAS != kScoreBias && step_scale > 0.f &&
               any_lane(abs_f32(tile_top) >= kHugeScore)) {
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j)
        #pragma unroll
        for (int s = 0; s < 8; ++s) s_acc[j][s] *= step_scale;
      step_scale = 1.f;
    }
    // Wave-uniform: the whole wave rescales, or none of it. The sums take the factor below, in the same
    // operations whether it is 1 or not.
    float rescale = 1.f;
    if (!T::kSkipsRescale || any_lane(tile_top > row_max)) {
      const float new_max = max_f32(row_max, tile_top);
      // a fully masked row must not give inf - inf
      rescale = exp2_approx(row_max - (new_max == kNegInf ? 0.f : new_max));
      row_max = new_max;
      if constexpr (T::kSkipsRescale) scale_output(rescale);
    }
    const float bias = (row_max == kNegInf ? 0.f : row_max) + prob_shift;

    u32 p_bits[kKeyFrags][4];
    float tile_sum = 0.f, exact_even = 0.f, exact_odd = 0.f;
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j)
      #pragma unroll
      for (int w = 0; w < 4; ++w) {
        float p[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float x = s_acc[j][2 * w + h];
          p[h] = exp2_approx(fma_f32(x, step_scale, -bias));
          // With a zero scale a masked score would give exp2(-inf * 0) = NaN.
          if (MASKED && x == kNegInf) p[h] = 0.f;
        }
        exact_even += p[0];
        exact_odd += p[1];
        p_bits[j][w] = pack_probabilities(dt, p[0], p[1]);
        tile_sum = add_pair(dt, p_bits[j][w], tile_sum);
      }
    row_sum = row_sum * rescale + tile_sum;
    exact_sum = exact_sum * rescale + (exact_even + exact_odd);
    if constexpr (!T::kSkipsRescale) scale_output(rescale);  // after P, as the scheduler handles best there

    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      const Isa::Operand p_op = Isa::keys_to_operand(p_bits[j], lane);
      #pragma unroll
      for (int f = 0; f < kOutFrags; ++f)
        Isa::mma(dt, o_acc[f], load_operand<Shape::kVtRow>(vt_lds + f * kFrag * Shape::kVtRow, j * kFrag, lane), p_op);
    }
  }
};

template <class DT, class T>
RDNA_DEV void fwd_body(const FwdArgs& a, u16* lds) {
  using Loop = FwdLoop<DT, T>;
  constexpr int D_PAD = T::kHeadDim, BLOCK_N = T::kBlockN, D_CHUNK = T::kChunk;
  constexpr bool HAS_MASK = T::kMasked;
  using Shape = typename Loop::Shape;
  constexpr int kChunks = D_PAD / D_CHUNK;
  const DT dt{};
  const float kNegInf = -__builtin_inff();

  const int tid = thread_id();
  const int lane = lane_id();
  const int wave = tid >> 5;
  const int chunk = block_id_x() % kChunks;
  int q_block = block_id_x() / kChunks;
  if (a.causal) q_block = a.q_blocks - 1 - q_block;  // longest rows first: better tail balance
  const i64 head = block_id_y() + a.head0, batch = block_id_z() + a.batch0, kv_head = head / a.kv_group;
  const Sequence seq = Sequence::of(a.cu_seqlens_q, a.cu_seqlens_k, batch, a.seqlen_q, a.seqlen_k, a.causal);
  const int q0 = q_block * Shape::kBlockM;
  if (q0 >= seq.seqlen_q) return;  // a shorter entry of a packed batch: the whole workgroup leaves
  const int col0 = chunk * D_CHUNK;

  const u16* q = a.q + batch * a.q_stride_b + head * a.q_stride_h + seq.q_row0 * a.q_stride_s;
  u16* q_lds = lds + Shape::kQOffset;

  load_rows<Shape::kBlockM, D_PAD, Shape::kRow, Shape::kThreads, false, /*UNIFORM_BASE=*/false>(
      q_lds, q, a.q_stride_s, q0, seq.seqlen_q, a.head_dim, tid);
  // The tile loop takes row maxima of the raw scores, which needs a scale >= 0: a negative one
  // becomes a positive one on -Q. Each thread flips the rows it stored itself.
  if (a.scale_log2 < 0.f)
    for (int i = tid; i < Shape::kBlockM * (D_PAD / 8); i += Shape::kThreads) {
      u16* p = q_lds + i / (D_PAD / 8) * Shape::kRow + i % (D_PAD / 8) * 8;
      u32x4 t = load16(p);
      #pragma unroll
      for (int w = 0; w < 4; ++w) t[w] ^= 0x80008000u;
      store16(p, t);
    }

  const int wave_q0 = q0 + wave * kFrag;
  const int query = wave_q0 + (lane & 15);
  const MaskView mask = MaskView::of(a.mask, a.mask_kind, a.mask_stride_b, a.mask_stride_h, a.mask_stride_q,
                                     a.mask_stride_k, batch, head, seq).rows_from(wave_uniform(wave_q0));
  Loop loop{a,
            a.k + batch * a.k_stride_b + kv_head * a.k_stride_h + seq.k_row0 * a.k_stride_s,
            a.v + batch * a.v_stride_b + kv_head * a.v_stride_h + seq.k_row0 * a.v_stride_s,
            lds + Shape::kKOffset,
            lds + Shape::kVtOffset,
            q_lds + wave * kFrag * Shape::kRow,
            mask,
            tid,
            lane,
            col0,
            seq.seqlen_k,
            mask.row(query - wave_q0),
            seq.visible_keys(a.causal, query),
            a.scale_log2 < 0.f ? -a.scale_log2 : a.scale_log2,
            float(probability_shift(dt, seq.seqlen_k)),
            reinterpret_cast<float*>(lds + Shape::kBiasOffset)};
  #pragma unroll
  for (int f = 0; f < Loop::kOutFrags; ++f) loop.o_acc[f] = zero_v8f();
  loop.row_max = kNegInf;
  loop.row_sum = 0.f;
  loop.exact_sum = 0.f;

  // Causal: query i sees keys 0..i + diagonal (0: SDPA's top-left alignment).
  const int key_end = seq.visible_keys(a.causal, q0 + Shape::kBlockM - 1);
  const int key_tiles = (key_end + BLOCK_N - 1) / BLOCK_N;
  // Tiles every query of the workgroup sees whole: no per-score mask.
  const int open_tiles = min_int(key_tiles, seq.visible_keys(a.causal, q0) / BLOCK_N);

  // Two copies of the loop in a masked kernel, each scheduled on its own: a key-padding mask's choice
  // per tile would cost a full mask's tiles instructions too.
  if constexpr (HAS_MASK) {
    if (a.mask_stride_q == 0)
      loop.template tiles<kKeyBias>(open_tiles, key_tiles);
    else
      loop.template tiles<kScoreBias>(open_tiles, key_tiles);
  } else {
    loop.template tiles<kNoBias>(open_tiles, key_tiles);
  }

  // Cross-lane exchanges stay outside lane-dependent branches: a disabled lane has nothing to give.
  const float total = loop.row_sum + other_half(loop.row_sum);
  const float exact_total = loop.exact_sum + other_half(loop.exact_sum);
  // A maximum of +inf is a score whose product with the scale overflows float32: the row gives NaN, as
  // SDPA's does (its probabilities were all taken against +inf, so they are 0, not the softmax).
  const float inv_total = loop.row_max == __builtin_inff() ? __builtin_nanf("") : total > 0.f ? 1.f / total : 0.f;
  const float ref = loop.row_max == kNegInf ? 0.f : loop.row_max;
  // A row that sees no key (masked, or before a bottom-right diagonal) gives zeros, and +inf as its
  // log-sum-exp (flash-attn's convention), which makes every probability the backward recomputes 0. A
  // row SDPA makes NaN (a NaN or +inf bias, a score overflowing float32) gives NaN as its log-sum-exp
  // and its probability sum, which make the backward's gradients NaN where SDPA's are.
  if (chunk == 0 && lane < 16 && query < seq.seqlen_q) {
    const i64 row = batch * a.lse_stride_b + head * a.lse_stride_h + seq.q_row0 + query;
    const bool sees_keys = exact_total > 0.f;
    const bool nan_row = !(exact_total == exact_total) || loop.row_max == __builtin_inff();
    const float no_softmax = nan_row ? __builtin_nanf("") : __builtin_inff();
    a.lse[row] = sees_keys ? (ref + loop.prob_shift + log2_approx(exact_total)) * kLn2 : no_softmax;
    // Kept apart, unlike in the lse, they give the backward this pass's probabilities even where float32
    // cannot hold log2(keys) beside a row offset near 2^30 (a huge finite bias).
    if (a.row_offset != nullptr) {
      a.row_offset[row] = sees_keys ? ref + loop.prob_shift : no_softmax;
      a.row_log2_sum[row] = sees_keys ? log2_approx(exact_total) : nan_row ? no_softmax : 0.f;
    }
  }

  // Stage O through this wave's own Q rows, then write 16-byte rows: coalesced on both layouts. A
  // workgroup barrier, not a wave's: with no key tile (a packed entry without keys, causal bottom-right
  // with more queries than keys) no tile's barrier has ordered the other waves' Q stores into these rows.
  block_barrier();
  const i64 o_offset = batch * a.o_stride_b + head * a.o_stride_h + seq.q_row0 * a.o_stride_s;
  u16* const wave_rows = q_lds + wave * kFrag * Shape::kRow;
  if (a.o_low != nullptr)
    stage_transposed_with_remainder<DT, Loop::kOutFrags, Shape::kRow>(
        dt, wave_rows, loop.o_acc, inv_total, lane, a.o_low + o_offset, a.o_stride_s, q0 + wave * kFrag, seq.seqlen_q,
        col0, a.head_dim);
  else
    stage_transposed<DT, Loop::kOutFrags, Shape::kRow>(dt, wave_rows, loop.o_acc, inv_total, lane);
  block_barrier();
  store_rows<Shape::kBlockM, D_CHUNK, Shape::kRow, Shape::kThreads>(a.o + o_offset, a.o_stride_s, q_lds, q0,
                                                                    seq.seqlen_q, col0, a.head_dim, tid);
}

}  // namespace rdna
