"""A1111's model code with the extension's forwards: an ldm SD1.5-config UNetModel (random init)
at 1024px (latent 128x128, batch 2 as with CFG) and the SD VAE decoder (its mid-block AttnBlock at
128x128 = 16384 tokens), each run unpatched (ldm's own attention, A1111's "None") and through the
patched CrossAttention/AttnBlock; reports the largest difference, the peak memory of both, and the
kernel/fallback call counts. On a GPU it runs in float16 under autocast, as A1111 does.

    RDNA_FA_FORCE=1 python -m bench.webui_ldm_gpu --out bench/results/webui_ldm_gpu.json   # GPU
    python -m bench.webui_ldm_gpu --tiny --out /tmp/webui_ldm_tiny.json                    # CPU check

--tiny: a small UNet and decoder at a 64px latent 8x8 in float32 on the CPU, where every call falls
back (it proves the script runs, not the kernels). Needs stable-diffusion-sdkit (ldm) + einops,
omegaconf, pillow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import rdna_flash_attn
from extension import a1111, ldm_attention

# Relative to the largest reference value: float16 activations through 25 blocks, attention in
# float32 accumulation on both paths.
TOLERANCE = 2e-2

SD15_UNET = dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, attention_resolutions=[4, 2, 1],
                 num_res_blocks=2, channel_mult=[1, 2, 4, 4], num_heads=8, use_spatial_transformer=True,
                 transformer_depth=1, context_dim=768, use_checkpoint=False, legacy=False)
SD15_DECODER = dict(ch=128, out_ch=3, ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0,
                    in_channels=3, resolution=256, z_channels=4, double_z=True)
TINY_UNET = dict(SD15_UNET, model_channels=32, channel_mult=[1, 2], attention_resolutions=[2, 1], num_res_blocks=1,
                 num_heads=2, context_dim=64)
TINY_DECODER = dict(SD15_DECODER, ch=32, ch_mult=[1, 2], num_res_blocks=1)


def build_models(tiny: bool, device, dtype):
    from ldm.modules.diffusionmodules.model import Decoder
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(0)
    unet = UNetModel(**(TINY_UNET if tiny else SD15_UNET))
    decoder = Decoder(**(TINY_DECODER if tiny else SD15_DECODER))
    for model in (unet, decoder):
        # ldm zero-initialises output layers (proj_out, out convs): with them at zero the attention
        # output would never reach the result, so give them random weights too.
        for layer in model.modules():
            if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Linear)) and not layer.weight.any():
                layer.reset_parameters()
    return unet.to(device, dtype).eval(), decoder.to(device, dtype).eval()


def inputs(tiny: bool, device, dtype):
    generator = torch.Generator().manual_seed(1)
    side, context_dim = (8, 64) if tiny else (128, 768)
    latent = torch.randn(2, 4, side, side, generator=generator).to(device, dtype)
    context = torch.randn(2, 77, context_dim, generator=generator).to(device, dtype)
    timesteps = torch.tensor([500, 500], device=device)
    return latent, context, timesteps


def measure(run, device) -> dict:
    """Run once; the output, seconds and peak memory (bytes) above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return {"out": out, "seconds": round(seconds, 3), "peak_bytes_above_weights": peak}


def compare(reference: torch.Tensor, patched: torch.Tensor) -> dict:
    difference = (patched.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return {"max_abs_diff": difference, "max_abs_reference": scale, "relative": difference / scale,
            "finite": bool(torch.isfinite(patched).all().item()), "tolerance_relative": TOLERANCE,
            "ok": bool(torch.isfinite(patched).all().item()) and difference <= TOLERANCE * scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small CPU-sized check")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    autocast = torch.autocast("cuda", dtype=torch.float16) if device.type == "cuda" else contextlib.nullcontext()
    unet, decoder = build_models(args.tiny, device, dtype)
    latent, context, timesteps = inputs(args.tiny, device, dtype)
    patch = a1111.ForwardPatch(ldm_attention.HostHooks())

    def run_unet():
        with torch.no_grad(), autocast:
            return unet(latent, timesteps=timesteps, context=context)

    def run_decoder():
        with torch.no_grad(), autocast:
            return decoder(latent[:1])

    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny,
              "force": rdna_flash_attn.settings.force, "latent": list(latent.shape)}
    # What the dispatcher says for an SD1.5 head (runs the device's first-use self-test now, outside
    # the measured passes).
    probe = torch.randn(2, 8, 64, 40, device=device, dtype=torch.float16)
    report["dispatcher"] = rdna_flash_attn.explain(probe, probe, probe)
    for name, run in (("unet", run_unet), ("vae_decoder", run_decoder)):
        unpatched = measure(run, device)
        patch.apply()
        rdna_flash_attn.reset_stats()
        try:
            patched = measure(run, device)
        finally:
            patch.undo()
        report[name] = {
            "compare": compare(unpatched["out"], patched["out"]),
            "unpatched": {k: v for k, v in unpatched.items() if k != "out"},
            "patched": {k: v for k, v in patched.items() if k != "out"},
            "calls": rdna_flash_attn.stats(),
        }
    report["ok"] = report["unet"]["compare"]["ok"] and report["vae_decoder"]["compare"]["ok"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        sys.exit("patched output differs from the unpatched one beyond the tolerance")


if __name__ == "__main__":
    main()
