// FlashAttention-2 backward in two kernels: dQ per query block (which also writes each row's
// delta = rowsum(P * dP) for the second), then dK and dV per key block. Every gradient element
// belongs to exactly one workgroup and is summed in a fixed order, so there are no atomics, no
// read-modify-write between workgroups, and gradients are bitwise reproducible run to run.
//
// Precision, judged by FlashAttention-2's own criterion (tests/gpu/test_backward.py): P and dS are
// rounded once to 16 bits for their products, as FA2 does. delta is FA2's rowsum(dO * O), but from O
// plus its saved rounding remainder (FwdArgs): from the 16-bit O alone it fails that criterion on
// short causal rows (bench/results/backward_precision_fa2.md). Where the
// forward saved nothing (a caller with only the lse), a first dQ sweep sums the exact
// rowsum(P * dP) instead. Counting one matrix product over the whole head dim as 1: dQ 2 + 1 (4 + 1
// with that sweep), dV 1 + 1, dK 2 + 1, so 8 (7 where one workgroup makes dK and dV from one S)
// against FA2's 5 (dQ summed with atomics in the dK/dV pass).
//
// dK/dV: each wave owns 16 keys, so S = Q K^T and dP = dO V^T come out with one key per lane and P,
// dS turn into B operands in registers for dV^T += dO^T P and dK^T += Q^T dS. Up to padded head dim
// 64, and unmasked at d128, a workgroup makes both from one S (1 + 1 + 2 + 2 units); elsewhere both
// accumulator sets do not fit beside the operands (or did no better), so a workgroup makes either dV or
// dK and S is computed twice per key block (the traits' kFused).
// dQ: each wave owns 16 queries, like the forward pass: S^T, dP^T with one query per lane; one sweep
// over the keys makes dS^T and dQ^T += K^T dS^T (two where delta is summed first).
// Grouped-query attention: a dK/dV workgroup sums over its key/value head's query heads in order,
// so dK and dV stay deterministic without atomics. Masks and packed batches: see sequence.h.
// K and V (dK/dV) or Q and dO (dQ) are private to a wave and read straight from global memory: K and
// V once per kernel into registers where they fit (kResidentK, kResidentV) or into the wave's own LDS
// rows (kStagedKv), the rest per use, as the instance's traits choose (rdna_flash_attn/runtime/tuning.py);
// the operands shared by the workgroup go through LDS.
#pragma once
#include "sequence.h"

