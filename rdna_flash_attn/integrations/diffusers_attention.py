"""diffusers attention processor that runs attention through the dispatcher, plus helpers that
install it on any diffusers model with attention processors (UNets, the VAE, the transformers of SD3,
Flux, Wan...) and put the model back as it was.

    from rdna_flash_attn import install_attention_processor, restore_attention_processors
    install_attention_processor(model)     # its attention now runs on the kernels where supported
    ...
    restore_attention_processors(model)    # the exact processor objects found at install time, no hooks

Layers whose processor is diffusers' plain `AttnProcessor2_0` or `AttnProcessor` get ours. Every other
layer (the transformers' own processors such as FluxAttnProcessor and JointAttnProcessor2_0, IP-Adapter,
custom LoRA, added-KV, fused projections) keeps its processor, which computes things ours does not;
while such a layer runs, `torch.nn.functional.scaled_dot_product_attention` is routed through the
dispatcher (a `patch_sdpa()` scope opened and closed by hooks on the layer), so the SDPA calls of
diffusers' "native" attention backend reach the kernels. Other diffusers backends (flash, sage,
xformers...) call their own libraries, which nothing here reaches; diffusers' backend names are a
closed enum, so no backend of ours is offered.

diffusers itself is never imported here: models are handled through the methods they carry.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..config import LOGGER_NAME
from ..dispatch import router
from ..dispatch.sdpa_patch import patch_sdpa

log = logging.getLogger(LOGGER_NAME)

REPLACEABLE_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")
_SAVED_ATTRIBUTE = "_rdna_flash_attn_previous_processors"
_HOOKS_ATTRIBUTE = "_rdna_flash_attn_routing_hooks"


class RdnaFlashAttnProcessor:
    """Processor for diffusers' `Attention` layers: the steps of diffusers' AttnProcessor2_0 (spatial
    and group norm, 4-D (B, C, H, W) inputs, cross-attention norm, q/k norms, output projection,
    residual, output rescale), with the attention itself from `rdna_flash_attn.scaled_dot_product_attention`.
    Calls the kernels cannot take (an attention mask, float32 outside autocast...) run on PyTorch SDPA
    with the same arguments, counted in `rdna_flash_attn.stats()`.

    The layer's own `attn.scale` is passed on: diffusers' SDPA processor leaves it at SDPA's default,
    which equals `attn.scale` for every layer that processor is installed on by default."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        spatial_shape = None
        if hidden_states.ndim == 4:  # VAE blocks hand over feature maps (B, C, H, W)
            spatial_shape = hidden_states.shape
            batch, channels, height, width = spatial_shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, context_length, _ = context.shape

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, context_length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        head_dim = key.shape[-1] // attn.heads
        # (B, S, H*D) -> (B, H, S, D) views: unit stride in D, which the kernels take without a copy.
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = router.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=attn.scale
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)  # projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if spatial_shape is not None:
            hidden_states = hidden_states.transpose(-1, -2).reshape(spatial_shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _processors(model: Any) -> dict[str, Any]:
    if not hasattr(model, "attn_processors") or not hasattr(model, "set_attn_processor"):
        raise TypeError(
            f"{type(model).__name__} has no attn_processors/set_attn_processor: not a diffusers model with "
            "attention processors (for other models use rdna_flash_attn.patch_sdpa())"
        )
    return dict(model.attn_processors)


def _processors_on_layers_only(model: Any) -> bool:
    """A diffusers model (it takes an attention backend) whose attention layers carry processors that
    no attn_processors registry lists."""
    return hasattr(model, "set_attention_backend") and not hasattr(model, "attn_processors")


def _unregistered_processors(model: Any) -> dict[str, Any]:
    """The processor of each attention layer (each submodule carrying one), named as attn_processors would."""
    return {f"{name}.processor": module.processor for name, module in model.named_modules()
            if name and hasattr(module, "processor")}


def _replaceable(processor: Any) -> bool:
    return type(processor).__name__ in REPLACEABLE_PROCESSORS or isinstance(processor, RdnaFlashAttnProcessor)


# Per thread: id of a layer -> the patch_sdpa() scopes its hooks opened. Module-level functions and
# state, so that a model with hooks still deep-copies and pickles (the hooks travel by reference).
_open_scopes = threading.local()


def _scopes_by_layer() -> dict[int, list[contextlib.ExitStack]]:
    if not hasattr(_open_scopes, "by_layer"):
        _open_scopes.by_layer = {}
    return _open_scopes.by_layer


def _enter_routed_scope(layer: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: torch's SDPA is the dispatcher until the layer's forward ends."""
    scope = contextlib.ExitStack()
    scope.enter_context(patch_sdpa())
    _scopes_by_layer().setdefault(id(layer), []).append(scope)


def _leave_routed_scope(layer: torch.nn.Module, args: Any, output: Any) -> None:
    """Always-called forward hook, so a layer that raises leaves the patch as it found it; a close
    without its open (an earlier pre-hook raised) finds no scope and does nothing."""
    scopes = _scopes_by_layer().get(id(layer))
    if scopes:
        scopes.pop().close()
        if not scopes:
            del _scopes_by_layer()[id(layer)]


def _route_while_running(layer: torch.nn.Module) -> list[Any]:
    return [layer.register_forward_pre_hook(_enter_routed_scope),
            layer.register_forward_hook(_leave_routed_scope, always_call=True)]


def _remove_routing_hooks(model: Any) -> None:
    for handle in getattr(model, _HOOKS_ATTRIBUTE, ()):
        handle.remove()
    if hasattr(model, _HOOKS_ATTRIBUTE):
        delattr(model, _HOOKS_ATTRIBUTE)


def install_attention_processor(model: Any, processor: RdnaFlashAttnProcessor | None = None) -> dict[str, Any]:
    """Put `processor` (default: a new RdnaFlashAttnProcessor) on every layer of `model` that runs
    diffusers' plain SDPA processor; other layers keep theirs, with torch's SDPA routed through the
    dispatcher while they run. A diffusers model that keeps no registry of its processors (Lumina 2,
    HiDream, Z-Image and Cosmos in diffusers 0.42) keeps every one, each layer routed while it runs
    (`processor` is not used there). Returns the processors found before (layer name -> object), which
    the model also keeps for restore_attention_processors(); installing again keeps the first install's
    originals."""
    on_layers = _processors_on_layers_only(model)
    previous = _unregistered_processors(model) if on_layers else _processors(model)
    if not on_layers and not getattr(sys.modules.get("diffusers.utils"), "USE_PEFT_BACKEND", True):
        # Without the PEFT backend, diffusers' processors pass a LoRA `scale` to the projections;
        # ours would drop it, so every layer keeps diffusers' processor.
        log.warning("%s: diffusers runs without its PEFT backend (old diffusers or peft); "
                    "its attention processors are kept", type(model).__name__)
        return previous
    if not on_layers:
        processor = processor or RdnaFlashAttnProcessor()
        model.set_attn_processor({name: processor if _replaceable(current) else current
                                  for name, current in previous.items()})
    kept = sorted(name for name, current in previous.items() if on_layers or not _replaceable(current))
    _remove_routing_hooks(model)
    hooks = [hook for name in kept for hook in _route_while_running(model.get_submodule(name.removesuffix(".processor")))]
    if kept:
        setattr(model, _HOOKS_ATTRIBUTE, hooks)
        log.info(
            "%s: %d attention layers keep their own processors (%s), with torch's SDPA routed to the kernels "
            "while they run", type(model).__name__, len(kept), ", ".join(sorted({type(previous[n]).__name__ for n in kept})),
        )
    if getattr(model, _SAVED_ATTRIBUTE, None) is None:
        setattr(model, _SAVED_ATTRIBUTE, previous)  # a plain attribute: not a submodule, not in state_dict
    return previous


def restore_attention_processors(model: Any, previous: Mapping[str, Any] | None = None) -> None:
    """Put back `previous` (a mapping from install_attention_processor), or the processors the model
    had before its first install; the exact objects, layer by layer, and no routing hooks."""
    saved = getattr(model, _SAVED_ATTRIBUTE, None)
    previous = saved if previous is None else previous
    if previous is None:
        raise ValueError(f"{type(model).__name__}: no processors saved by install_attention_processor() to restore")
    if _processors_on_layers_only(model):
        for name, processor in previous.items():
            model.get_submodule(name.removesuffix(".processor")).processor = processor
    else:
        model.set_attn_processor(dict(previous))  # set_attn_processor pops from the dict it is given
    _remove_routing_hooks(model)
    if saved is not None:
        delattr(model, _SAVED_ATTRIBUTE)


def attention_processor_installed(model: Any) -> bool:
    """Whether any attention layer of `model` runs RdnaFlashAttnProcessor or is routed by its hooks."""
    if getattr(model, _HOOKS_ATTRIBUTE, None):
        return True
    return not _processors_on_layers_only(model) and any(isinstance(p, RdnaFlashAttnProcessor)
                                                         for p in _processors(model).values())
