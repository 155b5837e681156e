"""The extension's settings: what each one changes, and their registration in the WebUI's Settings.

Each setting takes effect at once: the toggles are read on every attention call, and the others set
attributes of `rdna_flash_attn.settings`, which the dispatcher reads on every call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdna_flash_attn import settings

SECTION = ("rdna_flash_attn", "RDNA Flash Attention")
LOG_LEVEL_WHEN_ON = "INFO"  # the level at which the dispatcher logs each fallback reason once


class Toggles:
    """Which of the WebUI's attention calls the adapters route to the kernels (read per call)."""

    unet = True
    vae = True


toggles = Toggles()
# Defaults follow the environment (RDNA_FA_TRAINING, RDNA_FA_PRECISION, RDNA_FA_FP32_CAST, RDNA_FA_LOG_LEVEL)
# read at import.
_training_from_env = settings.training
_precision_from_env = settings.precision
_fp32_cast_from_env = settings.fp32_cast
# bfloat16 keeps float32's range: a VAE is kept in float32 (--no-half-vae) where float16 overflows into NaNs
FP32_CAST_WHEN_ON = "bf16"
_log_level_from_env = settings.log_level  # what "log fallbacks: off" returns to
_subscribers: list[Callable[[], None]] = []


def subscribe(callback: Callable[[], None]) -> None:
    """Call `callback()` after every settings change (adapters whose routing is not per call)."""
    if callback not in _subscribers:
        _subscribers.append(callback)


def _set_unet(on: bool) -> None:
    toggles.unet = on


def _set_vae(on: bool) -> None:
    toggles.vae = on


def _set_training(on: bool) -> None:
    settings.training = on


def _set_eight_bit(on: bool) -> None:
    settings.precision = "8bit-qkpv" if on else "exact"


def _set_fp32_cast(on: bool) -> None:
    # on: the environment's cast where it names one (fp16), else bfloat16; off: float32 calls fall back
    if on:
        settings.fp32_cast = _fp32_cast_from_env if _fp32_cast_from_env != "off" else FP32_CAST_WHEN_ON
    else:
        settings.fp32_cast = "off"


def _shows_info(level: str | None) -> bool:
    if level is None:
        return False
    number = int(level) if level.isdigit() else logging.getLevelName(level)
    return number <= logging.INFO


def _set_log_fallbacks(on: bool) -> None:
    # The dispatcher shows each reason once the "rdna_flash_attn" logger is enabled for INFO (reasons
    # seen while it was not included); settings.log_level sets that logger's level. A more verbose
    # level from the environment (DEBUG) stays.
    if on:
        settings.log_level = _log_level_from_env if _shows_info(_log_level_from_env) else LOG_LEVEL_WHEN_ON
    else:
        settings.log_level = _log_level_from_env


def _logs_fallbacks() -> bool:
    return _shows_info(settings.log_level)


@dataclass(frozen=True)
class Option:
    key: str
    label: str
    default: bool
    set: Callable[[bool], None]
    get: Callable[[], bool]


OPTIONS = (
    Option("rdna_fa_unet", "Use the kernels for UNet / diffusion model attention", True,
           _set_unet, lambda: toggles.unet),
    Option("rdna_fa_vae", "Use the kernels for VAE attention", True,
           _set_vae, lambda: toggles.vae),
    Option("rdna_fa_training", "Use the kernels for training (backward pass)", _training_from_env,
           _set_training, lambda: settings.training),
    Option("rdna_fa_8bit", "8-bit attention for generation on RDNA4 (RX 9060/9070): faster, approximate "
           "(int8 Q K^T, fp8 P V); RDNA3 and training stay exact", _precision_from_env == "8bit-qkpv",
           _set_eight_bit, lambda: settings.precision == "8bit-qkpv"),
    Option("rdna_fa_fp32_cast", "Run float32 attention on the kernels in bfloat16: a float32 VAE (--no-half-vae), "
           "--no-half, upcast attention",
           _fp32_cast_from_env != "off", _set_fp32_cast, lambda: settings.fp32_cast != "off"),
    Option("rdna_fa_log_fallbacks", "Log why attention calls fall back (once per reason)", False,
           _set_log_fallbacks, _logs_fallbacks),
)
BY_KEY = {option.key: option for option in OPTIONS}


def apply(key: str, value: Any) -> None:
    """Set one option by its key (what the WebUI's onchange and the settings page call)."""
    if not isinstance(value, bool):
        raise TypeError(f"{key}: expected a bool, got {value!r}")
    BY_KEY[key].set(value)
    for callback in _subscribers:
        callback()


def current(key: str) -> bool:
    return BY_KEY[key].get()


def sync_from(opts) -> None:
    """Apply every option's value as the WebUI's `shared.opts` holds it (the default if unset)."""
    for option in OPTIONS:
        value = getattr(opts, option.key, option.default)
        apply(option.key, value if isinstance(value, bool) else option.default)


def checkbox_component():
    """gr.Checkbox, the component of every setting; None without gradio (the WebUIs then make a
    checkbox for a bool default themselves)."""
    try:
        import gradio
    except ImportError:
        return None
    return gradio.Checkbox


def register(shared, status: str | None = None) -> None:
    """Add the options to the WebUI's Settings, in a section of their own (call from on_ui_settings);
    `status`, where given, is shown beside the first option."""
    component = checkbox_component()
    for index, option in enumerate(OPTIONS):
        info = shared.OptionInfo(
            option.default,
            option.label,
            component,
            onchange=functools.partial(_changed, shared, option.key),
            section=SECTION,
        )
        if index == 0 and status and hasattr(info, "info"):
            info = info.info(status)
        shared.opts.add_option(option.key, info)
    sync_from(shared.opts)


def _changed(shared, key: str) -> None:
    apply(key, getattr(shared.opts, key))
