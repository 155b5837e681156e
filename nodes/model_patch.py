"""Per-model routing: a ModelPatcher clone whose attention calls go through `routing`.

ComfyUI 2025-09 and later call `transformer_options["optimized_attention_override"](func, *args,
**kwargs)` from every attention backend; the clone's override puts the kernels beneath `func`, and
an override already present stays in charge: it is called with the routed backend as its `func`.
Older ComfyUI gets attn1/attn2 replace patches on every transformer block of a UNet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .routing import RoutingOptions, kernel_attention, routed_backend

log = logging.getLogger("rdna_flash_attn")

OVERRIDE_KEY = "optimized_attention_override"
OVERRIDE_MARK = "_rdna_flash_attn_options"  # set on our overrides, so a second node replaces, not stacks
PREVIOUS_ATTR = "_rdna_flash_attn_previous"  # on our overrides: the override they were put on top of


def comfy_has_override() -> bool:
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return False
    return hasattr(attention, "wrap_attn")


def make_override(options: RoutingOptions, previous: Callable | None = None) -> Callable:
    """An optimized_attention_override routing to the kernels, beneath `previous` if given."""
    if previous is not None and hasattr(previous, OVERRIDE_MARK):
        previous = getattr(previous, PREVIOUS_ATTR)

    def override(func, *args, **kwargs):
        backend = routed_backend(func, options)
        if previous is None:
            return backend(*args, **kwargs)
        return previous(backend, *args, **kwargs)

    setattr(override, OVERRIDE_MARK, options)
    setattr(override, PREVIOUS_ATTR, previous)
    return override


def remove_override(transformer_options: dict) -> None:
    """Put back whatever override was there before ours (none, or another node's)."""
    current = transformer_options.get(OVERRIDE_KEY)
    if current is None or not hasattr(current, OVERRIDE_MARK):
        return
    previous = getattr(current, PREVIOUS_ATTR)
    if previous is None:
        del transformer_options[OVERRIDE_KEY]
    else:
        transformer_options[OVERRIDE_KEY] = previous


def install_override(transformer_options: dict, options: RoutingOptions) -> None:
    transformer_options[OVERRIDE_KEY] = make_override(options, transformer_options.get(OVERRIDE_KEY))


def _replace_patch(options: RoutingOptions):
    """An attn1/attn2 replace patch: (q, k, v, extra_options) -> (B, L, H*D), for old ComfyUI."""

    def patch(q, k, v, extra_options):
        heads = extra_options["n_heads"]
        named = {"q": q, "k": k, "v": v, "heads": heads, "attn_precision": extra_options.get("attn_precision")}
        out = kernel_attention(named, {}, options)
        if isinstance(out, torch.Tensor):
            return out
        from comfy.ldm.modules.attention import optimized_attention

        return optimized_attention(q, k, v, heads, attn_precision=named["attn_precision"])

    return patch


def _unet_transformer_blocks(diffusion_model):
    """(block name, block number, transformer index) of every BasicTransformerBlock in a UNet."""
    from comfy.ldm.modules.attention import SpatialTransformer

    groups = [("input", getattr(diffusion_model, "input_blocks", [])),
              ("middle", [getattr(diffusion_model, "middle_block", [])]),
              ("output", getattr(diffusion_model, "output_blocks", []))]
    for name, blocks in groups:
        for number, block in enumerate(blocks):
            for layer in block:
                if isinstance(layer, SpatialTransformer):
                    for index in range(len(layer.transformer_blocks)):
                        yield name, number, index


def install_replace_patches(model, options: RoutingOptions) -> int:
    """attn1/attn2 replace patches on every UNet transformer block; returns how many blocks."""
    patch = _replace_patch(options)
    count = 0
    for name, number, index in _unet_transformer_blocks(model.model.diffusion_model):
        model.set_model_attn1_replace(patch, name, number, index)
        model.set_model_attn2_replace(patch, name, number, index)
        count += 1
    return count


def patch_model(model, options: RoutingOptions):
    """A clone of ComfyUI `model` (a ModelPatcher) with its attention routed to the kernels."""
    patched = model.clone()
    transformer_options = patched.model_options.setdefault("transformer_options", {})
    if comfy_has_override():
        install_override(transformer_options, options)
        return patched
    blocks = install_replace_patches(patched, options)
    log.info(
        "this ComfyUI has no optimized_attention_override: routed %d UNet transformer blocks through "
        "attn1/attn2 replace patches (DiT models need ComfyUI 2025-09 or later)", blocks
    )
    return patched


def unpatch_model(model):
    """A clone of `model` with our override removed (the one before it restored)."""
    clone = model.clone()
    remove_override(clone.model_options.setdefault("transformer_options", {}))
    return clone

