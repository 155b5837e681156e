"""Per-model routing: a ModelPatcher clone whose attention calls go through `routing`.

ComfyUI 2025-09 and later call `transformer_options["optimized_attention_override"](func, *args,
**kwargs)` from every attention backend given the model's options; the clone's override puts the
kernels beneath `func`, and an override already present stays in charge: it is called with the routed
backend as its `func`. ComfyUI's own attention backend node's override ignores `func`: its chosen
backend goes beneath the kernels instead (overrides.py). The calls a model makes without its options take the same route through
direct_calls. Older ComfyUI gets attn1/attn2 replace patches on the transformer blocks of a UNet that
have no replace patch of another node.
"""

from __future__ import annotations

from collections.abc import Callable

from . import direct_calls, memory_estimate
from .overrides import OVERRIDE_KEY, OVERRIDE_MARK, PREVIOUS_ATTR, comfy_backend_choice, note_backend_beneath
from .routing import RoutingOptions, log_once, routed_backend


def comfy_has_override() -> bool:
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return False
    return hasattr(attention, "wrap_attn")


def make_override(options: RoutingOptions, previous: Callable | None = None) -> Callable:
    """An optimized_attention_override routing to the kernels, beneath `previous` if given; where
    `previous` is ComfyUI's attention backend node's, above the backend it chose (which ignores the
    backend it is handed, so the kernels could not run beneath it)."""
    if previous is not None and hasattr(previous, OVERRIDE_MARK):
        previous = getattr(previous, PREVIOUS_ATTR)
    chosen = comfy_backend_choice(previous)
    if chosen is not None:
        note_backend_beneath(chosen)

    def override(func, *args, **kwargs):
        if chosen is not None:
            return routed_backend(chosen, options)(*args, **kwargs)
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
        from comfy.ldm.modules.attention import optimized_attention

        backend = routed_backend(optimized_attention, options)
        return backend(q, k, v, extra_options["n_heads"], attn_precision=extra_options.get("attn_precision"))

    setattr(patch, OVERRIDE_MARK, options)
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


def _foreign_patch(patches: dict, name: str, number: int, index: int):
    """Another node's replace patch for this block (ComfyUI looks up (name, number, index), then
    (name, number)), or None."""
    for key in ((name, number, index), (name, number)):
        patch = patches.get(key)
        if patch is not None and not hasattr(patch, OVERRIDE_MARK):
            return patch
    return None


def install_replace_patches(model, options: RoutingOptions) -> int:
    """attn1/attn2 replace patches on every UNet transformer block that has no replace patch of
    another node (IPAdapter and the like keep theirs); returns how many patches were set."""
    patch = _replace_patch(options)
    existing = model.model_options.get("transformer_options", {}).get("patches_replace", {})
    setters = {"attn1": model.set_model_attn1_replace, "attn2": model.set_model_attn2_replace}
    installed, kept = 0, []
    for name, number, index in _unet_transformer_blocks(model.model.diffusion_model):
        for slot, setter in setters.items():
            if _foreign_patch(existing.get(slot, {}), name, number, index) is not None:
                kept.append(f"{slot} {name} {number}.{index}")
                continue
            setter(patch, name, number, index)
            installed += 1
    if kept:
        log_once(
            f"RDNA Flash Attention: {len(kept)} UNet attention layers already have another node's replace "
            f"patch and keep it, with ComfyUI's attention: {', '.join(kept)}"
        )
    return installed


def remove_replace_patches(transformer_options: dict) -> None:
    """Drop our attn1/attn2 replace patches; other nodes' stay. The dicts are rebuilt, not edited,
    as ComfyUI may share them between clones."""
    replace = transformer_options.get("patches_replace")
    if not replace:
        return
    kept = {}
    for slot, patches in replace.items():
        others = {key: patch for key, patch in patches.items() if not hasattr(patch, OVERRIDE_MARK)}
        if others:
            kept[slot] = others
    if kept:
        transformer_options["patches_replace"] = kept
    else:
        del transformer_options["patches_replace"]


def patch_model(model, options: RoutingOptions):
    """A clone of ComfyUI `model` (a ModelPatcher) with its attention routed to the kernels."""
    patched = model.clone()
    transformer_options = patched.model_options.setdefault("transformer_options", {})
    if comfy_has_override():
        install_override(transformer_options, options)
        direct_calls.add_to(patched, direct_calls.apply_model_wrapper(options), direct_calls.sampling_wrapper(options))
        memory_estimate.add_to(patched)
        return patched
    installed = install_replace_patches(patched, options)
    log_once(
        f"this ComfyUI has no optimized_attention_override: routed {installed} UNet attention layers through "
        "attn1/attn2 replace patches (DiT models need ComfyUI 2025-09 or later)"
    )
    return patched


def unpatch_model(model):
    """A clone of `model` without our override (the one before it restored) or replace patches."""
    clone = model.clone()
    transformer_options = clone.model_options.setdefault("transformer_options", {})
    remove_override(transformer_options)
    remove_replace_patches(transformer_options)
    direct_calls.remove_from(clone)
    memory_estimate.remove_from(clone)
    return clone
