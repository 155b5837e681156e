"""AUTOMATIC1111: an `SdOptimization` ("RDNA Flash Attention" in Settings > Optimizations) that
patches ldm's (and sgm's, where importable) `CrossAttention.forward` and `AttnBlock.forward`, and the
`attention` function SD3's MMDiT bound at import (A1111's own optimizations never touch SD3).

A1111 applies a different optimization without a word in two cases that leave a user believing the
kernels run: the setting names ours where the kernels cannot run (A1111 then takes its first
available one), and "Automatic" with a command-line flag such as --opt-sdp-attention (A1111 then
takes that flag's optimization). After each model load the console says which, once.

A1111 lists only optimizations whose `is_available()` is true, and undoes the current one before
applying another; `undo()` puts back exactly the functions `apply()` found. Textual inversion
training keeps the optimization when `training_xattention_optimizations` is on; its backward then
runs on the kernels while the "training" setting is on (the dispatcher's `settings.training`).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from . import availability, guard, ldm_attention, options
from .attention_functions import Rebinding, routed_attention_function
from .ldm_attention import HostHooks

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


# SD3's attention function; its MMDiT binds it at import (its text encoders call it in place, and keep it).
SD3_ATTENTION_MODULE = "modules.models.sd3.other_impls"


class ForwardPatch:
    """Replaces the target classes' `forward` and SD3's attention function, and restores exactly
    what it found."""

    def __init__(self, hooks: HostHooks):
        self.hooks = hooks
        self.installed: dict[type, tuple] = {}  # class -> (found forward, ours)
        self.sd3 = Rebinding(SD3_ATTENTION_MODULE, {
            "attention": functools.partial(routed_attention_function, fallback_name="A1111's SD3 attention")})

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
        try:
            self.sd3.apply()
        except ImportError:  # an A1111 before SD3 support
            pass

    def undo(self) -> None:
        for cls, (found, ours) in self.installed.items():
            # A1111 may already have put its originals back; anything else installed after us stays.
            if cls.__dict__.get("forward") is ours:
                cls.forward = found
        self.installed.clear()
        self.sd3.restore()


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


def choice_note(optimization) -> str | None:
    """Why A1111 applied another optimization than ours where the user would expect ours, or None."""
    from modules import sd_hijack, shared

    current = sd_hijack.current_optimizer
    if current is optimization:
        return None
    applied = f"'{current.name}'" if current is not None else "no optimization"
    selection = shared.opts.cross_attention_optimization
    if selection == optimization.title():
        return (f"{NAME} is selected in Settings > Optimizations but cannot run here "
                f"({optimization.unavailable_reason}); A1111 applied {applied} instead")
    flag = getattr(current, "cmd_opt", None)
    if selection == "Automatic" and optimization.unavailable_reason is None and flag and getattr(shared.cmd_opts, flag, False):
        return (f"the kernels are available, but A1111's 'Automatic' applied {applied} because of "
                f"--{flag.replace('_', '-')}: choose '{NAME}' in Settings > Optimizations > Cross attention "
                "optimization to use them")
    return None


def say_choice(optimization) -> None:
    """After a model load (A1111 has applied its optimization by then): the choice note, once each."""
    try:
        note = choice_note(optimization)
    except Exception as error:
        guard.report_failure("checking A1111's optimization choice", error)
        return
    if note is not None:
        availability.say_once(note, logging.WARNING)


def setup() -> None:
    from modules import script_callbacks, sd_hijack_optimizations, shared

    optimization = optimization_class(sd_hijack_optimizations.SdOptimization)()
    optimization.is_available()  # says why not in the console now, once; A1111 asks again when listing
    script_callbacks.on_list_optimizers(lambda found: found.append(optimization))
    script_callbacks.on_model_loaded(lambda sd_model: say_choice(optimization))
    script_callbacks.on_ui_settings(
        lambda: options.register(shared, availability.status_text(optimization.unavailable_reason))
    )
