// What the forward and backward kernels share about one (batch, head) of a launch: where its rows
// lie in packed variable-length batches, its causal diagonal, and its attention mask.
#pragma once
#include "tiles.h"

namespace rdna {

// Kernel argument codes; mirrored by rdna_flash_attn/ops/launch_args.py.
enum Causal : int { kNotCausal = 0, kCausalTopLeft = 1, kCausalBottomRight = 2 };
enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskF16 = 2, kMaskBf16 = 3, kMaskF32 = 4 };

// One batch entry's queries and keys. Packed batches (cu_seqlens, flash-attn's varlen layout) give
// entry b the rows cu_seqlens[b] .. cu_seqlens[b + 1] of a batch stride 0 tensor; otherwise every
// entry has the launch's lengths and starts at row 0.
struct Sequence {
  int q_row0, k_row0, seqlen_q, seqlen_k;
  int diagonal;  // key index a query sees last is query + diagonal (causal only)

  static RDNA_DEV Sequence of(const int* cu_seqlens_q, const int* cu_seqlens_k, i64 batch, int seqlen_q,
                              int seqlen_k, int causal) {
    Sequence s{0, 0, seqlen_q, seqlen_k, 0};
    if (cu_seqlens_q) {
      s.q_row0 = cu_seqlens_q[batch];
      s.seqlen_q = cu_seqlens_q[batch + 1] - s.q_row0;
      s.k_row0 = cu_seqlens_k[batch];
      s.seqlen_k = cu_seqlens_k[batch + 1] - s.k_row0;
    }
    // Bottom-right alignment (flash-attn's): the last query sees the last key.
    s.diagonal = causal == kCausalBottomRight ? s.seqlen_k - s.seqlen_q : 0;
    return s;
  }

  // Keys [0, visible_keys(query)) are visible to `query`: its causal limit, clamped to [0, seqlen_k].
  RDNA_DEV int visible_keys(int causal, int query) const {
    if (!causal) return seqlen_k;
    const int end = query + 1 + diagonal;
    return end < 0 ? 0 : min_int(end, seqlen_k);
  }

  // The first query that sees `key` (visible_keys inverted), never negative: 0 when every query does,
  // INT_MAX past seqlen_k. So a query index subtracted from it cannot overflow.
  RDNA_DEV int first_query(int causal, int key) const {
    if (key >= seqlen_k) return 0x7fffffff;
    return causal && key > diagonal ? key - diagonal : 0;
  }
};

constexpr float kBiasFloor = -1073741824.f;  // -2^30, in log2 units
constexpr float kBiasCeiling = 1073741824.f;

// An attention mask or bias of one (batch, head) in any dtype SDPA takes, read as an additive bias in
// the kernels' log2 units: a bool mask's False is -inf, a float bias is scaled by log2(e). Element
// offsets are 32-bit: fewer registers beside the accumulators. The forward and dQ kernels count them
// from their wave's first query (rows_from), so there a (batch, head) may span more than 2^31 elements
// as long as 16 rows do not; dK/dV counts them from the (batch, head)'s first row (a 64-bit base per
// query tile spilled SGPRs at d128 on gfx11). The launcher checks both.
struct MaskView {
  const unsigned char* base;  // element (0, 0) of this (batch, head); null: no mask
  int stride_q, stride_k;     // in elements; 0 along broadcast dimensions
  int kind;
  int last_q, last_k;         // reads are clamped here: padding rows and keys are masked elsewhere

  static RDNA_DEV MaskView of(const void* mask, int kind, i64 stride_b, i64 stride_h, i64 stride_q, i64 stride_k,
                              i64 batch, i64 head, const Sequence& seq) {
    // Null without a mask. The select also makes the pointer generic: its flat loads take a 64-bit
    // VGPR address, where global loads of the four mask dtypes keep their bases in SGPRs and spill
    // 40 of them on gfx11 (report --check).
    const unsigned char* base =
        mask ? static_cast<const unsigned char*>(mask) + (batch * stride_b + head * stride_h) * element_bytes(kind)
             : nullptr;
    return MaskView{base, int(stride_q), int(stride_k), kind, seq.seqlen_q - 1, seq.seqlen_k - 1};
  }

  static RDNA_DEV int element_bytes(int kind) { return kind == kMaskBool ? 1 : kind == kMaskF32 ? 4 : 2; }

