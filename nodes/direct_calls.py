"""Attention calls a routed model makes without passing its options, routed all the same.

ComfyUI consults a model's `optimized_attention_override` only when the call passes the model's
`transformer_options`. Many model files call the attention function they imported without them
(PixArt, HunyuanDiT, Hunyuan3D 2.1, Wan-Animate's face blocks, some of SD3's blocks ...), or look it up
in ComfyUI's attention module at call time (SeedVR2's DiT, and MiniMax Music's through
`optimized_attention_for_device`), or pass a block's own default options, an empty dict (WanDancer's audio
injector), so the per-model override never sees those calls. Here every
`optimized_attention` / `optimized_attention_masked` name a `comfy.ldm` module bound, the attention
module's own included, is replaced by a router that runs the bound function unchanged, unless a routed
model is running at that moment (an APPLY_MODEL wrapper on the routed clone says so through a context
variable) and the call's options hold no override: then it takes the same route as the override's calls.
An OUTER_SAMPLE wrapper does the same for the routed model's whole sampling, where ComfyUI prepares its
conditioning with model code of its own once per sampling (LTX-2's text connectors, MiniMax H3's token
refiner), outside any model call.
ComfyUI's own SDPA wrapper, `comfy.ops.scaled_dot_product_attention`, gets a router for its causal
calls (HiDream-O1's autoregressive pass), which no attention function sees. Text encoders and VAEs,
which run outside the sampling, keep their attention.
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar

import torch

from .overrides import OVERRIDE_KEY, routing_replaced, sampling_replaced
from .routing import RoutingOptions, context_value, routed_backend, routing_failed, sdpa_call_attention

WRAPPER_KEY = "rdna_flash_attn"
ATTENTION_NAMES = ("optimized_attention", "optimized_attention_masked")
MODEL_PACKAGE = "comfy.ldm."
ATTENTION_MODULE = "comfy.ldm.modules.attention"  # defines the functions
OPS_MODULE = "comfy.ops"
SDPA_NAME = "scaled_dot_product_attention"

_running: ContextVar[RoutingOptions | None] = ContextVar("rdna_flash_attn_model", default=None)


class UnscopedCallRouter:
    """Stands in for one module's bound attention function."""

    def __init__(self, original):
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        options = _running.get()
        if options is None or reaches_an_override(kwargs):  # not in a routed model, or the override sees it
            return self.original(*args, **kwargs)
        return routed_backend(self.original, options)(*opened_containers(args), **kwargs)


def reaches_an_override(kwargs: dict) -> bool:
    """Whether ComfyUI's attention wrapper hands this call to an override: only where its transformer_options
    hold one."""
    return OVERRIDE_KEY in (kwargs.get("transformer_options") or {})


def opened_containers(args: tuple) -> tuple:
    """`args` with ComfyUI's single-use q/k/v tensor containers (MiniMax H3's token refiner passes them) taken, as
    ComfyUI's attention wrapper takes them before an override sees the call."""
    container = getattr(sys.modules.get(ATTENTION_MODULE), "AttentionTensorContainer", None)
    if container is None or len(args) < 3 or not all(isinstance(arg, container) for arg in args[:3]):
        return args
    return (*(arg.take() for arg in args[:3]), *args[3:])


class CausalSdpaRouter:
    """Stands in for comfy.ops.scaled_dot_product_attention: its causal calls within a routed model run
    on the kernels (its other calls are ComfyUI's PyTorch backend running calls already decided)."""

    def __init__(self, original):
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, q, k, v, *args, **kwargs):
        options = _running.get()
        is_causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
        if options is None or is_causal is not True:
            return self.original(q, k, v, *args, **kwargs)
        try:
            out = sdpa_call_attention(q, k, v, args, kwargs, options)
        except Exception as error:  # noqa: BLE001  (a fault of ours must cost the speed-up, never the sampling)
            routing_failed(error)
            out = None
        return out if isinstance(out, torch.Tensor) else self.original(q, k, v, *args, **kwargs)


def install_routers() -> None:
    """Put a router in place of every attention function bound in a loaded `comfy.ldm` module (once
    each; modules imported later get theirs at the next model the node routes)."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(MODEL_PACKAGE):
            continue
        for attribute in ATTENTION_NAMES:
            function = getattr(module, "__dict__", {}).get(attribute)
            if (callable(function) and not isinstance(function, UnscopedCallRouter)
                    and getattr(function, "__module__", "") == ATTENTION_MODULE):
                setattr(module, attribute, UnscopedCallRouter(function))
    ops = sys.modules.get(OPS_MODULE)
    sdpa = getattr(ops, "__dict__", {}).get(SDPA_NAME)
    if callable(sdpa) and not isinstance(sdpa, CausalSdpaRouter):
        setattr(ops, SDPA_NAME, CausalSdpaRouter(sdpa))


def running(options: RoutingOptions):
    """Within the block, option-less attention calls take the route `options` say."""
    return context_value(_running, options)


def apply_model_wrapper(options: RoutingOptions):
    """An APPLY_MODEL wrapper: the routed model's whole call runs with `options` in effect, unless a node
    placed after ours replaced its override (then that node decides, the option-less calls included)."""

    def wrapper(executor, *args, **kwargs):
        if routing_replaced(args, kwargs):
            return executor(*args, **kwargs)
        with running(options):
            return executor(*args, **kwargs)

    return wrapper


def sampling_wrapper(options: RoutingOptions):
    """An OUTER_SAMPLE wrapper: the routed model's sampling, its conditioning's preparation included, runs with
    `options` in effect, unless a node placed after ours replaced its override."""

    def wrapper(executor, *args, **kwargs):
        if sampling_replaced(executor.class_obj):
            return executor(*args, **kwargs)
        with running(options):
            return executor(*args, **kwargs)

    return wrapper


def comfy_has_wrappers() -> bool:
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        return False
    return hasattr(WrappersMP, "APPLY_MODEL")


def add_to(model, model_call, sampling, key: str = WRAPPER_KEY) -> bool:
    """Put the APPLY_MODEL wrapper `model_call` (apply_model_wrapper's) and the OUTER_SAMPLE wrapper `sampling`
    (sampling_wrapper's) on ModelPatcher `model` under `key`, in place of those there before, and the routers in
    place; False where this ComfyUI has no wrappers."""
    if not comfy_has_wrappers() or not hasattr(model, "add_wrapper_with_key"):
        return False
    from comfy.patcher_extension import WrappersMP

    install_routers()
    for wrapper_type, wrapper in ((WrappersMP.APPLY_MODEL, model_call), (WrappersMP.OUTER_SAMPLE, sampling)):
        model.remove_wrappers_with_key(wrapper_type, key)
        model.add_wrapper_with_key(wrapper_type, key, wrapper)
    return True


def remove_from(model, key: str = WRAPPER_KEY) -> None:
    if comfy_has_wrappers() and hasattr(model, "remove_wrappers_with_key"):
        from comfy.patcher_extension import WrappersMP

        model.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, key)
        model.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, key)
