"""fp64 attention reference and the error yardsticks: for the forward, PyTorch's math SDPA in the input
dtype; for the backward, FlashAttention-2's own criterion (the same attention computed in the input
dtype, flash-attn's `attention_ref(upcast=False, reorder_ops=True)`).

Masks follow SDPA (bool: True takes part; float: added to the scores), a causal mask is top-left
aligned unless bottom_right (flash-attn's), fewer key/value heads than query heads are shared by
groups (enable_gqa), and a row that sees no key gives zeros, as SDPA's math backend does.
"""

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def additive_mask(attn_mask, dtype=torch.float64):
    """attn_mask as a float bias: bool False becomes -inf."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return None if attn_mask is None else attn_mask.to(dtype)
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))


def causal_mask(seq_q, seq_k, bottom_right=False, device="cuda"):
    """True where a query sees a key: top-left (SDPA) or bottom-right (flash-attn) aligned."""
    shift = seq_k - seq_q if bottom_right else 0
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(diagonal=shift)


def _shared_heads(q, k, v):
    group = q.shape[1] // k.shape[1]
    return (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def _masked(scores, is_causal, attn_mask, bottom_right):
    """scores with the causal mask and attn_mask applied, in the dtype PyTorch's promotion gives them
    (a float32 mask promotes 16-bit scores; a bool mask keeps theirs)."""
    if is_causal:
        scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], bottom_right, scores.device), float("-inf"))
    if attn_mask is not None:
        scores = scores + additive_mask(attn_mask, torch.promote_types(scores.dtype, attn_mask.dtype))
    return scores


def attention_fp64(q, k, v, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    """Exact attention in float64 on (B, H, S, D) tensors; returns (out, lse). Differentiable."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = _shared_heads(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _masked((q @ k.transpose(-1, -2)) * scale, is_causal, attn_mask, bottom_right)
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)[..., None]
    row_max = torch.where(seen, scores.amax(-1, keepdim=True), torch.zeros_like(lse[..., None])).detach()
    weights = torch.exp(scores - row_max)  # 0 for every key of a row that sees none
    total = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(seen, total, torch.ones_like(total))
    return probs @ v, lse


def sdpa_math(q, k, v, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    """PyTorch's math SDPA in the inputs' dtype (a bottom-right causal mask passed as attn_mask)."""
    if is_causal and bottom_right:
        attn_mask, is_causal = causal_mask(q.shape[2], k.shape[2], True, q.device), False
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                                scale=scale, **extra)


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


def grads_fp64(q, k, v, dout, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    """dq, dk, dv of exact attention in float64."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_fp64(q, k, v, is_causal, scale, attn_mask, bottom_right)
    return torch.autograd.grad(out, (q, k, v), dout.double())


def grads_sdpa_math(q, k, v, dout, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = sdpa_math(q, k, v, is_causal, scale, attn_mask, bottom_right)
    return torch.autograd.grad(out, (q, k, v), dout)


def attention_input_dtype(q, k, v, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    """flash-attn's attention_ref(upcast=False, reorder_ops=True) on (B, H, S, D) tensors: the scores,
    the softmax (PyTorch's, whose result is rounded to the dtype) and both products in the inputs'
    dtype, the scale applied to k. A float mask is added as is (a float32 one promotes the scores, as in
    plain PyTorch); a row that sees no key gives zeros. Differentiable."""
    k, v = _shared_heads(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _masked(q @ (k * scale).transpose(-1, -2), is_causal, attn_mask, bottom_right)
    dead = torch.isneginf(scores).all(-1, keepdim=True)  # softmax of such a row is NaN, and so its gradient
    attention = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0).to(v.dtype)
    return attention @ v


def grads_input_dtype(q, k, v, dout, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_input_dtype(q, k, v, is_causal, scale, attn_mask, bottom_right)
    return torch.autograd.grad(out, (q, k, v), dout)


# flash-attn's tests/test_flash_attn.py: `(dq - dq_ref).abs().max() <= 2 * (dq_pt - dq_ref).abs().max() + 1e-5`
FA2_ABSOLUTE_FLOOR = 1e-5


def backward_bound(input_dtype_error: float) -> float:
    """FlashAttention-2's criterion for one gradient: 2 x the input-dtype attention's max error against
    float64, plus flash-attn's absolute floor (what lets an exact-zero error still pass)."""
    return 2 * input_dtype_error + FA2_ABSOLUTE_FLOOR


def summed_backward_bound(input_dtype_error: float, reference: torch.Tensor, dtype: torch.dtype,
                          roundings: int) -> float:
    """FlashAttention-2's criterion for a gradient that ring attention sums from partial gradients, each
    returned in `dtype` as flash-attn (and torch's attention ops) return them: the input-dtype attention's
    error plus one rounding of the gradient to `dtype` per partial and per cast of the sum (`roundings`),
    doubled, plus flash-attn's floor. `reference`: the float64 gradient."""
    rounding = max_error(reference.to(dtype), reference)
    return backward_bound(input_dtype_error + roundings * rounding)


def rising_scores(batch, heads, seq_q, seq_k, head_dim, rise, dtype, generator, device="cuda"):
    """Q and K (B, H, S, D) whose scores at the default scale, in base 2, rise by `rise` from each block of
    64 keys to the next and spread over 3 units inside one: with rise > 0 a forward's key tiles keep
    meeting new row maxima (every 64 keys at least), with rise < 0 the first tile holds them all
    (the traits' skips_rescale)."""
    q = 0.1 * torch.randn(batch, heads, seq_q, head_dim, generator=generator, device=device)
    k = 0.1 * torch.randn(batch, heads, seq_k, head_dim, generator=generator, device=device)
    q[..., 0] = 1.0
    blocks = torch.arange(seq_k, device=device) // 64
    base2_scores = blocks * rise - 3 * torch.rand(seq_k, generator=generator, device=device)
    k[..., 0] = base2_scores * math.sqrt(head_dim) * math.log(2)
    return q.to(dtype), k.to(dtype)
