"""Ring attention in one process, as yunchang and xDiT run it across GPUs: the sequence cut into chunks,
each query chunk's attention over every key/value chunk computed by flash-attn's private pair
(`_flash_attn_forward` per chunk, partial outputs merged by their log-sum-exp, then `_flash_attn_backward`
per chunk with the merged out and lse, gradients summed). The tests compare it with one attention over the
whole sequence.

Causal rings may cut keys finer than queries (`key_cuts`): a key chunk that ends where its query chunk ends
is flash-attn's bottom-right causal call with fewer keys than queries, whose first query rows see no key
(out 0, lse +inf); one that ends earlier inside the query chunk is a window. Tensors are flash-attn's
(batch, tokens, heads, head dim).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

INF = float("inf")


def merge_partial(out, lse, block_out, block_lse):
    """(out, lse) of attention over the keys of two disjoint parts, from each part's (out (B, S, H, D), lse
    (B, H, S)): out float32, lse -inf for a row no key of either part reaches. A row that sees no key of a
    part (flash-attn's lse +inf, or -inf) takes nothing from it, so the merge stays finite whichever part
    comes first."""
    block_lse = block_lse.float().masked_fill(~torch.isfinite(block_lse), -INF)
    if out is None:
        return block_out.float(), block_lse
    merged = torch.logaddexp(lse, block_lse)
    seen = torch.isfinite(merged)
    weight_old = torch.where(seen, (lse - merged).exp(), 0.0).transpose(1, 2)[..., None]
    weight_new = torch.where(seen, (block_lse - merged).exp(), 0.0).transpose(1, 2)[..., None]
    return out * weight_old + block_out.float() * weight_new, merged


def _pieces(length: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    bounds = [0, *cuts, length]
    return list(zip(bounds[:-1], bounds[1:]))


def _call(query_span, key_span, causal: bool):
    """flash-attn's (causal, window right) for queries query_span against keys key_span of one causal
    sequence (query i sees key j <= i), or None where no query sees any key. Key spans never cross a query
    chunk's end."""
    (a, b), (c, d) = query_span, key_span
    if not causal or d <= a + 1:  # every query of the chunk sees every key
        return False, -1
    if c >= b:
        return None
    if d == b:  # aligned bottom-right: flash-attn's causal
        return True, -1
    return False, b - d  # key j <= query i, counted from the keys' bottom-right diagonal


class RingResult(NamedTuple):
    out: torch.Tensor  # q's dtype
    lse: torch.Tensor  # float32 (batch, heads, tokens), +inf where no key is seen
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float32 sums of the chunks' own (in the inputs' dtype)
    calls: int  # forward calls, one backward call each


def ring_attention(fa, q, k, v, dout, chunks: int, causal: bool, key_cuts: Sequence[int] = (), scale=None):
    """Ring attention over `chunks` equal query chunks, through the flash_attn module `fa` (its
    `_flash_attn_forward` and `_flash_attn_backward`). Keys and values are cut at the query chunks' bounds
    and at `key_cuts`; gradients are summed in float32 from each call's, which come in the inputs' dtype
    (as yunchang sums them)."""
    length = q.shape[1]
    size = -(-length // chunks)
    query_spans = _pieces(length, range(size, length, size))
    key_spans = _pieces(length, sorted({*range(size, length, size), *key_cuts}))
    calls = {}
    outs, lses = [], []
    for query_span in query_spans:
        q_chunk = q[:, slice(*query_span)]
        out, lse = None, None
        # yunchang's order: the chunk's own keys first, then earlier ones; here the last key chunk first.
        for key_span in reversed(key_spans):
            call = _call(query_span, key_span, causal)
            if call is None:
                continue
            calls[query_span, key_span] = call
            block_out, block_lse, *_ = fa._flash_attn_forward(
                q_chunk, k[:, slice(*key_span)], v[:, slice(*key_span)], 0.0, scale, call[0], -1, call[1], 0.0,
                None, False)
            out, lse = merge_partial(out, lse, block_out, block_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse.masked_fill(lse == -INF, INF))
    out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    for (query_span, key_span), (call_causal, right) in calls.items():
        rows, keys = slice(*query_span), slice(*key_span)
        q_chunk, k_chunk, v_chunk = q[:, rows], k[:, keys], v[:, keys]
        buffers = [torch.empty_like(t) for t in (q_chunk, k_chunk, v_chunk)]
        fa._flash_attn_backward(dout[:, rows], q_chunk, k_chunk, v_chunk, out[:, rows], lse[:, :, rows], *buffers, 0.0,
                                scale, call_causal, -1, right, 0.0, None, False, None)
        for grad, span, buffer in zip(grads, (rows, keys, keys), buffers):
            grad[:, span] += buffer.float()
    return RingResult(out, lse, tuple(grads), len(calls))
