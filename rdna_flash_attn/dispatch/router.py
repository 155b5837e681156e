"""Routing of SDPA calls: the kernels where a call is supported, PyTorch SDPA everywhere else.

Every attention call of a diffusion model passes through `scaled_dot_product_attention`, so the
decision reads only tensor metadata and settings attributes, and caches what it learns per device.
Each decision is a short human reason; each distinct fallback reason is logged once (INFO) and every
call is counted (`stats()`). A kernel that fails is turned off for its device alone, with a one-line
reason (WARNING; the whole error at DEBUG): the calls that would launch it fall back, all others keep
the kernels.

The decision is cached per call signature (everything it reads: settings, devices, dtypes, shapes,
strides, storage alignment, the other arguments, autocast and grad mode), so a model's repeated calls
pay one dictionary lookup. While torch.compile traces, the same decision runs on the traced tensors'
metadata: a supported call puts the kernels' custom op into the graph, any other call SDPA, and
dynamo's guards on what the decision read (settings included) re-trace when one of them changes.

Malformed calls are never judged here: anything unusual falls back, so SDPA itself raises its own
exception for it, and no kernel is ever launched on input SDPA would reject.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from contextvars import ContextVar
from typing import Callable, NamedTuple

import torch

from ..config import LOGGER_NAME, check_precision, settings
from ..ops import attention, autograd, quantized
from ..runtime import device as devices, loader, variants
from ..runtime.loader import KernelLibrary, KernelUnavailable
from . import selftest

log = logging.getLogger(LOGGER_NAME)

# torch's own SDPA, not whatever `torch.nn.functional.scaled_dot_product_attention` names now: once
# patch_sdpa() points that name at us, falling back through it would recurse.
torch_sdpa = torch._C._nn.scaled_dot_product_attention
_fallback_sdpa = torch_sdpa  # where unsupported calls go; see use_fallback()

RDNA_TARGET_PREFIXES = ("gfx11", "gfx12")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_REASON_CHARS = 200  # a failure's reason, as logged and counted: one readable line
AUTOCAST_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what autocast converts
FP32_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4

    def _autocast_dtype(device_type: str) -> torch.dtype | None:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

else:  # older torch (ZLUDA hosts run 2.2 - 2.7): only CUDA-device autocast, which is all that runs kernels

    def _autocast_dtype(device_type: str) -> torch.dtype | None:
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


class KernelCall(NamedTuple):
    """A call the kernels will run: inputs already in the kernel dtype."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_causal: bool
    scale: float | None
    out_dtype: torch.dtype  # what SDPA would have returned
    backward: bool  # autograd needs the differentiable op
    attn_mask: torch.Tensor | None = None
    eight_bit: bool = False  # runs in 8-bit attention (settings.precision, or precision())
    exact_reason: str | None = None  # why not, where it was asked for


class Route(NamedTuple):
    """What becomes of every call of one signature that the kernels take."""

    run_dtype: torch.dtype | None  # cast the inputs to this first; None: run them as given
    out_dtype: torch.dtype  # what SDPA would have returned
    backward: bool  # autograd needs the differentiable op
    # A forward-only route's prepared kernel launch (attention.forward_launch), kept in the route cache
    # after its first eager call, so later calls of the signature pay one lookup in all.
    launch: Callable | None = None
    eight_bit: bool = False  # 8-bit attention (ops/quantized.py), as settings.precision or precision() asks
    exact_reason: str | None = None  # why a call asked to run in 8 bits runs exact
    kernels: tuple[str, ...] = ()  # symbols of the exact kernels the call launches: the forward first


# --- per-device verdicts, cached: devices do not change during a process ---------------------------


class DeviceVerdict(NamedTuple):
    """A device described once, and what follows for the kernels there."""

    info: devices.DeviceInfo
    library: KernelLibrary | None  # its loaded code object; None when refused
    refusal: str | None  # why the kernels cannot run there (policy, then the code object), or None


