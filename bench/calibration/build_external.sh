#!/usr/bin/env bash
# Builds the external gfx1201 attention kernels of the estimator's calibration (issue 22) from their
# public sources, which are not part of this repository: carlushuang/gcnasm, folder opus_attn_gfx1201/,
# at the commits bench/results/estimator_calibration.md names, copied into SRC:
#   SRC/v153/{attn_common.h, attn_gfx1201_kernel_v153.cc, attn_gfx1201_kernel_v153_template.hpp}
#   SRC/v63/{attn_common.h, attn_gfx1201_kernel_v63_template.hpp}
#   SRC/v201/attn_gfx1201_kernel_v201.s
# Writes OUT/{v153,v63_bm128_384_448,v201}_gfx1201.hsaco (default OUT: build/calibration), which
# bench/results/estimator_calibration_cases.json names. Needs clang-19 and ld.lld-19; no ROCm: the HIP
# sources compile against hip/hip_runtime.h here, a stand-in that gives them only what they use.
set -euo pipefail
src=${1:?usage: $0 SRC [OUT]}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${2:-build/calibration}" && cd "${2:-build/calibration}" && pwd)
hip=(clang-19 -x hip -std=c++17 --offload-arch=gfx1201 --cuda-device-only --no-gpu-bundle-output
     -nogpulib -nogpuinc -O3 -I"$here")
echo "v153 (HIP)"
(cd "$src/v153" && "${hip[@]}" -I. -c attn_gfx1201_kernel_v153.cc -o "$out/v153_gfx1201.hsaco")
echo "v63 at 128, 384 and 448 query rows (HIP)"
(cd "$src/v63" && "${hip[@]}" -I. -c "$here/instantiate_v63.cc" -o "$out/v63_bm128_384_448_gfx1201.hsaco")
echo "v201 (assembly)"
# clang-19's assembler does not know two kernel-descriptor directives of newer LLVM; the instructions
# are unchanged without them (the descriptor's prefetch size and round-robin bit differ).
grep -v -e '\.amdhsa_inst_pref_size' -e '\.amdhsa_round_robin_scheduling' "$src/v201/attn_gfx1201_kernel_v201.s" \
  > "$out/v201.s"
clang-19 -x assembler -target amdgcn-amd-amdhsa -mcpu=gfx1201 -c "$out/v201.s" -o "$out/v201.o"
ld.lld-19 -shared "$out/v201.o" -o "$out/v201_gfx1201.hsaco"
rm "$out/v201.s" "$out/v201.o"
sha256sum "$out"/*_gfx1201.hsaco
