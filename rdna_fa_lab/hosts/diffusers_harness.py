"""diffusers as a host, in this process: tiny random-weight models of the families SD.Next (a
diffusers-based WebUI) and the LoRA trainers built on diffusers run, one forward call each with the
inputs their pipelines pass (text masks included), with the kernels reached the two ways this package
offers: its attention processor (`install_attention_processor`, the diffusers/peft hook) or the SDPA
override (`patch_sdpa`, what the launcher and the .pth hook install). Used by the coverage benchmark
(rdna_fa_lab/coverage.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable

import torch

from rdna_flash_attn.dispatch.sdpa_patch import patch_sdpa
from rdna_flash_attn.integrations.diffusers_attention import install_attention_processor

TEXT_WIDTH = 32
TEXT_TOKENS = 7
T5_WIDTH = 128  # HunyuanDiT pools T5's states with 8 heads: 16 wide each here (256 released)
TEXT_ARGUMENT = "encoder_hidden_states"  # the prompt's token states, in every family whose call carries a mask
ROUTES = ("processor", "override")
# family -> (diffusers class, tiny config): head dims 16 (32 in SD1.5's inner block and the VAE; the
# released ones in REAL_HEAD_DIMS or comfyui_harness.REAL_HEAD_DIMS), 1-2 layers, 8 x 8 to 16 x 16
# latent tokens. Masks: the calls of MASKED_FAMILIES (chroma, qwen_image, lumina2, pixart, sana,
# hunyuan_video, ltxv) carry the text mask their pipelines pass, with the last prompt token padding,
# and it reaches their attention; hunyuan_dit takes masks too, but swaps the padded tokens for a
# learned embedding instead of masking them; the others' pipelines pass none.
MODELS = {
    "sd15": ("UNet2DConditionModel", dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=2, cross_attention_dim=TEXT_WIDTH, norm_num_groups=8)),
    "sdxl": ("UNet2DConditionModel", dict(  # attention_head_dim counts heads here, as in SDXL's config
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(1, 2), transformer_layers_per_block=(1, 2), use_linear_projection=True,
        cross_attention_dim=TEXT_WIDTH, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=TEXT_WIDTH + 6 * 8, norm_num_groups=8)),
    "flux": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6))),
    "sd3": ("SD3Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, caption_projection_dim=32, pooled_projection_dim=TEXT_WIDTH, out_channels=4)),
    "chroma": ("ChromaTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1)),
    "flux2": ("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4))),
    "qwen_image": ("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, axes_dims_rope=(4, 6, 6))),
    "z_image": ("ZImageTransformer2DModel", dict(
        in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT_WIDTH,
        axes_dims=[4, 6, 6], axes_lens=[64, 16, 16])),
    "hidream": ("HiDreamImageTransformer2DModel", dict(  # smallest that runs: 2 experts, 2 of Llama's layers
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[TEXT_WIDTH, TEXT_WIDTH], text_emb_dim=TEXT_WIDTH,
        num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16),
        llama_layers=(0, 1))),
    "lumina2": ("Lumina2Transformer2DModel", dict(  # one key/value head for two query heads, as Lumina2's 8 for 24
        sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(64, 16, 16),
        cap_feat_dim=TEXT_WIDTH)),
    "pixart": ("PixArtTransformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, out_channels=8, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, cross_attention_dim=32, caption_channels=TEXT_WIDTH)),
    "sana": ("SanaTransformer2DModel", dict(  # its self-attention is linear attention, no SDPA call to route
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
        caption_channels=TEXT_WIDTH)),
    "hunyuan_dit": ("HunyuanDiT2DModel", dict(  # two layers: its second half of layers takes skip connections
        sample_size=16, patch_size=2, in_channels=4, hidden_size=32, attention_head_dim=16, num_attention_heads=2,
        num_layers=2, cross_attention_dim=TEXT_WIDTH, cross_attention_dim_t5=T5_WIDTH, pooled_projection_dim=32,
        text_len=TEXT_TOKENS, text_len_t5=TEXT_TOKENS)),
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=TEXT_WIDTH, freq_dim=16, ffn_dim=64, num_layers=1, rope_max_seq_len=32)),
    "hunyuan_video": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=2, text_embed_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH,
        rope_axes_dim=(4, 6, 6))),
    "ltxv": ("LTXVideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        num_layers=1, caption_channels=TEXT_WIDTH)),
    # Without the padding-mask input channel the released config has: filling it needs torchvision, and
    # it only widens the patch embedding (the pipeline's padding mask is all zeros for text-to-image).
    "cosmos": ("CosmosTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        text_embed_dim=TEXT_WIDTH, adaln_lora_dim=8, max_size=(4, 16, 16), concat_padding_mask=False)),
    "vae": ("AutoencoderKL", dict(  # the SD VAE's one attention: its mid-block's, a single head as wide as the block
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8)),
}
MASKED_FAMILIES = ("chroma", "qwen_image", "lumina2", "pixart", "sana", "hunyuan_video", "ltxv")
FAMILIES = tuple(f"{family} ({route})" for family in MODELS for route in ROUTES)
# Head dims of the released checkpoints of the families comfyui_harness.REAL_HEAD_DIMS does not list,
# from their transformer/config.json on the Hugging Face Hub.
REAL_HEAD_DIMS = {
    # Efficient-Large-Model/Sana_1600M_1024px_diffusers (20 x 112) and Sana_Sprint_0.6B_1024px (16 x 72):
    # cross-attention only, the self-attention being linear
    "sana": (112, 72),
}


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


def padded_text_mask(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tokenizer's mask of a prompt whose last token is padding (batch 1: a batch's shorter prompt)."""
    mask = torch.ones(1, TEXT_TOKENS, dtype=dtype, device=device)
    mask[0, -1] = 0
    return mask