namespace rdna {

// Kernel argument block for both kernels; mirrored by rdna_flash_attn/ops/launch_args.py.
struct BwdArgs {
  const u16* q;
  const u16* k;
  const u16* v;
  const u16* dout;
  const float* lse;  // forward log-sum-exp, natural log, (batch, heads, seqlen_q), or see lse_to_log2
  float* delta;      // rowsum(P * dP) = rowsum(dO * O), same layout as lse: written by the dQ kernel, read by dK/dV
  u16* dq;
  u16* dk;
  u16* dv;
  i64 q_stride_b, q_stride_h, q_stride_s;
  i64 k_stride_b, k_stride_h, k_stride_s;
  i64 v_stride_b, v_stride_h, v_stride_s;
  i64 do_stride_b, do_stride_h, do_stride_s;
  i64 dq_stride_b, dq_stride_h, dq_stride_s;
  i64 dk_stride_b, dk_stride_h, dk_stride_s;
  i64 dv_stride_b, dv_stride_h, dv_stride_s;
  i64 lse_stride_b, lse_stride_h;  // lse and delta rows are contiguous
  int seqlen_q, seqlen_k, head_dim;  // with cu_seqlens: the longest entry's lengths
  int causal;                        // Causal (sequence.h)
  float scale_log2;  // softmax scale * log2(e)
  float scale;
  int blocks;  // row blocks along grid x (query blocks for dQ)
  const void* mask;  // as in FwdArgs
  i64 mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k;
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int mask_kind;
  int kv_group;  // query heads per key/value head; the dK/dV grid runs over key/value heads
  float* row_log2_sum;  // log2 of each row's probability sum (see below), layout of lse
  // What a training forward saved (FwdArgs; out_low with out's strides), or null: then the dQ kernel
  // sums delta and row_log2_sum in a first sweep.
  const u16* out;
  const u16* out_low;
  i64 out_stride_b, out_stride_h, out_stride_s;
  // lse * lse_to_log2 is the offset each row's base-2 exponents subtract: log2(e) for the forward's
  // natural-log lse, 1 where lse points at the training forward's own row offsets.
  float lse_to_log2;
  int head0, batch0;  // as in FwdArgs; head0 counts the launch's grid y: query heads (dQ), key/value heads (dK/dV)
};

// delta = rowsum(dO * (O + O_low)) for a wave's 16 queries, on the matrix unit and in the order dP's
// sums take: the diagonal of dO (O + O_low)^T. Where a row's probability sits on one key, O is that
// key's V and O_low is 0, so delta equals that key's dP bit for bit and dP - delta vanishes, as the
// exact gradient does (a first sweep gets this by summing P * dP itself).
template <class DT, int D_PAD>
RDNA_DEV float output_delta(DT dt, const BwdArgs& a, const u16* dout, const u16* out, const u16* out_low, int row0,
                            int seqlen, int lane) {
  v8f acc = zero_v8f();
  #pragma unroll
  for (int part = 0; part < 2; ++part) {
    #pragma unroll 1  // once per wave, outside the key loop: unrolling only costs registers
    for (int d = 0; d < D_PAD / kFrag; ++d)
      Isa::mma(dt, acc,
               load_operand_global(part == 0 ? out : out_low, a.out_stride_s, row0, seqlen, d * kFrag, a.head_dim,
                                   lane),
               load_operand_global(dout, a.do_stride_s, row0, seqlen, d * kFrag, a.head_dim, lane));
  }
  // Accumulator value s is row acc_row(lane, s) of column lane % 16: one half-wave holds the diagonal.
  float mine = 0.f;
  bool holds = false;
  #pragma unroll
  for (int s = 0; s < 8; ++s) {
    const bool diagonal = Isa::acc_row(lane, s) == (lane & 15);
    mine = diagonal ? acc[s] : mine;
    holds = holds || diagonal;
  }
  const float theirs = other_half(mine);
  return holds ? mine : theirs;
}

// P recomputed from the stored lse sums to 1 only within rounding, and for a row at a huge bias
// (sequence.h) only within a factor 2^7: float32 cannot hold log2(keys) beside a log-sum-exp near
// 2^30. So both kernels take exponents relative to the forward's own row offset and divide by its
// probability sum (its log2 in row_log2_sum) where the forward saved them; otherwise the dQ kernel
// sums each row's recomputed P in its first sweep (dividing by 1) and both divide by that. Exponents
// are capped at kMaxExponent, so that P and any row's sum stay finite even where the offset does not
// bound the scores (a foreign lse): a legitimate row's exponents stay below 7.
constexpr float kMaxExponent = 64.f;

// A row's terms of its scores' base-2 exponents. FOLD (unmasked kernels): the log2 of the probability
// sum is folded into the negated offset, so that dividing by the sum takes no op per score; that sum
// rounds at the offset's magnitude, as the scores' own fp32 values do. A masked row at a huge bias
// (offset near 2^30) would lose the log2 sum in it, so masked scores subtract it one by one.
template <bool FOLD>
struct RowExponent {
  float offset;
  float log2_sum;  // 0 where folded
  static RDNA_DEV RowExponent of(float neg_offset, float log2_sum) {
    return FOLD ? RowExponent{neg_offset - log2_sum, 0.f} : RowExponent{neg_offset, log2_sum};
  }
};
// A score's base-2 exponent relative to its row's offset (RowExponent), capped. A masked score is biased
// first, rounded as the forward rounds it (at a huge bias the offset is a maximum of such values); an
// unmasked one takes one fma for its multiply and subtraction.
template <bool HAS_MASK>
RDNA_DEV float capped_exponent(float s, float scale_log2, float bias, float offset) {
  const float x = HAS_MASK ? fma_f32(s, scale_log2, bias) + offset : fma_f32(s, scale_log2, offset);
  return min_f32(x, kMaxExponent);
}

// acc[f] += A_f x, A_f the f-th 16-row fragment of an LDS tile.
template <int FRAGS, int LDS_ROW, class DT>
RDNA_DEV void accumulate(DT dt, v8f (&acc)[FRAGS], const u16* tile, int col0, const Isa::Operand& x, int lane) {
  #pragma unroll
  for (int f = 0; f < FRAGS; ++f) Isa::mma(dt, acc[f], load_operand<LDS_ROW>(tile + f * kFrag * LDS_ROW, col0, lane), x);
}

// x, an accumulator tile whose rows are keys (or queries) in Isa::acc_key order, as the B operand of a
// product over them, each value rounded once to 16 bits. FETCH_INACTIVE (other_half's) saves a move per
// exchange and costs registers. PROBABILITIES: x holds no negative values (pack_probabilities).
template <bool FETCH_INACTIVE, bool PROBABILITIES, class DT>
RDNA_DEV Isa::Operand rounded_operand(DT dt, const v8f& x, int lane) {
  u32 bits[4];
  #pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float lo = x[2 * w], hi = x[2 * w + 1];
    bits[w] = PROBABILITIES ? pack_probabilities(dt, lo, hi) : pack_rounded(dt, lo, hi);
  }
  return Isa::keys_to_operand<FETCH_INACTIVE>(bits, lane);
}

