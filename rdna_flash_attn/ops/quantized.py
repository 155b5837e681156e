"""The opt-in 8-bit forward, "8-bit QK+PV" (kernels/fa_fwd8.h): inference on gfx12 (RDNA4), whose matrix
unit runs 8-bit operands at twice the 16-bit rate.

One pass on the GPU quantizes the inputs into buffers of the kernel's layout, then one launch runs the
attention. The arithmetic is bench/quantized_attention_accuracy.py's scheme "qkpv-int8-fp8-vsmooth",
which met the issue's bar (cosine >= 0.999, relative L1 <= 3 %) at every model shape there:
- Q as int8 with one scale per query row;
- K smoothed (its per-channel mean over the keys subtracted, which softmax does not see) as int8 with one
  scale per 16 keys;
- P as OCP e4m3 (fp8), scaled by 448, and V smoothed as e4m3 with one scale per channel, its mean added
  back to the output.
"8-bit QK" alone (P and V in 16 bits) is not offered: its int8 scores missed its own, tighter bar
(relative L1 <= 1 %) at every shape in that model.

The pass is torch operations (several reads of each input), done a few heads at a time so that its
float32 temporaries stay small; the kernel reads the quantized buffers once per query block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..runtime import loader, variants
from .attention import LOG2_E, _DTYPES, _device_guard, output_like
from .launch_args import Fwd8Args

__all__ = ["QuantizedInputs", "quantized_refusal", "quantize_inputs", "quantized_attention_forward"]

INT8_MAX = 127.0
FP8_MAX = 448.0  # OCP e4m3's largest finite value (gfx12's fp8, torch.float8_e4m3fn)
_PASS_ELEMENTS = 2**24  # float32 elements one step of the quantizing pass holds per temporary (64 MiB)


def quantized_refusal(q, k, v, is_causal: bool, attn_mask, target: str) -> str | None:
    """Why the 8-bit forward cannot take a call the 16-bit kernels take (forward_refusal passed), on
    code objects for `target`, or None."""
    if not variants.has_fwd8(target):
        return f"8-bit attention needs RDNA4 (gfx12); {target} has no faster 8-bit matrix rate"
    if attn_mask is not None:
        return "8-bit attention takes no attn_mask"
    if is_causal:
        return "8-bit attention is not causal"
    if q.shape[3] not in variants.FWD8_HEAD_DIMS:
        return f"8-bit attention takes head dims {variants.FWD8_HEAD_DIMS[0]}-{variants.FWD8_HEAD_DIMS[-1]}, not {q.shape[3]}"
    return None


class QuantizedInputs(NamedTuple):
    """The kernel's inputs (Fwd8Args): head dim zero-padded to the variant's, keys to whole tiles."""

    q8: torch.Tensor  # (B, H, Sq, d_pad) int8
    q_scale: torch.Tensor  # (B, H, Sq) float32: dequantisation x softmax scale x log2(e)
    k8: torch.Tensor  # (B, Hk, k_rows, d_pad) int8, K minus its per-channel mean
    k_scale: torch.Tensor  # (B, Hk, k_rows / 16) float32
    vt8: torch.Tensor  # (B, Hk, d_pad, k_rows) e4m3 bits (uint8), V minus its per-channel mean, transposed
    v_scale: torch.Tensor  # (B, Hk, d_pad) float32
    v_mean: torch.Tensor  # (B, Hk, d_pad) float32


def _scale_for(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The scale that maps amax to the format's limit (1 for an all-zero block)."""
    return torch.where(amax > 0, amax / limit, torch.ones_like(amax))


def _int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def _head_slices(heads: int, tokens: int, dim: int) -> list[slice]:
    """Heads taken together by one step of the pass: a float32 copy of theirs within _PASS_ELEMENTS."""
    step = max(1, _PASS_ELEMENTS // (tokens * dim))
    return [slice(h, min(h + step, heads)) for h in range(0, heads, step)]


def quantize_inputs(q, k, v, softmax_scale: float, variant: variants.Fwd8Variant) -> QuantizedInputs:
    """The 8-bit kernel's inputs from (B, H, S, D) float16/bfloat16 q, k and v (any strides)."""
    batch, heads, seq_q, dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    d_pad, block_n = variant.d_pad, variant.block_n
    k_rows = -(-seq_k // block_n) * block_n
    blocks = k_rows // variants.FWD8_SCALE_KEYS
    device = q.device
    q8 = torch.zeros(batch, heads, seq_q, d_pad, dtype=torch.int8, device=device)
    q_scale = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=device)
    k8 = torch.zeros(batch, kv_heads, k_rows, d_pad, dtype=torch.int8, device=device)
    k_scale = torch.ones(batch, kv_heads, blocks, dtype=torch.float32, device=device)
    vt8 = torch.zeros(batch, kv_heads, d_pad, k_rows, dtype=torch.uint8, device=device)
    v_scale = torch.ones(batch, kv_heads, d_pad, dtype=torch.float32, device=device)
    v_mean = torch.zeros(batch, kv_heads, d_pad, dtype=torch.float32, device=device)
    for b in range(batch):
        for heads_here in _head_slices(heads, seq_q, dim):
            x = q[b, heads_here].float()
            scale = _scale_for(x.abs().amax(dim=-1), INT8_MAX)
            q8[b, heads_here, :, :dim] = _int8(x, scale.unsqueeze(-1))
            q_scale[b, heads_here] = scale * (softmax_scale * LOG2_E)
        for heads_here in _head_slices(kv_heads, k_rows, dim):
            x = k[b, heads_here].float()
            x = torch.nn.functional.pad(x - x.mean(dim=1, keepdim=True), (0, 0, 0, k_rows - seq_k))
            x = x.view(x.shape[0], blocks, variants.FWD8_SCALE_KEYS, dim)
            scale = _scale_for(x.abs().amax(dim=(2, 3)), INT8_MAX)
            k_scale[b, heads_here] = scale
            k8[b, heads_here, :, :dim] = _int8(x, scale[..., None, None]).view(-1, k_rows, dim)
            x = v[b, heads_here].float()
            mean = x.mean(dim=1)
            x = x - mean.unsqueeze(1)
            scale = _scale_for(x.abs().amax(dim=1), FP8_MAX)
            v_mean[b, heads_here, :dim] = mean
            v_scale[b, heads_here, :dim] = scale
            e4m3 = (x / scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            vt8[b, heads_here, :dim, :seq_k] = e4m3.transpose(1, 2)
    return QuantizedInputs(q8, q_scale, k8, k_scale, vt8, v_scale, v_mean)


def quantized_attention_forward(q, k, v, scale: float | None = None) -> torch.Tensor:
    """SDPA's output for (B, H, S, D) q and (B, Hk, S, D) k, v (Hk dividing H), computed in 8 bits (see
    the module's docstring); like q, in q's memory order. The caller has checked quantized_refusal."""
    batch, heads, seq_q, dim = q.shape
    softmax_scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    variant = variants.fwd8_variant(_DTYPES[q.dtype], dim)
    library = loader.library_for(q.device)
    out = output_like(q)
    with _device_guard(q.device):
        inputs = quantize_inputs(q, k, v, softmax_scale, variant)
        args = Fwd8Args(*(t.data_ptr() for t in inputs), out.data_ptr(), *out.stride()[:3], heads, k.shape[1],
                        seq_q, k.shape[2], inputs.k8.shape[2], dim)
        grid = (-(-seq_q // variant.block_rows), heads, batch)
        library.launch(variant, grid, args, (*inputs, out))
    return out
