"""flash-attn 2.8.3's Python API (`flash_attn.flash_attn_interface`) on the dispatcher, for code
written against Dao-AILab's flash-attn: the same functions, arguments, defaults and results, with
the kernels where they take a call and PyTorch SDPA where they do not.

flash-attn semantics kept: (batch, tokens, heads, head dim) tensors in and contiguous ones out; causal
masks and sliding windows aligned to the bottom-right corner (SDPA's causal is top-left when query and
key lengths differ); ALiBi slopes; fewer key/value heads than query heads (MQA/GQA); rows that see no
key give zeros; packed variable-length batches (the varlen functions). Where SDPA's arguments cannot
say it, an explicit bottom-right mask or ALiBi bias does, which the kernels take too.

return_attn_probs=True gives flash-attn's (out, softmax_lse, None). Where SDPA runs a call, rows that see no
key still give zeros (and zero gradients), ALiBi is added in float32 as flash-attn adds it, and
deterministic=True holds SDPA to its math backend (the kernels' backward is deterministic already).

Not implemented (NotImplementedError): return_attn_probs=True with dropout_p > 0 (flash-attn's S_dmask, the
dropped-out probabilities, exists for its own tests), softcap, block_table (a paged KV cache); in the private
forward/backward pairs dropout, return_softmax=True, leftpad_k and seqused_k. float32 inputs are accepted (they
run on SDPA).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..dispatch import planner, router

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch 2.2, which ZLUDA hosts still run
    SDPBackend = sdpa_kernel = None
from ..ops import attention as ops
from ..ops.plans import Refusal

_DENSE_FALLBACK = "PyTorch SDPA"
_VARLEN_FALLBACK = "per-entry attention (flash_attn_varlen_func)"
# The float32 math of the private forward/backward pair works on blocks of query rows holding at most
# this many scores, so long sequences cost time, not memory.
_MATH_BLOCK_SCORES = 1 << 24


# --- argument checks ---------------------------------------------------------------------------------


def _refuse_unsupported(function: str, softcap, return_attn_probs, dropout_p, block_table=None) -> None:
    if return_attn_probs and dropout_p > 0:
        raise NotImplementedError(
            f"rdna_flash_attn's {function} does not support return_attn_probs=True with dropout_p > 0 "
            "(flash-attn's S_dmask, the dropped-out probabilities, exists for its own tests)"
        )
    if softcap:
        raise NotImplementedError(f"rdna_flash_attn's {function} does not support softcap (tanh soft-capping)")
    if block_table is not None:
        raise NotImplementedError(f"rdna_flash_attn's {function} does not support block_table (a paged KV cache)")


def _check_inputs(q, k, v, layout: str) -> None:
    """flash-attn's checks on q, k and v, as ValueError: `layout` names their dimensions."""
    dims = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D {layout} tensor")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"head dims of q, k and v differ ({q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]})")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ ({tuple(k.shape)}, {tuple(v.shape)})")
    if dims == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes of q and k differ ({q.shape[0]}, {k.shape[0]})")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"heads of k and v ({k.shape[-2]}) must divide the heads of q ({q.shape[-2]})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype ({q.dtype}, {k.dtype}, {v.dtype})")


def _check_alibi(alibi_slopes, batch: int, heads: int) -> None:
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must be ({heads},) or ({batch}, {heads}), not {tuple(alibi_slopes.shape)}")


# --- flash-attn's masks as SDPA's -------------------------------------------------------------------


def _window(causal: bool, window_size, seq_q: int, seq_k: int) -> tuple[int, int]:
    """flash-attn's (left, right) window on the bottom-right-aligned diagonal, -1 meaning unbounded;
    causal is right = 0. A bound that excludes no key of any row becomes -1, so what SDPA's own
    arguments can say needs no mask (a one-row causal query, windows wider than the keys)."""
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    if left >= seq_k - 1:  # the last row's lowest key is then 0 or below
        left = -1
    if right >= seq_q - 1:  # the first row's highest key is then seq_k - 1 or above
        right = -1
    return left, right


