"""Settings: each is an environment variable read once at import and a plain attribute of `settings`;
and the package's logger, whose every line names the project and starts on a line of its own.

The dispatcher reads the attributes on every call, so changing one from Python takes effect at once;
the environment is never read again on the hot path.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .environment import LOGGER_NAME, parse_bool, read

PROJECT_NAME = "RDNA Flash Attention"  # what the console lines of every host say first
FP32_CAST_CHOICES = ("off", "bf16", "fp16")
PRECISION_CHOICES = ("exact", "8bit-qkpv")

log = logging.getLogger(LOGGER_NAME)


def _clear_progress_bars() -> None:
    """Clear the tqdm progress bars being drawn on the console (a host's sampling loop); each redraws
    itself at its next update, below whatever was written meanwhile."""
    tqdm_std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(tqdm_std, "tqdm", None), "_instances", ())):
        if getattr(bar, "fp", None) in (sys.stdout, sys.stderr) and not getattr(bar, "disable", True):
            bar.clear()


class _ConsoleLines(logging.Filter):
    """Every line of the package's logger names the project, and is not glued to a progress bar: hosts
    print our records with their own handlers, in the middle of their sampling loops."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(PROJECT_NAME):
            record.msg, record.args = f"{PROJECT_NAME}: {message}", ()
        try:
            _clear_progress_bars()
        except Exception:  # noqa: BLE001  (a progress bar must never cost a log line)
            pass
        return True


# By name: a second copy of the package in the process (a host's plugin loader) shares the logger.
if not any(type(f).__name__ == _ConsoleLines.__name__ for f in log.filters):
    log.addFilter(_ConsoleLines())


def _option(env: str, default: Any, doc: str) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc})


def _check_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a bool, got {value!r}")
    return value


def _check_fp32_cast(value: Any) -> str:
    choice = value.strip().lower() if isinstance(value, str) else value
    if choice not in FP32_CAST_CHOICES:
        raise ValueError(f"expected one of {', '.join(FP32_CAST_CHOICES)}, got {value!r}")
    return choice


def check_precision(value: Any) -> str:
    """A precision choice (PRECISION_CHOICES, case and spaces ignored), or ValueError naming why not."""
    choice = value.strip().lower() if isinstance(value, str) else value
    if choice == "8bit-qk":
        raise ValueError("8-bit QK alone is not offered: its int8 scores missed their accuracy bar "
                         "(bench/results/quantized_attention_accuracy.md); 8bit-qkpv is")
    if choice not in PRECISION_CHOICES:
        raise ValueError(f"expected one of {', '.join(PRECISION_CHOICES)}, got {value!r}")
    return choice


def _check_log_level(value: Any) -> str | None:
    if value is None:
        return None
    level = str(value).strip().upper()
    if not level.isdigit() and not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"expected a logging level such as INFO or DEBUG, got {value!r}")
    return level


def _check_optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass
class Settings:
    """Runtime switches of rdna_flash_attn; `Settings.options()` lists them with their variables."""

    disable: bool = _option(
        "RDNA_FA_DISABLE", False, "1: never launch the kernels; every call goes to PyTorch SDPA."
    )
    force: bool = _option(
        "RDNA_FA_FORCE",
        False,
        "1: use the kernels where policy would not (NVIDIA emulation builds, other GPU targets); "
        "the self-test still applies.",
    )
    training: bool = _option(
        "RDNA_FA_TRAINING",
        True,
        "0: calls that need gradients fall back to SDPA instead of running backward on the kernels.",
    )
    fp32_cast: str = _option(
        "RDNA_FA_FP32_CAST",
        "off",
        "off | bf16 | fp16: float32 inputs fall back to SDPA (off), or run on the kernels in that "
        "precision and come back as float32.",
    )
    precision: str = _option(
        "RDNA_FA_PRECISION",
        "exact",
        "exact | 8bit-qkpv: 8bit-qkpv runs inference calls (no gradients, mask or causal) on RDNA4 (gfx12) in "
        "approximate 8-bit attention (int8 Q K^T, fp8 P V); RDNA3 has no faster 8-bit rate and stays exact.",
    )
    aten_ops: bool = _option(
        "RDNA_FA_ATEN_OPS",
        False,
        "1: the kernels also serve torch's aten::_scaled_dot_product_flash_attention and its backward on RDNA "
        "GPUs (torch's context parallelism and xDiT's default backend call them directly); PyTorch 2.9 or newer.",
    )
    log_level: str | None = _option(
        "RDNA_FA_LOG_LEVEL",
        None,
        "Level of the 'rdna_flash_attn' logger (DEBUG, INFO, WARNING...); fallback reasons are INFO.",
    )
    cache_dir: str | None = _option(
        "RDNA_FA_CACHE_DIR",
        None,
        "Folder of the cached self-test verdicts and local kernel builds (default: the user cache folder, "
        "subfolder rdna_flash_attn).",
    )

    def __setattr__(self, name: str, value: Any) -> None:
        # Validate on every assignment so a typo fails where it is made, not inside an attention call.
        check = _CHECKS.get(name)
        if check is None:
            raise AttributeError(f"no setting {name!r}; the settings are {', '.join(_CHECKS)}", name=name, obj=self)
        value = check(value)
        super().__setattr__(name, value)
        if name == "log_level" and self is globals().get("settings"):  # only the live object owns the logger
            _apply_log_level(value)

    @classmethod
    def options(cls) -> list[tuple[str, str, Any, str]]:
        """(attribute, environment variable, default, description) for every setting."""
        return [(f.name, f.metadata["env"], f.default, f.metadata["doc"]) for f in fields(cls)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from environment variables; a malformed value is logged and left at its default."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            parse = parse_bool if f.type == "bool" else _CHECKS[f.name]
            values[f.name] = read(environ, f.metadata["env"], parse, f.default)
        return cls(**values)

    def load(self, other: "Settings") -> None:
        """Copy every value of `other` into this object (keeps the one shared `settings` instance)."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))


_CHECKS = {
    "disable": _check_bool,
    "force": _check_bool,
    "training": _check_bool,
    "fp32_cast": _check_fp32_cast,
    "precision": check_precision,
    "aten_ops": _check_bool,
    "log_level": _check_log_level,
    "cache_dir": _check_optional_str,
}

_stderr_handler: logging.Handler | None = None


def _apply_log_level(level: str | None) -> None:
    """Set our logger's level; with no logging set up by the host, also print our records to stderr,
    since otherwise Python shows only warnings and RDNA_FA_LOG_LEVEL=INFO would show nothing."""
    global _stderr_handler
    if level is None:
        log.setLevel(logging.NOTSET)
        if _stderr_handler is not None:
            log.removeHandler(_stderr_handler)
            _stderr_handler = None
        return
    log.setLevel(int(level) if level.isdigit() else level)
    if _stderr_handler is None and not logging.getLogger().handlers:
        _stderr_handler = logging.StreamHandler()
        _stderr_handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        log.addHandler(_stderr_handler)


settings = Settings.from_env()
_apply_log_level(settings.log_level)
