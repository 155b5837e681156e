// RDNA3 / RDNA3.5 (gfx11) wave32 WMMA. An A or B operand lane holds all 16 k values of row
// (column) l % 16, and lanes 16-31 must hold the same as lanes 0-15. The accumulator lane holds
// column l % 16, rows 2s + l / 16.
#pragma once
#include "wave32.h"

namespace rdna {

struct Isa {
  static constexpr int kOperandElems = 16;
  struct Operand { u32 w[kOperandElems / 2]; };

  // First k index of the contiguous run an operand lane holds.
  static RDNA_DEV int operand_k0(int) { return 0; }
  static RDNA_DEV int acc_row(int lane, int s) { return 2 * s + (lane >> 4); }

  template <class DT>
  static RDNA_DEV void mma(DT dt, v8f& c, const Operand& a, const Operand& b) { c = wmma_gfx11(dt, a.w, b.w, c); }

  // The kernels store key (or query) k of a 16-row A operand fragment in LDS row key_slot(k) when the
  // product's accumulator rows become the k of the next product (the forward's P^T, the backward's
  // P and dS). Then accumulator row 2s + l / 16 holds key 8 * (l / 16) + s: each half-wave holds 8
  // consecutive keys (as on gfx12), and the B operand needs one permlanex16 and two selects per
  // packed pair instead of selects, masks and shifts per 16-bit value.
  static RDNA_DEV int key_slot(int key) { return ((key & 7) << 1) | (key >> 3); }
  static RDNA_DEV int acc_key(int lane, int s) { return 8 * (lane >> 4) + s; }

  // The B operand with k = key from this lane's probabilities, packed in pairs of acc_key order:
  // keys 0-7 come from the lower half-wave, keys 8-15 from the upper, and both halves hold all 16.
  template <bool FETCH_INACTIVE = true>  // other_half's
  static RDNA_DEV Operand keys_to_operand(const u32 (&packed)[4], int lane) {
    Operand out;
    const bool upper = lane >= 16;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 theirs = other_half<FETCH_INACTIVE>(packed[j]);
      out.w[j] = upper ? theirs : packed[j];
      out.w[4 + j] = upper ? packed[j] : theirs;
    }
    return out;
  }

  // Accumulator rows 8 * (l / 16) .. + 7 of this lane's column, 16-bit values packed in pairs. A lane
  // holds rows 2s + l / 16, interleaved with its partner's: each passes the other the half it lacks.
  static RDNA_DEV u32x4 rows_to_run(const u16 (&bits)[8], int lane) {
    const bool upper = lane >= 16;
    // lower lanes pass rows 8, 10, 12, 14 (s = 4..7), upper lanes rows 1, 3, 5, 7 (s = 0..3)
    const u32 given[2] = {upper ? pack_u16x2(bits[0], bits[1]) : pack_u16x2(bits[4], bits[5]),
                          upper ? pack_u16x2(bits[2], bits[3]) : pack_u16x2(bits[6], bits[7])};
    const u32 taken[2] = {other_half(given[0]), other_half(given[1])};
    u32x4 run;
    #pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u16 theirs = u16(taken[w >> 1] >> (16 * (w & 1)));
      run[w] = upper ? pack_u16x2(theirs, bits[4 + w]) : pack_u16x2(bits[w], theirs);
    }
    return run;
  }
};

}  // namespace rdna
