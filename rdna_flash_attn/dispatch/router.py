"""Routing of SDPA calls: the kernels where a call is supported, PyTorch SDPA everywhere else.

Every entry (the drop-in `scaled_dot_product_attention`, the SDPA patch, the hosts' `attention_or_reason`,
flash-attn's API, the diffusers processor) plans its call once (planner.py), then runs the plan here:
the kernels' result, or the plan's refusal. Each distinct fallback reason is logged once (INFO) and
every call is counted (`stats()`). A kernel that fails is turned off for its device alone, with a
one-line reason (WARNING; the whole error at DEBUG): the calls that would launch it fall back, all
others keep the kernels. Calls inside graphs being compiled put the kernels' custom op, or SDPA, into
the graph, and are not counted.

Everything the router and the planner learn lives in one object, state.state; the device verdicts
are read through the functions of state.py, which the command line and the hosts use from here.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..config import LOGGER_NAME, check_precision
from ..ops import attention, autograd, quantized
from ..ops.plans import Refusal, is_compiling
from ..runtime.loader import KernelUnavailable
from . import planner
from .planner import AttentionPlan, constant_while_tracing, plan_attention
from .state import (device_refusal, device_verdict, disable_eight_bit, disable_kernels, eight_bit_refusal,
                    forget_devices, selftest_refusal, state, torch_sdpa)

__all__ = ["attention_or_reason", "attention_with_lse_or_reason", "varlen_attention_or_reason",
           "scaled_dot_product_attention", "explain", "precision", "stats", "reset_stats", "use_fallback",
           "torch_sdpa", "device_verdict", "device_refusal", "selftest_refusal", "eight_bit_refusal", "forget_devices",
           "MAX_REASON_CHARS"]

log = logging.getLogger(LOGGER_NAME)

MAX_REASON_CHARS = 200  # a failure's reason, as logged and counted: one readable line
OUT_OF_MEMORY = "the kernels' buffers did not fit in GPU memory (this call only)"


# --- failures ---------------------------------------------------------------------------------------


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
    if ("the kernels", reason) not in state.logged:
        state.logged.add(("the kernels", reason))
        log.warning("not using the kernels: %s (%s runs these calls)", reason, fallback_name)
    log.debug("the error behind %r:", reason, exc_info=error)


def _launch_failed(error: Exception, symbols: tuple[str, ...], device: torch.device, fallback_name: str) -> str:
    """The reason a call whose kernels raised `error` falls back. `symbols`: the kernels the call launches,
    the forward first. Only a failure of the forward kernel itself turns something off: that kernel, for
    the device (an unavailable library or memory running out are this call's lot, and later calls try
    again)."""
    if isinstance(error, KernelUnavailable):
        return _shortened(_first_line(error), MAX_REASON_CHARS)
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return OUT_OF_MEMORY
    reason = _failure_reason(symbols[0], error, device)
    disable_kernels(device, symbols[:1], reason)
    _log_failure(reason, error, fallback_name)
    return reason


def _backward_failed(error: Exception, q: torch.Tensor, masked: bool) -> None:
    """A backward's kernels raised, inside autograd: its dQ and dK/dV kernels off for the device, so
    later calls of its class that need gradients fall back from their forward on (forward-only calls
    keep the kernels). The error itself still reaches the caller's backward, which nothing here runs."""
    if isinstance(error, (KernelUnavailable, torch.cuda.OutOfMemoryError)) or q.dtype not in planner.KERNEL_DTYPES:
        return
    symbols = planner.call_kernels(q.dtype, q.shape[-1], masked, True)[1:]
    reason = _failure_reason(" and ".join(symbols), error, q.device)
    disable_kernels(q.device, symbols, reason)
    _log_failure(reason, error, "PyTorch SDPA or the host's attention")


autograd.on_backward_failure(_backward_failed)


# --- counters and once-per-reason logging ---------------------------------------------------------


def stats() -> dict:
    """Calls per path since the last reset: {"kernel": n (of which "kernel_8bit" ran in 8-bit attention),
    "fallback": n, "fallback_reasons": {reason: n}, "exact_not_8bit_reasons": {reason: n}}."""
    return {"kernel": state.kernel_calls, "kernel_8bit": state.eight_bit_calls,
            "fallback": sum(state.fallbacks.values()), "fallback_reasons": dict(state.fallbacks),
            "exact_not_8bit_reasons": dict(state.exact_reasons)}


def reset_stats() -> None:
    """Zero the counters (reasons already logged stay logged)."""
    state.kernel_calls = state.eight_bit_calls = 0
    state.fallbacks.clear()
    state.exact_reasons.clear()


