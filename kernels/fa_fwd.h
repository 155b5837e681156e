// FlashAttention-2 forward.
//
// Each workgroup owns BLOCK_M = 16 * WAVES queries of one (batch, head) and one chunk of the output
// columns; each wave owns 16 queries. Per tile of BLOCK_N keys a wave computes S^T = K Q^T, so every
// lane holds one query's scores and the row statistics need one exchange between half-waves; then
// O^T += V^T P^T with P^T built in registers from S^T (P never goes through LDS).
#pragma once
#include "tiles.h"

namespace rdna {

// Kernel argument block; mirrored by rdna_flash_attn/launch_args.py (ABI version 1).
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
  int seqlen_q, seqlen_k, head_dim, causal;
  float scale_log2;  // softmax scale * log2(e): scores go straight into exp2
  int q_blocks;
};

// The LDS layout; rdna_flash_attn/variants.py computes the same size for the launcher.
template <int D_PAD, int WAVES, int BLOCK_N, int D_CHUNK>
struct FwdShape {
  static constexpr int kBlockM = kFrag * WAVES;
  static constexpr int kThreads = 32 * WAVES;
  static constexpr int kRow = D_PAD + kRowPad;       // Q and K rows
  static constexpr int kVtRow = BLOCK_N + kRowPad;   // V^T rows (one per output column)
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kBlockM * kRow;
  static constexpr int kVtOffset = kKOffset + BLOCK_N * kRow;
  static constexpr int kLdsElems = kVtOffset + D_CHUNK * kVtRow;
  static_assert(2 * kLdsElems <= 65536, "LDS over 64 KiB");
  static_assert(D_PAD % D_CHUNK == 0 && D_CHUNK % kFrag == 0 && BLOCK_N % kFrag == 0, "tile shape");
};

