// Moving tiles between global memory, LDS and WMMA fragments; shared by every kernel.
#pragma once
#include "isa/isa.h"

namespace rdna {

constexpr int kFrag = 16;
constexpr int kRowPad = 8;  // elements; keeps 16-byte alignment and spreads rows over LDS banks
constexpr float kLn2 = 0.69314718055994531f;
constexpr float kLog2e = 1.44269504088896341f;

// A compile-time choice passed to a generic lambda: one copy of a loop body per value.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};

RDNA_DEV u16 element_of(const u32x4& v, int e) { return u16(v[e >> 1] >> (16 * (e & 1))); }

RDNA_DEV u32x4 load16(const u16* p) { return *reinterpret_cast<const u32x4*>(p); }
RDNA_DEV void store16(u16* p, const u32x4& v) { *reinterpret_cast<u32x4*>(p) = v; }
// 16 bytes at a wave-uniform base plus a 32-bit byte offset: the global load's scalar-base form, whose
// address unit adds the two (a 64-bit address per lane costs two VALU adds per load).
RDNA_DEV u32x4 load16_at(const u16* uniform_base, u32 byte_offset) {
  return load16(reinterpret_cast<const u16*>(reinterpret_cast<const char*>(uniform_base) + byte_offset));
}

// Row r of a tile copied in key order (KEY_ORDER below) lies in LDS row key_order_row(r). key_slot
// permutes the bits of a row index within 16 rows, so key_order_row(a + b) = key_order_row(a) +
// key_order_row(b) wherever a and b share no set bit.
RDNA_DEV int key_order_row(int r) { return (r & ~15) + Isa::key_slot(r & 15); }

// Copies rows [row0, row0 + ROWS) x columns [0, COLS) of a (seq, dim) matrix into LDS, zero where
// the row is past seqlen or the column past head_dim: padding never reaches the arithmetic.
// KEY_ORDER: row r of each 16-row fragment goes to LDS row Isa::key_slot(r) (see the ISA headers),
// so that a product with these rows as A puts them in the accumulator in Isa::acc_key order.
// Loads are issued kCopyBatch at a time before their stores: one memory round trip per batch. More
// in flight spill registers in the backward kernels' dQ (d128) on gfx1100.
// UNIFORM_BASE: every load is the tile's uniform base plus a 32-bit byte offset per lane (load16_at;
// the dispatch keeps sequence strides below 2^23 elements, so a tile of up to 128 rows fits), not a
// 64-bit address per lane (about six VALU per load). Where the threads cover a whole number of rows, a
// thread keeps its column and steps by whole rows: one offset (loop_variant, amdgcn.h) and one LDS address
// per thread plus a 32-bit row step per load, as fa_fwd.h's K loads do. Those per-thread values stay
// live across a caller's loop, so kernels without registers to spare take the 64-bit form, and so
// does the forward's one Q load per workgroup (its kernels keep their register allocation).
constexpr int kCopyBatch = 2;

template <int ROWS, int COLS, int LDS_ROW, int THREADS, bool KEY_ORDER = false, bool UNIFORM_BASE = true>
RDNA_DEV void load_rows(u16* dst, const u16* src, i64 stride, int row0, int seqlen, int head_dim, int tid) {
  constexpr int kChunks = COLS / 8;
  constexpr int kTotal = ROWS * kChunks;
  constexpr int kLoads = (kTotal + THREADS - 1) / THREADS;
  constexpr int kBatch = kLoads < kCopyBatch ? kLoads : kCopyBatch;
  constexpr int kRowStep = UNIFORM_BASE && THREADS % kChunks == 0 ? THREADS / kChunks : 0;
  // key_order_row splits over the thread's row and its steps where the steps are whole powers of two.
  constexpr bool kSplitSlots = kRowStep > 0 && (kRowStep & (kRowStep - 1)) == 0;
  const u16* tile = src + i64(row0) * stride;
  const int rows_left = seqlen - row0;
  const int thread_row = tid / kChunks, thread_col = tid % kChunks * 8;
  const u32 thread_offset = kRowStep ? loop_variant(u32(thread_row * int(stride) + thread_col) * 2u) : 0u;
  const int thread_slot = KEY_ORDER ? key_order_row(thread_row) : thread_row;
  #pragma unroll 1
  for (int b = 0; b < kLoads; b += kBatch) {
    u32x4 val[kBatch];
    #pragma unroll
    for (int n = 0; n < kBatch; ++n) {
      const int i = tid + (b + n) * THREADS;
      const int r = kRowStep ? thread_row + (b + n) * kRowStep : i / kChunks;
      const int c = kRowStep ? thread_col : i % kChunks * 8;
      val[n] = zero_u32x4();
      const bool in_rows = UNIFORM_BASE ? r < rows_left : row0 + r < seqlen;
      if (b + n < kLoads && (kTotal % THREADS == 0 || i < kTotal) && in_rows && c < head_dim)
        val[n] = !UNIFORM_BASE ? load16(src + (row0 + r) * stride + c)
                 : kRowStep    ? load16_at(tile, thread_offset + u32((b + n) * kRowStep * int(stride)) * 2u)
                               : load16_at(tile, u32(r * int(stride) + c) * 2u);
    }
    #pragma unroll
    for (int n = 0; n < kBatch; ++n) {
      const int i = tid + (b + n) * THREADS;
      const int r = kRowStep ? thread_row + (b + n) * kRowStep : i / kChunks;
      const int c = kRowStep ? thread_col : i % kChunks * 8;
      const int slot = !KEY_ORDER ? r : kSplitSlots ? thread_slot + key_order_row((b + n) * kRowStep) : key_order_row(r);
      if (b + n < kLoads && (kTotal % THREADS == 0 || i < kTotal)) store16(dst + slot * LDS_ROW + c, val[n]);
    }
  }
}

// Stores 8 consecutive elements of two adjacent rows (first, second) transposed: element e of both to
// dst[e * LDS_ROW] and dst[e * LDS_ROW + 1]. One 16-bit store per element (the d16_hi form for odd ones):
// packing the pairs into 32-bit stores took a v_perm_b32 each, VALU issues in every key loop, where the
// LDS has cycles to spare. The fence keeps clang from merging each pair back into one 32-bit store (and
// its v_perm_b32); no memory operation crosses it, so a caller issues its loads before the first pair.
template <int LDS_ROW>
RDNA_DEV void store_transposed_pair(u16* dst, const u32x4& first, const u32x4& second) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) dst[e * LDS_ROW] = element_of(first, e);
  compiler_fence();
  #pragma unroll
  for (int e = 0; e < 8; ++e) dst[e * LDS_ROW + 1] = element_of(second, e);
}

