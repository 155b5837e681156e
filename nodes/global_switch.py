"""RDNA_FA_COMFYUI_GLOBAL=1: route every diffusion model ComfyUI loads, without wiring a node.

Every ModelPatcher made for a diffusion model gets the same override the model node sets; clones
inherit it. `disable_global()` undoes it: the patchers made meanwhile keep the override object, but
it then passes every call straight to ComfyUI's backend. A model node on top replaces it.
"""

from __future__ import annotations

import functools
import logging
import os

from . import direct_calls, memory_estimate
from .core import core_or_reason
from .model_patch import comfy_has_override
from .overrides import OVERRIDE_KEY, OVERRIDE_MARK, PREVIOUS_ATTR, routing_replaced, sampling_replaced
from .routing import RoutingOptions, routed_backend

log = logging.getLogger("rdna_flash_attn")

GLOBAL_ENV = "RDNA_FA_COMFYUI_GLOBAL"
GLOBAL_WRAPPER_KEY = "rdna_flash_attn_global"  # a model node's own wrapper runs inside it, and wins

_state = {"enabled": False, "options": RoutingOptions(), "original_init": None}


def global_override(func, *args, **kwargs):
    if not _state["enabled"]:
        return func(*args, **kwargs)
    return routed_backend(func, _state["options"])(*args, **kwargs)


setattr(global_override, OVERRIDE_MARK, "global")
setattr(global_override, PREVIOUS_ATTR, None)


def global_apply_model(executor, *args, **kwargs):
    """The APPLY_MODEL wrapper that routes a model's option-less attention calls while enabled."""
    if not _state["enabled"] or routing_replaced(args, kwargs):
        return executor(*args, **kwargs)
    with direct_calls.running(_state["options"]):
        return executor(*args, **kwargs)


def global_sampling(executor, *args, **kwargs):
    """The OUTER_SAMPLE wrapper that routes option-less calls of a model's sampling while enabled."""
    if not _state["enabled"] or sampling_replaced(executor.class_obj):
        return executor(*args, **kwargs)
    with direct_calls.running(_state["options"]):
        return executor(*args, **kwargs)


def global_prepare_sampling(executor, *args, **kwargs):
    """The PREPARE_SAMPLING wrapper: ComfyUI's memory reservation as for memory-efficient attention while enabled."""
    if not _state["enabled"]:
        return executor(*args, **kwargs)
    return memory_estimate.prepare_sampling_wrapper(executor, *args, **kwargs)


def global_enabled() -> bool:
    return _state["enabled"]


def enable_global(options: RoutingOptions | None = None) -> bool:
    """Route every diffusion model loaded from now on; False (and a log line) where this ComfyUI
    has no optimized_attention_override."""
    if not comfy_has_override():
        log.warning("%s=1 ignored: this ComfyUI has no optimized_attention_override; use the node", GLOBAL_ENV)
        return False
    from comfy.model_patcher import ModelPatcher

    _state["options"] = options or RoutingOptions()
    _state["enabled"] = True
    if _state["original_init"] is None:
        original_init = ModelPatcher.__init__

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            if _state["enabled"] and hasattr(self.model, "diffusion_model"):
                transformer_options = self.model_options.setdefault("transformer_options", {})
                transformer_options.setdefault(OVERRIDE_KEY, global_override)
                direct_calls.add_to(self, global_apply_model, global_sampling, GLOBAL_WRAPPER_KEY)
                memory_estimate.add_to(self, global_prepare_sampling, GLOBAL_WRAPPER_KEY)

        _state["original_init"] = original_init
        ModelPatcher.__init__ = init
    log.info("RDNA Flash Attention: routing every diffusion model's attention (%s=1)", GLOBAL_ENV)
    return True


def disable_global() -> None:
    """Undo enable_global()."""
    _state["enabled"] = False
    if _state["original_init"] is not None:
        from comfy.model_patcher import ModelPatcher

        ModelPatcher.__init__ = _state["original_init"]
        _state["original_init"] = None


def enable_from_environment() -> bool:
    core = core_or_reason()
    if isinstance(core, str):  # a broken install, already reported: the nodes pass models through
        return False
    try:
        return core.environment.read_bool(os.environ, GLOBAL_ENV) and enable_global()
    except Exception:  # never into ComfyUI's start
        log.exception("%s=1 could not be applied", GLOBAL_ENV)
        return False
