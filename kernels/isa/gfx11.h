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

  // Turns an accumulator tile X (rows k, columns n) into the B operand X of the next product,
  // each value converted to 16 bits by `convert`. Row 2s + h lives in half h, so each lane takes the
  // odd or even rows from its partner lane.
  template <class Convert>
  static RDNA_DEV Operand acc_to_operand(const v8f& c, int lane, Convert convert) {
    Operand out;
    const bool upper = lane >= 16;
    #pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const u32 mine = pack_u16x2(convert(c[j]), convert(c[j + 1]));
      const u32 theirs = other_half(mine);
      const u32 even_rows = upper ? theirs : mine;
      const u32 odd_rows = upper ? mine : theirs;
      out.w[j] = (even_rows & 0xffffu) | (odd_rows << 16);
      out.w[j + 1] = (even_rows >> 16) | (odd_rows & 0xffff0000u);
    }
    return out;
  }

  // The forward's S^T = K Q^T stores key k of a 16-key fragment in LDS row key_slot(k). Then
  // accumulator row 2s + l / 16 holds key 8 * (l / 16) + s: each half-wave holds 8 consecutive keys
  // (as on gfx12), and P^T needs one permlanex16 and two selects per packed pair of probabilities
  // instead of selects, masks and shifts per 16-bit value.
  static RDNA_DEV int key_slot(int key) { return ((key & 7) << 1) | (key >> 3); }
  static RDNA_DEV int acc_key(int lane, int s) { return 8 * (lane >> 4) + s; }

  // The B operand with k = key from this lane's probabilities, packed in pairs of acc_key order:
  // keys 0-7 come from the lower half-wave, keys 8-15 from the upper, and both halves hold all 16.
  static RDNA_DEV Operand keys_to_operand(const u32 (&packed)[4], int lane) {
    Operand out;
    const bool upper = lane >= 16;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 theirs = other_half(packed[j]);
      out.w[j] = upper ? theirs : packed[j];
      out.w[4 + j] = upper ? packed[j] : theirs;
    }
    return out;
  }
};

}  // namespace rdna