// Rows row0 + r and row0 + r + 1, 8 columns from col, into first and second, which come in zeroed:
// past seqlen or head_dim they stay zero. UNIFORM_BASE as in load_rows.
template <bool UNIFORM_BASE>
RDNA_DEV void load_row_pair(u32x4& first, u32x4& second, const u16* src, i64 stride, int row0, int seqlen, int r,
                            int col, int head_dim) {
  if (col >= head_dim) return;
  if constexpr (UNIFORM_BASE) {
    const u16* tile = src + i64(row0) * stride;
    const int rows_left = seqlen - row0;
    const u32 offset = u32(r * int(stride) + col) * 2u;
    if (r < rows_left) first = load16_at(tile, offset);
    if (r + 1 < rows_left) second = load16_at(tile, offset + u32(stride) * 2u);
  } else {
    const int row = row0 + r;
    if (row < seqlen) first = load16(src + row * stride + col);
    if (row + 1 < seqlen) second = load16(src + (row + 1) * stride + col);
  }
}

// Copies rows [row0, row0 + ROWS), columns [col0, col0 + COLS) into LDS transposed (one LDS row
// per output column). Consecutive threads take consecutive row pairs so the transposed stores fall in
// consecutive banks. SIXTEEN_BIT: every load first, then store_transposed_pair (no VALU; the loads'
// registers live together); else two rows per 32-bit store, one v_perm_b32 per element pair, each
// pair stored as soon as it is loaded.
template <int ROWS, int COLS, int LDS_ROW, int THREADS, bool UNIFORM_BASE, bool SIXTEEN_BIT>
RDNA_DEV void load_transposed(u16* dst, const u16* src, i64 stride, int row0, int seqlen, int col0,
                              int head_dim, int tid) {
  constexpr int kPairs = ROWS / 2;
  constexpr int kItems = kPairs * (COLS / 8);
  if constexpr (SIXTEEN_BIT) {
    constexpr int kPerThread = (kItems + THREADS - 1) / THREADS;
    u32x4 first[kPerThread], second[kPerThread];
    #pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int i = tid + n * THREADS;
      first[n] = zero_u32x4();
      second[n] = zero_u32x4();
      if (kItems % THREADS == 0 || i < kItems)
        load_row_pair<UNIFORM_BASE>(first[n], second[n], src, stride, row0, seqlen, 2 * (i % kPairs),
                                    col0 + (i / kPairs) * 8, head_dim);
    }
    #pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int i = tid + n * THREADS;
      if (kItems % THREADS == 0 || i < kItems)
        store_transposed_pair<LDS_ROW>(dst + (i / kPairs) * 8 * LDS_ROW + 2 * (i % kPairs), first[n], second[n]);
    }
  } else {
    for (int i = tid; i < kItems; i += THREADS) {
      const int r = 2 * (i % kPairs);
      const int c = (i / kPairs) * 8;
      u32x4 first = zero_u32x4(), second = zero_u32x4();
      load_row_pair<UNIFORM_BASE>(first, second, src, stride, row0, seqlen, r, col0 + c, head_dim);
      #pragma unroll
      for (int e = 0; e < 8; ++e) {  // element e of both rows: one v_perm_b32
        const u32 pair = e % 2 ? pack_high_halves(first[e / 2], second[e / 2]) : pack_low_halves(first[e / 2], second[e / 2]);
        *reinterpret_cast<u32*>(dst + (c + e) * LDS_ROW + r) = pair;
      }
    }
  }
}

