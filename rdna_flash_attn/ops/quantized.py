"""The opt-in 8-bit forward, "8-bit QK+PV" (kernels/fa_fwd8.h): inference on gfx12 (RDNA4), whose matrix
unit runs 8-bit operands at twice the 16-bit rate.

Three launches: K and V's quantizing pass (kernels/quant8.h: channel statistics, then the codes, in buffers
of the attention kernel's layout), then the attention, which reads Q in 16 bits and quantizes it itself
(each workgroup its own rows, once). The arithmetic is bench/quantized_attention_accuracy.py's
scheme "qkpv-int8-fp8-vsmooth", which met the issue's bar (cosine >= 0.999, relative L1 <= 3 %) at every
model shape there:
- Q as int8 with one scale per query row;
- K smoothed (its per-channel mean over the keys subtracted, which softmax does not see) as int8 with one
  scale per 16 keys;
- P as OCP e4m3 (fp8), scaled by 448, and V smoothed as e4m3 with one scale per channel, its mean added
  back to the output.
"8-bit QK" alone (P and V in 16 bits) is not offered: its int8 scores missed its own, tighter bar
(relative L1 <= 1 %) at every shape in that model.

That arithmetic misses the bar on other inputs (bench/results/quantized_attention_inputs.md): where V has
no channel mean to carry the output exactly and the rows are near uniform (iid Gaussian inputs), the
output is a small random mean of centred V, and the e4m3 roundings of P and V show whole; and where one Q
or K channel's range dwarfs the others', which then keep about one int8 bit. `accuracy_refusal` measures
both on the call's inputs; the dispatcher's 8-bit mode runs the exact kernels where it refuses.
`quantized_attention_forward` itself computes the arithmetic whatever the inputs.

`plan_quantized` makes the checks of a call plans.plan_forward took, `prepare_launches` makes its launches'
lookups once, `launch_quantized` launches its plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch

from ..runtime import loader, variants
from . import plans
from .attention import _device_guard, _strides, output_like
from .launch_args import Fwd8Args, Quant8Args
from .plans import DTYPE_NAMES, LOG2_E, MAX_GRID_YZ, Refusal

__all__ = ["QuantizedInputs", "InputStatistics", "QuantizedLaunches", "QuantizedPlan", "target_refusal",
           "plan_quantized", "prepare_launches", "input_statistics", "accuracy_refusal", "quantize_inputs",
           "quantized_attention_forward", "launch_quantized"]

FP8_MAX = 448.0  # OCP e4m3's largest finite value (gfx12's fp8, torch.float8_e4m3fn): P's scale
# The input bounds within which the arithmetic met its bar on every input class tried
# (bench/quantized_attention_inputs.py): every class that missed it had V's channel means below 0.035 of
# V's range or a channel spread of 10 and more; the diffusion-like inputs, which pass, have 0.108-0.17 and
# spreads up to 5.2. The bounds sit between, in log terms.
MIN_V_MEAN_OVER_RANGE = 0.06
MAX_CHANNEL_SPREAD = 8.0
# fa_fwd8.h addresses a head's K and V^T codes with 32-bit byte offsets from the head's base: k_rows x d_pad.
_MAX_TILE_OFFSET = 2**31


def target_refusal(target: str) -> str | None:
    """Why code objects for `target` have no 8-bit attention, or None."""
    if not variants.has_fwd8(target):
        return f"8-bit attention needs RDNA4 (gfx12); {target} has no faster 8-bit matrix rate"
    return None


class QuantizedLaunches(NamedTuple):
    """An 8-bit call's three launches, each launch(args, buffers) with its kernel, grid and stream lookups
    made (loader's launcher): K and V's quantizing pass (its statistics, then its codes), the attention."""

    stats: Callable
    codes: Callable
    attention: Callable


@dataclass(frozen=True)
class QuantizedPlan:
    """An 8-bit call, checked: its attention kernel (the quantizing pass's follow from it) and scale, and
    where prepared (prepare_launches), its launches on one device for the call's shapes."""

    variant: variants.Fwd8Variant
    scale: float | None  # as given; None: 1 / sqrt(head dim)
    launches: QuantizedLaunches | None = None


def plan_quantized(q, k, v, is_causal: bool = False, attn_mask=None, scale: float | None = None,
                   dtype: torch.dtype | None = None) -> QuantizedPlan | Refusal:
    """The 8-bit launches of a call plans.plan_forward took (with the same `dtype`: what q, k and v are
    cast to first, None for none), or why the 8-bit forward cannot take it."""
    if attn_mask is not None:
        return Refusal("8-bit attention takes no attn_mask")
    if is_causal:
        return Refusal("8-bit attention is not causal")
    if max(q.shape[:2]) > MAX_GRID_YZ:
        return Refusal("8-bit attention takes batch and heads up to 65535")
    head_dim = q.shape[3]
    if head_dim not in variants.FWD8_HEAD_DIMS:
        return Refusal(f"8-bit attention takes head dims {variants.FWD8_HEAD_DIMS[0]}-{variants.FWD8_HEAD_DIMS[-1]}, "
                       f"not {head_dim}")
    if (k.shape[2] + variants.FWD8_BLOCK_N) * variants.padded_head_dim(head_dim) >= _MAX_TILE_OFFSET:
        return Refusal("8-bit attention takes keys x head dim below 2^31")
    return QuantizedPlan(variants.fwd8_variant(DTYPE_NAMES[q.dtype if dtype is None else dtype], head_dim), scale)


def _key_rows(seq_k: int, variant: variants.Fwd8Variant) -> int:
    """Keys padded to whole tiles: the rows of the pass's K and V^T codes."""
    return -(-seq_k // variant.block_n) * variant.block_n


def _pass_launches(library, variant: variants.Fwd8Variant, k_shape, device: torch.device) -> tuple[Callable, Callable]:
    """The quantizing pass's launches (statistics, codes) for (B, Hk, Sk, D) keys, on `library`."""
    batch, kv_heads, seq_k, dim = k_shape
    rows = _key_rows(seq_k, variant)
    return (library.launcher(variants.quant8_variant("stats", variant.dtype, dim), (1, kv_heads, batch), device),
            library.launcher(variants.quant8_variant("codes", variant.dtype, dim),
                             (rows // variants.QUANT8_ROWS, kv_heads, batch), device))


def _launches(library, variant: variants.Fwd8Variant, q_shape, k_shape, device: torch.device) -> QuantizedLaunches:
    """The three launches of an 8-bit call on (B, H, Sq, D) queries and (B, Hk, Sk, D) keys, on `library`."""
    batch, heads, seq_q, _ = q_shape
    return QuantizedLaunches(*_pass_launches(library, variant, k_shape, device),
                             library.launcher(variant, (-(-seq_q // variant.block_rows), heads, batch), device))


def prepare_launches(plan: QuantizedPlan, q, k) -> QuantizedPlan:
    """`plan` with its launches prepared on q's device's library (an explicit one first), for a caller
    that launches one plan often: the dispatcher, once per call signature. Raises what loading the library
    raises."""
    return replace(plan, launches=_launches(loader.library_for(q.device), plan.variant, q.shape, k.shape, q.device))


class InputStatistics(NamedTuple):
    """The worst head's statistics of one call's inputs that decide whether 8-bit attention meets its bar."""

    q_channel_spread: float  # the largest channel's amax over the median channel's, per head
    k_channel_spread: float  # the same for K less its channel means (the kernel subtracts them)
    v_mean_over_range: float  # norm of V's channel means over the norm of the channels' amax |V - mean|


def _centred_ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head, channel) of (B, H, S, D) x: amax |x - mean| in float32, and the float32 mean.
    Rounding is monotone, so max(high - mean, mean - low) is that amax bit for bit without an x-sized
    temporary; the 16-bit extremes promote to float32 in the subtractions."""
    low, high = torch.aminmax(x, dim=2)
    mean = x.mean(dim=2, dtype=torch.float32)
    return torch.maximum(high - mean, mean - low), mean


def _spreads(*ranges: torch.Tensor) -> torch.Tensor:
    """Per tensor of (B, H, D) channel ranges, its worst head's largest channel over its median channel;
    ranges of one shape (no grouped heads) in one stacked set of reductions."""
    if len({r.shape for r in ranges}) > 1:
        return torch.cat([_spreads(r) for r in ranges])
    stacked = torch.stack(ranges) if len(ranges) > 1 else ranges[0][None]
    return (stacked.amax(dim=-1) / stacked.median(dim=-1).values).flatten(1).amax(dim=1)


def input_statistics(q, k, v) -> InputStatistics:
    """`InputStatistics` of (B, H, S, D) q and (B, Hk, S, D) k, v with S > 0: one reduction over Q, two
    over K and over V, and one read back to the host."""
    q_range = torch.linalg.vector_norm(q, math.inf, dim=2).float()  # amax |q|, exact
    k_range, _ = _centred_ranges(k)
    v_range, v_mean = _centred_ranges(v)
    range_norm = torch.linalg.vector_norm(v_range, dim=-1)
    # A constant V (no range) has its output carried whole by the mean the kernel adds back.
    v_ratio = (torch.linalg.vector_norm(v_mean, dim=-1) / range_norm).masked_fill_(range_norm == 0, math.inf).amin()
    return InputStatistics(*torch.cat([_spreads(q_range, k_range), v_ratio[None]]).tolist())


def accuracy_refusal(q, k, v) -> str | None:
    """Why 8-bit attention would miss its bar on these inputs (see the module's docstring), or None. Each
    reason is one fixed line (a count key in the dispatcher's stats)."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return None
    stats = input_statistics(q, k, v)
    if any(math.isnan(value) for value in stats):
        return "inputs outside 8-bit attention's bar: NaN or infinite values"
    if not max(stats.q_channel_spread, stats.k_channel_spread) <= MAX_CHANNEL_SPREAD:
        return (f"inputs outside 8-bit attention's bar: a Q or K channel's range over {MAX_CHANNEL_SPREAD:g}x the "
                "median channel's")
    if not stats.v_mean_over_range >= MIN_V_MEAN_OVER_RANGE:
        return (f"inputs outside 8-bit attention's bar: V's channel means under {MIN_V_MEAN_OVER_RANGE:g} of its "
                "range")
    return None


class QuantizedInputs(NamedTuple):
    """The pass's output, the kernel's K and V (Fwd8Args): head dim zero-padded to the variant's, keys to
    whole tiles."""

    k8: torch.Tensor  # (B, Hk, k_rows, d_pad) int8, K minus its per-channel mean
    k_scale: torch.Tensor  # (B, Hk, k_rows / 16) float32
    vt8: torch.Tensor  # (B, Hk, d_pad, k_rows) e4m3 bits (uint8), V minus its per-channel mean, transposed
    v_scale: torch.Tensor  # (B, Hk, d_pad) float32
    v_mean: torch.Tensor  # (B, Hk, d_pad) float32


def quantize_inputs(k, v, variant: variants.Fwd8Variant, launches: QuantizedLaunches | None = None) -> QuantizedInputs:
    """The 8-bit kernel's K and V from (B, Hk, S, D) float16/bfloat16 k and v as the kernels read them
    (plans.plan_forward): the quantizing pass's two launches, `launches`' where given (prepared for k's
    shape), else made now."""
    batch, kv_heads, seq_k, dim = k.shape
    d_pad = variant.d_pad
    k_rows = _key_rows(seq_k, variant)
    stats, codes = launches[:2] if launches else _pass_launches(loader.library_for(k.device), variant, k.shape,
                                                                k.device)
    device = k.device
    inputs = QuantizedInputs(torch.empty((batch, kv_heads, k_rows, d_pad), dtype=torch.int8, device=device),
                             torch.empty((batch, kv_heads, k_rows // variants.FWD8_SCALE_KEYS), device=device),
                             torch.empty((batch, kv_heads, d_pad, k_rows), dtype=torch.uint8, device=device),
                             torch.empty((batch, kv_heads, d_pad), device=device),
                             torch.empty((batch, kv_heads, d_pad), device=device))
    k_mean = torch.empty((batch, kv_heads, d_pad), device=device)
    args = Quant8Args(k.data_ptr(), v.data_ptr(), *_strides(k, v), inputs.k8.data_ptr(), inputs.k_scale.data_ptr(),
                      inputs.vt8.data_ptr(), k_mean.data_ptr(), inputs.v_mean.data_ptr(), inputs.v_scale.data_ptr(),
                      kv_heads, seq_k, k_rows, dim)
    buffers = (k, v, *inputs, k_mean)
    stats(args, buffers)
    codes(args, buffers)
    return inputs


def quantized_attention_forward(q, k, v, scale: float | None = None) -> torch.Tensor:
    """SDPA's output for (B, H, S, D) q and (B, Hk, S, D) k, v (Hk dividing H), computed in 8 bits (see
    the module's docstring) whatever the inputs' statistics (accuracy_refusal judges those); like q, in
    q's memory order. Raises ValueError for input the 8-bit path refuses (plans.plan_forward, then
    plan_quantized, then the device's target)."""
    plans.planned(plans.plan_forward(q, k, v, False, scale))
    plan = plans.planned(plan_quantized(q, k, v, scale=scale))
    reason = target_refusal(loader.library_for(q.device).artifact.target)
    if reason is not None:
        raise ValueError(reason)
    return launch_quantized(plan, q, k, v)


def launch_quantized(plan: QuantizedPlan, q, k, v) -> torch.Tensor:
    """SDPA's output in 8 bits for the q, k and v `plan` was made for (see quantized_attention_forward):
    the quantizing pass, then the attention; on the plan's prepared launches where it has them."""
    launches = plan.launches or _launches(loader.library_for(q.device), plan.variant, q.shape, k.shape, q.device)
    batch, heads, seq_q, dim = q.shape
    out = output_like(q)
    with _device_guard(q.device):
        inputs = quantize_inputs(k, v, plan.variant, launches)
        args = Fwd8Args(q.data_ptr(), *q.stride()[:3], *[t.data_ptr() for t in inputs], out.data_ptr(),
                        *out.stride()[:3], heads, k.shape[1], seq_q, k.shape[2], inputs.k8.shape[2], dim,
                        plans.softmax_scale(dim, plan.scale) * LOG2_E)
        launches.attention(args, (q, *inputs, out))
    return out
