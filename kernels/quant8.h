// The 8-bit forward's quantizing pass for K and V (gfx12; fa_fwd8.h takes its output and quantizes Q
// itself, with this file's rounding): two launches.
//
// quant8_stats: one workgroup per (batch, key/value head) reads K and V once and writes, per channel,
// K's mean, V's mean and V's scale (largest |V - mean| / 448, e4m3's largest value). Summed in a fixed
// order: the same inputs give the same bits.
// quant8_codes: one workgroup per 64 keys of one key/value head reads K and V once more and writes the
// codes in fa_fwd8.h's layout:
// - K - mean as int8, one scale per 16 keys;
// - V - mean as e4m3 with its channel's scale, transposed (a row per channel) through LDS.
// Rows past the sequence (keys up to k_rows) and channels past head_dim are written as zeros, scales of
// all-zero blocks as 1, so fa_fwd8.h reads whole tiles with no mask on its loads.
#pragma once
#include "tiles.h"

namespace rdna {

// Kernel argument block; mirrored by rdna_flash_attn/ops/launch_args.py (Quant8Args).
struct Quant8Args {
  const u16* k;
  const u16* v;
  i64 k_stride_b, k_stride_h, k_stride_s;
  i64 v_stride_b, v_stride_h, v_stride_s;
  u32* k8;
  float* k_scale;
  u32* vt8;
  float* k_mean;  // (batch, kv_heads, D_PAD), written by quant8_stats
  float* v_mean;
  float* v_scale;
  int kv_heads, seqlen_k, k_rows, head_dim;
};

constexpr int kQuantThreads = 256;  // quant8_stats
constexpr int kQuantRows = 64;      // quant8_codes: keys per workgroup, one thread each
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;

template <int D_PAD>
struct Quant8StatsShape {
  static constexpr int kChunks = D_PAD / 8;  // 16-byte pieces of a row
  static constexpr int kRowsPerStep = kQuantThreads / kChunks;
  static constexpr int kLdsFloats = 4 * 8 * kQuantThreads;  // each thread's partial sums, maxima, minima
};

template <int D_PAD>
struct Quant8CodesShape {
  static constexpr int kVtRowWords = kQuantRows / 4 + 4;  // one V^T row (channel) of the block, padded
  static constexpr int kAmaxOffset = D_PAD * kVtRowWords;  // then one float per row: K's block maxima
  static constexpr int kLdsWords = kAmaxOffset + kQuantRows;
};

// The scale that maps a row's or block's largest |value| to `limit`: 1 for all zeros, NaN where a value
// is NaN (max_f32 skips NaN), so that NaN inputs give NaN outputs, as SDPA's.
RDNA_DEV float scale_for(float amax, bool nan, float limit) {
  return nan ? __builtin_nanf("") : amax > 0.f ? amax / limit : 1.f;
}

RDNA_DEV i64 head_offset(i64 batch, i64 head, i64 stride_b, i64 stride_h) { return batch * stride_b + head * stride_h; }

// The 8 16-bit values of one 16-byte piece, as floats.
template <class DT>
RDNA_DEV void convert8(DT dt, const u32x4& raw, float* x) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = from_bits(dt, element_of(raw, e));
}

// 8 values of a row from one 16-byte load, as floats.
template <class DT>
RDNA_DEV void load8(DT dt, const u16* p, float (&x)[8]) {
  convert8(dt, load16(p), x);
}

// The largest |value| of a run (max_f32 skips NaN) and whether it holds a NaN: scale_for's inputs.
struct Magnitude {
  float amax;
  bool nan;
};
template <int N>
RDNA_DEV Magnitude largest_magnitude(const float* x) {
  Magnitude m{0.f, false};
  #pragma unroll
  for (int c = 0; c < N; ++c) {
    m.amax = max_f32(m.amax, abs_f32(x[c]));
    m.nan |= x[c] != x[c];
  }
  return m;
}

