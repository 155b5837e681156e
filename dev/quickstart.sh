#!/usr/bin/env bash
# Installs the package into ./.venv (with CPU PyTorch where there is no GPU) and runs the main job,
# the repository's lab's `python -m rdna_fa_lab bench`: the package's benchmark where the kernels run,
# elsewhere the shipped code objects on the CPU interpreter and their expected speed. Extra arguments
# go to bench (see `python -m rdna_fa_lab bench --help`).
source "$(dirname "$0")/_venv.sh"

step "Python environment $VENV with PyTorch"
make_venv
step "the package, and what the lab needs beyond it (the CPU interpreter, the plot)"
"$PY" -m pip install -q -e . -r rdna_fa_lab/requirements.txt
step "main job: python -m rdna_fa_lab bench"
"$PY" -m rdna_fa_lab bench "$@"
