"""Replacement forwards for ldm/sgm `CrossAttention` and `AttnBlock` (A1111's model code).

They compute what A1111's built-in "sdp" optimization computes (hypernetworks on the keys and
values, `upcast_attn` casting to float32, output cast back), with the attention itself from the
kernels. A call the kernels refuse runs on the forward that was installed before, with the same
arguments; where that was unoptimized attention (the model's own forward, or the einsum forward
A1111 installs when it undoes an optimization), on PyTorch SDPA instead (A1111's "sdp"), using the
projections already computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import rdna_flash_attn

from . import guard
from .options import toggles


def _no_hypernetworks(context):
    return context, context


def _nothing_else_unoptimized(forward) -> bool:
    return False


@dataclass(frozen=True)
class HostHooks:
    """What the host adds around attention: hypernetworks (context -> (context_k, context_v)),
    whether to upcast attention inputs to float32, and which of the forwards it installs are
    unoptimized attention (forward -> bool)."""

    apply_hypernetworks: Callable = _no_hypernetworks
    upcast_attn: Callable[[], bool] = lambda: False
    is_unoptimized: Callable[[object], bool] = _nothing_else_unoptimized


def defined_as(forward, module: str, qualname: str) -> bool:
    """Whether `forward` is the function `qualname` of module `module` (by name: identity would miss
    a class whose forward was already replaced when we first looked)."""
    return getattr(forward, "__module__", None) == module and getattr(forward, "__qualname__", None) == qualname


def is_own_forward(cls: type, forward) -> bool:
    """Whether `forward` is the one `cls`'s module defines (no optimization installed)."""
    return defined_as(forward, cls.__module__, f"{cls.__name__}.forward")


def runs_unoptimized(cls: type, forward, hooks: HostHooks) -> bool:
    """Whether `forward`, found on `cls`, is plain attention (O(N^2) memory): refused calls then run
    on SDPA instead of it."""
    if is_own_forward(cls, forward):
        return True
    try:
        return bool(hooks.is_unoptimized(forward))
    except Exception as error:  # a host without the function we look for: treat what it installed as optimized
        guard.report_failure(f"checking {cls.__module__}.{cls.__name__}'s forward", error)
        return False


def _fallback_name(sdpa_fallback: bool) -> str:
    """What runs a call the kernels refuse, for the console line that says so."""
    return "PyTorch SDPA" if sdpa_fallback else "the WebUI's own attention"


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, H*D) -> (B, H, N, D), a view (unit stride in D stays)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _extra_arguments_used(kwargs: dict) -> bool:
    # sgm passes additional_tokens=None, n_times_crossframe_attn_in_self=0: only their defaults are ours.
    return any(not (value is None or (type(value) in (int, bool) and value == 0)) for value in kwargs.values())


def _key_mask(mask: torch.Tensor, batch: int, keys: int) -> torch.Tensor | None:
    """ldm's mask (boolean, B x ..., True = attend to that key) as SDPA's (B, 1, 1, keys) mask; None
    where SDPA would not give ldm's result (not boolean, other shape, a row with no key left)."""
    if mask.dtype != torch.bool or mask.numel() != batch * keys:
        return None
    keep = mask.reshape(batch, keys)
    if not bool(keep.any(dim=1).all()):
        return None
    return keep[:, None, None, :]


def cross_attention_forward(cls: type, replaced, hooks: HostHooks):
    """CrossAttention.forward(self, x, context=None, mask=None, **kwargs) for class `cls`, which had
    `replaced` installed."""
    sdpa_fallback = runs_unoptimized(cls, replaced, hooks)

    def attend(self, x, context, mask):
        """The attention output (B, N, H*D) before to_out, or None: run `replaced` instead."""
        if not sdpa_fallback and not toggles.unet:
            return None
        q = self.to_q(x)
        context_k, context_v = hooks.apply_hypernetworks(x if context is None else context)
        k = self.to_k(context_k)
        v = self.to_v(context_v)
        dtype = q.dtype
        if hooks.upcast_attn():
            q, k, v = q.float(), k.float(), v.float()
        q, k, v = (_heads_first(t, self.heads) for t in (q, k, v))
        key_mask = None if mask is None else _key_mask(mask, q.shape[0], k.shape[2])
        if mask is not None and key_mask is None:
            return None
        out = (rdna_flash_attn.attention_or_reason(q, k, v, attn_mask=key_mask, fallback_name=_fallback_name(sdpa_fallback))
               if toggles.unet else "UNet setting off")
        if isinstance(out, str):
            if not sdpa_fallback:
                return None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return out.transpose(1, 2).flatten(2).to(dtype)

    def forward(self, x, context=None, mask=None, **kwargs):
        out = None
        if not _extra_arguments_used(kwargs):
            try:
                out = attend(self, x, context, mask)
            except Exception as error:
                guard.report_failure(f"{cls.__module__}.CrossAttention forward", error)
        if out is None:
            return replaced(self, x, context, mask, **kwargs)
        return self.to_out(out)

    return forward


def attn_block_forward(cls: type, replaced, hooks: HostHooks):
    """AttnBlock.forward(self, x) (VAE, one head of C channels) for class `cls`, which had `replaced`
    installed."""
    sdpa_fallback = runs_unoptimized(cls, replaced, hooks)

    def attend(self, x):
        """The attention output (B, C, H, W) before proj_out, or None: run `replaced` instead."""
        if not toggles.vae and not sdpa_fallback:
            return None
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        # (B, C, H, W) -> (B, 1, H*W, C): the channels become the head dim, which needs unit stride.
        q, k, v = (t.flatten(2).transpose(1, 2).contiguous().unsqueeze(1) for t in (q, k, v))
        dtype = q.dtype
        if hooks.upcast_attn():
            q, k, v = q.float(), k.float(), v.float()
        out = (rdna_flash_attn.attention_or_reason(q, k, v, fallback_name=_fallback_name(sdpa_fallback))
               if toggles.vae else "VAE setting off")
        if isinstance(out, str):
            if not sdpa_fallback:
                return None
            out = F.scaled_dot_product_attention(q, k, v)
        return out.squeeze(1).to(dtype).transpose(1, 2).reshape(b, c, h, w)

    def forward(self, x):
        out = None
        try:
            out = attend(self, x)
        except Exception as error:
            guard.report_failure(f"{cls.__module__}.AttnBlock forward", error)
        if out is None:
            return replaced(self, x)
        return x + self.proj_out(out)

    return forward
