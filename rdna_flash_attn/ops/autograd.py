"""The differentiable attention op, for arguments a plan took (plans.plan_forward, plans.plan_varlen): it
launches, and checks nothing again.

On torch >= 2.4 the forward and backward kernels are registered as torch.library custom ops with
fake implementations (exact shapes, strides and dtypes), so torch.compile traces through them
without graph breaks. Older torch (ZLUDA users run 2.2 to 2.7) gets a torch.autograd.Function with
the same behaviour. A custom op's arguments are tensors and numbers: the op works its launch out again
from them (plans.forward_geometry), without the checks.
"""

from __future__ import annotations

import contextlib

import torch

from . import attention, plans

HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op")


def _free_op_namespace(base: str = "rdna_flash_attn") -> str:
    """The first op namespace with no `fwd` op yet. A second copy of this package in one process
    (imported under another module name, e.g. by a host's plugin loader) then registers its own ops
    instead of failing, as torch < 2.6 does on a repeated registration."""
    namespace, copy = base, 1
    while hasattr(getattr(torch.ops, namespace), "fwd"):
        copy += 1
        namespace = f"{base}_{copy}"
    return namespace


def _stats_or_empty(q, training: bool) -> attention.BackwardStats:
    """What a training forward saves for the backward (attention.BackwardStats), or empty tensors: a
    custom op's outputs are tensors."""
    if training:
        return attention.backward_stats_like(q)
    return attention.BackwardStats(q.new_empty(0), *(q.new_empty(0, dtype=torch.float32) for _ in range(2)))


def _forward(q, k, v, attn_mask, is_causal, scale, bottom_right, training):
    """(out, lse, *BackwardStats), the stats empty unless training."""
    stats = _stats_or_empty(q, training)
    saved = stats if training else None
    kernel_q, kernel_k, kernel_v = (attention.kernel_layout(t) for t in (q, k, v))
    plan = plans.forward_geometry(kernel_q, kernel_k, kernel_v, is_causal, scale, attn_mask, bottom_right)
    if kernel_q is q:
        out, lse = attention.launch_forward(plan, kernel_q, kernel_k, kernel_v, saved=saved)
        return out, lse, *stats
    # A copied query may lie in another memory order than q: the output keeps q's, as the fake
    # implementation promises a compiled graph.
    out, lse = attention.output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    attention.launch_forward(plan, kernel_q, kernel_k, kernel_v, out=out, lse=lse, saved=saved)
    return out, lse, *stats


_backward_failure_listeners = []


def on_backward_failure(listener) -> None:
    """Calls listener(error, q, masked) whenever a backward's kernels raise, before the error reaches
    the caller's backward: the dispatcher turns those kernels off for its later calls."""
    _backward_failure_listeners.append(listener)


@contextlib.contextmanager
def _failures_told(q, masked: bool):
    try:
        yield
    except Exception as error:
        for listener in _backward_failure_listeners:
            listener(error, q, masked)
        raise


def _backward(dout, q, k, v, out, lse, stats, attn_mask, is_causal, scale, bottom_right):
    """Gradients; with a training forward's out and stats (non-empty) dQ sweeps the keys once."""
    saved = attention.BackwardStats(*stats) if stats[0].numel() else None
    with _failures_told(q, attn_mask is not None):
        grads = attention.launch_backward(attention.kernel_layout(dout),
                                          *(attention.kernel_layout(t) for t in (q, k, v)), lse, is_causal, scale,
                                          attn_mask=attn_mask, bottom_right=bottom_right,
                                          out=out if saved is not None else None, saved=saved)
    return tuple(_in_memory_order_of(grad, t) for grad, t in zip(grads, (q, k, v)))


