"""First-use self-test: the kernels, forward and backward, against float32 attention on small shapes.

The verdict is cached on disk, keyed by what could change the kernels' results (artifact sha256,
torch version, HIP/CUDA runtime version, device name, this test's revision), so a user's GPU is
tested once per setup. A failure turns the kernels off for that device, with one warning.

The criterion is FlashAttention's own: the kernel's error against the float32 reference must stay
within twice the error of the same math done in the input dtype, plus two units of that dtype's
rounding, so it adapts to fp16 and bf16 alike.

8-bit attention (settings.precision, gfx12) has its own test, run the first time a call would use it:
its output against the float32 reference must meet its mode's bar (cosine >= 0.999, relative L1 <= 3 %)
on random inputs whose values carry a mean per channel (the arithmetic, done exactly, is at 0.7 % and
1 - cosine 3e-5 there); a failure keeps that device's calls on the exact kernels.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import LOGGER_NAME
from ..ops import attention, autograd, plans, quantized
from ..runtime import artifacts
from ..runtime.loader import KernelLibrary

log = logging.getLogger(LOGGER_NAME)

# Bumped when the checks change, so cached verdicts are redone (2: a first call under inference mode no
# longer fails them; 3: the third 8-bit case runs a negative scale).
REVISION = 3
CACHE_FILE_NAME = "selftest.json"

# (batch, heads, query tokens, key tokens, head dim, causal): SD head dims, lengths that are not
# multiples of any tile, cross-attention, causal with Sq != Sk (top-left aligned), the VAE's 512.
CASES = (
    (1, 2, 128, 128, 64, False),
    (2, 3, 77, 200, 40, False),
    (1, 2, 100, 130, 128, True),
    (1, 2, 33, 33, 160, True),
    (1, 1, 64, 64, 512, False),
)
DTYPES = (torch.float16, torch.bfloat16)
# (batch, heads, key/value heads, query tokens, key tokens, head dim, softmax scale's sign): ragged tiles,
# grouped heads, a negative scale (folded into Q's codes).
EIGHT_BIT_CASES = ((1, 2, 2, 100, 130, 64, 1), (2, 4, 2, 77, 200, 128, 1), (1, 2, 1, 33, 64, 40, -1))
EIGHT_BIT_BAR = MappingProxyType({"relative L1": 0.03, "1 - cosine": 0.001})  # the 8-bit mode's bar (docs/8bit.md)


@dataclass(frozen=True)
class Check:
    name: str
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # False for NaN too


def cache_dir() -> Path:
    """Where verdicts are cached: the package's user cache folder (settings.cache_dir overrides it)."""
    return artifacts.user_cache_dir()