def _attn_mask(q, k, left: int, right: int, alibi_slopes) -> torch.Tensor | None:
    """SDPA's attn_mask for (batch, heads, tokens, dim) views: bool (seq_q, seq_k) for the window, or a
    float32 ALiBi bias (heads or batch x heads, seq_q, seq_k) with -inf outside it; None for neither."""
    if left < 0 and right < 0 and alibi_slopes is None:
        return None
    seq_q, seq_k = q.shape[2], k.shape[2]
    diagonal = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    keys = torch.arange(seq_k, device=q.device)[None, :]
    allowed = None
    if left >= 0:
        allowed = keys >= diagonal - left
    if right >= 0:
        below = keys <= diagonal + right
        allowed = below if allowed is None else allowed & below
    if alibi_slopes is None:
        return allowed
    # flash-attn gives the slopes no gradient; a mask that needs one would keep the kernels off.
    slopes = alibi_slopes.detach().to(device=q.device, dtype=torch.float32)[..., None, None]
    bias = -slopes * (diagonal - keys).abs()
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


# --- dense batches --------------------------------------------------------------------------------------


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash-attn's attention on (batch, tokens, heads, head dim) tensors: the kernels through the
    dispatcher, else SDPA. (out contiguous (batch, tokens, heads, head dim), flash-attn's softmax_lse
    (batch, heads, seq_q) where return_lse, else None); return_lse needs dropout_p 0."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # views: (batch, heads, tokens, head dim)
    seq_q, seq_k = q.shape[2], k.shape[2]
    left, right = _window(causal, window_size, seq_q, seq_k)
    # SDPA's causal is top-left: the same as flash-attn's only when the lengths agree.
    is_causal = alibi_slopes is None and left < 0 and right == 0 and seq_q == seq_k
    mask = None if is_causal else _attn_mask(q, k, left, right, alibi_slopes)
    grouped = k.shape[1] != q.shape[1]
    if return_lse:
        result = router.attention_with_lse_or_reason(q, k, v, mask, is_causal, scale=softmax_scale,
                                                     enable_gqa=grouped, fallback_name=_DENSE_FALLBACK)
    else:
        result = router.attention_or_reason(q, k, v, mask, dropout_p, is_causal, scale=softmax_scale,
                                            enable_gqa=grouped, fallback_name=_DENSE_FALLBACK)
        result = result if isinstance(result, str) else (result, None)
    if isinstance(result, str):
        out = _sdpa(q, k, v, mask, dropout_p, is_causal, softmax_scale, deterministic)
        lse = None
        if return_lse:
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
            lse = _math_lse(q, k, scale, _attn_mask(q, k, left, right, alibi_slopes))
        result = out, lse
    out, lse = result
    return out.transpose(1, 2).contiguous(), None if lse is None else lse.contiguous()


def _deterministic_sdpa():
    """SDPA held to its math backend, whose backward adds in a fixed order (the others may use atomics)."""
    if sdpa_kernel is not None:
        return sdpa_kernel(SDPBackend.MATH)
    return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False)


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale, deterministic: bool) -> torch.Tensor:
    """torch's SDPA on (batch, heads, tokens, head dim) views, with flash-attn's semantics where SDPA's
    differ: every row that sees no key gives zeros (and zero gradients), an ALiBi bias is added in float32
    whatever the inputs' dtype, and deterministic=True holds SDPA to its math backend."""
    if k.shape[1] != q.shape[1]:  # torch < 2.5 has no enable_gqa: share the key/value heads explicitly
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if k.shape[2] == 0:
        return q.new_zeros(q.shape)
    sees_key = None
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
        sees_key = allowed.any(-1, keepdim=True)
        # SDPA gives such rows NaN (torch < 2.5, and some backends after), which would reach the gradients
        # too: they get every key here, and zeros below.
        mask = mask | ~sees_key if mask.dtype == torch.bool else mask.masked_fill(~sees_key, 0.0)
    # SDPA takes a bias only in the query's dtype; rounding ALiBi's large distances to 16 bits would
    # reweigh the keys, so such calls run in float32 as flash-attn adds the bias.
    in_float32 = mask is not None and mask.is_floating_point() and q.dtype != mask.dtype
    inputs = (q.float(), k.float(), v.float()) if in_float32 else (q, k, v)
    with _deterministic_sdpa() if deterministic else contextlib.nullcontext():
        out = router.torch_sdpa(*inputs, mask, dropout_p, is_causal, scale=scale).to(q.dtype)
    return out if sees_key is None else torch.where(sees_key, out, 0.0)