def needs_gradients(q, k, v) -> bool:
    """Whether autograd will want gradients of this call (the forward then saves what makes the
    backward's dQ one sweep)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _in_memory_order_of(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """grad laid out as attention.output_like(t), the layout the fake implementation promises (a copied
    input may have had another memory order)."""
    size, stride = plans.output_layout(t.shape, t.stride())
    if grad.stride() == stride:
        return grad
    return torch.empty_strided(size, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


if HAS_CUSTOM_OP:
    OP_NAMESPACE = _free_op_namespace()

    @torch.library.custom_op(f"{OP_NAMESPACE}::fwd", mutates_args=(), device_types="cuda")
    def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                scale: float | None, bottom_right: bool, training: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward(q, k, v, attn_mask, is_causal, scale, bottom_right, training)

    @_fwd_op.register_fake
    def _(q, k, v, attn_mask, is_causal, scale, bottom_right, training):
        return attention.output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), *_stats_or_empty(q, training)

    @torch.library.custom_op(f"{OP_NAMESPACE}::bwd", mutates_args=(), device_types="cuda")
    def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, out_low: torch.Tensor, row_offset: torch.Tensor, row_log2_sum: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                bottom_right: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(dout, q, k, v, out, lse, (out_low, row_offset, row_log2_sum), attn_mask, is_causal, scale,
                         bottom_right)

    @_bwd_op.register_fake
    def _(dout, q, k, v, out, lse, out_low, row_offset, row_log2_sum, attn_mask, is_causal, scale, bottom_right):
        return attention.output_like(q), attention.output_like(k), attention.output_like(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, attn_mask, is_causal, scale, bottom_right, _training_flag = inputs
        # The output too, as PyTorch's own flash SDPA saves it: modifying it in place before the
        # backward is the error autograd reports for SDPA on CUDA as well.
        ctx.save_for_backward(q, k, v, *output, attn_mask)
        ctx.is_causal, ctx.scale, ctx.bottom_right = is_causal, scale, bottom_right
        ctx.mark_non_differentiable(*output[1:])

    def _fwd_backward(ctx, dout, *_grads_of_statistics):
        q, k, v, out, lse, out_low, row_offset, row_log2_sum, attn_mask = ctx.saved_tensors
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, out_low, row_offset, row_log2_sum, attn_mask, ctx.is_causal,
                             ctx.scale, ctx.bottom_right)
        return dq, dk, dv, None, None, None, None, None

    _fwd_op.register_autograd(_fwd_backward, setup_context=_setup_context)

    def flash_attention_with_lse(q, k, v, is_causal: bool = False, scale: float | None = None, *,
                                 attn_mask: torch.Tensor | None = None, bottom_right: bool = False):
        """(out, lse) of flash_attention: lse (B, H, S_q) float32 natural log, not differentiable."""
        out, lse, *_stats = _fwd_op(q, k, v, attn_mask, bool(is_causal), None if scale is None else float(scale),
                                    bool(bottom_right), needs_gradients(q, k, v))
        return out, lse

else:

    class _FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, attn_mask, is_causal, scale, bottom_right, training):
            out, lse, *stats = _forward(q, k, v, attn_mask, is_causal, scale, bottom_right, training)
            ctx.save_for_backward(q, k, v, out, lse, *stats, attn_mask)
            ctx.is_causal, ctx.scale, ctx.bottom_right = is_causal, scale, bottom_right
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse, *stats, attn_mask = ctx.saved_tensors
            dq, dk, dv = _backward(dout, q, k, v, out, lse, stats, attn_mask, ctx.is_causal, ctx.scale,
                                   ctx.bottom_right)
            return dq, dk, dv, None, None, None, None, None

    def flash_attention_with_lse(q, k, v, is_causal: bool = False, scale: float | None = None, *,
                                 attn_mask: torch.Tensor | None = None, bottom_right: bool = False):
        """(out, lse) of flash_attention: lse (B, H, S_q) float32 natural log, not differentiable."""
        return _FlashAttention.apply(q, k, v, attn_mask, bool(is_causal), None if scale is None else float(scale),
                                     bool(bottom_right), needs_gradients(q, k, v))


def flash_attention(q, k, v, is_causal: bool = False, scale: float | None = None, *,
                    attn_mask: torch.Tensor | None = None, bottom_right: bool = False) -> torch.Tensor:
    """Attention through the kernels, differentiable in q, k and v, for arguments plans.plan_forward took
    (nothing is checked here); (B, H, S, D) views, SDPA's attn_mask (not differentiated), fewer key/value
    heads than query heads allowed."""
    return flash_attention_with_lse(q, k, v, is_causal, scale, attn_mask=attn_mask, bottom_right=bottom_right)[0]


class _VarlenAttention(torch.autograd.Function):
    """Packed variable-length batches (flash-attn's varlen layout); an autograd.Function: torch.compile
    breaks the graph around it."""

    @staticmethod
    def forward(ctx, plan, q, k, v, cu_seqlens_q, cu_seqlens_k, training):
        saved = attention.backward_stats_like(q, varlen=True) if training else None
        out, lse = attention.launch_varlen_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, saved=saved)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *(saved or ()))
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *stats = ctx.saved_tensors
        saved = attention.BackwardStats(*stats) if stats else None
        with _failures_told(q, False):
            grads = attention.launch_varlen_backward(ctx.plan, attention.packed_kernel_layout(dout), q, k, v, lse,
                                                     cu_seqlens_q, cu_seqlens_k,
                                                     out=out if saved is not None else None, saved=saved)
        return (None, *grads, None, None, None)


def varlen_attention(plan: plans.VarlenPlan, q, k, v, cu_seqlens_q, cu_seqlens_k):
    """(out, lse) of a packed batch `plan` took (attention.launch_varlen_forward), differentiable in q, k and v."""
    return _VarlenAttention.apply(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, needs_gradients(q, k, v))


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           is_causal: bool = False, scale: float | None = None):
    """varlen_attention, planned here: q, k and v as the kernels read them (odd views copied), then their
    offsets and themselves checked (attention.plan_packed), ValueError for what the kernels do not take."""
    q, k, v = (attention.packed_kernel_layout(t) for t in (q, k, v))
    plan = attention.plan_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    return varlen_attention(plan, q, k, v, cu_seqlens_q, cu_seqlens_k)
