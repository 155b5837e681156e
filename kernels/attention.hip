// The translation unit of every kernel, for every target: the matrix ISA comes from isa/gfx11.h or
// isa/gfx12.h, the hardware from platform/ (real AMD, or its NVIDIA emulation). The variant lists
// are generated from rdna_flash_attn/runtime/variants.py by kernels/build.py.
#include "fa_fwd.h"
#include "fa_bwd.h"
#if defined(__GFX12__)
#include "fa_fwd8.h"  // 8-bit WMMA at twice the 16-bit rate: gfx12 only
#include "quant8.h"   // its quantizing pass
#endif

// MASKED: the variant that reads the argument block's attention mask; the others ignore it.
#define RDNA_FA_FWD_INSTANCE(symbol, dtype, d_pad, waves, block_n, d_chunk, copy_loads, masked)    \
  RDNA_KERNEL(32 * (waves)) symbol(const rdna::FwdArgs args) {                                      \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::FwdShape<d_pad, waves, block_n, d_chunk, masked>::kLdsElems)); \
    rdna::fwd_body<rdna::dtype, d_pad, waves, block_n, d_chunk, copy_loads, masked>(args, lds);    \
  }

#define RDNA_FA_BWD_DKDV_INSTANCE(symbol, dtype, d_pad, waves, block_m, d_chunk, masked)           \
  RDNA_KERNEL(32 * (waves)) symbol(const rdna::BwdArgs args) {                                      \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::DkdvShape<d_pad, waves, block_m, d_chunk, masked>::kLdsElems)); \
    rdna::dkdv_body<rdna::dtype, d_pad, waves, block_m, d_chunk, masked>(args, lds);               \
  }

#define RDNA_FA_BWD_DQ_INSTANCE(symbol, dtype, d_pad, waves, block_n, d_chunk, masked)             \
  RDNA_KERNEL(32 * (waves)) symbol(const rdna::BwdArgs args) {                                      \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::DqShape<d_pad, waves, block_n, d_chunk, masked>::kLdsElems)); \
    rdna::dq_body<rdna::dtype, d_pad, waves, block_n, d_chunk, masked>(args, lds);                 \
  }

#define RDNA_FA_FWD8_INSTANCE(symbol, dtype, d_pad, waves, block_n)                                 \
  RDNA_KERNEL(32 * (waves)) symbol(const rdna::Fwd8Args args) {                                     \
    RDNA_LDS_ARRAY(rdna::u16, lds, (2 * rdna::Fwd8Shape<d_pad, waves, block_n>::kLdsWords));        \
    rdna::fwd8_body<rdna::dtype, d_pad, waves, block_n>(args, reinterpret_cast<rdna::u32*>(lds));   \
  }

#define RDNA_FA_QUANT8_STATS_INSTANCE(symbol, dtype, d_pad)                                           \
  RDNA_KERNEL(rdna::kQuantThreads) symbol(const rdna::Quant8Args args) {                            \
    RDNA_LDS_ARRAY(rdna::u16, lds, (2 * rdna::Quant8StatsShape<d_pad>::kLdsFloats));                \
    rdna::quant8_stats_body<rdna::dtype, d_pad>(args, reinterpret_cast<float*>(lds));               \
  }

#define RDNA_FA_QUANT8_CODES_INSTANCE(symbol, dtype, d_pad)                                           \
  RDNA_KERNEL(rdna::kQuantRows) symbol(const rdna::Quant8Args args) {                               \
    RDNA_LDS_ARRAY(rdna::u16, lds, (2 * rdna::Quant8CodesShape<d_pad>::kLdsWords));                 \
    rdna::quant8_codes_body<rdna::dtype, d_pad>(args, reinterpret_cast<rdna::u32*>(lds));           \
  }

#include "instances.inc"
