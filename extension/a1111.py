"""AUTOMATIC1111: an `SdOptimization` ("RDNA Flash Attention" in Settings > Optimizations) that
patches ldm's (and sgm's, where importable) `CrossAttention.forward` and `AttnBlock.forward`.

A1111 lists only optimizations whose `is_available()` is true, and undoes the current one before
applying another; `undo()` puts back exactly the functions `apply()` found. Textual inversion
training keeps the optimization when `training_xattention_optimizations` is on; its backward then
runs on the kernels while the "training" setting is on (the dispatcher's `settings.training`).
"""

from __future__ import annotations

import importlib
import logging

import torch

from . import availability, ldm_attention, options
from .ldm_attention import HostHooks

log = logging.getLogger("rdna_flash_attn")

NAME = "RDNA Flash Attention"
PRIORITY = 120  # above xformers (100): "Automatic" picks it wherever it is available

# (module, class, maker of the replacement forward); sgm's twins are patched where sgm exists.
TARGETS = (
    ("ldm.modules.attention", "CrossAttention", ldm_attention.cross_attention_forward),
    ("ldm.modules.diffusionmodules.model", "AttnBlock", ldm_attention.attn_block_forward),
    ("sgm.modules.attention", "CrossAttention", ldm_attention.cross_attention_forward),
    ("sgm.modules.diffusionmodules.model", "AttnBlock", ldm_attention.attn_block_forward),
)


def _target_classes():
    for module_name, class_name, maker in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            yield cls, maker


class ForwardPatch:
    """Replaces the target classes' `forward` and restores exactly what it found."""

    def __init__(self, hooks: HostHooks):
        self.hooks = hooks
        self.installed: dict[type, tuple] = {}  # class -> (found forward, ours)

    @property
    def applied(self) -> bool:
        return bool(self.installed)

    def apply(self) -> None:
        self.undo()
        for cls, maker in list(_target_classes()):  # import every target before patching any
            found = cls.forward
            ours = maker(cls, found, self.hooks)
            cls.forward = ours
            self.installed[cls] = (found, ours)

    def undo(self) -> None:
        for cls, (found, ours) in self.installed.items():
            # A1111 may already have put its originals back; anything else installed after us stays.
            if cls.__dict__.get("forward") is ours:
                cls.forward = found
        self.installed.clear()


def a1111_unoptimized(forward) -> bool:
    """Whether `forward` is one A1111 installs when it undoes an optimization (before applying any):
    its hypernetwork-aware einsum CrossAttention forward (on ldm's and sgm's class), and ldm's own
    AttnBlock forward (on sgm's AttnBlock too)."""
    from modules.hypernetworks import hypernetwork

    return forward is getattr(hypernetwork, "attention_CrossAttention_forward", None) or ldm_attention.defined_as(
        forward, "ldm.modules.diffusionmodules.model", "AttnBlock.forward"
    )


def a1111_hooks() -> HostHooks:
    """Hypernetworks and upcast_attn, looked up per call as A1111's own optimizations do."""
    from modules import shared
    from modules.hypernetworks import hypernetwork

    return HostHooks(
        apply_hypernetworks=lambda context: hypernetwork.apply_hypernetworks(shared.loaded_hypernetworks, context),
        upcast_attn=lambda: bool(shared.opts.upcast_attn),
        is_unoptimized=a1111_unoptimized,
    )


def webui_device() -> torch.device:
    from modules import devices

    return getattr(devices, "device", None) or torch.device("cpu")


def optimization_class(base: type) -> type:
    """The SdOptimization subclass, built on A1111's own base class."""

    class RdnaFlashAttention(base):
        name = NAME
        label = None
        cmd_opt = None
        priority = PRIORITY

        def __init__(self):
            super().__init__()
            self.unavailable_reason: str | None = None
            self.patch: ForwardPatch | None = None

        def is_available(self) -> bool:
            device = webui_device()
            self.unavailable_reason = availability.reason(device)
            availability.explain_once("A1111", device, self.unavailable_reason)
            return self.unavailable_reason is None

        def apply(self) -> None:
            if self.patch is None:
                self.patch = ForwardPatch(a1111_hooks())
            self.patch.apply()

        def undo(self) -> None:
            if self.patch is not None:
                self.patch.undo()

    return RdnaFlashAttention


def setup() -> None:
    from modules import script_callbacks, sd_hijack_optimizations, shared

    optimization = optimization_class(sd_hijack_optimizations.SdOptimization)()
    optimization.is_available()  # says why not in the console now, once; A1111 asks again when listing
    script_callbacks.on_list_optimizers(lambda found: found.append(optimization))
    script_callbacks.on_ui_settings(
        lambda: options.register(shared, availability.status_text(optimization.unavailable_reason))
    )