def _math_lse(q, k, scale: float, mask) -> torch.Tensor:
    """flash-attn's softmax_lse in float32 math on (batch, heads, tokens, dim) views: (batch, heads, seq_q),
    natural log, +inf for rows that see no key. Not differentiable, as flash-attn's is not."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for rows in _row_blocks(q, k):
            lse[:, :, rows] = _scores(q[:, :, rows], k, scale, mask, rows).logsumexp(-1)
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_func`: q (batch, seq_q, heads, head dim), k and v (batch, seq_k,
    kv_heads, head dim) with kv_heads dividing heads; out like q, contiguous. Causal masks and windows
    are aligned to the bottom-right corner; alibi_slopes (heads,) or (batch, heads) add
    -slope * |i + seq_k - seq_q - j|. With return_attn_probs (dropout_p 0), (out, softmax_lse, None):
    softmax_lse float32 (batch, heads, seq_q), natural log, +inf for rows that see no key."""
    _refuse_unsupported("flash_attn_func", softcap, return_attn_probs, dropout_p)
    _check_inputs(q, k, v, "(batch, seqlen, nheads, headdim)")
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    out, lse = _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          return_attn_probs)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head dim)."""
    _refuse_unsupported("flash_attn_qkvpacked_func", softcap, return_attn_probs, dropout_p)
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must be a (batch, seqlen, 3, nheads, headdim) tensor")
    return flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func on q (batch, seq_q, heads, head dim) and kv (batch, seq_k, 2, kv_heads, head dim)."""
    _refuse_unsupported("flash_attn_kvpacked_func", softcap, return_attn_probs, dropout_p)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("kv must be a (batch, seqlen_k, 2, nheads_k, headdim) tensor")
    return flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


