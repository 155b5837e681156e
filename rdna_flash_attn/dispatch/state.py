"""What the dispatch layer learns while the process runs, held by one object, `state`, the layer's only
mutable module-level name: per device its description, loaded code object and verdicts (policy, the
self-tests, kernels turned off), the plans decided per call signature, the counters stats() reports,
the reasons already logged, the precision a block asked for, and the SDPA patch's own state.

Devices do not change during a process: what is learnt of one is kept until forget_devices() (after a
new self-test, when the runtime drops its loaded code objects, or in tests). Whatever changes a
verdict also drops the plans decided on it and bumps `state.generation`, which graphs compiled on the
old verdicts read, so that dynamo's guard on it makes them decide again.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from ..config import settings
from ..ops import attention, quantized
from ..runtime import device as devices, loader
from ..runtime.loader import KernelLibrary, KernelUnavailable
from . import selftest

RDNA_TARGET_PREFIXES = ("gfx11", "gfx12")
MAX_CACHED_SIGNATURES = 4096  # far above any model's count of attention shapes; a bound against leaks
# torch's own SDPA, not whatever `torch.nn.functional.scaled_dot_product_attention` names now: once
# patch_sdpa() points that name at us, falling back through it would recurse.
torch_sdpa = torch._C._nn.scaled_dot_product_attention


class DeviceVerdict(NamedTuple):
    """A device described once, and what follows for the kernels there under one settings.force."""

    info: devices.DeviceInfo
    library: KernelLibrary | None  # its loaded code object; None when refused
    refusal: str | None  # why the kernels cannot run there (policy, then the code object), or None


@dataclass
class DeviceState:
    """One device as the dispatcher knows it."""

    verdicts: dict[bool, DeviceVerdict] = field(default_factory=dict)  # per settings.force
    self_tests: dict[str, str | None] = field(default_factory=dict)  # "exact", "8-bit" -> why not (None: passed)
    failed_kernels: dict[str, str] = field(default_factory=dict)  # kernel symbol -> why it is off


@dataclass
class SdpaPatch:
    """patch_sdpa()'s state: it is on while anyone wants it (sdpa_patch.py)."""

    replaced: Callable | None = None  # the exact object the patch replaced, until it is switched off
    enabled_explicitly: bool = False
    open_scopes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class DispatchState:
    """Everything the dispatch layer remembers; `state` is the one instance."""

    def __init__(self):
        self.devices: dict[torch.device, DeviceState] = {}
        self.plans: dict[tuple, object] = {}  # call signature -> planner.AttentionPlan or plans.Refusal
        self.generation = 0
        self.kernel_calls = 0
        self.eight_bit_calls = 0
        self.fallbacks: Counter[str] = Counter()
        self.exact_reasons: Counter[str] = Counter()  # calls asked to run in 8 bits that ran exact
        self.logged: set[tuple[str, str]] = set()  # (what was not used, why) shown in the log
        self.traced_reasons: set[str] = set()  # fallback reasons of calls in compiled graphs, logged
        # The precision a `precision()` block asked for, in this thread or task; None: settings.precision.
        self.precision: ContextVar[str | None] = ContextVar("rdna_flash_attn_precision", default=None)
        self.fallback_sdpa: Callable = torch_sdpa  # where unsupported calls go (router.use_fallback)
        self.patch = SdpaPatch()

    def device(self, device: torch.device) -> DeviceState:
        known = self.devices.get(device)
        if known is None:
            known = self.devices[device] = DeviceState()
        return known

    def remember(self, signature: tuple, plan, generation: int) -> None:
        """Keeps the plan decided for `signature`, unless verdicts changed since `generation` (it is then
        decided again at the next call)."""
        if generation == self.generation:
            if len(self.plans) >= MAX_CACHED_SIGNATURES:
                self.plans.clear()
            self.plans[signature] = plan

    def verdicts_changed(self) -> None:
        """Drops the plans decided so far, for graphs compiled on them too."""
        self.plans.clear()
        self.generation += 1