// One 16x16 operand fragment from an LDS tile: lane row (l % 16), its run of k values.
template <int LDS_ROW>
RDNA_DEV Isa::Operand load_operand(const u16* tile, int col0, int lane) {
  const u16* p = tile + (lane & 15) * LDS_ROW + col0 + Isa::operand_k0(lane);
  Isa::Operand op;
  #pragma unroll
  for (int c = 0; c < Isa::kOperandElems / 8; ++c) {
    const u32x4 t = load16(p + 8 * c);
    #pragma unroll
    for (int i = 0; i < 4; ++i) op.w[4 * c + i] = t[i];
  }
  return op;
}

// One operand fragment straight from global memory, for operands private to a wave: lane row
// row0 + (l % 16), zero past seqlen or head_dim.
RDNA_DEV Isa::Operand load_operand_global(const u16* src, i64 stride, int row0, int seqlen, int col0, int head_dim,
                                          int lane) {
  const int row = row0 + (lane & 15);
  const int col = col0 + Isa::operand_k0(lane);
  Isa::Operand op;
  #pragma unroll
  for (int c = 0; c < Isa::kOperandElems / 8; ++c) {
    u32x4 t = zero_u32x4();
    if (row < seqlen && col + 8 * c < head_dim) t = load16(src + row * stride + col + 8 * c);
    #pragma unroll
    for (int i = 0; i < 4; ++i) op.w[4 * c + i] = t[i];
  }
  return op;
}

// A wave's 16 operand rows read straight from global memory again and again (dQ's Q and dO, once per
// key tile), without zero fill: rows past seqlen repeat the last row and columns past head_dim the last
// 8 real ones. Only for a product whose other factor is zero past head_dim and whose results for rows
// past seqlen are dropped or multiplied by zero. Each lane's offset is computed once and a load adds
// its column (clamped by a uniform min): no exec mask, zeroed registers or lane address per load, as
// load_operand_global takes.
struct RepeatingRows {
  const u16* tile;  // row `first`: uniform, below seqlen and at most row0
  u32 row_offset;   // bytes to the lane's row
  u32 k_offset;     // and to its run of k values (Isa::operand_k0)

