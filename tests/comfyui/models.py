"""Tiny ComfyUI models with the attention shapes of the real ones, random weights, and sampling
through ComfyUI's own sampler (comfy.sample.sample) so transformer_options reach every block.

Model configs follow ComfyUI's comfy/supported_models.py (SD15, SD20, SDXL, Flux): the same
model_base classes, latent formats and extra UNet settings, declared here because that module
imports the text encoders (transformers), which neither these tests nor the GPU bench need.
"""

from __future__ import annotations

import torch

CPU = torch.device("cpu")
TEXT_WIDTH = 32

UNET_COMMON = dict(
    image_size=32, in_channels=4, out_channels=4, num_res_blocks=[1, 1], channel_mult=[1, 2],
    context_dim=TEXT_WIDTH, use_spatial_transformer=True, legacy=False, adm_in_channels=None,
    use_temporal_attention=False, use_temporal_resblock=False,
)

# name -> (model_base class, latent format, extra UNet settings ComfyUI adds, tiny config,
#          latent channels, needs a pooled text vector)
MODELS = {
    # SD1.5: 8 heads whose dim doubles per level (8 x 8, 8 x 16 here; 8 x 40 ... 8 x 160 for real)
    "sd15": ("BaseModel", "SD15", {"num_heads": 8, "num_head_channels": -1}, dict(UNET_COMMON, model_channels=64, transformer_depth=[1, 1], transformer_depth_middle=1,
                          transformer_depth_output=[1, 1, 1, 1], use_linear_in_transformer=False), 4, False),
    # SD2.x: head dim 64, attn_precision=torch.float32 from ComfyUI's SD20 config
    "sd2": ("BaseModel", "SD15", {"num_heads": -1, "num_head_channels": 64, "attn_precision": torch.float32}, dict(UNET_COMMON, model_channels=64, transformer_depth=[1, 1], transformer_depth_middle=1,
                         transformer_depth_output=[1, 1, 1, 1], use_linear_in_transformer=True), 4, False),
    # SDXL: head dim 64, no attention at the first level, two-block transformers, label embedding
    "sdxl": ("SDXL", "SDXL", {"num_heads": -1, "num_head_channels": 64}, dict(UNET_COMMON, model_channels=64, transformer_depth=[0, 2], transformer_depth_middle=2,
                          transformer_depth_output=[0, 0, 2, 2], use_linear_in_transformer=True,
                          num_classes="sequential", adm_in_channels=TEXT_WIDTH + 6 * 256), 4, True),
    # Flux: joint text+image attention through skip_reshape (4 x 16 here; 24 x 128 for real)
    "flux": ("Flux", "Flux", {}, dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=TEXT_WIDTH,
                          context_in_dim=TEXT_WIDTH, hidden_size=64, mlp_ratio=2.0, num_heads=4, depth=1,
                          depth_single_blocks=1, axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True,
                          guidance_embed=False), 16, True),
    # SD3.5: joint blocks and an extra x-block self-attention, head dim 64 (2 x 64 here; 24 x 64 for
    # real); its code passes v as (B, L, H, D) beside (B, L, H*D) q and k
    "sd3": ("SD3", "SD3", {}, dict(in_channels=16, pos_embed_scaling_factor=None, patch_size=2, depth=2,
                          adm_in_channels=TEXT_WIDTH, pos_embed_max_size=16, num_patches=256, qk_norm="rms",
                          context_embedder_config={"target": "torch.nn.Linear",
                                                   "params": {"in_features": TEXT_WIDTH, "out_features": 128}},
                          x_block_self_attn=True, x_block_self_attn_layers=[0]), 16, True),
}

# Models whose attention calls do not pass the model's options (so ComfyUI's per-model override never
# sees them), with the latent size they need and their attention calls per sampling (two steps).
OPTIONLESS_MODELS = {
    # PixArt-alpha: self-attention (skip_reshape) and cross-attention per block (2 x 32 here; 16 x 72
    # for real); its position embedding needs a latent of at least 64 x 64
    "pixart": (64, 2 * 2 * 2),
}
MODELS["pixart"] = ("PixArt", "SD15", {}, dict(image_model="pixart_alpha", input_size=16, patch_size=2, in_channels=4,
                                               hidden_size=64, depth=2, num_heads=2, caption_channels=TEXT_WIDTH,
                                               pe_interpolation=1.0, micro_condition=False, model_max_length=7), 4, False)


def initialise(module: torch.nn.Module, seed: int = 0) -> None:
    """ComfyUI creates layers uninitialised: give every parameter a fixed random value."""
    generators = {}
    with torch.no_grad():
        for parameter in module.parameters():
            device = parameter.device
            if device not in generators:
                generators[device] = torch.Generator(device).manual_seed(seed)
            draw = dict(generator=generators[device], device=device, dtype=torch.float32)
            if parameter.dim() > 1:
                std = parameter[0].numel() ** -0.5
                parameter.copy_(torch.randn(parameter.shape, **draw) * std)
            else:
                parameter.copy_(torch.rand(parameter.shape, **draw) * 0.2 - 0.1)


def model_config(name: str, unet_config: dict, dtype: torch.dtype):
    """ComfyUI's model config object for model family `name` with this UNet/DiT config."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.supported_models_base

    base_class, latent_format, extra, _, _, _ = MODELS[name]

    class Config(comfy.supported_models_base.BASE):
        unet_extra_config = extra

        def get_model(self, state_dict=None, prefix="", device=None):
            return getattr(comfy.model_base, base_class)(self, device=device)

    Config.latent_format = getattr(comfy.latent_formats, latent_format)
    config = Config(unet_config)
    config.set_inference_dtype(dtype, None)
    return config


def build(name: str, dtype=torch.float32, unet_config: dict | None = None, device=CPU):
    """A ComfyUI ModelPatcher around a random `name` model (the tiny config unless one is given)."""
    import comfy.model_patcher

    config = model_config(name, dict(unet_config or MODELS[name][3]), dtype)
    model = config.get_model(device=device)
    initialise(model)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=CPU)


def conditioning(name: str, seed: int, text_width: int = TEXT_WIDTH, pooled_width: int = TEXT_WIDTH, tokens: int = 7):
    generator = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": torch.randn(1, pooled_width, generator=generator)} if MODELS[name][5] else {}
    return [[torch.randn(1, tokens, text_width, generator=generator), extra]]


def sample(patcher, name: str, size: int = 16, steps: int = 2, seed: int = 1, **text) -> torch.Tensor:
    """`steps` Euler steps with CFG (batch 2) through ComfyUI's sampler; the denoised latent."""
    import comfy.sample

    channels = MODELS[name][4]
    noise = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(seed))
    latent = torch.zeros(1, channels, size, size)
    return comfy.sample.sample(
        patcher, noise, steps, 5.0, "euler", "normal", conditioning(name, 2, **text), conditioning(name, 3, **text), latent,
        seed=seed, disable_pbar=True,
    )


def counting_override(calls: list):
    """A prior optimized_attention_override, as another node would set: records and calls on."""

    def override(func, *args, **kwargs):
        calls.append(args[0].shape)
        return func(*args, **kwargs)

    return override
