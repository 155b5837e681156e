// Calibration-only instantiation file (not from gcnasm): v63 kernel at BLOCK_M=384 and 448, BLOCK_N=32
// (the BLOCK_M values of PR #24's "Phase 5: BLOCK_M sweep (v66)" table).
#include "attn_gfx1201_kernel_v63_template.hpp"
template __global__ void opus_attn_gfx1201_kernel_v63<opus_attn_traits<384, 32, 128>>(opus_attn_kargs);
template __global__ void opus_attn_gfx1201_kernel_v63<opus_attn_traits<448, 32, 128>>(opus_attn_kargs);
template __global__ void opus_attn_gfx1201_kernel_v63<opus_attn_traits<128, 32, 128>>(opus_attn_kargs);