template <class DT, int D_PAD>
RDNA_DEV void quant8_stats_body(const Quant8Args& a, float* lds) {
  using Shape = Quant8StatsShape<D_PAD>;
  const DT dt{};
  const int tid = thread_id();
  const i64 kv_head = block_id_y(), batch = block_id_z();
  const int chunk = tid % Shape::kChunks, row0 = tid / Shape::kChunks;
  const bool active = row0 < Shape::kRowsPerStep && chunk * 8 < a.head_dim;
  const u16* k = a.k + head_offset(batch, kv_head, a.k_stride_b, a.k_stride_h) + chunk * 8;
  const u16* v = a.v + head_offset(batch, kv_head, a.v_stride_b, a.v_stride_h) + chunk * 8;
  float k_sum[8], v_sum[8], v_max[8], v_min[8];
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    k_sum[e] = v_sum[e] = 0.f;
    v_max[e] = -__builtin_inff();
    v_min[e] = __builtin_inff();
  }
  if (active)
    for (int row = row0; row < a.seqlen_k; row += Shape::kRowsPerStep) {
      float kx[8], vx[8];
      load8(dt, k + row * a.k_stride_s, kx);
      load8(dt, v + row * a.v_stride_s, vx);
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        k_sum[e] += kx[e];
        v_sum[e] += vx[e];
        v_max[e] = max_f32(v_max[e], vx[e]);
        v_min[e] = min_f32(v_min[e], vx[e]);
      }
    }
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    lds[(0 * 8 + e) * kQuantThreads + tid] = k_sum[e];
    lds[(1 * 8 + e) * kQuantThreads + tid] = v_sum[e];
    lds[(2 * 8 + e) * kQuantThreads + tid] = v_max[e];
    lds[(3 * 8 + e) * kQuantThreads + tid] = v_min[e];
  }
  block_barrier();
  // Thread c sums channel c's partials, row group by row group.
  for (int c = tid; c < D_PAD; c += kQuantThreads) {
    const int from = c / 8, e = c % 8;
    float ks = 0.f, vs = 0.f, hi = -__builtin_inff(), lo = __builtin_inff();
    for (int r = 0; r < Shape::kRowsPerStep; ++r) {
      const int t = r * Shape::kChunks + from;
      ks += lds[(0 * 8 + e) * kQuantThreads + t];
      vs += lds[(1 * 8 + e) * kQuantThreads + t];
      hi = max_f32(hi, lds[(2 * 8 + e) * kQuantThreads + t]);
      lo = min_f32(lo, lds[(3 * 8 + e) * kQuantThreads + t]);
    }
    const bool real = c < a.head_dim;
    const float inv_keys = 1.f / float(a.seqlen_k);
    const float k_mean = real ? ks * inv_keys : 0.f, v_mean = real ? vs * inv_keys : 0.f;
    const float amax = real ? max_f32(hi - v_mean, v_mean - lo) : 0.f;
    const i64 at = (batch * a.kv_heads + kv_head) * D_PAD + c;
    a.k_mean[at] = k_mean;  // a NaN key makes its channel's mean NaN, then every K block's scale (codes)
    a.v_mean[at] = v_mean;  // likewise every output's value in this channel
    a.v_scale[at] = scale_for(amax, v_mean != v_mean, kFp8Max);
  }
}

// Four values as int8 codes of x / scale (rounded to nearest even, clamped to +-127), one to a byte.
RDNA_DEV u32 int8_codes(const float* x, float scale) {
  u32 word = 0;
  #pragma unroll
  for (int b = 0; b < 4; ++b) {
    const float code = min_f32(max_f32(round_even(x[b] / scale), -kInt8Max), kInt8Max);
    word |= (u32(int(code)) & 0xffu) << (8 * b);
  }
  return word;
}

// A row of head_dim values (zeros past it) as int8 codes of x / scale, stored as 16-byte pieces: the
// scale maps the block's largest |value| to 127.
template <int D_PAD>
RDNA_DEV void store_int8_row(u32* dst, const float (&x)[D_PAD], float scale) {
  #pragma unroll
  for (int p = 0; p < D_PAD / 16; ++p) {
    u32x4 piece;
    #pragma unroll
    for (int w = 0; w < 4; ++w) piece[w] = int8_codes(&x[16 * p + 4 * w], scale);
    store16(reinterpret_cast<u16*>(dst + 4 * p), piece);
  }
}

