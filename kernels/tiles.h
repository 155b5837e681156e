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
// REPEAT_EDGES: rows past seqlen repeat the last row and columns past head_dim the last 8, read without
// a guard (no exec mask, zeroed registers or compare per load): with whole-row steps each load's offset
// is clamped by one min to the last row's. Only for a tile whose products stay exact where those values
// are finite: its other factor is zero past head_dim, and what its rows past seqlen make is dropped or
// multiplied by 0.
constexpr int kCopyBatch = 2;

RDNA_DEV u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

template <int ROWS, int COLS, int LDS_ROW, int THREADS, bool KEY_ORDER = false, bool UNIFORM_BASE = true,
          bool REPEAT_EDGES = false>
RDNA_DEV void load_rows(u16* dst, const u16* src, i64 stride, int row0, int seqlen, int head_dim, int tid) {
  constexpr int kChunks = COLS / 8;
  constexpr int kTotal = ROWS * kChunks;
  constexpr int kLoads = (kTotal + THREADS - 1) / THREADS;
  constexpr int kBatch = REPEAT_EDGES || kLoads < kCopyBatch ? kLoads : kCopyBatch;
  constexpr int kRowStep = UNIFORM_BASE && THREADS % kChunks == 0 ? THREADS / kChunks : 0;
  // key_order_row splits over the thread's row and its steps where the steps are whole powers of two.
  constexpr bool kSplitSlots = kRowStep > 0 && (kRowStep & (kRowStep - 1)) == 0;
  const u16* tile = src + i64(row0) * stride;
  const int rows_left = seqlen - row0;
  const int thread_row = tid / kChunks, thread_col = tid % kChunks * 8;
  const int read_col = REPEAT_EDGES ? min_int(thread_col, head_dim - 8) : thread_col;  // kRowStep's
  const u32 thread_offset = kRowStep ? loop_variant(u32(thread_row * int(stride) + read_col) * 2u) : 0u;
  // REPEAT_EDGES and kRowStep; within the tile, as the 32-bit offsets must be
  const u32 last_offset = u32((min_int(rows_left, ROWS) - 1) * int(stride) + read_col) * 2u;
  const int thread_slot = KEY_ORDER ? key_order_row(thread_row) : thread_row;
  #pragma unroll 1
  for (int b = 0; b < kLoads; b += kBatch) {
    u32x4 val[kBatch];
    #pragma unroll
    for (int n = 0; n < kBatch; ++n) {
      const int i = tid + (b + n) * THREADS;
      const int r = kRowStep ? thread_row + (b + n) * kRowStep : i / kChunks;
      const int c = kRowStep ? thread_col : i % kChunks * 8;
      const bool in_tile = b + n < kLoads && (kTotal % THREADS == 0 || i < kTotal);
      val[n] = zero_u32x4();
      if constexpr (REPEAT_EDGES) {
        const int read_row = min_int(r, rows_left - 1);
        if (in_tile)
          val[n] = !UNIFORM_BASE ? load16(src + (row0 + read_row) * stride + min_int(c, head_dim - 8))
                   : kRowStep    ? load16_at(tile, min_u32(thread_offset + u32((b + n) * kRowStep * int(stride)) * 2u,
                                                           last_offset))
                                 : load16_at(tile, u32(read_row * int(stride) + min_int(c, head_dim - 8)) * 2u);
      } else {
        const bool in_rows = UNIFORM_BASE ? r < rows_left : row0 + r < seqlen;
        if (in_tile && in_rows && c < head_dim)
          val[n] = !UNIFORM_BASE ? load16(src + (row0 + r) * stride + c)
                   : kRowStep    ? load16_at(tile, thread_offset + u32((b + n) * kRowStep * int(stride)) * 2u)
                                 : load16_at(tile, u32(r * int(stride) + c) * 2u);
      }
    }
    // A load under the same test as its store would sink to it, one memory round trip per load.
    if constexpr (REPEAT_EDGES) compiler_fence();
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
// past seqlen or head_dim they stay zero. UNIFORM_BASE and REPEAT_EDGES (which writes both) as in load_rows.
// UNIFORM_COL: col is wave-uniform and goes into the scalar base; otherwise into each lane's 32-bit offset.
template <bool UNIFORM_BASE, bool REPEAT_EDGES, bool UNIFORM_COL = false>
RDNA_DEV void load_row_pair(u32x4& first, u32x4& second, const u16* src, i64 stride, int row0, int seqlen, int r,
                            int col, int head_dim) {
  if constexpr (REPEAT_EDGES) {
    const int last = seqlen - row0 - 1;
    const int read_col = min_int(col, head_dim - 8);
    if constexpr (UNIFORM_BASE) {
      const u16* tile = src + i64(row0) * stride + (UNIFORM_COL ? read_col : 0);
      const int lane_col = UNIFORM_COL ? 0 : read_col;
      first = load16_at(tile, u32(min_int(r, last) * int(stride) + lane_col) * 2u);
      second = load16_at(tile, u32(min_int(r + 1, last) * int(stride) + lane_col) * 2u);
    } else {
      const u16* tile = src + i64(row0) * stride + read_col;
      first = load16(tile + min_int(r, last) * stride);
      second = load16(tile + min_int(r + 1, last) * stride);
    }
    return;
  }
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
// consecutive banks. SIXTEEN_BIT: every load first, then store_transposed_pair (no v_perm_b32; the
// loads' registers live together); else two rows per 32-bit store, one v_perm_b32 per element pair, each
// pair stored as soon as it is loaded. REPEAT_EDGES as in load_rows.
template <int ROWS, int COLS, int LDS_ROW, int THREADS, bool UNIFORM_BASE, bool SIXTEEN_BIT, bool REPEAT_EDGES = false>
RDNA_DEV void load_transposed(u16* dst, const u16* src, i64 stride, int row0, int seqlen, int col0,
                              int head_dim, int tid) {
  constexpr int kPairs = ROWS / 2;
  constexpr int kItems = kPairs * (COLS / 8);
  const auto in_tile = [](int i) { return kItems % THREADS == 0 || i < kItems; };
  if constexpr (SIXTEEN_BIT) {
    constexpr int kPerThread = (kItems + THREADS - 1) / THREADS;
    // Where a wave's 32 lanes take one column's 32 pairs, its column is uniform: with REPEAT_EDGES, which
    // has no column test, a scalar base.
    constexpr bool kWaveColumns = REPEAT_EDGES && kPairs % 32 == 0 && THREADS % kPairs == 0;
    const int first_item_col = kWaveColumns ? wave_uniform(tid / kPairs) : 0;
    u32x4 first[kPerThread], second[kPerThread];
    #pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int i = tid + n * THREADS;
      const int item_col = kWaveColumns ? first_item_col + n * (THREADS / kPairs) : i / kPairs;
      first[n] = zero_u32x4();
      second[n] = zero_u32x4();
      if (REPEAT_EDGES || in_tile(i))  // may run past the tile: in bounds, not stored
        load_row_pair<UNIFORM_BASE, REPEAT_EDGES, kWaveColumns>(first[n], second[n], src, stride, row0, seqlen,
                                                                2 * (i % kPairs), col0 + item_col * 8, head_dim);
    }
    // Without the fence the stores' lane test would draw their loads into its exec-masked block: one
    // memory round trip per load.
    if constexpr (REPEAT_EDGES) compiler_fence();
    #pragma unroll
    for (int n = 0; n < kPerThread; ++n) {
      const int i = tid + n * THREADS;
      if (in_tile(i))
        store_transposed_pair<LDS_ROW>(dst + (i / kPairs) * 8 * LDS_ROW + 2 * (i % kPairs), first[n], second[n]);
    }
  } else {
    for (int i = tid; i < kItems; i += THREADS) {
      const int r = 2 * (i % kPairs);
      const int c = (i / kPairs) * 8;
      u32x4 first = zero_u32x4(), second = zero_u32x4();
      load_row_pair<UNIFORM_BASE, REPEAT_EDGES>(first, second, src, stride, row0, seqlen, r, col0 + c, head_dim);
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
