# Sourced by quickstart.sh and test.sh: Debian/Ubuntu packages when missing, and ./.venv with PyTorch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION=2.13.0  # the version the tests and CI run; any PyTorch >= 2.2 runs the package
VENV=${RDNA_FA_VENV:-.venv}
PY="$VENV/bin/python"

step() { echo; echo "=== [$SECONDS s] $* ==="; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else echo "root or sudo needed for: $*" >&2; return 1
  fi
}

# Debian/Ubuntu packages, installing only those missing.
apt_install() {
  local missing=()
  for package in "$@"; do dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if ! command -v apt-get >/dev/null; then
    echo "install these with your package manager, then rerun: ${missing[*]}" >&2
    return 1
  fi
  echo "apt-get install ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# PyPI's Linux x86-64 build of torch is CUDA's (several GB); PyTorch's own index has the CPU one. torch
# alone from there, then its dependencies from PyPI.
cpu_torch() {
  "$1" -m pip install -q --no-deps --retries 1 "torch==$TORCH_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
  "$1" -m pip install -q "torch==$TORCH_VERSION"
}

make_venv() {
  command -v python3 >/dev/null || apt_install python3 python3-venv  # a bare Debian/Ubuntu image has none
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "Python >= 3.10 needed; python3 is $(python3 --version 2>&1)" >&2; exit 1; }
  if [ ! -x "$PY" ]; then
    # Debian and Ubuntu ship venv's pip bootstrap separately.
    python3 -c 'import ensurepip' 2>/dev/null || apt_install python3-venv
    python3 -m venv "$VENV"
  fi
  if "$PY" -c 'import torch' 2>/dev/null; then
    echo "PyTorch $("$PY" -c 'import torch; print(torch.__version__)') already in $VENV: kept"
    return
  fi
  if [ -e /dev/kfd ]; then
    echo "An AMD GPU is present: for the kernels, install PyTorch for ROCm into $VENV first (pytorch.org)." \
         "Going on with the CPU build." >&2
  fi
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION"  # PyPI's Linux build is CUDA's
  else
    cpu_torch "$PY"
  fi
}