def count_kernel_call() -> None:
    """Counts a call an integration ran on the kernels through its own plan (stats()["kernel"])."""
    state.kernel_calls += 1


def count_fallback(reason: str, fallback_name: str) -> str:
    """`reason` of a call an integration sent to its own fallback, counted in stats() and logged once."""
    return _fell_back(reason, fallback_name)


def _ran_exact(reason: str) -> None:
    """Counts, and logs once per reason, why a call asked to run in 8 bits ran exact."""
    state.exact_reasons[reason] += 1
    _log_once("8-bit attention", reason, "the exact kernels", "run")


def _fell_back(reason: str, fallback_name: str) -> str:
    """`reason`, counted and logged once."""
    state.fallbacks[reason] += 1
    _log_once("the kernels", reason, fallback_name)
    return reason


def _log_once(unused: str, reason: str, runner: str, verb: str = "runs") -> None:
    """INFO "not using <unused>: <reason> (<runner> <verb> these calls)", once per (unused, reason).
    Remembered only once shown, so turning INFO on later still shows every reason once."""
    if (unused, reason) not in state.logged and log.isEnabledFor(logging.INFO):
        state.logged.add((unused, reason))
        log.info("not using %s: %s (%s %s these calls)", unused, reason, runner, verb)


@constant_while_tracing
def _note_traced_fallback(reason: str, fallback_name: str) -> str:
    """`reason`, logged once per reason as why calls in a graph being compiled go to the fallback; runs
    at trace time."""
    if reason not in state.traced_reasons and log.isEnabledFor(logging.INFO):
        state.traced_reasons.add(reason)
        log.info("not using the kernels in a torch.compile graph: %s (%s runs these calls)", reason, fallback_name)
    return reason


@contextlib.contextmanager
def precision(choice: str):
    """Within the block (in this thread or task), calls take `choice` ("exact" | "8bit-qkpv") instead of
    settings.precision: a host's per-model option, such as the ComfyUI node's. Not inside code that
    torch.compile traces (dynamo cannot trace a context variable; compiled graphs run exact anyway)."""
    token = state.precision.set(check_precision(choice))
    try:
        yield
    finally:
        state.precision.reset(token)


# --- running a plan ------------------------------------------------------------------------------------


def _cast(plan: AttentionPlan, query, key, value):
    """(query, key, value) cast to the plan's run_dtype, once per call; callers skip the call where the
    plan makes no cast."""
    return query.to(plan.run_dtype), key.to(plan.run_dtype), value.to(plan.run_dtype)


def _eight_bit_output(plan: AttentionPlan, query, key, value) -> torch.Tensor:
    """8-bit attention's output; the exact kernels' where this call's inputs are outside the 8-bit bar
    (quantized.accuracy_refusal) or the 8-bit kernels failed."""
    reason = quantized.accuracy_refusal(query, key, value)
    if reason is None:
        try:
            out = quantized.launch_quantized(plan.eight_bit, query, key, value)
        except KernelUnavailable:
            raise
        except Exception as exc:  # 8-bit attention failing must cost precision's speed, not the exact kernels
            if isinstance(exc, torch.cuda.OutOfMemoryError):  # the pass's buffers: later calls try again
                reason = "8-bit attention's buffers did not fit in GPU memory"
            else:
                reason = _failure_reason("8-bit attention", exc, query.device)
                log.warning("8-bit attention is now off: %s (the exact kernels run its calls)", reason)
                log.debug("the error behind %r:", reason, exc_info=exc)
                disable_eight_bit(query.device, reason)
        else:
            state.eight_bit_calls += 1
            return out
    out = attention.launch_forward(plan.kernel, query, key, value, launcher=plan.launcher)[0]
    _ran_exact(reason)
    return out


# --- the entry points ---------------------------------------------------------------------------------