def grid_ids(height: int, width: int, columns: int, device: torch.device) -> torch.Tensor:
    """Flux-style position ids of a height x width latent: (row, column) in `columns` 1 and 2."""
    ids = torch.zeros(height * width, columns, device=device)
    positions = torch.arange(height * width, device=device)
    ids[:, 1], ids[:, 2] = positions // width, positions % width
    return ids


class Draw:
    """Random inputs, the same on every call of `inputs` (a generator of its own, seeded afresh)."""

    def __init__(self, device: torch.device):
        self.generator = torch.Generator().manual_seed(5)
        self.device = device

    def __call__(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.device)

    def text(self) -> torch.Tensor:
        return self(1, TEXT_TOKENS, TEXT_WIDTH)


def _timestep(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([float(value)], device=device)


def _unet(draw: Draw, device: torch.device) -> dict:
    return dict(sample=draw(1, 4, 16, 16), timestep=_timestep(500, device), encoder_hidden_states=draw.text())


def _sdxl(draw: Draw, device: torch.device) -> dict:
    # the pooled text embedding and (original size, crop corner, target size) of the image
    time_ids = torch.tensor([[128.0, 128.0, 0.0, 0.0, 128.0, 128.0]], device=device)
    return dict(_unet(draw, device), added_cond_kwargs=dict(text_embeds=draw(1, TEXT_WIDTH), time_ids=time_ids))


def _flux(draw: Draw, device: torch.device) -> dict:
    # the latent packed: an 8 x 8 grid of 16-channel tokens
    return dict(hidden_states=draw(1, 64, 16), encoder_hidden_states=draw.text(),
                pooled_projections=draw(1, TEXT_WIDTH), timestep=_timestep(0.5, device),
                img_ids=grid_ids(8, 8, 3, device), txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device))


def _sd3(draw: Draw, device: torch.device) -> dict:
    return dict(hidden_states=draw(1, 4, 16, 16), encoder_hidden_states=draw.text(),
                pooled_projections=draw(1, TEXT_WIDTH), timestep=_timestep(500, device))


def _chroma(draw: Draw, device: torch.device) -> dict:
    # Chroma's pipeline keeps the first padding token and masks the rest (here the last, of two), in the
    # embeddings' dtype, with the 64 image tokens appended unmasked
    mask = torch.cat([padded_text_mask(torch.float32, device), torch.ones(1, 64, device=device)], dim=1)
    return dict(hidden_states=draw(1, 64, 16), encoder_hidden_states=draw.text(), timestep=_timestep(0.5, device),
                img_ids=grid_ids(8, 8, 3, device), txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device),
                attention_mask=mask)


def _flux2(draw: Draw, device: torch.device) -> dict:
    # positions (t, h, w, l): the image on an 8 x 8 grid, the text along l
    text_ids = torch.zeros(1, TEXT_TOKENS, 4, device=device)
    text_ids[0, :, 3] = torch.arange(TEXT_TOKENS, device=device)
    return dict(hidden_states=draw(1, 64, 16), encoder_hidden_states=draw.text(), timestep=_timestep(0.5, device),
                img_ids=grid_ids(8, 8, 4, device)[None], txt_ids=text_ids, guidance=_timestep(4.0, device))


def _qwen_image(draw: Draw, device: torch.device) -> dict:
    # a 4-channel 16 x 16 latent packed in 2 x 2 patches: 8 x 8 tokens of 16
    return dict(hidden_states=draw(1, 64, 16), encoder_hidden_states=draw.text(),
                encoder_hidden_states_mask=padded_text_mask(torch.long, device), timestep=_timestep(0.5, device),
                img_shapes=[[(1, 8, 8)]])


def _z_image(draw: Draw, device: torch.device) -> dict:
    # lists, one entry per image: latents (C, frames, H, W) and the prompt's states without padding
    return dict(x=[draw(4, 1, 16, 16)], t=_timestep(0.5, device), cap_feats=[draw(TEXT_TOKENS, TEXT_WIDTH)])


def _hidream(draw: Draw, device: torch.device) -> dict:
    # T5's states, and Llama's stacked by layer (the model picks its llama_layers), no masks
    return dict(hidden_states=draw(1, 4, 16, 16), timesteps=_timestep(500, device),
                encoder_hidden_states_t5=draw.text(), encoder_hidden_states_llama3=draw(2, 1, TEXT_TOKENS, TEXT_WIDTH),
                pooled_embeds=draw(1, TEXT_WIDTH))


