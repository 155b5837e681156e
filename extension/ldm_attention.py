"""Replacement forwards for ldm/sgm `CrossAttention` and `AttnBlock` (A1111's model code).

They compute what A1111's built-in "sdp" optimization computes (hypernetworks on the keys and
values, `upcast_attn` casting to float32, output cast back), with the attention itself from the
kernels. A call the kernels refuse runs on the forward that was installed before, with the same
arguments; where that was the model's own unoptimized forward, on PyTorch SDPA instead (A1111's
"sdp"), using the projections already computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import rdna_flash_attn

from .options import toggles


def _no_hypernetworks(context):
    return context, context


@dataclass(frozen=True)
class HostHooks:
    """What the host adds around attention: hypernetworks (context -> (context_k, context_v)) and
    whether to upcast attention inputs to float32."""

    apply_hypernetworks: Callable = _no_hypernetworks
    upcast_attn: Callable[[], bool] = lambda: False


def is_own_forward(cls: type, forward) -> bool:
    """Whether `forward` is the one `cls`'s module defines (no optimization installed)."""
    return getattr(forward, "__module__", None) == cls.__module__ and getattr(
        forward, "__qualname__", None
    ) == f"{cls.__name__}.forward"


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, H*D) -> (B, H, N, D), a view (unit stride in D stays)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _extra_arguments_used(kwargs: dict) -> bool:
    # sgm passes additional_tokens=None, n_times_crossframe_attn_in_self=0: only their defaults are ours.
    return any(not (value is None or (type(value) in (int, bool) and value == 0)) for value in kwargs.values())


def cross_attention_forward(cls: type, replaced, hooks: HostHooks):
    """CrossAttention.forward(self, x, context=None, mask=None, **kwargs) for class `cls`, which had
    `replaced` installed."""
    sdpa_fallback = is_own_forward(cls, replaced)

    def forward(self, x, context=None, mask=None, **kwargs):
        if mask is not None or _extra_arguments_used(kwargs) or (not toggles.unet and not sdpa_fallback):
            return replaced(self, x, context, mask, **kwargs)
        q = self.to_q(x)
        context_k, context_v = hooks.apply_hypernetworks(x if context is None else context)
        k = self.to_k(context_k)
        v = self.to_v(context_v)
        dtype = q.dtype
        if hooks.upcast_attn():
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = (_heads_first(t, self.heads) for t in (q, k, v))
        out = rdna_flash_attn.attention_or_reason(q, k, v) if toggles.unet else "UNet setting off"
        if isinstance(out, str):
            if not sdpa_fallback:
                return replaced(self, x, context, mask, **kwargs)
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).flatten(2).to(dtype)
        return self.to_out(out)

    return forward


def attn_block_forward(cls: type, replaced, hooks: HostHooks):
    """AttnBlock.forward(self, x) (VAE, one head of C channels) for class `cls`, which had `replaced`
    installed."""
    sdpa_fallback = is_own_forward(cls, replaced)

    def forward(self, x):
        if not toggles.vae and not sdpa_fallback:
            return replaced(self, x)
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        # (B, C, H, W) -> (B, 1, H*W, C): the channels become the head dim, which needs unit stride.
        q, k, v = (t.flatten(2).transpose(1, 2).contiguous().unsqueeze(1) for t in (q, k, v))
        dtype = q.dtype
        if hooks.upcast_attn():
            q, k, v = q.float(), k.float(), v.float()
        out = rdna_flash_attn.attention_or_reason(q, k, v) if toggles.vae else "VAE setting off"
        if isinstance(out, str):
            if not sdpa_fallback:
                return replaced(self, x)
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.squeeze(1).to(dtype).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)

    return forward
