"""torch's private flash attention ops on the kernels, opt-in (RDNA_FA_ATEN_OPS=1 / serve_aten_attention()).

torch's context parallelism (torch.distributed.tensor.experimental.context_parallel) runs its ring over
`aten::_scaled_dot_product_flash_attention` and `aten::_scaled_dot_product_flash_attention_backward` on
each rank's chunk, called directly, so no override of `F.scaled_dot_product_attention` reaches it; xDiT's
default backend calls the forward op directly too. Here both ops get a kernel at the GPU's dispatch key
(CUDA, which ROCm builds of PyTorch use for HIP) that runs our kernels on the calls the dispatcher takes
(on RDNA GPUs only, decided per call as for every other entry) and hands every other call, with its
dispatch key set, to the kernel that was registered before (torch.library.get_kernel, PyTorch 2.9 and
newer). Autograd stays torch's: its derivative of the forward op is the backward op, which recomputes from
the out and logsumexp it is given, as ring attention needs.

Calls taken: float16/bfloat16 without dropout or debug mask, causal only with as many queries as keys
(the op's causal mask is then the same in every alignment), on a device whose kernels passed their
self-test. `aten::_scaled_dot_product_efficient_attention` is left alone: its logsumexp is padded to a
multiple of 32 rows and its backward takes a bias and a gradient mask; callers that choose it keep
PyTorch's kernel.
"""

from __future__ import annotations

import logging

import torch

from ..config import LOGGER_NAME, settings
from ..dispatch import planner, router
from ..ops import attention as ops
from ..ops.plans import Refusal

FORWARD = "_scaled_dot_product_flash_attention"
BACKWARD = "_scaled_dot_product_flash_attention_backward"
_FALLBACK = "PyTorch's own _scaled_dot_product_flash_attention"

log = logging.getLogger(LOGGER_NAME)
# device type -> the aten IMPL library holding our kernels for it
_served: dict[str, torch.library.Library] = {}


def serve_aten_attention(device_type: str = "cuda") -> str | None:
    """Register our kernels for the flash attention aten ops at `device_type`'s dispatch key; None once
    serving, else why not (also logged). For "cuda" only in ROCm builds of PyTorch (or with
    settings.force, for the NVIDIA emulation): each call's plan then decides per device, so calls on a
    GPU the kernels do not run on (CDNA, an older RDNA) keep PyTorch's kernel. Probes no device.
    Idempotent."""
    if device_type in _served:
        return None
    reason = None
    if not hasattr(torch.library, "get_kernel"):
        reason = f"PyTorch {torch.__version__} has no torch.library.get_kernel (PyTorch 2.9 or newer)"
    elif device_type == "cuda" and not torch.version.hip and not settings.force:
        reason = "not a ROCm build of PyTorch"
    if reason is not None:
        log.warning("not serving torch's flash attention ops: %s", reason)
        return reason
    key = "Meta" if device_type == "meta" else device_type.upper()
    library = torch.library.Library("aten", "IMPL")
    library.impl(FORWARD, _forward_kernel(_previous(FORWARD, key)), key, with_keyset=True)
    library.impl(BACKWARD, _backward_kernel(_previous(BACKWARD, key)), key, with_keyset=True)
    _served[device_type] = library
    log.info("serving torch's flash attention ops (%s, %s) on %s devices", FORWARD, BACKWARD, device_type)
    return None


def _previous(name: str, key: str):
    """call(keyset, *args, **kwargs) of the kernel registered for aten::name at `key` before ours; where
    there is none (PyTorch's CPU builds have no CUDA or CPU kernel for these ops), one that raises the
    NotImplementedError the op raised without us."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
        return torch.library.get_kernel(f"aten::{name}", key).call_boxed

    def missing(keyset, *args, **kwargs):
        raise NotImplementedError(f"aten::{name} has no {key} kernel in this PyTorch build "
                                  "(rdna_flash_attn's kernels do not take this call)")

    return missing


def stop_serving_aten_attention(device_type: str = "cuda") -> None:
    """Give the ops back their previous kernels."""
    library = _served.pop(device_type, None)
    if library is not None:
        library._destroy()


def serve_if_requested() -> str | None:
    """serve_aten_attention() where settings.aten_ops (RDNA_FA_ATEN_OPS=1) asks for it; None otherwise."""
    return serve_aten_attention() if settings.aten_ops else None


def _plan(query, key, value, dropout_p, is_causal, scale):
    """The exact kernels' plan of an op call, or why the call stays with PyTorch's kernel."""
    if dropout_p:
        return Refusal("dropout_p is not 0")
    if is_causal and query.shape[2] != key.shape[2]:
        return Refusal("causal with different query and key lengths (the op's alignment is its own)")
    with torch.no_grad():
        plan = planner.plan_attention(query, key, value, None, 0.0, bool(is_causal), scale,
                                      key.shape[1] != query.shape[1], backward=True)
    if isinstance(plan, Refusal):
        return plan
    if plan.kernel.dtype != query.dtype:
        return Refusal(f"{query.dtype} inputs")
    return plan


def _rng_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's philox seed and offset, unused without dropout, in the dtypes its builds give."""
    if torch.version.hip:
        return torch.zeros((), dtype=torch.long, device=device), torch.zeros((), dtype=torch.long, device=device)
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def _forward_kernel(original):
    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        plan = Refusal("return_debug_mask") if return_debug_mask else _plan(query, key, value, dropout_p, is_causal,
                                                                              scale)
        if isinstance(plan, Refusal):
            router.count_fallback(plan.reason, _FALLBACK)
            return original(keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
        out, lse = ops.launch_forward(plan.kernel, query, key, value, launcher=plan.launcher)
        router.count_kernel_call()
        seed, offset = _rng_placeholders(query.device)
        return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, query.new_empty(0)

    return forward


def _backward_kernel(original):
    def backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, philox_seed, philox_offset, *, scale=None):
        plan = Refusal("packed (nested) sequences") if cum_seq_q is not None else _plan(query, key, value, dropout_p,
                                                                                        is_causal, scale)
        if not isinstance(plan, Refusal) and (grad_out.dtype != query.dtype or out.dtype != query.dtype):
            plan = Refusal("grad_out or out in another dtype than the query")
        if isinstance(plan, Refusal):
            router.count_fallback(plan.reason, _FALLBACK)
            return original(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                            dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
        grads = ops.launch_backward_from_output(ops.kernel_layout(grad_out), query, key, value,
                                                ops.kernel_layout(out), logsumexp, bool(is_causal), plan.kernel.scale)
        router.count_kernel_call()
        return grads

    return backward