def _lumina2(draw: Draw, device: torch.device) -> dict:
    return dict(hidden_states=draw(1, 4, 16, 16), timestep=_timestep(0.5, device), encoder_hidden_states=draw.text(),
                encoder_attention_mask=padded_text_mask(torch.long, device))


def _pixart(draw: Draw, device: torch.device) -> dict:
    return dict(hidden_states=draw(1, 4, 16, 16), encoder_hidden_states=draw.text(),
                encoder_attention_mask=padded_text_mask(torch.long, device), timestep=_timestep(500, device),
                added_cond_kwargs=dict(resolution=None, aspect_ratio=None))


def _sana(draw: Draw, device: torch.device) -> dict:
    return dict(hidden_states=draw(1, 4, 8, 8), encoder_hidden_states=draw.text(),
                encoder_attention_mask=padded_text_mask(torch.long, device), timestep=_timestep(500, device))


def _hunyuan_dit(draw: Draw, device: torch.device) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    # CLIP's and T5's states with their masks, the image's size conditioning, style 0, and the rotary
    # embedding of the 8 x 8 patch grid the pipeline computes
    rotary = get_2d_rotary_pos_embed(16, ((0, 0), (8, 8)), (8, 8), device=device)
    return dict(hidden_states=draw(1, 4, 16, 16), timestep=_timestep(500, device), encoder_hidden_states=draw.text(),
                text_embedding_mask=padded_text_mask(torch.long, device),
                encoder_hidden_states_t5=draw(1, TEXT_TOKENS, T5_WIDTH),
                text_embedding_mask_t5=padded_text_mask(torch.long, device),
                image_meta_size=torch.tensor([[128.0, 128.0, 128.0, 128.0, 0.0, 0.0]], device=device),
                style=torch.zeros(1, dtype=torch.long, device=device), image_rotary_emb=rotary)


def _wan(draw: Draw, device: torch.device) -> dict:
    # two latent frames of 16 x 16 (8 x 8 patches); Wan pads prompts with zeros and passes no mask
    return dict(hidden_states=draw(1, 4, 2, 16, 16), timestep=_timestep(500, device), encoder_hidden_states=draw.text())


def _hunyuan_video(draw: Draw, device: torch.device) -> dict:
    # two latent frames of 16 x 16; the mask in the embeddings' dtype, the guidance scaled by 1000
    return dict(hidden_states=draw(1, 4, 2, 16, 16), timestep=_timestep(500, device), encoder_hidden_states=draw.text(),
                encoder_attention_mask=padded_text_mask(torch.float32, device), pooled_projections=draw(1, TEXT_WIDTH),
                guidance=_timestep(6000, device))


def _ltxv(draw: Draw, device: torch.device) -> dict:
    # two latent frames of 8 x 8, packed; the rope scale of LTX's VAE (8x in time at 25 fps, 32x in space)
    return dict(hidden_states=draw(1, 2 * 8 * 8, 8), encoder_hidden_states=draw.text(), timestep=_timestep(500, device),
                encoder_attention_mask=padded_text_mask(torch.bool, device), num_frames=2, height=8, width=8,
                rope_interpolation_scale=(8 / 25, 32, 32))


def _cosmos(draw: Draw, device: torch.device) -> dict:
    return dict(hidden_states=draw(1, 4, 1, 16, 16), timestep=_timestep(0.5, device), encoder_hidden_states=draw.text())


def _vae(draw: Draw, device: torch.device) -> dict:
    return dict(z=draw(1, 4, 8, 8))


INPUTS: dict[str, Callable[[Draw, torch.device], dict]] = {
    "sd15": _unet, "sdxl": _sdxl, "flux": _flux, "sd3": _sd3, "chroma": _chroma, "flux2": _flux2,
    "qwen_image": _qwen_image, "z_image": _z_image, "hidream": _hidream, "lumina2": _lumina2, "pixart": _pixart,
    "sana": _sana, "hunyuan_dit": _hunyuan_dit, "wan": _wan, "hunyuan_video": _hunyuan_video, "ltxv": _ltxv,
    "cosmos": _cosmos, "vae": _vae,
}


def inputs(family: str, device: torch.device) -> dict:
    """The keyword arguments of `family`'s forward call, as its pipeline passes them (batch 1)."""
    return INPUTS[family](Draw(device), device)


def forward(model: torch.nn.Module, family: str, arguments: dict) -> torch.Tensor:
    """`model` called with `arguments`: the VAE decodes; Z-Image answers a list, one latent per image."""
    if family == "vae":
        return model.decode(**arguments).sample
    sample = model(**arguments).sample
    return torch.stack(sample) if family == "z_image" else sample


def run(model: torch.nn.Module, family: str, device: torch.device) -> torch.Tensor:
    """One forward call as a pipeline or trainer makes it."""
    return forward(model, family, inputs(family, device))
