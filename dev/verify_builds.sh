#!/usr/bin/env bash
# The builds, proven: gfx1100's code objects (v5, and v4 for older HIP runtimes) rebuilt from the
# kernel sources with Debian's clang-19 through the package's local-rebuild path must equal prebuilt/'s
# byte for byte; and, where nvcc is installed, the NVIDIA emulation builds of both layers compile.
# About 8 minutes on 2 cores, 1 without nvcc (CI runs it after dev/test.sh). Uses ./.venv from dev/test.sh.
source "$(dirname "$0")/_venv.sh"
[ -x "$PY" ] || { echo "run dev/test.sh first: it makes $VENV" >&2; exit 1; }
apt_install clang-19 lld-19 llvm-19
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "gfx1100 rebuilt through the local-rebuild path with clang-19 into a temporary cache"
RDNA_FA_CACHE_DIR="$work/cache" "$PY" -m rdna_flash_attn rebuild --target gfx1100 --clang clang-19
built=$(ls "$work"/cache/kernels/*/rdna_fa_gfx1100.hsaco)
cmp "$built" prebuilt/rdna_fa_gfx1100.hsaco
cmp "$(dirname "$built")/rdna_fa_gfx1100.cov4.hsaco" prebuilt/rdna_fa_gfx1100.cov4.hsaco
echo "gfx1100 rebuilt from the sources is identical to prebuilt/rdna_fa_gfx1100.hsaco and .cov4.hsaco"
RDNA_FA_CACHE_DIR="$work/cache" "$PY" -c "
from rdna_flash_attn.runtime import artifacts
for artifact in artifacts.amd_artifacts('gfx1100'):
    assert artifact.local and artifact.read_verified(), artifact
    print(f'runtime picks the local build (code object v{artifact.code_object_version}):', artifact.path)"

step "NVIDIA emulation builds (gfx11 and gfx12 layers, sm_80 and sm_90)"
if command -v nvcc >/dev/null; then
  "$PY" kernels/build.py --no-amd --emulate
else
  echo "skipped: nvcc is not installed"
fi
echo
echo "builds verified in $SECONDS s"
