// The translation unit of every kernel, for every target: the matrix ISA comes from isa/gfx11.h or
// isa/gfx12.h, the hardware from platform/ (real AMD, or its NVIDIA emulation). The variants and their
// traits are generated from rdna_flash_attn/runtime/variants.py and tuning.py by kernels/build.py.
#include "fa_fwd.h"
#include "fa_bwd.h"
#if defined(__GFX12__)
#include "fa_fwd8.h"  // 8-bit WMMA at twice the 16-bit rate: gfx12 only
#include "quant8.h"   // its quantizing pass
#endif

// Each instance's traits struct (TRAITS) holds its geometry and tuning choices; the generated
// instances.inc defines it before instantiating the kernel.
#define RDNA_FA_FWD_INSTANCE(symbol, dtype, traits)                                                 \
  RDNA_KERNEL(32 * traits::kWaves) symbol(const rdna::FwdArgs args) {                               \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::FwdLoop<rdna::dtype, traits>::Shape::kLdsElems));         \
    rdna::fwd_body<rdna::dtype, traits>(args, lds);                                                 \
  }

#define RDNA_FA_BWD_DKDV_INSTANCE(symbol, dtype, traits)                                            \
  RDNA_KERNEL(32 * traits::kWaves) symbol(const rdna::BwdArgs args) {                               \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::DkdvShape<traits>::kLdsElems));                           \
    rdna::dkdv_body<rdna::dtype, traits>(args, lds);                                                \
  }

#define RDNA_FA_BWD_DQ_INSTANCE(symbol, dtype, traits)                                              \
  RDNA_KERNEL(32 * traits::kWaves) symbol(const rdna::BwdArgs args) {                               \
    RDNA_LDS_ARRAY(rdna::u16, lds, (rdna::DqShape<traits>::kLdsElems));                             \
    rdna::dq_body<rdna::dtype, traits>(args, lds);                                                  \
  }

#define RDNA_FA_FWD8_INSTANCE(symbol, dtype, traits)                                                \
  RDNA_KERNEL(32 * traits::kWaves) symbol(const rdna::Fwd8Args args) {                              \
    RDNA_LDS_ARRAY(rdna::u16, lds, (2 * rdna::Fwd8Shape<traits::kHeadDim, traits::kWaves, traits::kBlockN>::kLdsWords)); \
    rdna::fwd8_body<rdna::dtype, traits>(args, reinterpret_cast<rdna::u32*>(lds));                  \
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