template <class DT, int D_PAD, int WAVES, int BLOCK_N, int D_CHUNK>
RDNA_DEV void fwd_body(const FwdArgs& a, u16* lds) {
  using Shape = FwdShape<D_PAD, WAVES, BLOCK_N, D_CHUNK>;
  constexpr int kKeyFrags = BLOCK_N / kFrag;
  constexpr int kOutFrags = D_CHUNK / kFrag;
  constexpr int kDimFrags = D_PAD / kFrag;
  constexpr int kChunks = D_PAD / D_CHUNK;
  const DT dt{};
  const float kNegInf = -__builtin_inff();

  const int tid = thread_id();
  const int lane = lane_id();
  const int wave = tid >> 5;
  const int chunk = block_id_x() % kChunks;
  int q_block = block_id_x() / kChunks;
  if (a.causal) q_block = a.q_blocks - 1 - q_block;  // longest rows first: better tail balance
  const i64 head = block_id_y(), batch = block_id_z();
  const int q0 = q_block * Shape::kBlockM;
  const int col0 = chunk * D_CHUNK;

  const u16* q = a.q + batch * a.q_stride_b + head * a.q_stride_h;
  const u16* k = a.k + batch * a.k_stride_b + head * a.k_stride_h;
  const u16* v = a.v + batch * a.v_stride_b + head * a.v_stride_h;
  u16* q_lds = lds + Shape::kQOffset;
  u16* k_lds = lds + Shape::kKOffset;
  u16* vt_lds = lds + Shape::kVtOffset;
  const u16* wave_q_lds = q_lds + wave * kFrag * Shape::kRow;

  load_rows<Shape::kBlockM, D_PAD, Shape::kRow, Shape::kThreads>(q_lds, q, a.q_stride_s, q0, a.seqlen_q, a.head_dim, tid);

  // Top-left causal alignment (SDPA's): query i sees keys 0..i.
  const int key_end = a.causal ? min_int(a.seqlen_k, q0 + Shape::kBlockM) : a.seqlen_k;
  const int key_tiles = (key_end + BLOCK_N - 1) / BLOCK_N;
  const int query = q0 + wave * kFrag + (lane & 15);
  const int key_limit = a.causal ? min_int(a.seqlen_k, query + 1) : a.seqlen_k;

  v8f o_acc[kOutFrags];
  #pragma unroll
  for (int f = 0; f < kOutFrags; ++f) o_acc[f] = zero_v8f();
  float row_max = kNegInf;  // in log2 units, on the same scaled value that is exponentiated
  float row_sum = 0.f;      // this lane's share of the rounded probabilities; the partner lane has the rest
  float exact_sum = 0.f;    // the same before rounding, for the log-sum-exp

  for (int tile = 0; tile < key_tiles; ++tile) {
    const int key0 = tile * BLOCK_N;
    block_barrier();  // every wave is done with the previous tile
    load_rows<BLOCK_N, D_PAD, Shape::kRow, Shape::kThreads>(k_lds, k, a.k_stride_s, key0, a.seqlen_k, a.head_dim, tid);
    load_transposed<BLOCK_N, D_CHUNK, Shape::kVtRow, Shape::kThreads>(vt_lds, v, a.v_stride_s, key0, a.seqlen_k,
                                                                      col0, a.head_dim, tid);
    block_barrier();

    v8f s_acc[kKeyFrags];
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) s_acc[j] = zero_v8f();
    // Unrolling this loop fully lets the scheduler hoist every K fragment load at once and run out
    // of VGPRs; two steps in flight hide the LDS latency well enough.
    #pragma unroll 2
    for (int d = 0; d < kDimFrags; ++d) {
      const Isa::Operand q_op = load_operand<Shape::kRow>(wave_q_lds, d * kFrag, lane);
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j)
        Isa::mma(dt, s_acc[j], load_operand<Shape::kRow>(k_lds + j * kFrag * Shape::kRow, d * kFrag, lane), q_op);
    }

    float tile_max = kNegInf;
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j)
      #pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int key = key0 + j * kFrag + Isa::acc_row(lane, s);
        const float x = key < key_limit ? s_acc[j][s] * a.scale_log2 : kNegInf;
        s_acc[j][s] = x;
        tile_max = max_f32(tile_max, x);
      }
    tile_max = max_f32(tile_max, other_half(tile_max));
    const float new_max = max_f32(row_max, tile_max);
    const float ref = new_max == kNegInf ? 0.f : new_max;  // a fully masked row must not give inf - inf
    const float rescale = exp2_approx(row_max - ref);
    row_max = new_max;

    float tile_sum = 0.f, tile_exact_sum = 0.f;
    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j)
      #pragma unroll
      for (int s = 0; s < 8; ++s) {
        const float exact = exp2_approx(s_acc[j][s] - ref);
        const float p = round_probability(dt, exact);
        s_acc[j][s] = p;
        tile_sum += p;
        tile_exact_sum += exact;
      }
    row_sum = row_sum * rescale + tile_sum;
    exact_sum = exact_sum * rescale + tile_exact_sum;
    #pragma unroll
    for (int f = 0; f < kOutFrags; ++f)
      #pragma unroll
      for (int s = 0; s < 8; ++s) o_acc[f][s] *= rescale;

    #pragma unroll
    for (int j = 0; j < kKeyFrags; ++j) {
      const Isa::Operand p_op = Isa::acc_to_operand(s_acc[j], lane, [dt](float x) { return probability_bits(dt, x); });
      #pragma unroll
      for (int f = 0; f < kOutFrags; ++f)
        Isa::mma(dt, o_acc[f], load_operand<Shape::kVtRow>(vt_lds + f * kFrag * Shape::kVtRow, j * kFrag, lane), p_op);
    }
  }

  // Cross-lane exchanges stay outside lane-dependent branches: a disabled lane has nothing to give.
  const float total = row_sum + other_half(row_sum);
  const float exact_total = exact_sum + other_half(exact_sum);
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
  const float ref = row_max == kNegInf ? 0.f : row_max;
  if (chunk == 0 && lane < 16 && query < a.seqlen_q)
    a.lse[batch * a.lse_stride_b + head * a.lse_stride_h + query] = (ref + log2_approx(exact_total)) * kLn2;

  // Stage O through this wave's own Q rows, then write 16-byte rows: coalesced on both layouts.
  wave_barrier();  // every lane of the wave is done reading those rows
  stage_transposed<DT, kOutFrags, Shape::kRow>(dt, q_lds + wave * kFrag * Shape::kRow, o_acc, inv_total, lane);
  block_barrier();
  store_rows<Shape::kBlockM, D_CHUNK, Shape::kRow, Shape::kThreads>(a.o + batch * a.o_stride_b + head * a.o_stride_h,
                                                                    a.o_stride_s, q_lds, q0, a.seqlen_q, col0,
                                                                    a.head_dim, tid);
}

}  // namespace rdna