// LDS of the dK/dV kernel of traits T; rdna_flash_attn/runtime/variants.py computes the same size.
template <class T>
struct DkdvShape {
  static constexpr int D_PAD = T::kHeadDim, WAVES = T::kWaves, BLOCK_M = T::kBlockM, D_CHUNK = T::kChunk;
  static constexpr int kBlockN = kFrag * WAVES;
  static constexpr int kThreads = 32 * WAVES;
  static constexpr int kRow = D_PAD + kRowPad;      // Q and dO rows
  static constexpr int kTRow = BLOCK_M + kRowPad;   // Q^T and dO^T rows (one per output column)
  static constexpr int kStageRow = D_CHUNK + kRowPad;
  static constexpr int kQOffset = 0;
  static constexpr int kDoOffset = BLOCK_M * kRow;
  static constexpr int kQtOffset = kDoOffset + BLOCK_M * kRow;
  static constexpr int kDotOffset = kQtOffset + D_CHUNK * kTRow;
  // float offset[BLOCK_M], delta[BLOCK_M], and where it is not folded into the offset log2_sum[BLOCK_M]
  static constexpr int kRowStats = T::kFoldedLog2Sum ? 2 : 3;
  static constexpr int kStatsOffset = kDotOffset + D_CHUNK * kTRow;
  // T::kStagedKv: per wave its 16 K rows, then its 16 V rows
  static constexpr int kKvOffset = kStatsOffset + 2 * kRowStats * BLOCK_M;
  static constexpr int kWaveKvElems = 2 * kFrag * kRow;
  static constexpr int kLdsElems = kKvOffset + (T::kStagedKv ? WAVES * kWaveKvElems : 0);
  static_assert(2 * kLdsElems <= 65536, "LDS over 64 KiB");
  static_assert(kBlockN * kStageRow <= kLdsElems, "gradient staging must fit in the LDS tiles");
};