state = DispatchState()


def policy_refusal(info: devices.DeviceInfo) -> str | None:
    """Why policy keeps the kernels off a device, or None; settings.force overrides it."""
    if info.backend in ("rocm", "zluda"):
        if info.gfx_target and info.gfx_target.startswith(RDNA_TARGET_PREFIXES):
            return None
        return f"{info.name}: GPU target {info.gfx_target or 'unknown'} is not RDNA3/RDNA4"
    if info.backend == "cuda":
        return f"{info.name}: NVIDIA GPUs get only a test emulation of the kernels (RDNA_FA_FORCE=1 uses it)"
    if info.backend == "cpu":
        return "CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"
    return f"{info.name} ({info.backend}): the kernels run on AMD RDNA3/RDNA4 GPUs only"


def _judge_device(device: torch.device, force: bool) -> DeviceVerdict:
    info = devices.describe(device)
    refusal = None if force else policy_refusal(info)
    if refusal:
        return DeviceVerdict(info, None, refusal)
    try:
        return DeviceVerdict(info, loader.loaded_library(info), None)
    except KernelUnavailable as error:
        return DeviceVerdict(info, None, str(error))


def device_verdict(device: torch.device) -> DeviceVerdict:
    """The device's description, library and refusal under the current settings.force. Cached."""
    verdicts = state.device(device).verdicts
    verdict = verdicts.get(settings.force)
    if verdict is None:
        verdict = verdicts[settings.force] = _judge_device(device, settings.force)
    return verdict


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (policy, then its code object), or None. Cached."""
    return device_verdict(device).refusal


def selftest_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` or failed its self-test, or None. Runs the self-test
    at the first ask, which the dispatcher makes on the first call that would otherwise reach the
    kernels. Cached."""
    self_tests = state.device(device).self_tests
    if "exact" not in self_tests:
        verdict = device_verdict(device)
        self_tests["exact"] = verdict.refusal or selftest.verdict(device, verdict.library)
    return self_tests["exact"]


def eight_bit_refusal(device: torch.device) -> str | None:
    """Why 8-bit attention cannot run on `device` (the kernels off there, a target without it, a failed
    8-bit self-test or 8-bit kernel), or None. Runs its self-test at the first ask. Cached."""
    self_tests = state.device(device).self_tests
    if "8-bit" not in self_tests:
        verdict = device_verdict(device)
        refusal = (selftest_refusal(device) or quantized.target_refusal(verdict.library.artifact.target)
                   or selftest.eight_bit_verdict(device, verdict.library))
        self_tests.setdefault("8-bit", refusal)  # an 8-bit failure recorded meanwhile stands
    return self_tests["8-bit"]


def failed_kernel(device: torch.device, kernels: tuple[str, ...]) -> str | None:
    """Why a call launching `kernels` cannot run on `device` (one of them failed there), or None."""
    known = state.devices.get(device)
    if known is not None and known.failed_kernels:
        for symbol in kernels:
            if symbol in known.failed_kernels:
                return known.failed_kernels[symbol]
    return None


def disable_kernels(device: torch.device, kernels: tuple[str, ...], reason: str) -> None:
    """These kernels off for `device` (every other kernel stays on); plans made since are decided again."""
    failed = state.device(device).failed_kernels
    for symbol in kernels:
        failed.setdefault(symbol, reason)
    state.verdicts_changed()


def disable_eight_bit(device: torch.device, reason: str) -> None:
    """8-bit attention off for `device` (the exact kernels stay on); plans made since are decided again."""
    state.device(device).self_tests["8-bit"] = reason
    state.verdicts_changed()


def forget_devices() -> None:
    """Drop what is known of every device and every plan made on it (after a new self-test, when the
    runtime drops its loaded libraries, or in tests)."""
    state.devices.clear()
    attention.forget_launches()
    state.verdicts_changed()


loader.on_forget(forget_devices)
