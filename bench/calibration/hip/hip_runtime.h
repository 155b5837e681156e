// Minimal stand-in for device-only compilation with clang -x hip -nogpuinc.
// Written from scratch for calibration; provides only what the opus_attn_gfx1201 kernels use.
#pragma once
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__   __attribute__((host))
#define __shared__ __attribute__((shared))
#define __launch_bounds__(MAXT, MINW) \
  __attribute__((amdgpu_flat_work_group_size(1, MAXT), amdgpu_waves_per_eu(MINW)))
struct __calib_uint3 { unsigned x, y, z; };
__device__ static inline __calib_uint3 __calib_tid() {
  return {__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(), __builtin_amdgcn_workitem_id_z()};
}
__device__ static inline __calib_uint3 __calib_bid() {
  return {__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(), __builtin_amdgcn_workgroup_id_z()};
}
#define threadIdx (__calib_tid())
#define blockIdx  (__calib_bid())
