#!/usr/bin/env bash
# The forward kernel's GPU checks on the NVIDIA test machine, one call: the test grid through both
# emulated layers, then compute-sanitizer memcheck and racecheck on a small grid.
# Needs build/emu/ (python kernels/build.py --no-amd --emulate). Results go to ${OUT:-bench/out}.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/device.txt"

start=$(date +%s)
RDNA_FA_GRID_REPORT="$out/forward_grid.json" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_forward.py \
  2>&1 | tail -n 25 | tee "$out/pytest_forward.txt"
echo "grid seconds: $(( $(date +%s) - start ))" | tee -a "$out/pytest_forward.txt"

for layer in gfx11 gfx12; do
  for tool in memcheck racecheck; do
    PYTHONPATH=. compute-sanitizer --tool "$tool" --error-exitcode 3 python3 tests/gpu/sanitize_forward.py "$layer" \
      > "$out/sanitizer_${tool}_${layer}.txt" 2>&1
    echo "$tool $layer: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_${tool}_${layer}.txt" | tail -1)"
  done
done | tee "$out/sanitizer_summary.txt"
