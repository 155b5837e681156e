"""Whose attention override is in charge of a model: ours, ComfyUI's own attention backend node's, or
another node's.

ComfyUI's ModelAttentionBackend node (model/patch) sets, through
`ModelPatcher.set_model_optimized_attention(function)`, an override that ignores the backend ComfyUI
hands it and calls the chosen `function` instead; it replaces any override already there. Placed
before our node, its choice becomes the backend beneath the kernels (the calls they do not take run
on it); placed after, it replaces our override, and the routed model's wrapper says once that the
later node decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .routing import log_once

OVERRIDE_KEY = "optimized_attention_override"
OVERRIDE_MARK = "_rdna_flash_attn_options"  # on our overrides and replace patches: a second node replaces, not stacks
PREVIOUS_ATTR = "_rdna_flash_attn_previous"  # on our overrides: the override they were put on top of
COMFY_BACKEND_OVERRIDE = "ModelPatcher.set_model_optimized_attention.<locals>.optimized_attention_override"


def comfy_backend_choice(override: Callable | None) -> Callable | None:
    """The attention function ComfyUI's attention backend node chose, where `override` is the one that
    node set; else None."""
    if getattr(override, "__qualname__", None) != COMFY_BACKEND_OVERRIDE:
        return None
    captured = dict(zip(override.__code__.co_freevars, override.__closure__ or ()))
    cell = captured.get("optimized_attention")
    return None if cell is None else cell.cell_contents


def backend_label(function: Callable) -> str:
    """How ComfyUI names an attention function (its registered name), for console lines."""
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return getattr(function, "__name__", repr(function))
    registered = getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", {})
    names = [name for name, candidate in registered.items() if candidate is function]
    return f"ComfyUI's {names[0]} attention" if names else getattr(function, "__name__", repr(function))


def note_backend_beneath(chosen: Callable) -> None:
    """Says once that our node, placed after ComfyUI's attention backend node, runs on top of its choice."""
    label = backend_label(chosen)
    log_once(f"RDNA Flash Attention: placed after ComfyUI's attention backend node, the kernels run this model's "
             f"attention and {label} the calls they do not take")


def later_override(transformer_options: dict | None) -> tuple[str, bool] | None:
    """Where a node placed after ours set its own override in these options: (the console line about
    it, whether it certainly replaced ours); else None. ComfyUI's attention backend node always
    replaces it; another node's override may call ours or not, which cannot be told from outside."""
    if not transformer_options:
        return None
    current = transformer_options.get(OVERRIDE_KEY)
    if current is None or hasattr(current, OVERRIDE_MARK):
        return None
    chosen = comfy_backend_choice(current)
    if chosen is not None:
        return (f"RDNA Flash Attention: ComfyUI's attention backend node ({backend_label(chosen)}), placed after "
                "this node, decides this model's attention, so the kernels do not run it; place the RDNA Flash "
                "Attention node after it to run the kernels with that backend beneath them"), True
    name = getattr(current, "__qualname__", type(current).__name__)
    return (f"RDNA Flash Attention: a node placed after this one set its own attention override ({name}); this "
            "model's attention reaches the kernels only where that override calls the one it replaced: if it "
            "does not, place the RDNA Flash Attention node after it"), False


def model_call_options(args: tuple, kwargs: dict) -> dict | None:
    """The transformer_options of an APPLY_MODEL call: (x, t, c_concat, c_crossattn, control,
    transformer_options, **kwargs)."""
    if len(args) > 5:
        return args[5]
    return kwargs.get("transformer_options")


def routing_replaced(args: tuple, kwargs: dict) -> bool:
    """Whether a later node's override certainly replaced ours for this APPLY_MODEL call; a later
    override is named once in the console either way."""
    return options_replaced(model_call_options(args, kwargs))


def sampling_replaced(guider) -> bool:
    """routing_replaced for the sampling a CFGGuider runs (an OUTER_SAMPLE wrapper's executor's object)."""
    return options_replaced(getattr(guider, "model_options", {}).get("transformer_options"))


def options_replaced(transformer_options: dict | None) -> bool:
    found = later_override(transformer_options)
    if found is None:
        return False
    message, replaced = found
    log_once(message, logging.WARNING if replaced else logging.INFO)
    return replaced