def cache_key(library: KernelLibrary, test: str = "exact") -> dict:
    """What the verdict of the device `library` was loaded on depends on."""
    return {
        "artifact_sha256": library.artifact.sha256,
        "torch": torch.__version__,
        "runtime": library.device_info.runtime_version,
        "device": library.device_info.name,
        "revision": REVISION,
        **({} if test == "exact" else {"test": test}),
    }


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _load_cache() -> dict:
    try:
        data = json.loads((cache_dir() / CACHE_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(key: dict, record: dict) -> None:
    folder = cache_dir()
    entries = _load_cache()
    entries[_key_id(key)] = record
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{CACHE_FILE_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, folder / CACHE_FILE_NAME)  # atomic: concurrent processes never see half a file
    except OSError as exc:
        log.debug("could not cache the self-test verdict in %s: %s", folder, exc)


def cached(library: KernelLibrary, test: str = "exact") -> dict | None:
    """The cached record for the setup of the device `library` was loaded on, or None."""
    key = cache_key(library, test)
    record = _load_cache().get(_key_id(key))
    return record if isinstance(record, dict) and record.get("key") == key else None


# --- the checks ---------------------------------------------------------------------------------


def _reference(q, k, v, causal: bool, dtype: torch.dtype, scale: float | None = None):
    """Attention as SDPA's math backend defines it (scale None: 1 / sqrt(head dim)), computed in `dtype` on
    fresh leaves: (out, logsumexp in float32, the leaves)."""
    leaves = tuple(t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    q, k, v = leaves
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v, scores.float().logsumexp(-1), leaves


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _compare(name: str, got, ref32, ref_low, dtype: torch.dtype) -> Check:
    floor = 2 * torch.finfo(dtype).eps
    return Check(name, _max_error(got, ref32), 2 * _max_error(ref_low, ref32) + floor)


def autograd_gradients(q, k, v, lse, grad_out, causal):
    """Gradients through the public autograd function (its custom op on torch >= 2.4)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(autograd.flash_attention(*leaves, causal, None), leaves, grad_out)


def direct_gradients(q, k, v, lse, grad_out, causal):
    """Gradients from the ops themselves, for a library torch's custom ops do not dispatch to (the CPU)."""
    return attention.flash_attention_backward(grad_out, q, k, v, lse, causal, None)


def case_checks(device, dtype, case, generator, gradients=autograd_gradients) -> list[Check]:
    """Forward (out, lse) and backward (dq, dk, dv) checks of one case, each against float32 with
    the input dtype's own error as the yardstick."""
    batch, heads, sq, sk, dim, causal = case
    dtype_name = str(dtype).removeprefix("torch.")
    shape = f"{dtype_name} b{batch} h{heads} q{sq} k{sk} d{dim}{' causal' if causal else ''}"
    q, k, v = (
        torch.randn(batch, heads, n, dim, generator=generator, device=device, dtype=dtype) for n in (sq, sk, sk)
    )
    with torch.no_grad():
        out, lse = attention.flash_attention_forward(q, k, v, causal, None)
    grad_out = torch.randn(out.shape, generator=generator, device=device, dtype=dtype)
    with torch.enable_grad():
        grads = gradients(q, k, v, lse, grad_out, causal)
        out32, lse32, leaves32 = _reference(q, k, v, causal, torch.float32)
        grads32 = torch.autograd.grad(out32, leaves32, grad_out.float())
        out_low, lse_low, leaves_low = _reference(q, k, v, causal, dtype)
        grads_low = torch.autograd.grad(out_low, leaves_low, grad_out)
    return [
        _compare(f"forward out {shape}", out, out32, out_low, dtype),
        _compare(f"forward lse {shape}", lse, lse32, lse_low, dtype),
    ] + [
        _compare(f"backward d{n} {shape}", g, g32, g_low, dtype)
        for n, g, g32, g_low in zip("qkv", grads, grads32, grads_low)
    ]


def run_checks(device: torch.device, gradients=autograd_gradients) -> list[Check]:
    """Every check on `device`, forward and backward. May raise."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.autocast(device.type, enabled=False):
        return [check for dtype in DTYPES for case in CASES
                for check in case_checks(device, dtype, case, generator, gradients)]


def eight_bit_checks(device: torch.device) -> list[Check]:
    """8-bit attention against float32 attention, per case and dtype: relative L1 and 1 - cosine."""
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.autocast(device.type, enabled=False):
        return [check for dtype in DTYPES for case in EIGHT_BIT_CASES
                for check in _eight_bit_case_checks(device, dtype, case, generator)]


def _eight_bit_case_checks(device, dtype, case, generator) -> list[Check]:
    batch, heads, kv_heads, sq, sk, dim, sign = case
    scale = sign * dim**-0.5
    q = torch.randn(batch, heads, sq, dim, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, sk, dim, generator=generator, device=device, dtype=dtype) for _ in range(2))
    # V with a mean per channel, as models' values have: without one the outputs average out near zero,
    # and the mode's relative L1 on them (about 3.5 %) says nothing about a kernel.
    v = v + torch.randn(1, 1, 1, dim, generator=generator, device=device, dtype=dtype)
    out = quantized.quantized_attention_forward(q, k, v, scale=scale).float().flatten()
    group = heads // kv_heads
    ref = _reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False,
                     torch.float32, scale)[0].detach().flatten()
    errors = {"relative L1": float((out - ref).abs().sum() / ref.abs().sum()),
              "1 - cosine": 1 - float(out @ ref / (out.norm() * ref.norm()))}
    name = (f"8-bit {str(dtype).removeprefix('torch.')} b{batch} h{heads}/{kv_heads} q{sq} k{sk} d{dim} "
            f"scale {scale:.3g}")
    return [Check(f"{name} {metric}", errors[metric], bar) for metric, bar in EIGHT_BIT_BAR.items()]


# --- verdicts -----------------------------------------------------------------------------------


def _failure(checks: list[Check]) -> str | None:
    failed = [c for c in checks if not c.passed]
    if not failed:
        return None
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return f"self-test failed: {failed[0].name}: error {failed[0].error:.3g} > {failed[0].tolerance:.3g}{more}"


def run(device: torch.device, library: KernelLibrary, test: str = "exact") -> dict:
    """Run the self-test ("exact", or "8-bit") on `device` (whose loaded library is `library`) now, cache
    and return its record: passed, reason, checks, key, time."""
    key = cache_key(library, test)
    # The custom op serves GPUs; a library of another device type (loader.stand_in's on the CPU) is
    # checked through the ops' own gradients.
    on_gpu = getattr(library, "device_type", plans.KERNEL_DEVICE_TYPE) == plans.KERNEL_DEVICE_TYPE
    try:
        # The first call may come under torch.inference_mode (ComfyUI runs every node so), which keeps
        # autograd off even inside enable_grad: the backward checks need it on.
        with torch.inference_mode(False):
            checks = (run_checks(device, autograd_gradients if on_gpu else direct_gradients) if test == "exact"
                      else eight_bit_checks(device))
        reason = _failure(checks)
    except Exception as exc:  # a kernel that cannot even run is a failed self-test, not a crash
        checks, reason = [], f"self-test raised {type(exc).__name__}: {exc}"
    record = {
        "passed": reason is None,
        "reason": reason,
        "checks": [dict(asdict(c), passed=c.passed) for c in checks],
        "key": key,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    _store(key, record)
    return record


def verdict(device: torch.device, library: KernelLibrary) -> str | None:
    """None when the kernels passed the self-test on `device` (cached or run now), else why not.
    Logs the outcome once: a failure as a warning, since it turns the kernels off for the device."""
    record = cached(library) or run(device, library)
    name = library.device_info.name
    if record["passed"]:
        log.info("self-test passed on %s: using the kernels", name)
        return None
    log.warning(
        "%s on %s: the kernels are off for this device and attention falls back to PyTorch SDPA "
        "(re-run with `python -m rdna_flash_attn selftest`)",
        record["reason"],
        name,
    )
    return record["reason"]


def eight_bit_verdict(device: torch.device, library: KernelLibrary) -> str | None:
    """None when 8-bit attention passed its self-test on `device` (cached or run now), else why not
    (logged once as a warning: that device's calls stay on the exact kernels)."""
    record = cached(library, "8-bit") or run(device, library, "8-bit")
    if record["passed"]:
        log.info("8-bit attention's self-test passed on %s", library.device_info.name)
        return None
    log.warning("8-bit attention's %s on %s: its calls run the exact kernels", record["reason"],
                library.device_info.name)
    return f"8-bit attention's {record['reason']}"