  // This view from query `first` on (clamped to the last row): query first + r is its row r.
  RDNA_DEV MaskView rows_from(int first) const {
    const int skipped = min_int(first, last_q);
    return MaskView{base ? base + i64(skipped) * stride_q * element_bytes(kind) : nullptr, stride_q, stride_k, kind,
                    last_q - skipped, last_k};
  }

  // The offset of a query's row, for bias_log2.
  RDNA_DEV int row(int query) const { return min_int(query, last_q) * stride_q; }

  // Element i of this (batch, head) (i counted from base, in elements) as a bias in log2 units.
  RDNA_DEV float bias_at(int i) const {
    if (kind == kMaskBool) return base[i] ? 0.f : -__builtin_inff();
    if (kind == kMaskF16) return scaled(from_bits(f16{}, reinterpret_cast<const u16*>(base)[i]));
    if (kind == kMaskBf16) return scaled(from_bits(bf16{}, reinterpret_cast<const u16*>(base)[i]));
    return scaled(reinterpret_cast<const float*>(base)[i]);
  }

  // bias_at in two steps, so that a load can be issued long before its value is needed: the element's
  // bits, zero-extended, then those bits as a bias in log2 units. (bias_at itself stays one step: built
  // from these two, the backward's per-element reads wait for each load on its own.)
  RDNA_DEV u32 bits_at(int i) const {
    if (kind == kMaskBool) return base[i];
    if (kind == kMaskF16 || kind == kMaskBf16) return reinterpret_cast<const u16*>(base)[i];
    return reinterpret_cast<const u32*>(base)[i];
  }
  RDNA_DEV float bias_of_bits(u32 bits) const {
    if (kind == kMaskBool) return bits ? 0.f : -__builtin_inff();
    if (kind == kMaskF16) return scaled(from_bits(f16{}, u16(bits)));
    if (kind == kMaskBf16) return scaled(from_bits(bf16{}, u16(bits)));
    return scaled(as_f32(bits));
  }

  // A key's offset within a row, clamped to the last key.
  RDNA_DEV int key_offset(int key) const { return min_int(key, last_k) * stride_k; }

  RDNA_DEV float bias_log2(int row_offset, int key) const { return bias_at(row_offset + key_offset(key)); }

  // The biases of keys key0 .. key0 + 7 of one row. Keys in a row (stride 1, the usual case) are 8
  // loads from one address, the dtype chosen once for all eight so that they are issued together and
  // share one wait (chosen per element, each load waited for its own round trip); otherwise one load
  // at a time, so that no more than one address is live beside the accumulators.
  RDNA_DEV void biases_log2(int row_offset, int key0, float (&out)[8]) const {
    if (stride_k == 1 && key0 + 7 <= last_k) {
      const int i = row_offset + key0;
      const u16* halves = reinterpret_cast<const u16*>(base) + i;
      if (kind == kMaskBool) return eight(out, [&](int s) { return base[i + s] ? 0.f : -__builtin_inff(); });
      if (kind == kMaskF16) return eight(out, [&](int s) { return scaled(from_bits(f16{}, halves[s])); });
      if (kind == kMaskBf16) return eight(out, [&](int s) { return scaled(from_bits(bf16{}, halves[s])); });
      const float* floats = reinterpret_cast<const float*>(base) + i;
      return eight(out, [&](int s) { return scaled(floats[s]); });
    }
    #pragma unroll
    for (int s = 0; s < 8; ++s) {
      out[s] = bias_log2(row_offset, key0 + s);
      compiler_fence();
    }
  }

  template <typename Value>
  static RDNA_DEV void eight(float (&out)[8], Value value) {
    #pragma unroll
    for (int s = 0; s < 8; ++s) out[s] = value(s);
  }

  // A finite bias stays finite, within +-2^30: a row whose keys all carry huge finite biases (a dtype's
  // lowest, -1e9) then averages them as SDPA's float32 does, instead of giving zeros, and its scores keep
  // magnitudes whose log-sum-exp float32 holds within 2^7 (the backward renormalises the rest, fa_bwd.h).
  // Finite biases beyond +-2^30 / log2(e) = 7.4e8 count alike; a key at +3e38 (which scaled would be
  // +inf) takes the row as in SDPA. Infinities and NaN stay as they are: -inf masks the key, and +inf or
  // NaN make the row NaN, as SDPA's do.
  static RDNA_DEV float scaled(float value) {
    if (!(abs_f32(value) < __builtin_inff())) return value;
    return min_f32(max_f32(value * kLog2e, kBiasFloor), kBiasCeiling);
  }
};

}  // namespace rdna
