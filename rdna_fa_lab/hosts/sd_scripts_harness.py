"""kohya sd-scripts as a host, in this process: its own model code from an sd-scripts folder on this
machine, routed as this package's launcher routes a training run there (the SDPA override,
`patch_sdpa`). Used by the coverage benchmark (rdna_fa_lab/coverage.py).

- SD1.5 and SDXL: sd-scripts' own U-Nets (library/original_unet.py, library/sdxl_original_unet.py),
  at their released sizes (sd-scripts fixes them in module constants; random weights, a 16 x 16
  latent), with `--sdpa` (the U-Net's `set_use_sdpa(True)`, attention through PyTorch's SDPA) and, for
  SD1.5, without it (sd-scripts' own matrix-product attention, which nothing can route).
- Flux: library/flux_models.py at a tiny size, with and without `--apply_t5_attn_mask` (a boolean
  key-padding mask over the T5 tokens, broadcast to every head and query).

One forward call each on a CFG-free training batch of 2. sd-scripts imports torchvision (for image
transforms no model here uses), so a bare stand-in module is put in its place where torchvision is
absent (comfyui_harness does the same for ComfyUI); any use of it fails loudly. Its other imports
(opencv among them) must be installed: its own requirements.

What it does not have: the training scripts (their argument parsing, accelerate, LoRA networks, the
backward pass); SD3, Lumina and the other models sd-scripts trains.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn

from . import comfyui_harness
from .comfyui_harness import initialise, put_first_on_path

TEXT_TOKENS = 77
SD15_TEXT_WIDTH, SDXL_TEXT_WIDTH, SDXL_LABEL_WIDTH = 768, 2048, 2816
LATENT = 16
FLUX_TEXT_WIDTH, FLUX_TEXT_TOKENS, FLUX_PADDING = 32, 8, 3
FLUX_SETTINGS = dict(in_channels=64, vec_in_dim=32, context_in_dim=FLUX_TEXT_WIDTH, hidden_size=64, mlp_ratio=2.0,
                     num_heads=4, depth=1, depth_single_blocks=1, axes_dim=[4, 6, 6], theta=10000, qkv_bias=True,
                     guidance_embed=False)  # 4 x 16 here; 24 x 128 for real
SDPA, NO_SDPA, T5_MASK = "--sdpa", "no --sdpa", "--apply_t5_attn_mask"
FAMILIES = (f"sd15 ({SDPA})", f"sd15 ({NO_SDPA})", f"sdxl ({SDPA})", "flux", f"flux ({T5_MASK})")
RELEASED = {f"sd15 ({SDPA})": "sd15", f"sd15 ({NO_SDPA})": "sd15", f"sdxl ({SDPA})": "sdxl", "flux": "flux",
            f"flux ({T5_MASK})": "flux"}  # whose released head dims a family has


class NotSdScripts(Exception):
    """The folder holds no sd-scripts."""


def start(folder: Path) -> None:
    """Put the sd-scripts folder first on sys.path (its `library` package)."""
    if not (folder / "library" / "original_unet.py").is_file():
        raise NotSdScripts(f"{folder} holds no sd-scripts (library/original_unet.py)")
    put_first_on_path(folder)
    comfyui_harness.stub_torchvision()


def _library(name: str):
    return importlib.import_module(f"library.{name}")


def build(family: str, device: torch.device) -> nn.Module:
    if family.startswith("sd15"):
        # as sd-scripts' model_util builds SD1.x: 8 heads, CLIP-L's 768-wide text
        model = _library("original_unet").UNet2DConditionModel(
            sample_size=LATENT, attention_head_dim=8, cross_attention_dim=SD15_TEXT_WIDTH,
            use_linear_projection=False, upcast_attention=False)
    elif family.startswith("sdxl"):
        model = _library("sdxl_original_unet").SdxlUNet2DConditionModel()
    else:
        flux = _library("flux_models")
        model = flux.Flux(flux.FluxParams(**FLUX_SETTINGS))
    if hasattr(model, "set_use_sdpa"):
        model.set_use_sdpa(family.endswith(f"({SDPA})"))
    initialise(model)
    return model.eval().to(device)


def run(model: nn.Module, family: str, device: torch.device) -> torch.Tensor:
    """One forward call as sd-scripts' training step makes it, on a batch of 2."""
    generator = torch.Generator().manual_seed(5)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    timesteps = torch.tensor([500, 500], device=device)
    if family.startswith("sd15"):
        return model(draw(2, 4, LATENT, LATENT), timesteps, draw(2, TEXT_TOKENS, SD15_TEXT_WIDTH)).sample
    if family.startswith("sdxl"):
        return model(draw(2, 4, LATENT, LATENT), timesteps, draw(2, TEXT_TOKENS, SDXL_TEXT_WIDTH),
                     draw(2, SDXL_LABEL_WIDTH))
    side = LATENT // 2  # Flux takes the latent packed: an 8 x 8 grid of 64-channel tokens here
    image_ids = torch.zeros(2, side * side, 3, device=device)
    image_ids[..., 1] = (torch.arange(side * side, device=device) // side).float()
    image_ids[..., 2] = (torch.arange(side * side, device=device) % side).float()
    mask = None
    if T5_MASK in family:  # the T5 tokenizer's attention mask: the prompt's last tokens are padding
        mask = torch.ones(2, FLUX_TEXT_TOKENS, dtype=torch.long, device=device)
        mask[:, -FLUX_PADDING:] = 0
    return model(draw(2, side * side, FLUX_SETTINGS["in_channels"]), image_ids,
                 draw(2, FLUX_TEXT_TOKENS, FLUX_TEXT_WIDTH), torch.zeros(2, FLUX_TEXT_TOKENS, 3, device=device),
                 timesteps / 1000, draw(2, FLUX_SETTINGS["vec_in_dim"]), txt_attention_mask=mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The U-Nets' CrossAttention modules (empty for Flux, whose attention is a function)."""
    classes = tuple(getattr(_library(name), "CrossAttention") for name in ("original_unet", "sdxl_original_unet"))
    return [m for m in model.modules() if isinstance(m, classes)]