  // Lane row row0 + (l % 16) of src; first as above (the workgroup's first row), so offsets stay small.
  static RDNA_DEV RepeatingRows of(const u16* src, i64 stride, int first, int row0, int seqlen, int lane) {
    const int row = min_int(row0 + (lane & 15), seqlen - 1);
    const u32 row_offset = u32((row - first) * int(stride)) * 2u;
    return {src + i64(first) * stride, row_offset, row_offset + u32(Isa::operand_k0(lane)) * 2u};
  }

  // The operand fragment at columns [col0, col0 + 16).
  RDNA_DEV Isa::Operand load(int col0, int head_dim) const {
    Isa::Operand op;
    #pragma unroll
    for (int c = 0; c < Isa::kOperandElems / 8; ++c) {
      const int col = col0 + 8 * c;
      // Every lane's 8 columns are real: each lane reads its own; otherwise all lanes read the same 8
      // columns, clamped to the last real ones (the lanes past head_dim repeat them).
      const bool whole = col + (16 - Isa::kOperandElems) + 8 <= head_dim;
      const u32x4 t = load16_at(tile + min_int(col, head_dim - 8), whole ? k_offset : row_offset);
      #pragma unroll
      for (int i = 0; i < 4; ++i) op.w[4 * c + i] = t[i];
    }
    return op;
  }
};

// Writes one accumulator fragment f of a transposed tile (rows = columns of the output, one output
// row per lane) into LDS as plain rows, scaled, in the output dtype.
template <class DT, int LDS_ROW>
RDNA_DEV void stage_fragment(DT dt, u16* rows, const v8f& acc, int f, float scale, int lane) {
  #pragma unroll
  for (int s = 0; s < 8; ++s)
    rows[(lane & 15) * LDS_ROW + f * kFrag + Isa::acc_row(lane, s)] = to_bits(dt, acc[s] * scale);
}

// Writes accumulators that hold a transposed tile into LDS as plain rows (stage_fragment).
template <class DT, int FRAGS, int LDS_ROW>
RDNA_DEV void stage_transposed(DT dt, u16* rows, const v8f (&acc)[FRAGS], float scale, int lane) {
  #pragma unroll
  for (int f = 0; f < FRAGS; ++f) stage_fragment<DT, LDS_ROW>(dt, rows, acc[f], f, scale, lane);
}

// stage_transposed, and each value's rounding remainder (remainder_bits) written straight to rows
// row0 + (lane % 16) of a (seq, dim) matrix in 16-byte pieces, skipping rows past seqlen and columns
// past head_dim. A fragment at a time, so that each accumulator is free once both are written.
template <class DT, int FRAGS, int LDS_ROW>
RDNA_DEV void stage_transposed_with_remainder(DT dt, u16* rows, const v8f (&acc)[FRAGS], float scale, int lane,
                                              u16* low, i64 stride, int row0, int seqlen, int col0, int head_dim) {
  const int row = row0 + (lane & 15);
  #pragma unroll
  for (int f = 0; f < FRAGS; ++f) {
    stage_fragment<DT, LDS_ROW>(dt, rows, acc[f], f, scale, lane);
    u16 bits[8];
    #pragma unroll
    for (int s = 0; s < 8; ++s) bits[s] = remainder_bits(dt, acc[f][s] * scale);
    const u32x4 run = Isa::rows_to_run(bits, lane);  // its exchanges stay outside the lane-dependent branch
    const int col = col0 + f * kFrag + 8 * (lane >> 4);
    if (row < seqlen && col < head_dim) store16(low + row * stride + col, run);
  }
}

// Writes LDS rows [0, ROWS) x [0, COLS) to rows [row0, ...) x columns [col0, ...) of a (seq, dim)
// matrix in 16-byte pieces, skipping rows past seqlen and columns past head_dim.
template <int ROWS, int COLS, int LDS_ROW, int THREADS>
RDNA_DEV void store_rows(u16* dst, i64 stride, const u16* src, int row0, int seqlen, int col0, int head_dim, int tid) {
  constexpr int kChunks = COLS / 8;
  for (int i = tid; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    if (row0 + r < seqlen && col0 + c < head_dim) store16(dst + (row0 + r) * stride + col0 + c, load16(src + r * LDS_ROW + c));
  }
}

}  // namespace rdna