// T: the instance's traits, generated from rdna_flash_attn/runtime/tuning.py.
template <class DT, class T>
RDNA_DEV void dkdv_body(const BwdArgs& a, u16* lds) {
  constexpr int D_PAD = T::kHeadDim, BLOCK_M = T::kBlockM, D_CHUNK = T::kChunk;
  constexpr bool HAS_MASK = T::kMasked;
  using Shape = DkdvShape<T>;
  constexpr int kQueryFrags = BLOCK_M / kFrag;
  constexpr int kOutFrags = D_CHUNK / kFrag;
  constexpr int kDimFrags = D_PAD / kFrag;
  constexpr int kChunks = (D_PAD + D_CHUNK - 1) / D_CHUNK;
  const DT dt{};
  const float kInf = __builtin_inff();

  const int tid = thread_id();
  const int lane = lane_id();
  const int wave = tid >> 5;
  // A fused workgroup makes dK and dV of one column chunk. Otherwise each makes one of them: one
  // accumulator set in registers, and the dV workgroups skip dP altogether.
  constexpr int kJobs = T::kFused ? kChunks : 2 * kChunks;
  const int job = block_id_x() % kJobs;
  const bool make_dk = T::kFused || job >= kChunks;
  const int chunk = job % kChunks;
  const int k0 = block_id_x() / kJobs * Shape::kBlockN;  // block 0 sees the most queries when causal: first
  const int col0 = chunk * D_CHUNK;
  const i64 kv_head = block_id_y() + a.head0, batch = block_id_z() + a.batch0;
  const Sequence seq = Sequence::of(a.cu_seqlens_q, a.cu_seqlens_k, batch, a.seqlen_q, a.seqlen_k, a.causal);
  if (k0 >= seq.seqlen_k) return;  // a shorter entry of a packed batch: the whole workgroup leaves
  const u16* k = a.k + batch * a.k_stride_b + kv_head * a.k_stride_h + seq.k_row0 * a.k_stride_s;
  const u16* v = a.v + batch * a.v_stride_b + kv_head * a.v_stride_h + seq.k_row0 * a.v_stride_s;
  u16* q_lds = lds + Shape::kQOffset;
  u16* do_lds = lds + Shape::kDoOffset;
  u16* qt_lds = lds + Shape::kQtOffset;
  u16* dot_lds = lds + Shape::kDotOffset;
  float* offset_lds = reinterpret_cast<float*>(lds + Shape::kStatsOffset);  // RowExponent's
  float* delta_lds = offset_lds + BLOCK_M;
  float* log2_sum_lds = T::kFoldedLog2Sum ? nullptr : delta_lds + BLOCK_M;  // kRowStats

  const int wave_key0 = k0 + wave * kFrag;
  const int key = wave_key0 + (lane & 15);
  const int key_seen_from = seq.first_query(a.causal, key);  // the first query that sees this lane's key

  v8f acc[kOutFrags];  // dK, or dV when the workgroup makes dV only
  v8f dv_acc[T::kFused ? kOutFrags : 1];
  #pragma unroll
  for (int f = 0; f < kOutFrags; ++f) acc[f] = zero_v8f();
  #pragma unroll
  for (int f = 0; f < (T::kFused ? kOutFrags : 1); ++f) dv_acc[f] = zero_v8f();

  // This wave's K (and for dK its V) operands, loaded once where they stay in registers; or its K and V
  // rows, zero past seqlen and head_dim as load_operand_global reads them, staged in LDS (the first query
  // tile's barrier orders them before their reads).
  constexpr int kDimSteps = T::kResidentK ? kDimFrags : T::kDimUnroll;  // register arrays need constant indices
  Isa::Operand k_ops[T::kResidentK ? kDimFrags : 1], v_ops[T::kResidentV ? kDimFrags : 1];
  #pragma unroll
  for (int d = 0; d < kDimFrags; ++d) {
    if constexpr (T::kResidentK)
      k_ops[d] = load_operand_global(k, a.k_stride_s, wave_key0, seq.seqlen_k, d * kFrag, a.head_dim, lane);
    if constexpr (T::kResidentV) {
      if (make_dk)
        v_ops[d] = load_operand_global(v, a.v_stride_s, wave_key0, seq.seqlen_k, d * kFrag, a.head_dim, lane);
    }
  }
  u16* k_rows_lds = lds + Shape::kKvOffset + wave * Shape::kWaveKvElems;
  u16* v_rows_lds = k_rows_lds + kFrag * Shape::kRow;
  if constexpr (T::kStagedKv) {
    load_rows<kFrag, D_PAD, Shape::kRow, 32>(k_rows_lds, k, a.k_stride_s, wave_key0, seq.seqlen_k, a.head_dim, lane);
    load_rows<kFrag, D_PAD, Shape::kRow, 32>(v_rows_lds, v, a.v_stride_s, wave_key0, seq.seqlen_k, a.head_dim, lane);
  }

  // Causal: query i sees keys 0..i + diagonal, so queries before this key block's first key minus the
  // diagonal contribute nothing.
  const int first_query = a.causal ? k0 - seq.diagonal : 0;
  const int q_begin = first_query > 0 ? first_query / BLOCK_M * BLOCK_M : 0;
  // Grouped-query attention: the group's query heads in a fixed order, into the same accumulators.
  for (int group_head = 0; group_head < a.kv_group; ++group_head) {
    const i64 head = kv_head * a.kv_group + group_head;
    const u16* q = a.q + batch * a.q_stride_b + head * a.q_stride_h + seq.q_row0 * a.q_stride_s;
    const u16* dout = a.dout + batch * a.do_stride_b + head * a.do_stride_h + seq.q_row0 * a.do_stride_s;
    const i64 stats = batch * a.lse_stride_b + head * a.lse_stride_h + seq.q_row0;
    const MaskView mask = MaskView::of(a.mask, a.mask_kind, a.mask_stride_b, a.mask_stride_h, a.mask_stride_q,
                                       a.mask_stride_k, batch, head, seq);
    // A key-padding mask (one bias per key) gives this lane's key one bias for every query: read once.
    const bool key_padding = T::kKeyBiasOnce && a.mask_stride_q == 0;
    const float key_bias = key_padding ? mask.bias_log2(0, key) : 0.f;
    const v8f first_c = T::kHeldZeroC ? held_zero_v8f() : zero_v8f();
    for (int q0 = q_begin; q0 < seq.seqlen_q; q0 += BLOCK_M) {
      block_barrier();
      // T::kStatsWithCopies: the tile's row statistics, read by every thread at a row clamped into the tile
      // and the sequence: without a branch their loads join the copies' and share their memory round trip.
      float row_lse = 0.f, row_log2_sum = 0.f, row_delta = 0.f;
      if constexpr (T::kStatsWithCopies) {
        static_assert(BLOCK_M <= Shape::kThreads, "one thread per row's statistics");
        const i64 stat_row = stats + min_int(q0 + min_int(tid, BLOCK_M - 1), seq.seqlen_q - 1);
        row_lse = a.lse[stat_row];
        row_log2_sum = a.row_log2_sum[stat_row];
        row_delta = a.delta[stat_row];
      }
      // Edges may repeat (T::kRepeatingCopies): S = Q K^T and dP = dO V^T take K and V zero past head_dim;
      // the queries past seqlen have P = dS = 0 (offset -inf); the rows of Q^T and dO^T past head_dim make
      // gradient columns that are not stored.
      load_rows<BLOCK_M, D_PAD, Shape::kRow, Shape::kThreads, true, T::kUniformBase, T::kRepeatingCopies>(
          q_lds, q, a.q_stride_s, q0, seq.seqlen_q, a.head_dim, tid);
      if (make_dk) {
        load_rows<BLOCK_M, D_PAD, Shape::kRow, Shape::kThreads, true, T::kUniformBase, T::kRepeatingCopies>(
            do_lds, dout, a.do_stride_s, q0, seq.seqlen_q, a.head_dim, tid);
        load_transposed<BLOCK_M, D_CHUNK, Shape::kTRow, Shape::kThreads, T::kUniformBase, T::kSixteenBitTranspose,
                        T::kRepeatingCopies>(qt_lds, q, a.q_stride_s, q0, seq.seqlen_q, col0, a.head_dim, tid);
      }
      if (!make_dk || T::kFused) {
        load_transposed<BLOCK_M, D_CHUNK, Shape::kTRow, Shape::kThreads, T::kUniformBase, T::kSixteenBitTranspose,
                        T::kRepeatingCopies>(dot_lds, dout, a.do_stride_s, q0, seq.seqlen_q, col0, a.head_dim, tid);
      }
      // -inf: padding rows get probability 0
      if constexpr (T::kStatsWithCopies) {
        if (tid < BLOCK_M) {
          const bool valid = q0 + tid < seq.seqlen_q;
          offset_lds[tid] =
              valid ? RowExponent<T::kFoldedLog2Sum>::of(-(row_lse * a.lse_to_log2), row_log2_sum).offset : -kInf;
          delta_lds[tid] = valid ? row_delta : 0.f;
        }
      } else {
        for (int i = tid; i < BLOCK_M; i += Shape::kThreads) {
          const bool valid = q0 + i < seq.seqlen_q;
          offset_lds[i] = valid ? RowExponent<T::kFoldedLog2Sum>::of(-(a.lse[stats + q0 + i] * a.lse_to_log2),
                                                        a.row_log2_sum[stats + q0 + i]).offset
                                : -kInf;
          delta_lds[i] = valid ? a.delta[stats + q0 + i] : 0.f;
          if constexpr (!T::kFoldedLog2Sum) log2_sum_lds[i] = valid ? a.row_log2_sum[stats + q0 + i] : 0.f;
        }
      }
      block_barrier();

      // One query fragment at a time: unrolling this loop multiplies the live accumulators.
      #pragma unroll 1
      for (int qf = 0; qf < kQueryFrags; ++qf) {
        v8f s_acc = first_c, dp_acc = first_c;
        #pragma unroll kDimSteps
        for (int d = 0; d < kDimFrags; ++d) {
          const Isa::Operand k_op = T::kResidentK ? k_ops[T::kResidentK ? d : 0]
                                    : T::kStagedKv ? load_operand<Shape::kRow>(k_rows_lds, d * kFrag, lane)
                                                   : load_operand_global(k, a.k_stride_s, wave_key0, seq.seqlen_k,
                                                                         d * kFrag, a.head_dim, lane);
          Isa::mma(dt, s_acc, load_operand<Shape::kRow>(q_lds + qf * kFrag * Shape::kRow, d * kFrag, lane), k_op);
          if (make_dk) {
            const Isa::Operand v_op = T::kResidentV ? v_ops[T::kResidentV ? d : 0]
                                      : T::kStagedKv ? load_operand<Shape::kRow>(v_rows_lds, d * kFrag, lane)
                                                     : load_operand_global(v, a.v_stride_s, wave_key0, seq.seqlen_k,
                                                                           d * kFrag, a.head_dim, lane);
            Isa::mma(dt, dp_acc, load_operand<Shape::kRow>(do_lds + qf * kFrag * Shape::kRow, d * kFrag, lane), v_op);
          }
        }
        // Q and dO rows lie in key_slot order, so accumulator value s is query acc_key(lane, s), which
        // is acc_key(lane, 0) + s on both ISAs: it sees this lane's key from s = first_s on.
        const int first_s = key_seen_from - (q0 + qf * kFrag + Isa::acc_key(lane, 0));
        const auto probability = [&](auto tested, int s) {
          const int row = qf * kFrag + Isa::acc_key(lane, s);
          const bool visible = !decltype(tested)::value || s >= first_s;
          const float bias = !HAS_MASK ? 0.f : key_padding ? key_bias : mask.bias_log2(mask.row(q0 + row), key);
          const float exponent = capped_exponent<HAS_MASK>(s_acc[s], a.scale_log2, bias, offset_lds[row]);
          return visible ? exp2_approx(T::kFoldedLog2Sum ? exponent : exponent - log2_sum_lds[row]) : 0.f;
        };
        const auto dS = [&](int s, float p) { return p * (dp_acc[s] - delta_lds[qf * kFrag + Isa::acc_key(lane, s)]); };
        // P, or for dK alone dS. Fragments whose queries all see the wave's keys skip the per-score test
        // (one wave-uniform branch): it costs more than its compare where the compiler sinks each
        // probability into it, one exec-masked block per score (the split and masked kernels), which
        // serializes the statistics' LDS reads. Their choice between P and dS is taken once, not per score,
        // for the same reason (the tested fragments keep it per score: a fourth copy spilled SGPRs in gfx11's
        // split d112 and d128 kernels).
        const auto scores = [&](auto tested, bool ds) {
          #pragma unroll
          for (int s = 0; s < 8; ++s) {
            const float p = probability(tested, s);
            s_acc[s] = ds ? dS(s, p) : p;
          }
        };
        const bool ds_only = make_dk && !T::kFused;  // dK alone: the scores turn into dS straight away
        if (any_lane(first_s > 0))
          scores(Flag<true>{}, ds_only);
        else if (ds_only)
          scores(Flag<false>{}, true);
        else
          scores(Flag<false>{}, false);
        if constexpr (T::kFused) {  // dV^T += dO^T P, then P turns into dS
          accumulate<kOutFrags, Shape::kTRow>(dt, dv_acc, dot_lds, qf * kFrag,
                                              rounded_operand<T::kFetchInactive, true>(dt, s_acc, lane), lane);
          #pragma unroll
          for (int s = 0; s < 8; ++s) s_acc[s] = dS(s, s_acc[s]);
        }
        // P (for dV) or dS (for dK)
        accumulate<kOutFrags, Shape::kTRow>(dt, acc, make_dk ? qt_lds : dot_lds, qf * kFrag,
                                            rounded_operand<T::kFetchInactive, false>(dt, s_acc, lane), lane);
      }
    }
  }

  block_barrier();
  stage_transposed<DT, kOutFrags, Shape::kStageRow>(dt, lds + wave * kFrag * Shape::kStageRow, acc,
                                                    make_dk ? a.scale : 1.f, lane);
  block_barrier();
  const i64 grad_stride = make_dk ? a.dk_stride_s : a.dv_stride_s;
  u16* grad = (make_dk ? a.dk + batch * a.dk_stride_b + kv_head * a.dk_stride_h
                       : a.dv + batch * a.dv_stride_b + kv_head * a.dv_stride_h) + seq.k_row0 * grad_stride;
  store_rows<Shape::kBlockN, D_CHUNK, Shape::kStageRow, Shape::kThreads>(grad, grad_stride, lds, k0, seq.seqlen_k, col0,
                                                                         a.head_dim, tid);
  if constexpr (T::kFused) {
    block_barrier();
    stage_transposed<DT, kOutFrags, Shape::kStageRow>(dt, lds + wave * kFrag * Shape::kStageRow, dv_acc, 1.f, lane);
    block_barrier();
    store_rows<Shape::kBlockN, D_CHUNK, Shape::kStageRow, Shape::kThreads>(
        a.dv + batch * a.dv_stride_b + kv_head * a.dv_stride_h + seq.k_row0 * a.dv_stride_s, a.dv_stride_s, lds, k0,
        seq.seqlen_k, col0, a.head_dim, tid);
  }
}