// Row `row` of a (seq, head_dim) matrix as D_PAD floats, zero past head_dim or past seqlen.
template <class DT, int D_PAD>
RDNA_DEV void load_row(DT dt, const u16* src, i64 stride, int row, int seqlen, int head_dim, float (&x)[D_PAD]) {
  #pragma unroll
  for (int p = 0; p < D_PAD / 8; ++p) {
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (row < seqlen && p * 8 < head_dim) load8(dt, src + row * stride + p * 8, part);
    #pragma unroll
    for (int e = 0; e < 8; ++e) x[8 * p + e] = part[e];
  }
}

template <class DT, int D_PAD>
RDNA_DEV void quant8_codes_body(const Quant8Args& a, u32* lds) {
  using Shape = Quant8CodesShape<D_PAD>;
  constexpr int kWordsPerRow = D_PAD / 4;
  const DT dt{};
  const int tid = thread_id();
  const i64 kv_head = block_id_y(), batch = block_id_z();
  const int row0 = block_id_x() * kQuantRows, row = row0 + tid;
  float x[D_PAD];

  const i64 kv = batch * a.kv_heads + kv_head;
  const float* k_mean = a.k_mean + kv * D_PAD;
  const float* v_mean = a.v_mean + kv * D_PAD;
  const float* v_scale = a.v_scale + kv * D_PAD;
  // K - mean: one scale per 16 rows, their largest |value| shared through LDS.
  float* const block_amax = reinterpret_cast<float*>(lds + Shape::kAmaxOffset);
  load_row(dt, a.k + head_offset(batch, kv_head, a.k_stride_b, a.k_stride_h), a.k_stride_s, row, a.seqlen_k, a.head_dim,
           x);
  #pragma unroll
  for (int c = 0; c < D_PAD; ++c) x[c] = row < a.seqlen_k ? x[c] - k_mean[c] : 0.f;
  Magnitude m = largest_magnitude<D_PAD>(x);
  block_amax[tid] = m.nan ? __builtin_nanf("") : m.amax;  // a NaN row makes its block's scale NaN
  block_barrier();
  #pragma unroll
  for (int r = 0; r < kFrag; ++r) {
    const float other = block_amax[(tid & ~(kFrag - 1)) + r];
    m.amax = max_f32(m.amax, other);
    m.nan |= other != other;
  }
  const float scale = scale_for(m.amax, m.nan, kInt8Max);
  if (tid % kFrag == 0) a.k_scale[kv * (a.k_rows / kFrag) + row / kFrag] = scale;
  store_int8_row(a.k8 + (kv * a.k_rows + row) * kWordsPerRow, x, scale);

  // V - mean as e4m3, transposed: this thread's key becomes byte `tid` of every channel's LDS row.
  load_row(dt, a.v + head_offset(batch, kv_head, a.v_stride_b, a.v_stride_h), a.v_stride_s, row, a.seqlen_k, a.head_dim,
           x);
  u32* const vt_lds = lds;
  #pragma unroll
  for (int c = 0; c < D_PAD; c += 4) {
    float y[4];
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float centred = row < a.seqlen_k ? (x[c + e] - v_mean[c + e]) / v_scale[c + e] : 0.f;
      y[e] = min_f32(max_f32(centred, -kFp8Max), kFp8Max);
    }
    const u32 bytes = pack_fp8x4(y[0], y[1], y[2], y[3]);
    #pragma unroll
    for (int e = 0; e < 4; ++e)
      reinterpret_cast<unsigned char*>(vt_lds + (c + e) * Shape::kVtRowWords)[tid] = (bytes >> (8 * e)) & 0xffu;
  }
  block_barrier();
  // Each channel row of the block: 64 bytes, 4 pieces of 16.
  u32* const vt8 = a.vt8 + kv * D_PAD * (a.k_rows / 4) + row0 / 4;
  for (int i = tid; i < D_PAD * (kQuantRows / 16); i += kQuantRows) {
    const int c = i / (kQuantRows / 16), p = i % (kQuantRows / 16);
    store16(reinterpret_cast<u16*>(vt8 + i64(c) * (a.k_rows / 4) + 4 * p),
            load16(reinterpret_cast<const u16*>(vt_lds + c * Shape::kVtRowWords + 4 * p)));
  }
}

}  // namespace rdna
