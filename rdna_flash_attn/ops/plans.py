"""The kernels' plans: every check that keeps input off the GPU, made once, and the launch it leads to,
worked out with it. A call the kernels cannot take gets a Refusal, whose one line the dispatcher counts
and logs; the launchers (attention.py, quantized.py) take plans and check nothing again.

Tensors are (batch, heads, seq, head_dim) views with unit stride in head_dim; both (B, H, S, D) and
(B, S, H, D) memory layouts run as they are, with no copy, padding or transpose on the host. Masks
(bool or additive, anything broadcastable to (batch, heads, seq_q, seq_k)) are read where they lie,
broadcast dimensions with stride 0; key/value heads may be fewer than query heads (grouped-query
attention) without being repeated; packed variable-length batches are judged on their (1, heads,
tokens, head_dim) views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..runtime import loader, variants
from .launch_args import (CAUSAL_BOTTOM_RIGHT, CAUSAL_TOP_LEFT, FwdArgs, MASK_BF16, MASK_BOOL, MASK_F16, MASK_F32,
                          NOT_CAUSAL)

DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}  # the kernels' dtypes, as the variants table names them
MASK_KINDS = {torch.bool: MASK_BOOL, torch.float16: MASK_F16, torch.bfloat16: MASK_BF16, torch.float32: MASK_F32}
SUPPORTED_HEAD_DIMS = frozenset(variants.SUPPORTED_HEAD_DIMS)
VECTOR_ELEMS = 8  # the kernels move 16-byte vectors of 16-bit values
MAX_GRID_YZ = 65535  # workgroups along a grid's y (heads) and z (batch): larger grids launch in slices
# The kernels index rows as 32-bit ints: a row index plus a tile must stay below 2^31.
MAX_SEQLEN = 2**31 - 1024
# The kernels address the rows of a Q, K, V or dO tile as 32-bit byte offsets from its first row (their
# loads' scalar-base form): below 2^23 elements per row, a tile of 64 rows stays within 2^31 bytes.
MAX_SEQ_STRIDE = 2**23
# Masks are read at 32-bit element offsets (kernels/sequence.h MaskView): see mask_rows_per_launch.
MASK_OFFSETS = 2**31
# A dK/dV launch's first query, where the backward splits one: a multiple of this many rows, so that every
# row pointer and statistics offset keeps the alignment of the tensor's first row.
DKDV_QUERY_STEP = 64
EMPTY = "empty tensor"
LOG2_E = 1.4426950408889634  # the kernels take the softmax scale in base 2
KERNEL_DEVICE_TYPE = "cuda"  # ROCm and ZLUDA builds of torch name AMD GPUs "cuda" as well
is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


@dataclass(frozen=True)
class Refusal:
    """Why the kernels do not take a call: one line, as stats() counts it and the log shows it."""

    reason: str


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """A forward launch, checked: the kernel and its grid, the argument block filled in but for the
    buffers' addresses, the output's layout (q's memory order) and the mask view the kernel reads."""

    dtype: torch.dtype  # what the kernel runs in: the inputs' own, or the one they are cast to first
    is_causal: bool
    scale: float | None  # as given; None: 1 / sqrt(head dim)
    bottom_right: bool  # a causal mask aligned to the bottom-right corner (flash-attn's), not top-left
    kv_group: int  # query heads per key/value head
    variant: variants.FwdVariant
    grid: tuple[int, int, int]
    # A FwdArgs; None in a plan made while torch.compile traces, whose launch is the custom op's (dynamo
    # cannot trace a ctypes structure): the op plans its launch again (forward_geometry).
    args: bytes | None
    out_size: tuple[int, ...]
    out_stride: tuple[int, ...]
    mask: torch.Tensor | None  # attn_mask as the (B, H, Sq, Sk) view the kernel reads: stride 0 where broadcast

    @property
    def head_dim(self) -> int:
        return self.out_size[3]

    @property
    def lse_size(self) -> tuple[int, int, int]:
        return tuple(self.out_size[:3])


@dataclass(frozen=True)
class VarlenPlan:
    """A packed variable-length batch the kernels take, checked; the launches size their grids from it."""

    max_seqlen_q: int
    max_seqlen_k: int
    is_causal: bool  # aligned to each entry's bottom-right corner
    scale: float | None
    covered: PackedRows | None  # the rows the entries cover, where check_cu_seqlens could read the offsets


class PackedRows(NamedTuple):
    """How many leading rows of the packed q and k the entries cover: cu_seqlens_q[-1], cu_seqlens_k[-1]."""

    q: int
    k: int


def planned(plan):
    """`plan` itself, or ValueError with the reason where it is a Refusal: for callers of ops' own
    functions, whose bad arguments are errors."""
    if isinstance(plan, Refusal):
        raise ValueError(plan.reason)
    return plan


def plan_forward(q, k, v, is_causal: bool = False, scale: float | None = None, attn_mask=None, *,
                 backward: bool = False, bottom_right: bool = False,
                 dtype: torch.dtype | None = None) -> ForwardPlan | Refusal:
    """The forward launch for these arguments, or why the kernels cannot take them; with `backward`, the
    backward's checks too. `dtype`: what q, k and v are cast to before the launch (None: no cast), so
    that the checks judge, and the plan fits, the tensors the kernels get. Metadata only, no GPU work."""
    tensors = (("query", q), ("key", k), ("value", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return Refusal(f"{name} is not a tensor")
        if t.dim() != 4:
            return Refusal(f"{name} is {t.dim()}-D; the kernels take 4-D (batch, heads, seq, head_dim)")
    kernel_dtype = q.dtype if dtype is None else dtype
    if kernel_dtype not in DTYPE_NAMES:
        return Refusal(f"dtype {kernel_dtype} is not supported (float16 or bfloat16)")
    if dtype is None and (k.dtype != q.dtype or v.dtype != q.dtype):
        return Refusal("query, key and value have different dtypes")
    device = q.device
    on_kernel_device = device.type == KERNEL_DEVICE_TYPE or loader.explicit_library_for(device) is not None
    if not on_kernel_device or k.device != device or v.device != device:
        return Refusal("query, key and value must be on one GPU")
    shape = q.shape
    if shape[0] != k.shape[0] or shape[0] != v.shape[0]:
        return Refusal("batch sizes differ")
    if k.shape[1] != v.shape[1]:
        return Refusal("key and value head counts differ")
    if k.shape[1] == 0 or shape[1] % k.shape[1]:
        return Refusal("query heads are not a multiple of key/value heads")
    if k.shape[2] != v.shape[2]:
        return Refusal("key and value have different sequence lengths")
    head_dim = shape[3]
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        return Refusal("query, key and value head dims differ")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return Refusal(f"head dim {head_dim} is not supported (multiples of 8 up to 256, or 320, 384, 512)")
    if q.numel() == 0 or k.numel() == 0:
        return Refusal(EMPTY)
    if max(shape[2], k.shape[2]) > MAX_SEQLEN:
        return Refusal("sequence longer than 2^31 - 1024")
    strides = []
    for name, t in tensors:
        if t.dtype == kernel_dtype:
            stride, is_aligned = t.stride(), aligned(t)
        else:  # cast: a new tensor, 16-byte aligned, laid out as `.to` lays it out
            stride, is_aligned = torch.empty_like(t, dtype=kernel_dtype, device="meta").stride(), True
        reason = _read_problem(name, stride, is_aligned)
        if reason:
            return Refusal(reason)
        strides.append(stride)
    if scale is not None and not math.isfinite(scale):
        return Refusal("softmax scale is not finite")
    mask = None
    if attn_mask is not None:
        mask = mask_view(attn_mask, (shape[0], shape[1], shape[2], k.shape[2]), head_dim, kernel_dtype, device,
                         backward)
        if isinstance(mask, Refusal):
            return mask
        if backward and is_causal and mask_rows_per_launch(mask, shape[2]) < shape[2]:
            # A slice of the queries would move the causal diagonal, which the kernels place from the lengths.
            return Refusal("causal with an attn_mask whose rows span 2^31 elements (the backward's dK/dV "
                           "launches split only non-causal calls)")
    return _forward_plan(kernel_dtype, shape, k.shape, strides, is_causal, scale, bottom_right, mask)


def mask_view(attn_mask, target: tuple[int, int, int, int], head_dim: int, dtype: torch.dtype,
              device: torch.device, backward: bool = False) -> torch.Tensor | Refusal:
    """attn_mask as the view the kernels read for (B, H, Sq, head_dim) queries of `dtype` on `device` and
    Sk keys (`target`: B, H, Sq, Sk), or why the kernels (the forward's; with `backward` the backward's
    too) cannot take it. SDPA's rules: bool (True takes part) or an additive bias in float32 or the query's
    dtype, broadcastable to (B, H, Sq, Sk); anything else falls back to SDPA, which gives its own error."""
    if not isinstance(attn_mask, torch.Tensor):
        return Refusal("attn_mask is not a tensor")
    if attn_mask.is_nested or attn_mask.layout is not torch.strided:
        return Refusal("attn_mask is nested or sparse")
    if attn_mask.dtype not in (torch.bool, torch.float32, dtype):
        return Refusal(f"attn_mask dtype {attn_mask.dtype} is neither bool, float32 nor the query's")
    if attn_mask.device != device:
        return Refusal("attn_mask is on another device than the query")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        return Refusal("attn_mask requires grad (the kernels give no gradient for a mask)")
    if not 2 <= attn_mask.dim() <= 4:
        return Refusal(f"attn_mask is {attn_mask.dim()}-D (SDPA takes 2-D to 4-D masks)")
    padded = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    if any(size not in (1, full) for size, full in zip(padded, target)):
        return Refusal(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {target}")
    if head_dim not in variants.MASKED_HEAD_DIMS:
        return Refusal(f"attn_mask with head dim {head_dim} (masked kernels take head dims up to "
                       f"{variants.MASKED_HEAD_DIMS[-1]})")
    view = broadcast_mask(attn_mask, target)
    # 32-bit element offsets (kernels/sequence.h MaskView): the forward and dQ kernels count them from a
    # wave's first query, dK/dV from its launch's first query (mask_rows_per_launch).
    rows = min(target[2], variants.FRAG)
    if view.stride(2) * (rows - 1) + view.stride(3) * (target[3] - 1) >= MASK_OFFSETS:
        return Refusal(f"attn_mask's rows span 2^31 elements within {rows} queries")
    if backward and mask_rows_per_launch(view, target[2]) == 0:
        return Refusal(f"attn_mask's rows span 2^31 elements within {DKDV_QUERY_STEP} queries (the backward's "
                       "dK/dV launches take fewer)")
    return view


def mask_rows_per_launch(mask: torch.Tensor, seq_q: int) -> int:
    """How many of seq_q queries one dK/dV launch takes with `mask`, a (B, H, Sq, Sk) view: its kernels
    count the mask's element offsets from the launch's first query as 32-bit ints. All of them where
    those fit; else the most that fit, a multiple of DKDV_QUERY_STEP (0 where fewer than that do), and the
    backward launches dK/dV once per such slice of the queries (attention.py)."""
    key_span = mask.stride(3) * (mask.shape[3] - 1)
    if mask.stride(2) * (seq_q - 1) + key_span < MASK_OFFSETS:
        return seq_q
    fitting = (MASK_OFFSETS - 1 - key_span) // mask.stride(2) + 1 if key_span < MASK_OFFSETS else 0
    return fitting // DKDV_QUERY_STEP * DKDV_QUERY_STEP


def broadcast_mask(attn_mask: torch.Tensor, target: tuple[int, int, int, int]) -> torch.Tensor:
    """attn_mask as a (B, H, Sq, Sk) `target` view: broadcast dimensions get stride 0, no copy."""
    return attn_mask[(None,) * (4 - attn_mask.dim())].expand(target)


def aligned(t: torch.Tensor) -> bool:
    """Whether t starts on a 16-byte boundary; True for a tensor without storage (torch.compile's fake
    tensors, and any tensor while torch.compile traces): those are judged again when the real call runs,
    where the custom op copies a misaligned input (autograd.py)."""
    if is_compiling():
        return True
    try:
        return t.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):
        return True


def layout_problem(name: str, stride: tuple[int, ...], is_aligned: bool) -> str | None:
    """Why the kernels cannot address a 4-D tensor with these strides as it lies in memory, or None."""
    if stride[3] != 1:
        return f"{name} is not contiguous in head_dim"
    if any(s % VECTOR_ELEMS for s in stride[:3]):
        return f"{name} strides are not multiples of 8 elements (16 bytes)"
    if not is_aligned:
        return f"{name} does not start on a 16-byte boundary (storage offset)"
    return None


def _read_problem(name: str, stride: tuple[int, ...], is_aligned: bool) -> str | None:
    """layout_problem for a 4-D tensor the kernels read in tiles (Q, K, V, dO), whose rows their 32-bit
    offsets must also reach (see MAX_SEQ_STRIDE). Outputs are written with 64-bit addresses."""
    problem = layout_problem(name, stride, is_aligned)
    if problem is None and stride[2] >= MAX_SEQ_STRIDE:
        problem = f"{name} sequence stride {stride[2]} is 2^23 elements or more"
    return problem


def readable(t: torch.Tensor) -> bool:
    """Whether the kernels read the 4-D t in tiles as it lies in memory."""
    return _read_problem("", t.stride(), aligned(t)) is None


def output_layout(shape, stride) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(size, strides) of an output of a (B, H, S, D) `shape` in the memory order `stride` gives: (B, S, H, D)
    callers can reshape it to (B, S, H*D) for free."""
    batch, heads, seq, dim = shape
    if stride[2] > stride[1]:
        return (batch, heads, seq, dim), (seq * heads * dim, dim, heads * dim, 1)
    return (batch, heads, seq, dim), (heads * seq * dim, seq * dim, dim, 1)


def causal_code(is_causal: bool, bottom_right: bool) -> int:
    if not is_causal:
        return NOT_CAUSAL
    return CAUSAL_BOTTOM_RIGHT if bottom_right else CAUSAL_TOP_LEFT


def softmax_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _forward_plan(dtype: torch.dtype, shape, kv_shape, strides, is_causal: bool, scale: float | None,
                  bottom_right: bool, mask: torch.Tensor | None) -> ForwardPlan:
    batch, heads, seq_q, head_dim = shape
    kv_group = heads // kv_shape[1]
    variant = variants.fwd_variant(DTYPE_NAMES[dtype], head_dim, mask is not None)
    q_blocks = -(-seq_q // variant.block_rows)
    out_size, out_stride = output_layout(shape, strides[0])
    args = None
    if not is_compiling():
        block = FwdArgs(0, 0, 0, 0, 0, *(s for stride in strides for s in stride[:3]), *out_stride[:3],
                        heads * seq_q, seq_q, seq_q, kv_shape[2], head_dim, causal_code(is_causal, bottom_right),
                        softmax_scale(head_dim, scale) * LOG2_E, q_blocks)
        block.kv_group = kv_group
        if mask is not None:
            block.mask_kind = MASK_KINDS[mask.dtype]
            block.mask_stride_b, block.mask_stride_h, block.mask_stride_q, block.mask_stride_k = mask.stride()
        args = bytes(block)
    return ForwardPlan(dtype, is_causal, scale, bottom_right, kv_group, variant,
                       (q_blocks * variant.d_chunks, heads, batch), args, out_size, out_stride, mask)


def forward_geometry(q, k, v, is_causal: bool, scale: float | None, attn_mask: torch.Tensor | None = None,
                     bottom_right: bool = False) -> ForwardPlan:
    """The forward launch for tensors a plan_forward already took (or their kernel_layout copies), without
    checking them again: the custom op's, whose arguments cannot carry a plan."""
    mask = None if attn_mask is None else broadcast_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    return _forward_plan(q.dtype, q.shape, k.shape, (q.stride(), k.stride(), v.stride()), is_causal, scale,
                         bottom_right, mask)


def batch_views(*packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(total, heads, dim) tensors as (1, heads, total, dim) views, the kernels' layout for a packed batch."""
    return tuple(t.unsqueeze(0).transpose(1, 2) for t in packed)


def plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal: bool = False,
                scale: float | None = None, covered: PackedRows | None = None) -> VarlenPlan | Refusal:
    """The launches of a packed batch, or why the kernels cannot take it: q (total_q, heads, head_dim), k
    and v (total_k, kv_heads, head_dim), int32 cumulative lengths (batch + 1,) on the same GPU. `covered`:
    what check_cu_seqlens read of the offsets, which the caller checked first."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            return Refusal(f"{name} must be a 3-D (total_tokens, heads, head_dim) tensor")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            return Refusal(f"{name} must be a contiguous 1-D int32 tensor")
        if t.device != q.device:
            return Refusal(f"{name} is on another device than the query")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 2:
        return Refusal("cu_seqlens_q and cu_seqlens_k must both hold batch + 1 >= 2 offsets")
    if not (0 <= int(max_seqlen_q) <= MAX_SEQLEN and 0 <= int(max_seqlen_k) <= MAX_SEQLEN):
        return Refusal("max_seqlen_q or max_seqlen_k is negative or above 2^31 - 1024")
    dense = plan_forward(*batch_views(q, k, v))
    if isinstance(dense, Refusal) and dense.reason != EMPTY:  # no query or no key at all: nothing to launch
        return dense
    return VarlenPlan(int(max_seqlen_q), int(max_seqlen_k), bool(is_causal),
                      None if scale is None else float(scale), covered)
