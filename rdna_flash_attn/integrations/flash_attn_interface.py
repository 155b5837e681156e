"""flash-attn's `flash_attn_func`, for code written against flash-attn: (batch, tokens, heads, head
dim) tensors in and out, routed through the same dispatcher as SDPA calls.

flash-attn semantics kept: causal masks and sliding windows are aligned to the bottom-right corner
(which differs from SDPA's top-left when query and key lengths differ), ALiBi slopes, fewer key/value
heads than query heads (MQA/GQA), rows with no key to attend to give zeros. What plain SDPA arguments
cannot say becomes an explicit attn_mask, which the kernels do not take, so those calls run on SDPA.
"""

from __future__ import annotations

import torch

from ..dispatch import router


def _attn_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, window_size, alibi_slopes) -> torch.Tensor | None:
    """SDPA attn_mask for (batch, heads, tokens, dim) views, or None when is_causal alone says it."""
    sq, sk = q.shape[2], k.shape[2]
    left, right = window_size[0], 0 if causal else window_size[1]
    if alibi_slopes is None and left < 0 and (right < 0 or (causal and sq == sk)):
        return None
    # Key index on the query's bottom-right-aligned diagonal, and every key index.
    diagonal = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    keys = torch.arange(sk, device=q.device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= keys >= diagonal - left
    if right >= 0:
        allowed &= keys <= diagonal + right
    if alibi_slopes is None:
        return allowed
    slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)[..., None, None]  # (H|B,H, 1, 1)
    bias = -slopes * (diagonal - keys).abs()
    return bias.masked_fill(~allowed, float("-inf")).to(q.dtype)


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
    """flash-attn 2's `flash_attn_func(q, k, v, ...)` on (batch, tokens, heads, head dim) tensors.

    Unlike flash-attn, float32 inputs are accepted (they run on PyTorch SDPA). `deterministic` is
    accepted and has no effect. `softcap` and `return_attn_probs=True` raise NotImplementedError:
    SDPA cannot express the first, and the second returns flash-attn's internal buffers, which
    exist for its own tests.
    """
    if return_attn_probs:
        raise NotImplementedError(
            "rdna_flash_attn.flash_attn_func does not support return_attn_probs=True "
            "(flash-attn's softmax buffers exist for its own tests); call it without"
        )
    if softcap:
        raise NotImplementedError("rdna_flash_attn.flash_attn_func does not support softcap")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # views: (batch, heads, tokens, head dim)
    if k.shape[1] != q.shape[1] and k.shape[1] and q.shape[1] % k.shape[1] == 0:
        # MQA/GQA: share key/value heads explicitly, since torch < 2.5 has no enable_gqa.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = _attn_mask(q, k, causal, window_size, alibi_slopes)
    if mask is None:
        out = router.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
    else:
        out = router.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale)
    return out.transpose(1, 2).contiguous()  # flash-attn returns contiguous (batch, tokens, heads, dim)