_device_verdicts: dict[tuple[torch.device, bool], DeviceVerdict] = {}
_selftest_refusals: dict[torch.device, str | None] = {}
_eight_bit_refusals: dict[torch.device, str | None] = {}  # per device: why no 8-bit attention (None: it runs)
_failed_kernels: dict[torch.device, dict[str, str]] = {}  # per device: kernel symbol -> why it is off there
# Bumped whenever cached verdicts are dropped or changed: graphs compiled on the old ones read it, so
# dynamo's guard on it makes them decide again.
_verdict_generation = 0


def _policy_refusal(info: devices.DeviceInfo) -> str | None:
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
    refusal = None if force else _policy_refusal(info)
    if refusal:
        return DeviceVerdict(info, None, refusal)
    try:
        return DeviceVerdict(info, loader.loaded_library(info), None)
    except KernelUnavailable as error:
        return DeviceVerdict(info, None, str(error))


def device_verdict(device: torch.device) -> DeviceVerdict:
    """The device's description, library and refusal under the current settings.force. Cached."""
    key = (device, settings.force)
    verdict = _device_verdicts.get(key)
    if verdict is None:
        verdict = _device_verdicts[key] = _judge_device(device, settings.force)
    return verdict


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (policy, then its code object), or None. Cached."""
    return device_verdict(device).refusal


def selftest_refusal(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` or failed its self-test, or None. Runs the self-test
    at the first ask, which the dispatcher makes on the first call that would otherwise reach the
    kernels. Cached."""
    if device not in _selftest_refusals:
        verdict = device_verdict(device)
        _selftest_refusals[device] = verdict.refusal or selftest.verdict(device, verdict.library)
    return _selftest_refusals[device]


def forget_devices() -> None:
    """Drop the cached per-device verdicts and every decision made on them (after a new self-test,
    when the runtime drops its loaded libraries, or in tests)."""
    global _verdict_generation
    _device_verdicts.clear()
    _selftest_refusals.clear()
    _eight_bit_refusals.clear()
    _failed_kernels.clear()
    _routes.clear()
    attention.forget_launches()
    _verdict_generation += 1


loader.on_forget(forget_devices)


def _disable_eight_bit(device: torch.device, reason: str) -> None:
    """8-bit attention off for `device` (the exact kernels stay on); decisions made since are redone."""
    global _verdict_generation
    _eight_bit_refusals[device] = reason
    _routes.clear()
    _verdict_generation += 1


def _disable_kernels(device: torch.device, kernels: tuple[str, ...], reason: str) -> None:
    """These kernels off for `device` (every other kernel stays on); decisions made since are redone."""
    global _verdict_generation
    failed = _failed_kernels.setdefault(device, {})
    for symbol in kernels:
        failed.setdefault(symbol, reason)
    _routes.clear()
    _verdict_generation += 1


def failed_kernels_refusal(device: torch.device, kernels: tuple[str, ...]) -> str | None:
    """Why a call launching `kernels` cannot run on `device` (one of them failed there), or None."""
    failed = _failed_kernels.get(device)
    if failed:
        for symbol in kernels:
            if symbol in failed:
                return failed[symbol]
    return None


