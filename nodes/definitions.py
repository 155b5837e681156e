"""The ComfyUI nodes: inputs, tooltips, descriptions, and the calls into model_patch / vae_patch."""

from __future__ import annotations

from .core import core_or_reason
from .model_patch import patch_model, unpatch_model
from .routing import FALLBACK_CHOICES, FALLBACK_ORIGINAL, RoutingOptions
from .vae_patch import (
    PRECISION_BF16,
    PRECISION_CHOICES,
    PSNR_CHOICES,
    PSNR_FIRST,
    patch_vae,
)

CATEGORY = "advanced/attention"

# The node's attention precision choices -> rdna_flash_attn's (settings.precision's values).
ATTENTION_PRECISION = {"exact": "exact", "8-bit QK+PV (RDNA4)": "8bit-qkpv"}


class RDNAFlashAttentionModel:
    DESCRIPTION = (
        "Runs the model's attention on exact FlashAttention-2 kernels for AMD RDNA3/RDNA4 GPUs "
        "(SD1.5, SD2.x, SDXL, SD3, Flux, WAN and other ComfyUI models). Calls the kernels do not "
        "support (masks, other GPUs, unsupported head dims) run on ComfyUI's own attention; the "
        "console says why, once per reason."
    )
    CATEGORY = CATEGORY
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with its attention routed to the kernels.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model (from a checkpoint loader or LoRA)."}),
                "enable": ("BOOLEAN", {"default": True, "tooltip": "Off: the model passes through with this node's routing removed."}),
                "use_for_training": ("BOOLEAN", {"default": True, "tooltip": "Also run training (backward) on the kernels; off: training uses ComfyUI's attention."}),
                "unsupported_calls": (list(FALLBACK_CHOICES), {"default": FALLBACK_ORIGINAL, "tooltip": "Where calls the kernels do not support go: ComfyUI's selected attention, or PyTorch SDPA."}),
            },
            # Optional: prompts saved before it existed still validate.
            "optional": {
                "attention_precision": (list(ATTENTION_PRECISION), {"default": "exact", "tooltip": "8-bit QK+PV: on RDNA4 (RX 9060/9070), sampling calls run approximate 8-bit attention (int8 Q K^T, fp8 P V; SageAttention-style); RDNA3 has no faster 8-bit rate and stays exact, as do training, masked and causal calls."}),
            },
        }

    def patch(self, model, enable, use_for_training, unsupported_calls, attention_precision="exact"):
        if not enable or isinstance(core_or_reason(), str):
            return (unpatch_model(model),)
        options = RoutingOptions(training=use_for_training, fallback=unsupported_calls,
                                 precision=ATTENTION_PRECISION[attention_precision])
        return (patch_model(model, options),)


class RDNAFlashAttentionVAE:
    DESCRIPTION = (
        "Runs the VAE's attention (one head of 512 channels) on the RDNA FlashAttention-2 kernels. "
        "A float32 VAE's attention runs in bfloat16 (or float16 where the values fit); the console "
        "shows the decoded image's PSNR against the VAE's own float32 attention."
    )
    CATEGORY = CATEGORY
    FUNCTION = "patch"
    RETURN_TYPES = ("VAE",)
    OUTPUT_TOOLTIPS = ("The VAE with its attention routed to the kernels; the input VAE is unchanged.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE", {"tooltip": "The VAE to decode (or encode) with."}),
                "enable": ("BOOLEAN", {"default": True, "tooltip": "Off: the VAE passes through unchanged."}),
                "fp32_attention": (list(PRECISION_CHOICES), {"default": PRECISION_BF16, "tooltip": "For a float32 VAE: compute attention in bf16, in fp16 when every value fits, or keep float32 (which only runs on the kernels with RDNA_FA_FP32_CAST set)."}),
                "psnr_check": (list(PSNR_CHOICES), {"default": PSNR_FIRST, "tooltip": "Decode again with the VAE's own attention and log the PSNR of the difference (costs one extra decode each time)."}),
            }
        }

    def patch(self, vae, enable, fp32_attention, psnr_check):
        if not enable or isinstance(core_or_reason(), str):
            return (vae,)
        return (patch_vae(vae, precision=fp32_attention, psnr_check=psnr_check),)


NODE_CLASS_MAPPINGS = {
    "RDNAFlashAttentionModel": RDNAFlashAttentionModel,
    "RDNAFlashAttentionVAE": RDNAFlashAttentionVAE,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "RDNAFlashAttentionModel": "RDNA Flash Attention (model)",
    "RDNAFlashAttentionVAE": "RDNA Flash Attention (VAE)",
}