# --- packed variable-length batches -----------------------------------------------------------------------


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's `flash_attn_varlen_func`: entry b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    of q (total_q, heads, head dim), its keys and values those of k and v (total_k, kv_heads, head dim);
    cu_seqlens int32 (batch + 1,); max_seqlen an int or a 0-d tensor, no smaller than any entry. Masks,
    windows and ALiBi are aligned to each entry's bottom-right corner. Out (total_q, heads, head dim),
    contiguous; rows of entries without keys, and rows past cu_seqlens_q[-1] (flash-attn leaves those
    uninitialised), are zeros. Unsound offsets or lengths raise ValueError before anything runs, on
    the kernels and entry by entry alike (ops.check_cu_seqlens says what is checked, and when not).
    With return_attn_probs (dropout_p 0), (out, softmax_lse, None): softmax_lse float32 (heads, total_q),
    natural log, +inf for rows that see no key and rows past cu_seqlens_q[-1]."""
    _refuse_unsupported("flash_attn_varlen_func", softcap, return_attn_probs, dropout_p, block_table)
    out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                 softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs)
    return (out, lse, None) if return_attn_probs else out


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, alibi_slopes, deterministic, return_lse: bool):
    """(out, softmax_lse (heads, total_q) or None) of flash_attn_varlen_func's arguments: the varlen kernels
    where they take the call, else entry by entry."""
    _check_inputs(q, k, v, "(total, nheads, headdim)")
    ops.check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1])
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    left, right = _window(causal, window_size, max_seqlen_q, max_seqlen_k)
    if dropout_p == 0 and alibi_slopes is None and left < 0 and right <= 0:
        result = router.varlen_attention_or_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   right == 0, softmax_scale, fallback_name=_VARLEN_FALLBACK)
        if not isinstance(result, str):
            out, lse = result
            return out, lse if return_lse else None
    return _varlen_by_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
                            alibi_slopes, deterministic, return_lse)


def _varlen_by_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
                     alibi_slopes, deterministic, return_lse: bool):
    """(out, softmax_lse (heads, total_q) or None) of a packed batch, one entry at a time through the dense
    path (which takes windows, ALiBi and dropout), on offsets flash_attn_varlen_func has checked as it does
    for the kernels."""
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[1::-1], float("inf"), dtype=torch.float32, device=q.device) if return_lse else None
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for entry in range(len(offsets_q) - 1):
        rows = slice(offsets_q[entry], offsets_q[entry + 1])
        keys = slice(offsets_k[entry], offsets_k[entry + 1])
        if rows.stop <= rows.start or keys.stop <= keys.start:  # nothing to compute; no key: zeros
            continue
        slopes = alibi_slopes[entry] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        entry_out, entry_lse = _attention(q[None, rows], k[None, keys], v[None, keys], dropout_p, softmax_scale,
                                          causal, window_size, slopes, deterministic, return_lse)
        out[rows] = entry_out[0]
        if return_lse:
            lse[:, rows] = entry_lse[0]
    return out, lse


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func on qkv (total, 3, heads, head dim), one cu_seqlens for queries and keys."""
    _refuse_unsupported("flash_attn_varlen_qkvpacked_func", softcap, return_attn_probs, dropout_p)
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError("qkv must be a (total, 3, nheads, headdim) tensor")
    ops.check_cu_seqlens(qkv, qkv, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, shared=True)
    return flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func on q (total_q, heads, head dim) and kv (total_k, 2, kv_heads, head dim)."""
    _refuse_unsupported("flash_attn_varlen_kvpacked_func", softcap, return_attn_probs, dropout_p)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError("kv must be a (total_k, 2, nheads_k, headdim) tensor")
    return flash_attn_varlen_func(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# --- the private forward/backward pair (flash-attn >= 2.7): diffusers' context parallelism, yunchang's and
# xDiT's ring attention drive it ----------------------------------------------------------------------------


def _refuse_private(function: str, dropout_p, softcap) -> None:
    if dropout_p:
        raise NotImplementedError(
            f"rdna_flash_attn's {function} does not support dropout_p > 0 (its backward would need "
            "flash-attn's random state)"
        )
    if softcap:
        raise NotImplementedError(f"rdna_flash_attn's {function} does not support softcap (tanh soft-capping)")


def _row_blocks(q, k):
    """Slices of query rows, each holding at most _MATH_BLOCK_SCORES scores."""
    batch, heads, seq_q = q.shape[:3]
    rows = max(1, _MATH_BLOCK_SCORES // max(1, batch * heads * k.shape[2]))
    return (slice(start, min(start + rows, seq_q)) for start in range(0, seq_q, rows))


def _scores(q_rows, k, scale: float, mask, rows: slice) -> torch.Tensor:
    """float32 scaled scores of a block of query rows, with the mask's rows applied (k already repeated
    to the query heads)."""
    scores = (q_rows.float() @ k.float().transpose(-2, -1)) * scale
    if mask is None:
        return scores
    mask_rows = mask[..., rows, :]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask_rows, float("-inf"))
    return scores + mask_rows


def _math_forward(q, k, v, scale: float, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float32 math on (batch, heads, tokens, dim) views: out in q's dtype, lse
    (batch, heads, seq_q) natural log, +inf for rows that see no key (whose output is zeros)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows in _row_blocks(q, k):
        scores = _scores(q[:, :, rows], k, scale, mask, rows)
        row_lse = scores.logsumexp(-1)
        row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))  # flash-attn's mark of an empty row
        out[:, :, rows] = ((scores - row_lse[..., None]).exp() @ v.float()).to(q.dtype)
        lse[:, :, rows] = row_lse
    return out, lse


def _math_backward(dout, q, k, v, out, lse, scale: float, mask):
    """(dq, dk, dv, softmax_d) in float32 math, as flash-attn computes them: the probabilities from the
    given lse and softmax_d = rowsum(dout * out) from the given out, so a ring of key/value chunks that
    passes the combined out and lse gets each chunk's share of the gradients."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    softmax_d = (dout.float() * out.float()).sum(-1)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(k_full), torch.zeros_like(v_full)
    for rows in _row_blocks(q, k_full):
        q_rows, dout_rows = q[:, :, rows].float(), dout[:, :, rows].float()
        probs = (_scores(q_rows, k_full, scale, mask, rows) - lse[:, :, rows, None]).exp()
        dprobs = dout_rows @ v_full.transpose(-2, -1)
        dscores = probs * (dprobs - softmax_d[:, :, rows, None])
        dq[:, :, rows] = (dscores @ k_full) * scale
        dk += (dscores.transpose(-2, -1) @ q_rows) * scale
        dv += probs.transpose(-2, -1) @ dout_rows
    batch, kv_heads, seq_k, dim = k.shape
    dk, dv = (g.view(batch, kv_heads, group, seq_k, dim).sum(2) for g in (dk, dv))  # per key/value head
    return dq, dk, dv, softmax_d


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    """flash-attn's `_flash_attn_forward`: (out, softmax_lse, S_dmask, rng_state) for q (batch, seq_q,
    heads, head dim), k and v (batch, seq_k, kv_heads, head dim): out like q, contiguous; softmax_lse
    (batch, heads, seq_q) float32 natural log (+inf for rows that see no key); S_dmask empty;
    rng_state two int64 zeros. Not differentiable: `_flash_attn_backward` is its backward. The kernels
    run it where they take it, float32 math (correct, not fast) everywhere else."""
    _refuse_private("_flash_attn_forward", dropout_p, softcap)
    if return_softmax:
        raise NotImplementedError(
            "rdna_flash_attn's _flash_attn_forward does not support return_softmax=True (flash-attn's "
            "S_dmask exists for its own tests)"
        )
    _check_inputs(q, k, v, "(batch, seqlen, nheads, headdim)")
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # views: (batch, heads, tokens, head dim)
    left, right = _window(causal, (window_size_left, window_size_right), q4.shape[2], k4.shape[2])
    causal_only = alibi_slopes is None and left < 0 and right == 0  # the kernels align it bottom-right themselves
    mask = None if causal_only else _attn_mask(q4, k4, left, right, alibi_slopes)
    with torch.no_grad():
        # The dispatcher's plan, as for a call of SDPA aligned bottom-right, taken only where it runs the
        # tensors as they are (no cast) and in the exact kernels.
        plan = planner.plan_attention(q4, k4, v4, mask, 0.0, causal_only, scale, k4.shape[1] != q4.shape[1],
                                      bottom_right=True)
        if not isinstance(plan, Refusal) and plan.kernel.dtype == q4.dtype:
            out, lse = ops.launch_forward(plan.kernel, q4, k4, v4, launcher=plan.launcher)
        else:
            out, lse = _math_forward(q4, k4, v4, scale, _attn_mask(q4, k4, left, right, alibi_slopes))
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    return out.transpose(1, 2).contiguous(), lse.contiguous(), q.new_empty(0), rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn's `_flash_attn_backward`: writes the gradients of q, k and v into dq, dk and dv
    (those given) and returns softmax_d, rowsum(dout * out) as float32 (batch, heads, seq_q rounded up
    to 128), zero past seq_q. The probabilities come from the given softmax_lse and softmax_d from the
    given out, as flash-attn computes them, so ring attention's calls with the merged out and lse of every
    chunk get each chunk's share; a row whose lse is infinite (+inf, flash-attn's mark, or -inf) gets zero
    gradients, and a NaN lse NaN ones (that row's dQ, every dK and dV of its head), as in flash-attn. The kernels run it where they take the call (as _flash_attn_forward's plan, with their
    backward), float32 math everywhere else."""
    _refuse_private("_flash_attn_backward", dropout_p, softcap)
    _check_inputs(q, k, v, "(batch, seqlen, nheads, headdim)")
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q4, k4, v4, dout4, out4 = (t.transpose(1, 2) for t in (q, k, v, dout, out))
    left, right = _window(causal, (window_size_left, window_size_right), q4.shape[2], k4.shape[2])
    causal_only = alibi_slopes is None and left < 0 and right == 0
    mask = None if causal_only else _attn_mask(q4, k4, left, right, alibi_slopes)
    with torch.no_grad():
        plan = planner.plan_attention(q4, k4, v4, mask, 0.0, causal_only, scale, k4.shape[1] != q4.shape[1],
                                      bottom_right=True, backward=True)
        if (not isinstance(plan, Refusal) and plan.kernel.dtype == q4.dtype and dout.dtype == q.dtype
                and out.dtype == q.dtype):
            kernel = plan.kernel
            grads = ops.launch_backward_from_output(ops.kernel_layout(dout4), q4, k4, v4, ops.kernel_layout(out4),
                                                    softmax_lse, kernel.is_causal, kernel.scale, attn_mask=kernel.mask,
                                                    bottom_right=True)
        else:  # a row whose lse is infinite saw no key, as on the kernels
            lse = softmax_lse.float().masked_fill(torch.isinf(softmax_lse), float("inf"))
            grads = _math_backward(dout4, q4, k4, v4, out4, lse, scale, _attn_mask(q4, k4, left, right, alibi_slopes))
        for target, grad in zip((dq, dk, dv), grads):
            if target is not None:
                target.copy_(grad.transpose(1, 2))
    softmax_d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    padded = math.ceil(softmax_d.shape[2] / 128) * 128
    return torch.nn.functional.pad(softmax_d, (0, padded - softmax_d.shape[2]))


# flash-attn >= 2.7 names its torch.library ops so; diffusers imports these names.
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward


def _refuse_private_varlen(function: str, return_softmax, block_table, leftpad_k, seqused_k) -> None:
    if return_softmax:
        raise NotImplementedError(
            f"rdna_flash_attn's {function} does not support return_softmax=True (flash-attn's S_dmask exists "
            "for its own tests)"
        )
    for name, value in (("block_table", block_table), ("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if value is not None:
            raise NotImplementedError(f"rdna_flash_attn's {function} does not support {name} (a KV cache's)")


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """flash-attn's `_flash_attn_varlen_forward`: (out, softmax_lse, S_dmask, rng_state) for a packed batch
    as flash_attn_varlen_func takes it: out like q, contiguous; softmax_lse (heads, total_q) float32 natural
    log, +inf for rows that see no key and rows past cu_seqlens_q[-1] (-inf there with zero_tensors, as
    flash-attn fills them); S_dmask empty; rng_state two int64 zeros. num_splits only tunes flash-attn's
    speed. Not differentiable: `_flash_attn_varlen_backward` is its backward."""
    _refuse_private("_flash_attn_varlen_forward", dropout_p, softcap)
    _refuse_private_varlen("_flash_attn_varlen_forward", return_softmax, block_table, leftpad_k, seqused_k)
    with torch.no_grad():
        out, lse = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                     softmax_scale, causal, (window_size_left, window_size_right), alibi_slopes,
                                     False, True)
    if zero_tensors:
        lse[:, int(cu_seqlens_q[-1]):] = float("-inf")
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    return out, lse, q.new_empty(0), rng_state


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """flash-attn's `_flash_attn_varlen_backward`: writes the gradients of q, k and v into dq, dk and dv
    (those given; zeros for rows no entry covers) and returns softmax_d, rowsum(dout * out) as float32
    (heads, total_q + 128 * batch) in flash-attn's layout: entry b's rows from cu_seqlens_q[b] + 128 * b,
    zeros elsewhere. Float32 math entry by entry from the given out and softmax_lse, as
    `_flash_attn_backward` computes."""
    _refuse_private("_flash_attn_varlen_backward", dropout_p, softcap)
    _check_inputs(q, k, v, "(total, nheads, headdim)")
    ops.check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch = len(offsets_q) - 1
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    softmax_d = torch.zeros(q.shape[1], q.shape[0] + 128 * batch, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for entry in range(batch):
            rows = slice(offsets_q[entry], offsets_q[entry + 1])
            keys = slice(offsets_k[entry], offsets_k[entry + 1])
            if rows.stop <= rows.start or keys.stop <= keys.start:  # no score: zero gradients
                continue
            q4, dout4, out4 = (t[None, rows].transpose(1, 2) for t in (q, dout, out))
            k4, v4 = (t[None, keys].transpose(1, 2) for t in (k, v))
            left, right = _window(causal, (window_size_left, window_size_right), q4.shape[2], k4.shape[2])
            slopes = alibi_slopes[entry] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
            entry_grads = _math_backward(dout4, q4, k4, v4, out4, softmax_lse[None, :, rows].float(), scale,
                                         _attn_mask(q4, k4, left, right, slopes))
            for grad, span, entry_grad in zip(grads, (rows, keys, keys), entry_grads):
                grad[span] = entry_grad[0].transpose(0, 1)
            softmax_d[:, rows.start + 128 * entry:rows.stop + 128 * entry] = entry_grads[3][0]
        for target, grad in zip((dq, dk, dv), grads):
            if target is not None:
                target.copy_(grad)
    return softmax_d


# flash-attn >= 2.7 names its torch.library ops so.
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
