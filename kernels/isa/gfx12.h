// RDNA4 (gfx12) wave32 WMMA. An A or B operand lane holds 8 k values, k = 8 * (l / 16) + s, of row
// (column) l % 16. The accumulator lane holds column l % 16, rows 8 * (l / 16) + s.
#pragma once
#include "wave32.h"

namespace rdna {

struct Isa {
  static constexpr int kOperandElems = 8;
  struct Operand { u32 w[kOperandElems / 2]; };

  static RDNA_DEV int operand_k0(int lane) { return 8 * (lane >> 4); }
  static RDNA_DEV int acc_row(int lane, int s) { return 8 * (lane >> 4) + s; }

  template <class DT>
  static RDNA_DEV void mma(DT dt, v8f& c, const Operand& a, const Operand& b) { c = wmma_gfx12(dt, a.w, b.w, c); }

  // The key order of gfx11.h's key_slot: the natural one here, where the accumulator's rows in a
  // lane are exactly the k values its B operand needs.
  static RDNA_DEV int key_slot(int key) { return key; }
  static RDNA_DEV int acc_key(int lane, int s) { return acc_row(lane, s); }
  template <bool FETCH_INACTIVE = true>  // as gfx11.h's; no exchange here
  static RDNA_DEV Operand keys_to_operand(const u32 (&packed)[4], int) {
    Operand out;
    #pragma unroll
    for (int j = 0; j < 4; ++j) out.w[j] = packed[j];
    return out;
  }
  // 8-bit operands (int8, fp8; fa_fwd8.h): a lane holds the same 8 k values, k = 8 * (l / 16) + byte,
  // four to a word; the int8 accumulator's layout is the float one.
  struct alignas(8) Operand8 { u32 w[2]; };
  static RDNA_DEV void mma_i8(v8i& c, const Operand8& a, const Operand8& b) { c = wmma_gfx12_i8(a.w, b.w, c); }
  static RDNA_DEV void mma_fp8(v8f& c, const Operand8& a, const Operand8& b) { c = wmma_gfx12_fp8(a.w, b.w, c); }
  // The B operand with k = key from this lane's accumulator keys (acc_key order), four to a word.
  static RDNA_DEV Operand8 keys_to_operand8(u32 keys_0_3, u32 keys_4_7) { return Operand8{{keys_0_3, keys_4_7}}; }

  // Accumulator rows 8 * (l / 16) .. + 7 of this lane's column, packed in pairs: the lane's own.
  static RDNA_DEV u32x4 rows_to_run(const u16 (&bits)[8], int) {
    u32x4 run;
    #pragma unroll
    for (int w = 0; w < 4; ++w) run[w] = pack_u16x2(bits[2 * w], bits[2 * w + 1]);
    return run;
  }
};

}  // namespace rdna
