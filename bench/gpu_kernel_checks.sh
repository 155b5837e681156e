#!/usr/bin/env bash
# The kernels' GPU checks on the NVIDIA test machine, one call: forward, backward, mask / packed
# batch / grouped-head and edge test grids and the custom-op tests through both emulated layers, then
# compute-sanitizer memcheck and racecheck on a small forward+backward grid. Needs build/emu/ (python kernels/build.py
# --no-amd --emulate; with --cuda-archs 90 it is 5 MB, small enough to build off the GPU machine with nvcc and carry).
# Results go to ${OUT:-bench/out}. SKIP_FORWARD=1 / SKIP_API=1 leave those parts out. Needs pytest-xdist. bench/compare_grids.py
# then compares the grids with the recorded cases, bit for bit.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/device.txt"

run_tests() {  # name, files...
  local name=$1; shift
  local start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider "$@" > "$out/pytest_$name.txt" 2>&1
  echo "$name: $(tail -n 1 "$out/pytest_$name.txt") ($(( $(date +%s) - start )) s)"
}
[ -z "${SKIP_FORWARD:-}" ] && RDNA_FA_GRID_REPORT="$out/forward_grid.json" run_tests forward tests/gpu/test_forward.py
RDNA_FA_BWD_GRID_REPORT="$out/backward_grid.json" run_tests backward tests/gpu/test_backward.py
RDNA_FA_PROBLEM_GRID_REPORT="$out/problem_grids.json" run_tests problems tests/gpu/test_masks_varlen_gqa.py
# The edge grid's small cases in 8 processes (pytest-xdist), then its large tensors one at a time.
run_tests edge_grid tests/gpu/test_edge_grid_gpu.py -n 8 -k "not past_2_31 and not past_65535"
run_tests edge_large tests/gpu/test_edge_grid_gpu.py -k "past_2_31 or past_65535"
run_tests custom_ops tests/gpu/test_custom_ops.py
[ -z "${SKIP_API:-}" ] && RDNA_FA_FORCE=1 run_tests api tests/gpu/test_api_gpu.py

for layer in gfx11 gfx12; do
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 python3 -m tests.gpu.sanitize_kernels "$layer" \
      > "$out/sanitizer_${tool}_${layer}.txt" 2>&1
    echo "$tool $layer: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_${tool}_${layer}.txt" | tail -1)"
  done
done | tee "$out/sanitizer_summary.txt"
grep -h -E "^(FAILED|ERROR)" "$out"/pytest_*.txt | head -n 30