// LDS of the dQ kernel of traits T; rdna_flash_attn/runtime/variants.py computes the same size.
template <class T>
struct DqShape {
  static constexpr int D_PAD = T::kHeadDim, WAVES = T::kWaves, BLOCK_N = T::kBlockN, D_CHUNK = T::kChunk;
  static constexpr int kBlockM = kFrag * WAVES;
  static constexpr int kThreads = 32 * WAVES;
  static constexpr int kRow = D_PAD + kRowPad;      // K and V rows
  static constexpr int kTRow = BLOCK_N + kRowPad;   // K^T rows
  static constexpr int kStageRow = D_CHUNK + kRowPad;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = BLOCK_N * kRow;
  static constexpr int kKtOffset = kVOffset + BLOCK_N * kRow;
  // T::kStagedQdo: the workgroup's Q rows, then its dO rows
  static constexpr int kQdoOffset = kKtOffset + D_CHUNK * kTRow;
  static constexpr int kLdsElems = kQdoOffset + (T::kStagedQdo ? 2 * kBlockM * kRow : 0);
  static_assert(2 * kLdsElems <= 65536, "LDS over 64 KiB");
  static_assert(kBlockM * kStageRow <= kLdsElems, "gradient staging must fit in the LDS tiles");
};

template <class DT, class T>
RDNA_DEV void dq_body(const BwdArgs& a, u16* lds) {
  constexpr int D_PAD = T::kHeadDim, BLOCK_N = T::kBlockN, D_CHUNK = T::kChunk;
  constexpr bool HAS_MASK = T::kMasked;
  using Shape = DqShape<T>;
  constexpr int kKeyFrags = BLOCK_N / kFrag;
  constexpr int kOutFrags = D_CHUNK / kFrag;
  constexpr int kDimFrags = D_PAD / kFrag;
  constexpr int kChunks = (D_PAD + D_CHUNK - 1) / D_CHUNK;
  const DT dt{};

  const int tid = thread_id();
  const int lane = lane_id();
  const int wave = tid >> 5;
  const int chunk = block_id_x() % kChunks;
  int q_block = block_id_x() / kChunks;
  if (a.causal) q_block = a.blocks - 1 - q_block;  // longest rows first
  const int q0 = q_block * Shape::kBlockM;
  const int col0 = chunk * D_CHUNK;
  const i64 head = block_id_y() + a.head0, batch = block_id_z() + a.batch0, kv_head = head / a.kv_group;
  const Sequence seq = Sequence::of(a.cu_seqlens_q, a.cu_seqlens_k, batch, a.seqlen_q, a.seqlen_k, a.causal);
  if (q0 >= seq.seqlen_q) return;  // a shorter entry of a packed batch: the whole workgroup leaves
  const u16* q = a.q + batch * a.q_stride_b + head * a.q_stride_h + seq.q_row0 * a.q_stride_s;
  const u16* k = a.k + batch * a.k_stride_b + kv_head * a.k_stride_h + seq.k_row0 * a.k_stride_s;
  const u16* v = a.v + batch * a.v_stride_b + kv_head * a.v_stride_h + seq.k_row0 * a.v_stride_s;
  const u16* dout = a.dout + batch * a.do_stride_b + head * a.do_stride_h + seq.q_row0 * a.do_stride_s;
  const int wave_q0 = q0 + wave * kFrag;
  const MaskView mask = MaskView::of(a.mask, a.mask_kind, a.mask_stride_b, a.mask_stride_h, a.mask_stride_q,
                                     a.mask_stride_k, batch, head, seq).rows_from(wave_uniform(wave_q0));
  u16* k_lds = lds + Shape::kKOffset;
  u16* v_lds = lds + Shape::kVOffset;
  u16* kt_lds = lds + Shape::kKtOffset;

  const int query = wave_q0 + (lane & 15);
  const int mask_row = mask.row(lane & 15);
  const bool valid_query = query < seq.seqlen_q;
  const i64 stats = batch * a.lse_stride_b + head * a.lse_stride_h + seq.q_row0 + query;
  const float neg_offset = valid_query ? -(a.lse[stats] * a.lse_to_log2) : -__builtin_inff();

  // S^T = K Q^T and dP^T = V dO^T: K and V are zero past head_dim in LDS, and P^T is zero for the
  // queries past seqlen (their offset is -inf), so Q and dO may repeat their edges (RepeatingRows).
  const RepeatingRows q_rows = RepeatingRows::of(q, a.q_stride_s, q0, wave_q0, seq.seqlen_q, lane);
  const RepeatingRows do_rows = RepeatingRows::of(dout, a.do_stride_s, q0, wave_q0, seq.seqlen_q, lane);
  // This wave's Q or dO operand at head-dim step d, by T::kRepeatingQdo.
  const auto wave_operand = [&](const RepeatingRows& rows, const u16* src, i64 stride, int d) {
    return T::kRepeatingQdo
               ? rows.load(d * kFrag, a.head_dim)
               : load_operand_global(src, stride, wave_q0, seq.seqlen_q, d * kFrag, a.head_dim, lane);
  };
  // T::kHeldQdo: this wave's operands, loaded once. T::kStagedQdo: the workgroup's rows, zero past seqlen and
  // head_dim (the first key tile's barrier orders them before their reads).
  Isa::Operand q_ops[T::kHeldQdo ? kDimFrags : 1], do_ops[T::kHeldQdo ? kDimFrags : 1];
  if constexpr (T::kHeldQdo) {
    #pragma unroll
    for (int d = 0; d < kDimFrags; ++d) {
      q_ops[d] = wave_operand(q_rows, q, a.q_stride_s, d);
      do_ops[d] = wave_operand(do_rows, dout, a.do_stride_s, d);
    }
  }
  const u16* q_wave_lds = lds + Shape::kQdoOffset + wave * kFrag * Shape::kRow;
  const u16* do_wave_lds = q_wave_lds + Shape::kBlockM * Shape::kRow;
  if constexpr (T::kStagedQdo) {
    u16* q_rows_lds = lds + Shape::kQdoOffset;
    load_rows<Shape::kBlockM, D_PAD, Shape::kRow, Shape::kThreads>(q_rows_lds, q, a.q_stride_s, q0, seq.seqlen_q,
                                                                   a.head_dim, tid);
    load_rows<Shape::kBlockM, D_PAD, Shape::kRow, Shape::kThreads>(q_rows_lds + Shape::kBlockM * Shape::kRow, dout,
                                                                   a.do_stride_s, q0, seq.seqlen_q, a.head_dim, tid);
  }
  const int key_end = seq.visible_keys(a.causal, q0 + Shape::kBlockM - 1);
  const int key_limit = seq.visible_keys(a.causal, query);
  const int open_end = seq.visible_keys(a.causal, q0);  // keys every query of the workgroup sees: its first's
  v8f dq_acc[kOutFrags];
  #pragma unroll
  for (int f = 0; f < kOutFrags; ++f) dq_acc[f] = zero_v8f();
  // This lane's keys' share of rowsum(P * dP) and rowsum(P); the partner lane has the rest.
  float delta_share = 0.f, p_share = 0.f;
  float delta = 0.f, norm = 0.f;
  const bool saved = a.out != nullptr;  // uniform
  if (saved) {
    const i64 out_offset = batch * a.out_stride_b + head * a.out_stride_h + seq.q_row0 * a.out_stride_s;
    delta = output_delta<DT, D_PAD>(dt, a, dout, a.out + out_offset, a.out_low + out_offset, wave_q0, seq.seqlen_q,
                                    lane);
    norm = valid_query ? a.row_log2_sum[stats] : 0.f;
    if (chunk == 0 && lane < 16 && valid_query) a.delta[stats] = delta;
  }

  // Without the forward's saved values, sweep 0 sums delta and sweep 1 uses it: the same S^T and dP^T
  // each time.
  #pragma unroll 1
  for (int sweep = saved ? 1 : 0; sweep < 2; ++sweep) {
    if (sweep == 1 && !saved) {
      // Dividing P by its actual sum (see kMaxExponent) also makes dP - delta vanish where it must
      // (one visible key: the gradient is exactly zero).
      const float p_total = p_share + other_half(p_share);
      const float pdp_total = delta_share + other_half(delta_share);  // exchanges outside any branch
      // A NaN log-sum-exp (a row SDPA makes NaN, fa_fwd.h) makes both NaN, and through them every P of the
      // row's masked kernels and every dS of it: the gradients are NaN where SDPA's are.
      const bool nan_row = !(neg_offset == neg_offset);
      delta = nan_row ? neg_offset : p_total > 0.f ? pdp_total / p_total : 0.f;
      norm = nan_row ? neg_offset : p_total > 0.f ? log2_approx(p_total) : 0.f;
      if (chunk == 0 && lane < 16 && valid_query) {
        a.delta[stats] = delta;
        a.row_log2_sum[stats] = norm;
      }
    }
    const RowExponent<!HAS_MASK> row = RowExponent<!HAS_MASK>::of(neg_offset, norm);
    // One key tile. MASKED: some key of the tile is past seqlen_k or (causal) past a query of this
    // workgroup, so each score is tested; the other tiles skip the test. Where T::kOpenKeyTiles is false,
    // every tile is tested.
    const auto key_tile = [&](auto masked, int key0) {
      block_barrier();
      load_rows<BLOCK_N, D_PAD, Shape::kRow, Shape::kThreads, true, T::kUniformBase>(k_lds, k, a.k_stride_s, key0,
                                                                                  seq.seqlen_k, a.head_dim, tid);
      load_rows<BLOCK_N, D_PAD, Shape::kRow, Shape::kThreads, true, T::kUniformBase>(v_lds, v, a.v_stride_s, key0,
                                                                                  seq.seqlen_k, a.head_dim, tid);
      if (sweep == 1)
        load_transposed<BLOCK_N, D_CHUNK, Shape::kTRow, Shape::kThreads, T::kUniformBase, true>(
            kt_lds, k, a.k_stride_s, key0, seq.seqlen_k, col0, a.head_dim, tid);
      block_barrier();

      v8f s_acc[kKeyFrags], dp_acc[kKeyFrags];
      const auto product_step = [&](int d) {
        const Isa::Operand q_op = T::kHeldQdo ? q_ops[T::kHeldQdo ? d : 0]
                                  : T::kStagedQdo ? load_operand<Shape::kRow>(q_wave_lds, d * kFrag, lane)
                                                  : wave_operand(q_rows, q, a.q_stride_s, d);
        const Isa::Operand do_op = T::kHeldQdo ? do_ops[T::kHeldQdo ? d : 0]
                                   : T::kStagedQdo ? load_operand<Shape::kRow>(do_wave_lds, d * kFrag, lane)
                                                   : wave_operand(do_rows, dout, a.do_stride_s, d);
        #pragma unroll
        for (int j = 0; j < kKeyFrags; ++j) {
          Isa::mma(dt, s_acc[j], load_operand<Shape::kRow>(k_lds + j * kFrag * Shape::kRow, d * kFrag, lane), q_op);
          Isa::mma(dt, dp_acc[j], load_operand<Shape::kRow>(v_lds + j * kFrag * Shape::kRow, d * kFrag, lane), do_op);
        }
      };
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) s_acc[j] = dp_acc[j] = zero_v8f();
      #pragma unroll
      for (int d = 0; d < T::kPeeledSteps; ++d) product_step(d);
      #pragma unroll T::kLoopUnroll
      for (int d = T::kPeeledSteps; d < kDimFrags; ++d) product_step(d);
      // K and V rows lie in key_slot order, so accumulator value s is key acc_key(lane, s).
      #pragma unroll
      for (int j = 0; j < kKeyFrags; ++j) {
        const int key = key0 + j * kFrag + Isa::acc_key(lane, 0);  // value s: key + s, on both ISAs
        float bias[8] = {};
        if constexpr (HAS_MASK) mask.biases_log2(mask_row, key, bias);
        #pragma unroll
        for (int s = 0; s < 8; ++s) {
          const float exponent = capped_exponent<HAS_MASK>(s_acc[j][s], a.scale_log2, bias[s], row.offset);
          const bool visible = !decltype(masked)::value || s < key_limit - key;
          s_acc[j][s] = visible ? exp2_approx(HAS_MASK ? exponent - row.log2_sum : exponent) : 0.f;  // P^T
        }
        if (sweep == 0) {
          #pragma unroll
          for (int s = 0; s < 8; ++s) {
            delta_share += s_acc[j][s] * dp_acc[j][s];
            p_share += s_acc[j][s];
          }
        } else {
          #pragma unroll
          for (int s = 0; s < 8; ++s) dp_acc[j][s] = s_acc[j][s] * (dp_acc[j][s] - delta);  // dS^T
          const Isa::Operand ds_op = rounded_operand</*FETCH_INACTIVE=*/true, /*PROBABILITIES=*/false>(dt, dp_acc[j], lane);
          accumulate<kOutFrags, Shape::kTRow>(dt, dq_acc, kt_lds, j * kFrag, ds_op, lane);
        }
      }
    };
    // Tiles every query of the workgroup sees whole, then the rest.
    int key0 = 0;
    if constexpr (T::kOpenKeyTiles)
      for (; key0 + BLOCK_N <= open_end; key0 += BLOCK_N) key_tile(Flag<false>{}, key0);
    for (; key0 < key_end; key0 += BLOCK_N) key_tile(Flag<true>{}, key0);
  }

  block_barrier();
  stage_transposed<DT, kOutFrags, Shape::kStageRow>(dt, lds + wave * kFrag * Shape::kStageRow, dq_acc, a.scale, lane);
  block_barrier();
  store_rows<Shape::kBlockM, D_CHUNK, Shape::kStageRow, Shape::kThreads>(
      a.dq + batch * a.dq_stride_b + head * a.dq_stride_h + seq.q_row0 * a.dq_stride_s, a.dq_stride_s, lds, q0,
      seq.seqlen_q, col0, a.head_dim, tid);
}

}  // namespace rdna
