"""diffusers as a host, in this process: tiny random-weight models of the families LoRA trainers built
on diffusers train (an SD1.5-layout UNet, Flux's and SD3's transformers), one forward call each, with
the kernels reached the two ways this package offers trainers: its attention processor
(`install_attention_processor`, the diffusers/peft hook) or the SDPA override (`patch_sdpa`, what the
launcher and the .pth hook install). Used by the coverage benchmark (tools/coverage.py).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from ..dispatch.sdpa_patch import patch_sdpa
from ..integrations.diffusers_attention import install_attention_processor

TEXT_WIDTH = 32
TEXT_TOKENS = 7
ROUTES = ("processor", "override")
# family -> (diffusers class, tiny config); head dims 16 here (40-160, 128 and 64 for real)
MODELS = {
    "sd15": ("UNet2DConditionModel", dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=2, cross_attention_dim=TEXT_WIDTH, norm_num_groups=8)),
    "flux": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6))),
    "sd3": ("SD3Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, caption_projection_dim=32, pooled_projection_dim=TEXT_WIDTH, out_channels=4)),
}
FAMILIES = tuple(f"{family} ({route})" for family in MODELS for route in ROUTES)


def diffusers_available() -> bool:
    return importlib.util.find_spec("diffusers") is not None


def split(name: str) -> tuple[str, str]:
    """'flux (override)' -> ('flux', 'override')."""
    family, _, route = name.partition(" (")
    return family, route.rstrip(")")


def build(family: str, device: torch.device) -> torch.nn.Module:
    import diffusers

    class_name, config = MODELS[family]
    torch.manual_seed(0)
    return getattr(diffusers, class_name)(**config).to(device).eval()


def routed(model: torch.nn.Module, route: str):
    """A context in which `model`'s attention takes `route` to the kernels."""
    if route == "processor":
        install_attention_processor(model)
        return contextlib.nullcontext()
    return patch_sdpa()


def run(model: torch.nn.Module, family: str, device: torch.device) -> torch.Tensor:
    """One forward call as a trainer makes it (batch 1, latent 16 x 16)."""
    generator = torch.Generator().manual_seed(5)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    text, pooled = draw(1, TEXT_TOKENS, TEXT_WIDTH), draw(1, TEXT_WIDTH)
    timestep = torch.tensor([500.0], device=device)
    if family == "sd15":
        return model(draw(1, 4, 16, 16), timestep, encoder_hidden_states=text).sample
    if family == "sd3":
        return model(draw(1, 4, 16, 16), encoder_hidden_states=text, pooled_projections=pooled,
                     timestep=timestep).sample
    tokens = 8 * 8  # Flux takes the latent packed: an 8 x 8 grid of 16-channel tokens here
    image_ids = torch.zeros(tokens, 3, device=device)
    image_ids[:, 1], image_ids[:, 2] = torch.arange(tokens, device=device) // 8, torch.arange(tokens, device=device) % 8
    return model(draw(1, tokens, 16), encoder_hidden_states=text, pooled_projections=pooled,
                 timestep=timestep / 1000, img_ids=image_ids, txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device)).sample
