#!/usr/bin/env bash
# On the NVIDIA test machine, kernels forced on through the emulation: the LoRA training comparison
# (bench/lora_training.py) and the dispatcher's benchmark. diffusers and peft travel as wheels in
# .whl/ (see the device tool's notes). Results go to ${OUT:-bench/out}.
set -uo pipefail
export PYTHONUNBUFFERED=1 RDNA_FA_FORCE=1
out=${OUT:-bench/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 bench/lora_training.py --steps 20 --out "$out" 2>&1 | tail -n 30
python3 -m rdna_flash_attn bench --out "$out" 2>&1 | tail -n 40