def call_kernels(dtype: torch.dtype, head_dim: int, masked: bool, backward: bool) -> tuple[str, ...]:
    """Symbols of the exact kernels a call launches, the forward first: the class of calls a failure
    turns off, since a kernel that fails once fails for every call it runs."""
    name = attention.DTYPE_NAMES[dtype]
    kernels = (variants.fwd_variant(name, head_dim, masked).symbol,)
    if backward:
        kernels += tuple(variants.bwd_variant(kind, name, head_dim, masked).symbol for kind in ("dq", "dkdv"))
    return kernels


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def _shortened(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure_summary(error: BaseException, limit: int) -> str:
    """The error's type and the first line of its message, cut to `limit` characters."""
    message = _first_line(error)
    return _shortened(f"{type(error).__name__}: {message}" if message else type(error).__name__, limit)


def _failure_reason(what: str, error: BaseException, device: torch.device) -> str:
    """'<what> failed (<error's summary>); off for <device>', at most MAX_REASON_CHARS characters."""
    frame = f"{what} failed (); off for {device}"
    return f"{what} failed ({_failure_summary(error, max(MAX_REASON_CHARS - len(frame), 20))}); off for {device}"


def _log_failure(reason: str, error: BaseException, fallback_name: str) -> None:
    """The failure's one line, once per reason (WARNING: kernels were turned off); the whole error at DEBUG."""
    if ("the kernels", reason) not in _logged_reasons:
        _logged_reasons.add(("the kernels", reason))
        log.warning("not using the kernels: %s (%s runs these calls)", reason, fallback_name)
    log.debug("the error behind %r:", reason, exc_info=error)


def _backward_failed(error: Exception, q: torch.Tensor, masked: bool) -> None:
    """A backward's kernels raised, inside autograd: its dQ and dK/dV kernels off for the device, so
    later calls of its class that need gradients fall back from their forward on (forward-only calls
    keep the kernels). The error itself still reaches the caller's backward, which nothing here runs."""
    if isinstance(error, (KernelUnavailable, torch.cuda.OutOfMemoryError)) or q.dtype not in attention.DTYPE_NAMES:
        return
    kernels = call_kernels(q.dtype, q.shape[-1], masked, True)[1:]
    reason = _failure_reason(" and ".join(kernels), error, q.device)
    _disable_kernels(q.device, kernels, reason)
    _log_failure(reason, error, "PyTorch SDPA or the host's attention")


autograd.on_backward_failure(_backward_failed)


def _constant_while_tracing(function):
    """Marks `function` as torch.compiler.assume_constant_result does: while torch.compile traces,
    a call runs for real and its result is a constant of the graph. Its arguments must be values the
    traced code read (so dynamo guards on them). The marker is set here directly because the public
    helper imports torch._dynamo, which would double this package's import time."""
    function._dynamo_marked_constant = True
    return function


@_constant_while_tracing
def _device_refusal_while_tracing(device: torch.device, force: bool, generation: int) -> str | None:
    return device_refusal(device)


@_constant_while_tracing
def _selftest_refusal_while_tracing(device: torch.device, generation: int) -> str | None:
    # Runs a device's first-use self-test eagerly, at trace time, outside the graph.
    return selftest_refusal(device)


@_constant_while_tracing
def _failed_kernels_refusal_while_tracing(device: torch.device, kernels: tuple[str, ...],
                                          generation: int) -> str | None:
    return failed_kernels_refusal(device, kernels)


# --- the decision -----------------------------------------------------------------------------------


def _kernel_dtypes(query, key, value) -> tuple[torch.dtype | None, torch.dtype] | str:
    """(dtype to cast the inputs to first, or None for no cast; dtype to return), or a reason.
    Casts mirror what SDPA would do under autocast, or what the user opted into for float32."""
    dtypes = (query.dtype, key.dtype, value.dtype)
    autocast_to = _autocast_dtype(query.device.type)
    if autocast_to is not None and all(d in AUTOCAST_CAST_DTYPES for d in dtypes):
        # SDPA is an autocast op: it would compute in, and return, the autocast dtype.
        if autocast_to not in KERNEL_DTYPES:
            return f"autocast to {autocast_to}"
        return autocast_to, autocast_to
    if dtypes == (torch.float32,) * 3:
        if settings.fp32_cast == "off":
            return "float32 inputs (RDNA_FA_FP32_CAST=bf16 runs them on the kernels in bfloat16)"
        return FP32_CAST_DTYPES[settings.fp32_cast], torch.float32
    return None, query.dtype  # as given: attention.forward_refusal judges the dtypes


def _settings_or_type_refusal(tensors) -> str | None:
    """The first checks of every route: the kernels turned off, and tensors that are not plain ones."""
    if settings.disable:
        return "disabled (RDNA_FA_DISABLE / settings.disable)"
    if any(type(t) is not torch.Tensor for t in tensors):
        return "query, key and value are not all plain torch.Tensor objects"
    return None


_TRAINING_OFF = "gradients needed and RDNA_FA_TRAINING=0"
_precision_override: ContextVar[str | None] = ContextVar("rdna_flash_attn_precision", default=None)


@contextlib.contextmanager
def precision(choice: str):
    """Within the block (in this thread or task), calls take `choice` ("exact" | "8bit-qkpv") instead of
    settings.precision: a host's per-model option, such as the ComfyUI node's. Not inside code that
    torch.compile traces (dynamo cannot trace a context variable; compiled graphs run exact anyway)."""
    token = _precision_override.set(check_precision(choice))
    try:
        yield
    finally:
        _precision_override.reset(token)


def _precision() -> str:
    return _precision_override.get() or settings.precision


def _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Route | str:
    """The route for these SDPA arguments, or the reason the call falls back to SDPA. Reads
    metadata and settings (and casts the inputs where the route would, to judge the cast tensors),
    so torch.compile can trace it; the per-device verdicts come from cached facts or, the first
    time, from a call run eagerly at trace time."""
    tensors = (query, key, value)
    refusal = _settings_or_type_refusal(tensors)
    if refusal:
        return refusal
    if any(t.is_nested or t.layout is not torch.strided for t in tensors):
        return "nested or sparse tensors"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs are not 4-D (batch, heads, tokens, head dim)"
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return "dropout_p is not 0"
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return "is_causal or enable_gqa is not a bool"
    if is_causal and attn_mask is not None:
        return "attn_mask and is_causal both given"  # SDPA raises its own error for these
    if query.shape[1] != key.shape[1] and not enable_gqa:
        return "key/value heads differ from query heads and enable_gqa is False"
    if scale is not None and type(scale) not in (float, int):
        return "scale is not a Python number"
    if key.shape[2] != value.shape[2]:
        return "key and value have different lengths"
    tracing = _is_compiling()
    if tracing and not autograd.HAS_CUSTOM_OP:
        return "traced by torch.compile, which needs torch >= 2.4 for the kernels' custom op"
    if tracing:
        refusal = _device_refusal_while_tracing(query.device, settings.force, _verdict_generation)
    else:
        refusal = device_refusal(query.device)
    if refusal:
        return refusal
    dtypes = _kernel_dtypes(query, key, value)
    if isinstance(dtypes, str):
        return dtypes
    run_dtype, out_dtype = dtypes
    backward = autograd.needs_gradients(query, key, value)
    if backward and not settings.training:
        return _TRAINING_OFF
    if run_dtype is not None:
        query, key, value = query.to(run_dtype), key.to(run_dtype), value.to(run_dtype)
    scale = None if scale is None else float(scale)
    refusal = attention.forward_refusal(query, key, value, is_causal, scale, attn_mask, backward)
    if refusal:
        return refusal
    if tracing:
        refusal = _selftest_refusal_while_tracing(query.device, _verdict_generation)
    else:
        refusal = selftest_refusal(query.device)
    if refusal:
        return refusal
    kernels = call_kernels(query.dtype, query.shape[-1], attn_mask is not None, backward)
    if tracing:
        refusal = _failed_kernels_refusal_while_tracing(query.device, kernels, _verdict_generation)
    else:
        refusal = failed_kernels_refusal(query.device, kernels)
    if refusal:
        return refusal
    route = Route(run_dtype, out_dtype, backward, kernels=kernels)
    # Graphs being compiled keep the exact kernels' op (8-bit attention runs in eager calls); dynamo
    # cannot trace the precision's context variable either.
    if tracing or _precision() == "exact":
        return route
    refusal = _eight_bit_refusal(query, key, value, is_causal, attn_mask, backward)
    return route._replace(exact_reason=refusal) if refusal else route._replace(eight_bit=True)


def _eight_bit_refusal(query, key, value, is_causal, attn_mask, backward: bool) -> str | None:
    """Why an eager call the exact kernels take cannot run in 8-bit attention, or None."""
    if backward:
        return "gradients needed (8-bit attention is for inference)"
    return eight_bit_refusal(query.device) or quantized.quantized_refusal(query, key, value, is_causal, attn_mask)


def eight_bit_refusal(device: torch.device) -> str | None:
    """Why 8-bit attention cannot run on `device` (the kernels off there, a target without it, a failed
    8-bit self-test or 8-bit kernel), or None. Runs its self-test at the first ask. Cached."""
    if device not in _eight_bit_refusals:
        verdict = device_verdict(device)
        refusal = (selftest_refusal(device) or quantized.target_refusal(verdict.library.artifact.target)
                   or selftest.eight_bit_verdict(device, verdict.library))
        _eight_bit_refusals.setdefault(device, refusal)  # an 8-bit failure recorded meanwhile stands
    return _eight_bit_refusals[device]


_routes: dict[tuple, Route | str] = {}
_MAX_CACHED_SIGNATURES = 4096  # far above any model's count of attention shapes; a bound against leaks


def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple | None:
    """Everything _decide reads, as a dictionary key; None for calls it does not cache (masks,
    tensor subclasses, odd argument types, tensors without strides or storage): _decide judges
    those every time."""
    if (attn_mask is not None or type(query) is not torch.Tensor or type(key) is not torch.Tensor
            or type(value) is not torch.Tensor or type(is_causal) is not bool or type(enable_gqa) is not bool
            or type(dropout_p) not in (float, int) or (scale is not None and type(scale) not in (float, int))):
        return None
    try:
        device = query.device
        return (settings.disable, settings.force, settings.training, settings.fp32_cast, _precision(),
                device, key.device, value.device, query.dtype, key.dtype, value.dtype,
                query.layout, key.layout, value.layout, query.shape, key.shape, value.shape,
                query.stride(), key.stride(), value.stride(),
                query.data_ptr() & 15, key.data_ptr() & 15, value.data_ptr() & 15,
                dropout_p, is_causal, scale, enable_gqa, _autocast_dtype(device.type),
                autograd.needs_gradients(query, key, value))
    except (RuntimeError, NotImplementedError):
        return None


def _signed_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """(signature, route): _decide's answer, from the cache when this signature was decided before
    (eager calls only: in a compiled graph, dynamo's guards do the caching); signature None when the
    call is not cached."""
    signature = _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if signature is None:
        return None, _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    route = _routes.get(signature)
    if route is None:
        generation = _verdict_generation
        route = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        _remember(signature, route, generation)
    return signature, route


def _remember(signature: tuple, route: Route | str, generation: int) -> None:
    if generation == _verdict_generation:  # else verdicts changed meanwhile: decide again next call
        if len(_routes) >= _MAX_CACHED_SIGNATURES:
            _routes.clear()
        _routes[signature] = route


def plan(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> KernelCall | str:
    """The kernel call for these SDPA arguments, or the reason the call falls back to SDPA."""
    if _is_compiling():
        route = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        route = _signed_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[1]
    if isinstance(route, str):
        return route
    query, key, value, scale = _kernel_inputs(route, query, key, value, scale)
    return KernelCall(query, key, value, is_causal, scale, route.out_dtype, route.backward, attn_mask, route.eight_bit,
                      route.exact_reason)


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> str:
    """Why a call with these SDPA arguments would or would not run on the kernels (nothing is run,
    apart from the device's first-use self-test)."""
    call = plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(call, str):
        return f"falls back to PyTorch SDPA: {call}"
    kind = "causal" if call.is_causal else "non-causal"
    if call.attn_mask is not None:
        kind += f", {'bool' if call.attn_mask.dtype == torch.bool else 'additive'} mask"
    if call.key.shape[1] != call.query.shape[1]:
        kind += f", {call.query.shape[1] // call.key.shape[1]} query heads per key/value head"
    grad = ", forward and backward" if call.backward else ""
    exact_reason = call.exact_reason
    if call.eight_bit:
        exact_reason = quantized.accuracy_refusal(call.query, call.key, call.value)
    precision = ", in 8-bit attention (int8 Q K^T, fp8 P V)" if exact_reason is None and call.eight_bit else ""
    if exact_reason:
        precision = f", exact, not 8-bit: {exact_reason}"
    return f"runs on the kernels: {call.query.dtype}, head dim {call.query.shape[-1]}, {kind}{grad}{precision}"


# --- counters and once-per-reason logging ---------------------------------------------------------

_kernel_calls = 0
_eight_bit_calls = 0
_fallbacks: Counter[str] = Counter()
_exact_reasons: Counter[str] = Counter()  # calls asked to run in 8 bits that ran exact
_logged_reasons: set[tuple[str, str]] = set()  # (what was not used, why) shown in the log


def stats() -> dict:
    """Calls per path since the last reset: {"kernel": n (of which "kernel_8bit" ran in 8-bit attention),
    "fallback": n, "fallback_reasons": {reason: n}, "exact_not_8bit_reasons": {reason: n}}."""
    return {"kernel": _kernel_calls, "kernel_8bit": _eight_bit_calls, "fallback": sum(_fallbacks.values()),
            "fallback_reasons": dict(_fallbacks), "exact_not_8bit_reasons": dict(_exact_reasons)}


def reset_stats() -> None:
    """Zero the counters (reasons already logged stay logged)."""
    global _kernel_calls, _eight_bit_calls
    _kernel_calls = _eight_bit_calls = 0
    _fallbacks.clear()
    _exact_reasons.clear()


def _note_precision(route: Route) -> None:
    """Counts an 8-bit call, or logs (once per reason) why one asked for in 8 bits ran exact."""
    global _eight_bit_calls
    if route.eight_bit:
        _eight_bit_calls += 1
        return
    _exact_reasons[route.exact_reason] += 1
    _log_once("8-bit attention", route.exact_reason, "the exact kernels", "run")


def _note_fallback(reason: str, fallback_name: str) -> None:
    _fallbacks[reason] += 1
    _log_once("the kernels", reason, fallback_name)


def _log_once(unused: str, reason: str, runner: str, verb: str = "runs") -> None:
    """INFO "not using <unused>: <reason> (<runner> <verb> these calls)", once per (unused, reason).
    Remembered only once shown, so turning INFO on later still shows every reason once."""
    if (unused, reason) not in _logged_reasons and log.isEnabledFor(logging.INFO):
        _logged_reasons.add((unused, reason))
        log.info("not using %s: %s (%s %s these calls)", unused, reason, runner, verb)


# --- the entry points ---------------------------------------------------------------------------------


def _kernel_inputs(route: Route, query, key, value, scale):
    """(query, key, value, scale) as the kernels take them on this route: cast where it says."""
    if route.run_dtype is not None:
        query, key, value = query.to(route.run_dtype), key.to(route.run_dtype), value.to(route.run_dtype)
    return query, key, value, None if scale is None else float(scale)


def _run_eight_bit(route: Route, query, key, value, is_causal: bool, scale) -> tuple[torch.Tensor, Route]:
    """8-bit attention's output and the route the call took: the exact kernels' where this call's inputs
    are outside the 8-bit bar (quantized.accuracy_refusal) or the 8-bit kernels failed."""
    reason = quantized.accuracy_refusal(query, key, value)
    if reason is None:
        try:
            return quantized.launch_quantized(query, key, value, scale), route  # _decide made its checks
        except KernelUnavailable:
            raise
        except Exception as exc:  # 8-bit attention failing must cost precision's speed, not the exact kernels
            if isinstance(exc, torch.cuda.OutOfMemoryError):  # the pass's buffers: later calls try again
                reason = "8-bit attention's buffers did not fit in GPU memory"
            else:
                reason = _failure_reason("8-bit attention", exc, query.device)
                log.warning("8-bit attention is now off: %s (the exact kernels run its calls)", reason)
                log.debug("the error behind %r:", reason, exc_info=exc)
                _disable_eight_bit(query.device, reason)
    out, _lse = attention.flash_attention_forward(query, key, value, is_causal, scale)
    return out, route._replace(eight_bit=False, exact_reason=reason)


def _run(route: Route, query, key, value, attn_mask, is_causal: bool, scale, signature: tuple | None = None,
         tracing: bool = False) -> torch.Tensor:
    """The kernels' result on `route`. An eager forward-only call of a cached signature (never one
    with a mask) runs the route's prepared launch, preparing it (and caching the route with it) the
    first time."""
    query, key, value, scale = _kernel_inputs(route, query, key, value, scale)
    if route.eight_bit:
        out, route = _run_eight_bit(route, query, key, value, is_causal, scale)
    elif route.backward or tracing:  # the custom op: differentiable, and what a graph can hold
        out = autograd.flash_attention(query, key, value, is_causal, scale, attn_mask=attn_mask)
    elif route.launch is not None:
        out, _lse = route.launch(query, key, value)
    elif signature is not None:
        generation = _verdict_generation
        launch = attention.forward_launch(query, key, value, is_causal, scale)
        _remember(signature, route._replace(launch=launch), generation)
        out, _lse = launch(query, key, value)
    else:
        out, _lse = attention.flash_attention_forward(query, key, value, is_causal, scale, attn_mask=attn_mask)
    if not tracing and (route.eight_bit or route.exact_reason is not None):
        _note_precision(route)
    return out if out.dtype == route.out_dtype else out.to(route.out_dtype)


_traced_reasons: set[str] = set()


@_constant_while_tracing
def _note_traced_fallback(reason: str, fallback_name: str) -> None:
    """Logs, once per reason, why calls in a graph being compiled go to the fallback; runs at trace time."""
    if reason not in _traced_reasons and log.isEnabledFor(logging.INFO):
        _traced_reasons.add(reason)
        log.info("not using the kernels in a torch.compile graph: %s (%s runs these calls)", reason, fallback_name)


def attention_or_reason(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
    fallback_name="the caller's attention",
) -> torch.Tensor | str:
    """The kernels' result for a supported call, else the reason it is not (counted in stats() and
    logged once, with `fallback_name`: what the caller runs instead); the caller then runs its own
    fallback. For hosts whose fallback is their own attention backend rather than PyTorch SDPA.
    Calls inside compiled graphs are decided once per graph and not counted."""
    if _is_compiling():
        route = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if isinstance(route, str):
            _note_traced_fallback(route, fallback_name)
            return route
        return _run(route, query, key, value, attn_mask, is_causal, scale, tracing=True)
    signature, route = _signed_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(route, str):
        _note_fallback(route, fallback_name)
        return route
    return _counted(lambda: _run(route, query, key, value, attn_mask, is_causal, scale, signature), query.device,
                    fallback_name, route.kernels)


def _run_with_lse(route: Route, query, key, value, attn_mask, is_causal: bool, scale):
    """(out, lse) of the exact kernels on `route` (8-bit attention has no lse), differentiable through out."""
    query, key, value, scale = _kernel_inputs(route, query, key, value, scale)
    out, lse = autograd.flash_attention_with_lse(query, key, value, is_causal, scale, attn_mask=attn_mask)
    return (out if out.dtype == route.out_dtype else out.to(route.out_dtype)), lse


def attention_with_lse_or_reason(query, key, value, attn_mask=None, is_causal=False, *, scale=None, enable_gqa=False,
                                 fallback_name="the caller's attention"):
    """attention_or_reason (dropout_p 0) with the log-sum-exp: (out, lse (batch, heads, seq_q) float32
    natural log, +inf for rows that see no key), or the reason the kernels do not take the call."""
    if _is_compiling():
        route = _decide(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
        if isinstance(route, str):
            _note_traced_fallback(route, fallback_name)
            return route
        return _run_with_lse(route, query, key, value, attn_mask, is_causal, scale)
    route = _signed_route(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)[1]
    if isinstance(route, str):
        _note_fallback(route, fallback_name)
        return route
    return _counted(lambda: _run_with_lse(route, query, key, value, attn_mask, is_causal, scale), query.device,
                    fallback_name, route.kernels)


_OUT_OF_MEMORY = "the kernels' buffers did not fit in GPU memory (this call only)"


def _counted(run, device: torch.device, fallback_name: str, kernels: tuple[str, ...]):
    """run()'s result, counted as a kernel call; or, when the kernels fail, the reason (counted as a
    fallback). `kernels`: what the call launches, the forward first. Only a failure of the forward
    kernel itself turns something off: that kernel, for the device (an unavailable library or memory
    running out are this call's lot, and later calls try again)."""
    global _kernel_calls
    reason = failed_kernels_refusal(device, kernels) if _failed_kernels else None
    if reason is None:
        try:
            out = run()
        except KernelUnavailable as exc:
            reason = _shortened(_first_line(exc), MAX_REASON_CHARS)
        except torch.cuda.OutOfMemoryError:
            reason = _OUT_OF_MEMORY
        except Exception as exc:  # a kernel-side bug must cost speed, never the host's run
            reason = _failure_reason(kernels[0], exc, device)
            _disable_kernels(device, kernels[:1], reason)
            _log_failure(reason, exc, fallback_name)
        else:
            _kernel_calls += 1
            return out
    _note_fallback(reason, fallback_name)
    return reason


def _varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> str | None:
    refusal = _settings_or_type_refusal((q, k, v))
    if refusal:
        return refusal
    if _is_compiling():
        return "packed variable-length batches are not traced by torch.compile"
    refusal = device_refusal(q.device)
    if refusal:
        return refusal
    if autograd.needs_gradients(q, k, v) and not settings.training:
        return _TRAINING_OFF
    return (attention.varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            or selftest_refusal(q.device))


def varlen_attention_or_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                               is_causal: bool = False, scale: float | None = None, *,
                               fallback_name: str = "the caller's attention"):
    """(out, lse) of a packed variable-length batch (flash-attn's varlen layout, causal aligned
    bottom-right per entry) through the kernels, differentiable; else the reason they cannot take it
    (counted and logged once, as attention_or_reason does). Unsound offsets or lengths raise ValueError
    first (attention.check_cu_seqlens), whether or not the kernels would take the call: they are the
    caller's error, which its fallback would otherwise get silently wrong."""
    attention.check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    reason = _varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if reason is not None:
        _note_fallback(reason, fallback_name)
        return reason
    return _counted(lambda: autograd.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                            max_seqlen_k, is_causal, scale), q.device, fallback_name,
                    call_kernels(q.dtype, q.shape[-1], False, autograd.needs_gradients(q, k, v)))


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False
):
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`: same arguments, results and
    exceptions; supported calls run on the kernels, all others on PyTorch SDPA unchanged."""
    out = attention_or_reason(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
        fallback_name="PyTorch SDPA",
    )
    if isinstance(out, torch.Tensor):
        return out
    # The caller's own arguments, untouched; enable_gqa only when given, as torch < 2.5 lacks it.
    extra = {} if enable_gqa is False else {"enable_gqa": enable_gqa}
    return _fallback_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)


def use_fallback(function=None) -> None:
    """Send unsupported calls to `function`, or to torch's own SDPA when None. patch_sdpa() passes
    the function it replaced, so a host's own SDPA wrapper (SD.Next's sliced or Triton attention)
    keeps serving every call the kernels do not take."""
    global _fallback_sdpa
    _fallback_sdpa = torch_sdpa if function is None else function
