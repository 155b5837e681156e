#!/usr/bin/env bash
# Installs the package into ./.venv (with CPU PyTorch where there is no GPU) and runs the main job,
# `python -m rdna_flash_attn bench`. Extra arguments go to bench (see `bench --help`).
source "$(dirname "$0")/_venv.sh"

step "Python environment $VENV with PyTorch"
make_venv
step "the package, with the CPU interpreter and the plot's needs"
"$PY" -m pip install -q -e ".[interpret]" matplotlib==3.11.2
step "main job: python -m rdna_flash_attn bench"
"$PY" -m rdna_flash_attn bench "$@"
