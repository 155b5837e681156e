"""ComfyUI's attention memory reservation for a routed model.

Before sampling, ComfyUI reserves GPU memory for the diffusion model's activations by
`BaseModel.memory_required(input_shape)`. Where its attention is memory-efficient (xformers, or PyTorch
attention where `model_management.pytorch_attention_flash_attention()` holds) it counts the latent's
elements x dtype size x 0.01 MB x the model's memory_usage_factor; otherwise 0.15 MB per element,
sized for attention that holds the whole score matrix: 7.5x more in 16 bits. An AMD GPU on which
ComfyUI does not enable PyTorch attention (gfx1102, gfx1103, gfx1200/gfx1201 before ROCm 7, any GPU
whose AOTriton probe fails) gets the large figure, though the kernels keep no score matrix: ComfyUI
then loads less of the model or offloads it.

ComfyUI up to 0.33 has no way for a backend to declare itself memory-efficient for one model (a
pending upstream change adds one to set_model_optimized_attention). So a PREPARE_SAMPLING wrapper on
the routed clone has ComfyUI's own estimate take its memory-efficient branch while that model is
prepared, where the kernels take its calls: the core loads, its load device has no refusal, and its
dtype is 16-bit (or float32 cast to 16 bits by RDNA_FA_FP32_CAST).
"""

from __future__ import annotations

import contextlib

import torch

from .core import core_or_reason
from .overrides import later_override
from .routing import log_once

WRAPPER_KEY = "rdna_flash_attn_memory"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def kernels_take_model(model) -> bool:
    """Whether the kernels take this ModelPatcher's attention calls on its load device."""
    core = core_or_reason()
    if isinstance(core, str):
        return False
    found = later_override(model.model_options.get("transformer_options"))
    if found is not None and found[1]:  # a node placed after ours decides this model's attention
        return False
    dtype = model.model.get_dtype_inference() if hasattr(model.model, "get_dtype_inference") else model.model.get_dtype()
    if dtype not in KERNEL_DTYPES and not (dtype == torch.float32 and core.settings.fp32_cast != "off"):
        return False
    return core.dispatch.state.device_refusal(torch.device(model.load_device)) is None


@contextlib.contextmanager
def memory_efficient_estimate():
    """Within the block, ComfyUI's memory_required takes its memory-efficient attention branch (ComfyUI
    prepares a model in its one worker thread)."""
    from comfy import model_management

    original = model_management.pytorch_attention_flash_attention
    model_management.pytorch_attention_flash_attention = lambda: True
    try:
        yield
    finally:
        model_management.pytorch_attention_flash_attention = original


def prepare_sampling_wrapper(executor, model, *args, **kwargs):
    """The PREPARE_SAMPLING wrapper of a routed model: ComfyUI's memory reservation for memory-efficient
    attention where the kernels take the model's calls."""
    if not kernels_take_model(model):
        return executor(model, *args, **kwargs)
    log_once("RDNA Flash Attention: ComfyUI reserves memory for this model's attention as for memory-efficient "
             "attention (the kernels keep no score matrix)")
    with memory_efficient_estimate():
        return executor(model, *args, **kwargs)


def comfy_has_prepare_wrappers() -> bool:
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        return False
    return hasattr(WrappersMP, "PREPARE_SAMPLING")


def add_to(model, wrapper=prepare_sampling_wrapper, key: str = WRAPPER_KEY) -> bool:
    """Put PREPARE_SAMPLING `wrapper` on ModelPatcher `model` under `key`; False where this ComfyUI has no
    PREPARE_SAMPLING wrappers."""
    if not comfy_has_prepare_wrappers() or not hasattr(model, "add_wrapper_with_key"):
        return False
    from comfy.patcher_extension import WrappersMP

    model.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, key)
    model.add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, key, wrapper)
    return True


def remove_from(model) -> None:
    if comfy_has_prepare_wrappers() and hasattr(model, "remove_wrappers_with_key"):
        from comfy.patcher_extension import WrappersMP

        model.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, WRAPPER_KEY)