def _run(plan: AttentionPlan | Refusal, query, key, value, fallback_name: str, with_lse: bool = False):
    """What an entry returns for its plan: the kernels' output, in the dtype SDPA would return (`with_lse`:
    (out, lse) of the exact kernels), counted in stats(); else the reason the call falls back, the plan's
    refusal or why its kernels failed, counted and logged once. In a graph being compiled nothing is
    counted, and a kernel that fails raises there."""
    tracing = is_compiling()
    if isinstance(plan, Refusal):
        return _note_traced_fallback(plan.reason, fallback_name) if tracing else _fell_back(plan.reason, fallback_name)
    try:
        if plan.run_dtype is not None:
            query, key, value = _cast(plan, query, key, value)
        kernel, lse = plan.kernel, None
        if with_lse or plan.backward or tracing:  # the differentiable op, which a graph can hold too
            out, lse = autograd.flash_attention_with_lse(query, key, value, kernel.is_causal, kernel.scale,
                                                         attn_mask=kernel.mask, bottom_right=kernel.bottom_right)
        elif plan.eight_bit is not None:
            out = _eight_bit_output(plan, query, key, value)
        else:
            out = attention.launch_forward(kernel, query, key, value, launcher=plan.launcher)[0]
        if out.dtype != plan.out_dtype:
            out = out.to(plan.out_dtype)
    except Exception as error:  # a kernel-side bug must cost speed, never the host's run
        if tracing:
            raise
        return _fell_back(_launch_failed(error, plan.symbols, query.device, fallback_name), fallback_name)
    if not tracing:
        state.kernel_calls += 1
        if plan.exact_reason is not None and not with_lse:
            _ran_exact(plan.exact_reason)
    return (out, lse) if with_lse else out


def attention_or_reason(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
    fallback_name="the caller's attention",
) -> torch.Tensor | str:
    """The kernels' result for a supported call, else the reason it is not (counted in stats() and
    logged once, with `fallback_name`: what the caller runs instead); the caller then runs its own
    fallback. For hosts whose fallback is their own attention backend rather than PyTorch SDPA.
    Calls inside compiled graphs are decided once per graph and not counted."""
    plan = plan_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _run(plan, query, key, value, fallback_name)


def attention_with_lse_or_reason(query, key, value, attn_mask=None, is_causal=False, *, scale=None, enable_gqa=False,
                                 fallback_name="the caller's attention"):
    """attention_or_reason (dropout_p 0) with the log-sum-exp: (out, lse (batch, heads, seq_q) float32
    natural log, +inf for rows that see no key), or the reason the kernels do not take the call. 8-bit
    attention has no lse: these calls run exact."""
    plan = plan_attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    return _run(plan, query, key, value, fallback_name, with_lse=True)


def varlen_attention_or_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                               is_causal: bool = False, scale: float | None = None, *,
                               fallback_name: str = "the caller's attention"):
    """(out, lse) of a packed variable-length batch (flash-attn's varlen layout, causal aligned
    bottom-right per entry) through the kernels, differentiable; else the reason they cannot take it
    (counted and logged once, as attention_or_reason does). Unsound offsets or lengths raise ValueError
    first (planner.plan_varlen)."""
    plan = planner.plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    if isinstance(plan, Refusal):
        return _fell_back(plan.reason, fallback_name)
    try:
        result = autograd.varlen_attention(plan.kernel, q, k, v, cu_seqlens_q, cu_seqlens_k)
    except Exception as error:  # a kernel-side bug must cost speed, never the host's run
        return _fell_back(_launch_failed(error, plan.symbols, q.device, fallback_name), fallback_name)
    state.kernel_calls += 1
    return result


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
    return state.fallback_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)


def use_fallback(function=None) -> None:
    """Send unsupported calls to `function`, or to torch's own SDPA when None. patch_sdpa() passes
    the function it replaced, so a host's own SDPA wrapper (SD.Next's sliced or Triton attention)
    keeps serving every call the kernels do not take."""
    state.fallback_sdpa = torch_sdpa if function is None else function


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> str:
    """Why a call with these SDPA arguments would or would not run on the kernels (nothing is run,
    apart from the device's first-use self-test)."""
    plan = plan_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(plan, Refusal):
        return f"falls back to PyTorch SDPA: {plan.reason}"
    kernel = plan.kernel
    kind = "causal" if kernel.is_causal else "non-causal"
    if kernel.mask is not None:
        kind += f", {'bool' if kernel.mask.dtype == torch.bool else 'additive'} mask"
    if kernel.kv_group != 1:
        kind += f", {kernel.kv_group} query heads per key/value head"
    grad = ", forward and backward" if plan.backward else ""
    exact_reason = plan.exact_reason
    if plan.eight_bit is not None:
        if plan.run_dtype is not None:
            query, key, value = _cast(plan, query, key, value)
        exact_reason = quantized.accuracy_refusal(query, key, value)
    precision = ", in 8-bit attention (int8 Q K^T, fp8 P V)" if exact_reason is None and plan.eight_bit else ""
    if exact_reason:
        precision = f", exact, not 8-bit: {exact_reason}"
    return f"runs on the kernels: {kernel.dtype}, head dim {kernel.head_dim}, {kind}{grad}{precision}"
