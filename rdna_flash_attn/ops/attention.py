"""Tensor-level entry to the kernels: the checks that keep bad input off the GPU, and the launch.

Tensors are (batch, heads, seq, head_dim) views with unit stride in head_dim; both (B, H, S, D) and
(B, S, H, D) memory layouts run as they are, with no copy, padding or transpose on the host. Masks
(bool or additive, anything broadcastable to (batch, heads, seq_q, seq_k)) are read where they lie,
broadcast dimensions with stride 0; key/value heads may be fewer than query heads (grouped-query
attention) without being repeated; packed variable-length batches run through the varlen functions.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import NamedTuple

import torch

from ..runtime import artifacts, device as devices, loader, variants
from ..runtime.loader import KernelUnavailable
from .launch_args import (BwdArgs, CAUSAL_BOTTOM_RIGHT, CAUSAL_TOP_LEFT, FwdArgs, MASK_BF16, MASK_BOOL, MASK_F16,
                          MASK_F32, MASK_NONE, NOT_CAUSAL)

__all__ = ["KernelUnavailable", "DTYPE_NAMES", "BackwardStats", "backward_stats_like", "forward_refusal", "mask_refusal",
           "varlen_refusal", "check_cu_seqlens", "PackedRows", "artifact_info", "forward_launch",
           "flash_attention_forward", "flash_attention_backward", "flash_attention_varlen_forward",
           "flash_attention_varlen_backward", "kernel_layout", "packed_kernel_layout"]

DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}  # the kernels' dtypes, as the variants table names them
_MASK_KINDS = {torch.bool: MASK_BOOL, torch.float16: MASK_F16, torch.bfloat16: MASK_BF16, torch.float32: MASK_F32}
_SUPPORTED_HEAD_DIMS = frozenset(variants.SUPPORTED_HEAD_DIMS)
_VECTOR_ELEMS = 8  # the kernels move 16-byte vectors of 16-bit values
_MAX_GRID_YZ = 65535  # workgroups along a grid's y (heads) and z (batch): larger grids launch in slices
# The kernels index rows as 32-bit ints: a row index plus a tile must stay below 2^31.
_MAX_SEQLEN = 2**31 - 1024
# The kernels address the rows of a Q, K, V or dO tile as 32-bit byte offsets from its first row (their
# loads' scalar-base form): below 2^23 elements per row, a tile of 64 rows stays within 2^31 bytes.
_MAX_SEQ_STRIDE = 2**23
_EMPTY = "empty tensor"
LOG2_E = 1.4426950408889634  # the kernels take the softmax scale in base 2
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
KERNEL_DEVICE_TYPE = "cuda"  # ROCm and ZLUDA builds of torch name AMD GPUs "cuda" as well


def forward_refusal(q, k, v, is_causal: bool = False, scale: float | None = None, attn_mask=None,
                    backward: bool = False) -> str | None:
    """Why the forward kernel (with `backward`, the backward's too) cannot take these arguments, or None.
    Metadata only, no GPU work."""
    tensors = (("query", q), ("key", k), ("value", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D; the kernels take 4-D (batch, heads, seq, head_dim)"
    if q.dtype not in DTYPE_NAMES:
        return f"dtype {q.dtype} is not supported (float16 or bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "query, key and value have different dtypes"
    on_kernel_device = q.device.type == KERNEL_DEVICE_TYPE or loader.explicit_library_for(q.device) is not None
    if not on_kernel_device or k.device != q.device or v.device != q.device:
        return "query, key and value must be on one GPU"
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        return "batch sizes differ"
    if k.shape[1] != v.shape[1]:
        return "key and value head counts differ"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return "query heads are not a multiple of key/value heads"
    if k.shape[2] != v.shape[2]:
        return "key and value have different sequence lengths"
    head_dim = q.shape[3]
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        return "query, key and value head dims differ"
    if head_dim not in _SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} is not supported (multiples of 8 up to 256, or 320, 384, 512)"
    if q.numel() == 0 or k.numel() == 0:
        return _EMPTY
    if max(q.shape[2], k.shape[2]) > _MAX_SEQLEN:
        return "sequence longer than 2^31 - 1024"
    for name, t in tensors:
        reason = _read_refusal(name, t)
        if reason:
            return reason
    if scale is not None and not math.isfinite(scale):
        return "softmax scale is not finite"
    return mask_refusal(attn_mask, q, k, backward)


def mask_refusal(attn_mask, q, k, backward: bool = False) -> str | None:
    """Why the kernels (the forward's, with `backward` the backward's too) cannot take this attn_mask for
    (B, H, Sq, D) q and (B, Hk, Sk, D) k, or None.
    SDPA's rules: bool (True takes part) or an additive bias in float32 or the query's dtype,
    broadcastable to (B, H, Sq, Sk); anything else falls back to SDPA, which gives its own error."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if attn_mask.is_nested or attn_mask.layout is not torch.strided:
        return "attn_mask is nested or sparse"
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return f"attn_mask dtype {attn_mask.dtype} is neither bool, float32 nor the query's"
    if attn_mask.device != q.device:
        return "attn_mask is on another device than the query"
    if attn_mask.requires_grad and torch.is_grad_enabled():
        return "attn_mask requires grad (the kernels give no gradient for a mask)"
    target = _mask_target(q, k)
    if not 2 <= attn_mask.dim() <= 4:
        return f"attn_mask is {attn_mask.dim()}-D (SDPA takes 2-D to 4-D masks)"
    if any(size not in (1, full) for size, full in zip(_padded_shape(attn_mask), target)):
        return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {target}"
    if q.shape[3] not in variants.MASKED_HEAD_DIMS:
        return f"attn_mask with head dim {q.shape[3]} (masked kernels take head dims up to {variants.MASKED_HEAD_DIMS[-1]})"
    mask = kernel_mask(attn_mask, q, k)
    # 32-bit element offsets (kernels/sequence.h MaskView): the forward and dQ kernels count them from a
    # wave's first query, dK/dV from the (batch, head)'s first row.
    rows = target[2] if backward else min(target[2], variants.FRAG)
    if mask.stride(2) * (rows - 1) + mask.stride(3) * (target[3] - 1) >= 2**31:
        return (f"attn_mask's rows span 2^31 elements within {rows} queries"
                + (" (the backward's dK/dV kernels take less)" if backward else ""))
    return None


def _mask_target(q, k) -> tuple[int, int, int, int]:
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2]


def _padded_shape(attn_mask: torch.Tensor) -> tuple[int, ...]:
    return (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)


def kernel_mask(attn_mask: torch.Tensor, q, k) -> torch.Tensor:
    """attn_mask as the (B, H, Sq, Sk) view the kernels read: broadcast dimensions get stride 0, no copy."""
    return attn_mask[(None,) * (4 - attn_mask.dim())].expand(_mask_target(q, k))


def _causal_code(is_causal: bool, bottom_right: bool) -> int:
    if not is_causal:
        return NOT_CAUSAL
    return CAUSAL_BOTTOM_RIGHT if bottom_right else CAUSAL_TOP_LEFT


def _set_problem(args, q, k, attn_mask: torch.Tensor | None, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """The fields both argument blocks share past ABI 1: the mask, the head grouping, the packed batch."""
    args.kv_group = q.shape[1] // k.shape[1]
    if attn_mask is not None:
        mask = kernel_mask(attn_mask, q, k)
        args.mask, args.mask_kind = mask.data_ptr(), _MASK_KINDS[mask.dtype]
        args.mask_stride_b, args.mask_stride_h, args.mask_stride_q, args.mask_stride_k = mask.stride()
    else:
        args.mask, args.mask_kind = None, MASK_NONE
    if cu_seqlens_q is not None:
        # Every entry of a packed batch starts from the same base, at its cu_seqlens row.
        args.cu_seqlens_q, args.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        for field, _ in args._fields_:
            if field.endswith("_stride_b") and not field.startswith(("lse", "mask")):
                setattr(args, field, 0)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned, or a tensor without storage (torch.compile's fake tensors, and any tensor
    while torch.compile traces): those are checked again when the real call runs, where the custom
    op copies a misaligned input (autograd.py)."""
    if _is_compiling():
        return True
    try:
        return t.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):
        return True


def _layout_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why the kernels cannot address a 4-D tensor as it lies in memory, or None."""
    if t.stride(3) != 1:
        return f"{name} is not contiguous in head_dim"
    if any(t.stride(i) % _VECTOR_ELEMS for i in range(3)):
        return f"{name} strides are not multiples of 8 elements (16 bytes)"
    if not _aligned(t):
        return f"{name} does not start on a 16-byte boundary (storage offset)"
    return None


def _read_refusal(name: str, t: torch.Tensor) -> str | None:
    """_layout_refusal for a 4-D tensor the kernels read in tiles (Q, K, V, dO), whose rows their 32-bit
    offsets must also reach (see _MAX_SEQ_STRIDE). Outputs are written with 64-bit addresses."""
    reason = _layout_refusal(name, t)
    if reason is None and t.stride(2) >= _MAX_SEQ_STRIDE:
        reason = f"{name} sequence stride {t.stride(2)} is 2^23 elements or more"
    return reason


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t (4-D) itself when the kernels can read it as it is, else a compact copy (only for odd views
    such as a gradient arriving with a storage offset)."""
    return t if _read_refusal("", t) is None else t.clone(memory_format=torch.contiguous_format)


def packed_kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """kernel_layout for a packed (total, heads, dim) tensor, judged on the kernels' (1, heads, total,
    dim) view, where the sequence stride is the tokens' own."""
    return t if _read_refusal("", _batch_views(t)[0]) is None else t.clone(memory_format=torch.contiguous_format)


def artifact_info(device: torch.device) -> dict:
    """What the library launches for `device` would run (an explicit one first): for records."""
    library = loader.library_for(torch.device(device))
    artifact: artifacts.Artifact = library.artifact
    return {"target": artifact.target, "path": str(artifact.path), "sha256": artifact.sha256,
            "emulated": artifact.emulated, "code_object_version": artifact.code_object_version,
            "runtime_version": library.runtime_version}


def output_layout(q: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(size, strides) of an output in q's memory order: (B, S, H, D) callers can reshape it to
    (B, S, H*D) for free."""
    batch, heads, seq, dim = q.shape
    if q.stride(2) > q.stride(1):
        return (batch, heads, seq, dim), (seq * heads * dim, dim, heads * dim, 1)
    return (batch, heads, seq, dim), (heads * seq * dim, seq * dim, dim, 1)


def output_like(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of q's shape, dtype and device, in q's memory order."""
    size, stride = output_layout(q)
    return torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)


def _output_refusal(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> str | None:
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            return "out must have the query's shape, dtype and device"
        reason = _layout_refusal("out", out)
        if reason:
            return reason
    if lse is not None:
        if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device or lse.stride(2) != 1:
            return "lse must be float32 (batch, heads, seq_q), contiguous in seq_q, on the query's device"
    return None


class BackwardStats(NamedTuple):
    """What a training forward saves beside out and lse so that the backward's dQ kernel needs one
    sweep over the keys instead of two (kernels/fa_fwd.h): O's rounding remainder, rounded to 16 bits
    again (out_low, with out's shape and strides), and per row the forward's base-2 exponent offset and
    log2 of its probability sum (like lse). One more output-sized tensor and 8 bytes per row. (In
    float16, remainders of outputs below 2^-3 lose bits to its subnormal range; bfloat16's do not.)"""

    out_low: torch.Tensor
    row_offset: torch.Tensor
    row_log2_sum: torch.Tensor


def backward_stats_like(q: torch.Tensor, varlen: bool = False) -> BackwardStats:
    """Uninitialised BackwardStats for a forward on q that allocates its own out: out_low laid out as
    that out, the row statistics as the lse ((batch, heads, seq_q), or (heads, total_q) for a packed q)."""
    rows = (q.shape[1], q.shape[0]) if varlen else q.shape[:3]
    out_low = torch.empty_like(q, memory_format=torch.contiguous_format) if varlen else output_like(q)
    return BackwardStats(out_low, *(torch.empty(rows, dtype=torch.float32, device=q.device) for _ in range(2)))


def _stats_refusal(out: torch.Tensor | None, saved: BackwardStats | None, like: torch.Tensor,
                   lse: torch.Tensor) -> str | None:
    """Why out / saved cannot go with a call on `like`-shaped output and this lse, or None."""
    if saved is None:
        return None
    if not isinstance(saved, BackwardStats) or not all(isinstance(t, torch.Tensor) for t in saved):
        return "saved must be a BackwardStats of tensors (see backward_stats_like)"
    if out is not None and not isinstance(out, torch.Tensor):
        return "out is not a tensor"
    if out is not None and (out.shape != like.shape or out.dtype != like.dtype or out.device != like.device):
        return "out must have the query's shape, dtype and device"
    low = saved.out_low
    if low.shape != like.shape or low.dtype != like.dtype or low.device != like.device:
        return "saved.out_low must have the query's shape, dtype and device"
    if low.stride() != (out.stride() if out is not None else output_layout(like)[1]):  # the kernels share them
        return "saved.out_low must have the output's strides"
    for name, t in (("out", out), ("saved.out_low", low)):
        reason = t is not None and _layout_refusal(name, t.unsqueeze(0) if t.dim() == 3 else t)
        if reason:
            return reason
    for name in ("row_offset", "row_log2_sum"):
        t = getattr(saved, name)
        if t.shape != lse.shape or t.dtype != torch.float32 or t.device != like.device or t.stride() != lse.stride():
            return f"saved.{name} must be float32 like the lse, with its shape and strides"
    return None


def _backward_stats_refusal(out: torch.Tensor | None, saved: BackwardStats | None, like: torch.Tensor,
                            lse: torch.Tensor) -> str | None:
    """_stats_refusal for a backward, which takes the training forward's out and saved together or neither."""
    if (out is None) != (saved is None):
        return "out and saved go together (the training forward's output and BackwardStats)"
    return _stats_refusal(out, saved, like, lse)


def _set_saved_forward(args, saved: BackwardStats) -> None:
    """The training forward's extra outputs (out_low with the output's strides)."""
    args.o_low, args.row_offset, args.row_log2_sum = (t.data_ptr() for t in saved)


def _softmax_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _device_guard(device: torch.device):
    """The GPU made current for a launch; nothing to do for an explicitly chosen CPU library."""
    return devices.device_guard(device) if device.type == "cuda" else contextlib.nullcontext()


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()[:3]]


def _grid_slices(grid: tuple[int, int, int]) -> list[tuple[tuple[int, int, int], int, int]]:
    """(grid, head0, batch0) per launch covering `grid`: at most _MAX_GRID_YZ workgroups along y and z
    each, the kernels adding head0 and batch0 to their y and z indices."""
    x, heads, batch = grid
    return [((x, min(_MAX_GRID_YZ, heads - head0), min(_MAX_GRID_YZ, batch - batch0)), head0, batch0)
            for batch0 in range(0, batch, _MAX_GRID_YZ) for head0 in range(0, heads, _MAX_GRID_YZ)]


def _launcher(library: loader.KernelLibrary, variant, grid: tuple[int, int, int], device: torch.device):
    """launch(args, buffers) of `variant` over `grid`: the library's own launcher, or one per slice of a
    grid past _MAX_GRID_YZ along y or z (args.head0 and args.batch0 set for each)."""
    slices = _grid_slices(grid)
    if len(slices) == 1:
        return library.launcher(variant, grid, device)
    parts = [(library.launcher(variant, part, device), head0, batch0) for part, head0, batch0 in slices]

    def launch(args, buffers) -> None:
        for part, args.head0, args.batch0 in parts:
            part(args, buffers)
    return launch


def _launch(library: loader.KernelLibrary, variant, grid: tuple[int, int, int], args, buffers) -> None:
    """library.launch of `variant` over `grid`, slice by slice (_grid_slices)."""
    for part, args.head0, args.batch0 in _grid_slices(grid):
        library.launch(variant, part, args, buffers)


class _ForwardLaunch:
    """What a forward launch needs that depends only on the call's signature (device, library, dtype,
    shapes, strides, causality, scale): the kernel, its grid, the output's layout and an argument
    block with everything but the five pointers filled in. Built once per signature, after the full
    checks passed."""

    __slots__ = ("launcher", "args", "device", "dtype", "out_size", "out_stride", "lse_size")

    def __init__(self, library: loader.KernelLibrary, q, k, v, is_causal: bool, scale: float | None,
                 bottom_right: bool = False, masked: bool = False):
        batch, heads, seq_q, head_dim = q.shape
        variant = variants.fwd_variant(DTYPE_NAMES[q.dtype], head_dim, masked)
        q_blocks = -(-seq_q // variant.block_rows)
        self.device, self.dtype = q.device, q.dtype
        self.out_size, self.out_stride = output_layout(q)
        self.lse_size = (batch, heads, seq_q)  # contiguous: strides (heads * seq_q, seq_q, 1)
        self.launcher = _launcher(library, variant, (q_blocks * variant.d_chunks, heads, batch), q.device)
        self.args = FwdArgs(0, 0, 0, 0, 0, *_strides(q, k, v), *self.out_stride[:3], heads * seq_q, seq_q,
                            seq_q, k.shape[2], head_dim, _causal_code(is_causal, bottom_right),
                            _softmax_scale(head_dim, scale) * LOG2_E, q_blocks)
        _set_problem(self.args, q, k, None)

    def __call__(self, q, k, v, attn_mask: torch.Tensor | None = None, saved: BackwardStats | None = None):
        out = torch.empty_strided(self.out_size, self.out_stride, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_size, dtype=torch.float32, device=self.device)
        args = FwdArgs.from_buffer_copy(self.args)  # a copy per call: launches may run on several threads
        args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        args.o, args.lse = out.data_ptr(), lse.data_ptr()
        if attn_mask is not None:
            _set_problem(args, q, k, attn_mask)
        if saved is not None:
            _set_saved_forward(args, saved)
        self.launcher(args, (q, k, v, out, lse, attn_mask, *(saved or ())))
        return out, lse


_forward_launches: dict[tuple, _ForwardLaunch] = {}
_MAX_CACHED_SIGNATURES = 4096  # far above any model's count of attention shapes; a bound against leaks


def forget_launches() -> None:
    """Drop the prepared launches (their libraries and devices are looked up again)."""
    _forward_launches.clear()


def forward_launch(q, k, v, is_causal: bool = False, scale: float | None = None) -> _ForwardLaunch:
    """A prepared forward launch without a mask: launch(q, k, v) -> (out, lse) on tensors of this
    call's signature (device, dtypes, shapes, strides, 16-byte aligned storage) skips every check and
    lookup. The dispatcher keeps one per cached route. Raises ValueError for input the kernels refuse."""
    reason = forward_refusal(q, k, v, is_causal, scale)
    if reason is not None:
        raise ValueError(reason)
    return _ForwardLaunch(loader.library_for(q.device), q, k, v, is_causal, scale)


def flash_attention_forward(q, k, v, is_causal: bool = False, scale: float | None = None,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                            attn_mask: torch.Tensor | None = None, bottom_right: bool = False,
                            saved: BackwardStats | None = None):
    """(out, lse): out like q, lse (batch, heads, seq_q) float32 natural-log log-sum-exp (+inf for a
    row that sees no key; its output is zeros, as SDPA gives).

    `attn_mask`: SDPA's (see mask_refusal). `bottom_right`: a causal mask aligned to the bottom-right
    corner (flash-attn's) rather than SDPA's top-left; the same when seq_q == seq_k. `out` and `lse`
    may be given to be written in place. `saved` (training; BackwardStats like out and a contiguous
    lse, see backward_stats_like) is written for flash_attention_backward. A call without a mask or
    `saved` whose signature passed the checks before, with 16-byte aligned inputs, reuses that
    launch: no checks, lookups or packing again."""
    signature = None
    if (out is None and lse is None and attn_mask is None and not bottom_right and type(q) is torch.Tensor
            and (scale is None or type(scale) is float) and saved is None):
        signature = _launch_signature(q, k, v, is_causal, scale)
        launch = _forward_launches.get(signature) if signature is not None else None
        if launch is not None:
            return launch(q, k, v)
    reason = forward_refusal(q, k, v, is_causal, scale, attn_mask) or _output_refusal(q, out, lse)
    if reason is None and saved is not None:
        stats_lse = lse if lse is not None else torch.empty(q.shape[:3], dtype=torch.float32, device="meta")
        reason = _stats_refusal(out, saved, q, stats_lse)
    if reason is not None:  # before the library loads: bad arguments are named whatever the device
        raise ValueError(reason)
    launch = _ForwardLaunch(loader.library_for(q.device), q, k, v, is_causal, scale, bottom_right,
                            attn_mask is not None)
    if out is None and lse is None:
        if signature is not None:
            if len(_forward_launches) >= _MAX_CACHED_SIGNATURES:
                _forward_launches.clear()
            _forward_launches[signature] = launch
        return launch(q, k, v, attn_mask, saved)
    out = output_like(q) if out is None else out
    lse = torch.empty(launch.lse_size, dtype=torch.float32, device=q.device) if lse is None else lse
    args = FwdArgs.from_buffer_copy(launch.args)
    args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.o, args.lse = out.data_ptr(), lse.data_ptr()
    args.o_stride_b, args.o_stride_h, args.o_stride_s = out.stride()[:3]
    args.lse_stride_b, args.lse_stride_h = lse.stride(0), lse.stride(1)
    if attn_mask is not None:
        _set_problem(args, q, k, attn_mask)
    if saved is not None:
        _set_saved_forward(args, saved)
    launch.launcher(args, (q, k, v, out, lse, attn_mask, *(saved or ())))
    return out, lse


def _launch_signature(q, k, v, is_causal, scale) -> tuple | None:
    """Everything forward_refusal and the launch read, for tensors whose storage is 16-byte aligned
    (alignment is per call, not per signature); None for anything else."""
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    try:
        if q.device.type != KERNEL_DEVICE_TYPE:  # an explicit library's launches (the interpreter) are not kept
            return None
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            return None
        return (q.device, q.dtype, k.dtype, v.dtype, q.layout, k.layout, v.layout, q.shape, k.shape, v.shape,
                q.stride(), k.stride(), v.stride(), k.device, v.device, bool(is_causal), scale,
                loader.emulated_layer())
    except (RuntimeError, NotImplementedError):  # nested or storage-less tensors: the full checks judge
        return None


def flash_attention_backward(dout, q, k, v, lse, is_causal: bool = False, scale: float | None = None, *,
                             attn_mask: torch.Tensor | None = None, bottom_right: bool = False,
                             out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """(dq, dk, dv) in the inputs' dtypes and memory orders, from the forward's lse; dk and dv have
    the key/value heads (summed over each one's query heads in a fixed order).

    Two launches: dQ per query block, which also writes delta = rowsum(P * dP), then dK/dV per key
    block. With the forward's `out` and `saved` (see flash_attention_forward) delta comes from them
    and dQ sweeps the keys once; without them, twice. No workgroup writes memory another one reads or
    writes within a launch, so the result is bitwise reproducible."""
    reason = forward_refusal(q, k, v, is_causal, scale, attn_mask, backward=True) or forward_refusal(dout, k, v)
    if reason is None and dout.shape != q.shape:
        reason = "dout must match the query's shape"
    if reason is None and (lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous()):
        reason = "lse must be the forward's contiguous float32 (batch, heads, seq_q) log-sum-exp"
    reason = reason or _backward_stats_refusal(out, saved, q, lse)
    if reason is not None:
        raise ValueError(reason)
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    _launch_backward(dout, q, k, v, lse, dq, dk, dv, _causal_code(is_causal, bottom_right), scale, attn_mask,
                     q.shape[0], q.shape[2], k.shape[2], (lse.stride(0), lse.stride(1)), out, saved)
    return dq, dk, dv


def _launch_backward(dout, q, k, v, lse, dq, dk, dv, causal: int, scale, attn_mask, batch: int, seq_q: int,
                     seq_k: int, lse_strides: tuple[int, int], out=None, saved: BackwardStats | None = None,
                     cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """The dQ then the dK/dV launch on (B, H, S, D) views (batch stride 0 for packed batches); out and
    saved.out_low as such views too."""
    library = loader.library_for(q.device)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    dtype = DTYPE_NAMES[q.dtype]
    delta = torch.empty_like(lse)  # lse's layout: the kernels share its strides
    # With the training forward's statistics the kernels read its row offsets where the lse would be.
    row_offsets, lse_to_log2 = (lse, LOG2_E) if saved is None else (saved.row_offset, 1.0)
    row_log2_sum = torch.empty_like(lse) if saved is None else saved.row_log2_sum
    softmax_scale = _softmax_scale(head_dim, scale)
    args = BwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), row_offsets.data_ptr(),
                   delta.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), *_strides(q, k, v, dout, dq, dk, dv),
                   *lse_strides, seq_q, seq_k, head_dim, causal, softmax_scale * LOG2_E, softmax_scale, 0)
    args.row_log2_sum, args.lse_to_log2 = row_log2_sum.data_ptr(), lse_to_log2
    if saved is not None:
        args.out, args.out_low = out.data_ptr(), saved.out_low.data_ptr()
        args.out_stride_b, args.out_stride_h, args.out_stride_s = out.stride()[:3]
    _set_problem(args, q, k, attn_mask, cu_seqlens_q, cu_seqlens_k)
    masked = attn_mask is not None
    dq_kernel = variants.bwd_variant("dq", dtype, head_dim, masked)
    dkdv = variants.bwd_variant("dkdv", dtype, head_dim, masked)
    stats = (out, saved.out_low) if saved is not None else ()
    buffers = (q, k, v, dout, row_offsets, delta, dq, dk, dv, attn_mask, cu_seqlens_q, cu_seqlens_k, row_log2_sum,
               *stats)
    with _device_guard(q.device):
        args.blocks = -(-seq_q // dq_kernel.block_rows)
        _launch(library, dq_kernel, (args.blocks * dq_kernel.jobs_per_block, heads, batch), args, buffers)
        args.blocks = -(-seq_k // dkdv.block_rows)
        _launch(library, dkdv, (args.blocks * dkdv.jobs_per_block, kv_heads, batch), args, buffers)


# --- packed variable-length batches (flash-attn's varlen layout) ---------------------------------------


def varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> str | None:
    """Why the kernels cannot take this packed batch, or None: q (total_q, heads, head_dim), k and v
    (total_k, kv_heads, head_dim), int32 cumulative lengths (batch + 1,) on the same GPU."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            return f"{name} must be a 3-D (total_tokens, heads, head_dim) tensor"
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            return f"{name} must be a contiguous 1-D int32 tensor"
        if t.device != q.device:
            return f"{name} is on another device than the query"
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 2:
        return "cu_seqlens_q and cu_seqlens_k must both hold batch + 1 >= 2 offsets"
    if not (0 <= int(max_seqlen_q) <= _MAX_SEQLEN and 0 <= int(max_seqlen_k) <= _MAX_SEQLEN):
        return "max_seqlen_q or max_seqlen_k is negative or above 2^31 - 1024"
    reason = forward_refusal(*_batch_views(q, k, v))
    return None if reason == _EMPTY else reason  # no query or no key at all: nothing to launch


class PackedRows(NamedTuple):
    """How many leading rows of the packed q and k the entries cover: cu_seqlens_q[-1], cu_seqlens_k[-1]."""

    q: int
    k: int


class _Offsets(NamedTuple):
    """What one cu_seqlens tensor holds, once its values are read."""

    last: int
    longest: int  # the longest entry's length
    longest_entry: int


# Per side (queries, keys): the names errors give its offsets, its max_seqlen, its packed tensor, its rows.
_SIDES = (("cu_seqlens_q", "max_seqlen_q", "q", "queries"), ("cu_seqlens_k", "max_seqlen_k", "k", "keys"))
_SHARED_SIDES = (("cu_seqlens", "max_seqlen", "qkv", "tokens"),) * 2  # flash-attn's qkvpacked arguments

# id(tensor) -> ((version, data_ptr, shape, strides), its _Offsets or what is wrong with it); an entry
# is dropped when its tensor is freed, so an id is never reused while its entry stands.
_offsets_read: dict[int, tuple[tuple, _Offsets | str]] = {}


def check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     shared: bool = False) -> PackedRows | None:
    """Raises ValueError, naming the argument, unless the offsets of a packed batch are sound: both
    cu_seqlens 1-D int32 tensors of batch + 1 offsets, starting at 0, never decreasing, ending within the
    rows of q (resp. k), no entry longer than max_seqlen_q (resp. max_seqlen_k), which are not negative.
    Returns the rows the entries cover, or None where the values could not be read (below). Every public
    varlen entry (these ops, the dispatcher, the flash-attn API) calls it before anything else, so bad
    offsets give the same error whether the kernels or a fallback would have run. `shared`: queries and
    keys have one cu_seqlens and max_seqlen (flash-attn's qkvpacked form), which errors then name so.

    The host checks everything: the kernels read cu_seqlens[b] and cu_seqlens[b + 1] as they are
    (kernels/sequence.h) and bound their work only by those and by max_seqlen, which sizes the grid.
    Offsets may end before the last row, as in flash-attn; the rows past the end are then zeros here
    (flash-attn leaves them uninitialised), and so are their gradients.

    Reading the values is a device-to-host copy, a sync. What a tensor holds is therefore remembered
    per tensor object while its version counter, data pointer, shape and strides stay the same: a
    model's layers passing one cu_seqlens tensor sync once, and an in-place write (which bumps the
    version) is read again. Inference tensors (made under torch.inference_mode) have no version counter
    and are read at every call. The values are not read, and are trusted as flash-attn trusts them,
    while torch.compile traces and while a CUDA graph is being captured (unless read before the
    capture: the usual warm-up call does): both forbid the sync."""
    sides = _SHARED_SIDES if shared else _SIDES
    for (name, *_), offsets in zip(sides, (cu_seqlens_q, cu_seqlens_k)):
        if not isinstance(offsets, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of batch + 1 int32 offsets, not {type(offsets).__name__}")
        if offsets.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, not {offsets.dtype}")
        if offsets.dim() != 1 or offsets.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 offsets, not of shape {tuple(offsets.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same batch + 1 offsets, not "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    covered = []
    for (name, max_name, packed_name, tokens), offsets, packed, max_seqlen in zip(
            sides, (cu_seqlens_q, cu_seqlens_k), (q, k), (max_seqlen_q, max_seqlen_k)):
        max_seqlen = int(max_seqlen)
        if max_seqlen < 0:
            raise ValueError(f"{max_name} must not be negative ({max_seqlen})")
        read = _read_offsets(offsets)
        if isinstance(read, str):
            raise ValueError(f"{name} {read}")
        covered.append(None if read is None else read.last)
        if read is None:
            continue
        rows = packed.shape[0] if isinstance(packed, torch.Tensor) and packed.dim() else None
        if rows is not None and read.last > rows:
            raise ValueError(f"{name} ends at {read.last}, beyond the {rows} rows of {packed_name}")
        if read.longest > max_seqlen:
            raise ValueError(f"{max_name} {max_seqlen} is smaller than entry {read.longest_entry}'s "
                             f"{read.longest} {tokens}")
    return None if None in covered else PackedRows(*covered)


def _read_offsets(offsets: torch.Tensor) -> _Offsets | str | None:
    """What `offsets` holds (remembered, see check_cu_seqlens), or what is wrong with it; None where
    its values cannot be read now."""
    if _is_compiling() or offsets.device.type == "meta":
        return None
    versioned = not offsets.is_inference()
    identity = (offsets._version if versioned else None, offsets.data_ptr(), offsets.shape, offsets.stride())
    remembered = _offsets_read.get(id(offsets))
    if remembered is not None and remembered[0] == identity:
        return remembered[1]
    if _capturing_graph(offsets.device):
        return None
    read = _summarise_offsets(offsets.detach().to("cpu", torch.int64))  # int64: differences cannot overflow
    if versioned:
        if remembered is None:
            weakref.finalize(offsets, _offsets_read.pop, id(offsets), None).atexit = False
        _offsets_read[id(offsets)] = (identity, read)
    return read


def _capturing_graph(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the device's current stream, where a sync is an error."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _summarise_offsets(offsets: torch.Tensor) -> _Offsets | str:
    """_Offsets of host int64 offsets, or what is wrong with them (to follow the argument's name)."""
    negative = (offsets < 0).nonzero()
    if negative.numel():
        index = int(negative[0])
        return f"holds a negative offset at index {index} ({int(offsets[index])})"
    if offsets[0] != 0:
        return f"must start at 0, not {int(offsets[0])}"
    lengths = offsets.diff()
    falling = (lengths < 0).nonzero()
    if falling.numel():
        index = int(falling[0]) + 1
        return f"is not non-decreasing at index {index} ({int(offsets[index - 1])} -> {int(offsets[index])})"
    longest_entry = int(lengths.argmax())
    return _Offsets(int(offsets[-1]), int(lengths[longest_entry]), longest_entry)


def _uncovered(packed_rows: int, covered: int | None) -> slice:
    """The trailing rows no entry covers, which the kernels leave untouched; all rows where the
    offsets were not read (the kernels then overwrite the covered ones)."""
    return slice(0 if covered is None else covered, packed_rows)


def _nothing_to_launch(q, k, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    return q.shape[0] == 0 or k.shape[0] == 0 or int(max_seqlen_q) == 0 or int(max_seqlen_k) == 0


def _batch_views(*packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(total, heads, dim) tensors as (1, heads, total, dim) views, the kernels' layout for a packed batch."""
    return tuple(t.unsqueeze(0).transpose(1, 2) for t in packed)


def flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                   is_causal: bool = False, scale: float | None = None, *,
                                   saved: BackwardStats | None = None):
    """(out, lse) for a packed batch: entry b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of
    q (total_q, heads, head_dim), its keys those of k and v (total_k, kv_heads, head_dim). out is
    like q; lse is (heads, total_q) float32, flash-attn's varlen layout. A causal mask is aligned to
    each entry's bottom-right corner (flash-attn's). The offsets and lengths are checked first
    (check_cu_seqlens); rows past cu_seqlens_q[-1] get zeros and an lse of +inf, as rows that see no key.
    `saved` (training; BackwardStats like q and the lse) is written for flash_attention_varlen_backward."""
    covered = check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    reason = varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if reason is not None:
        raise ValueError(reason)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    reason = _stats_refusal(out, saved, q, lse)
    if reason is not None:
        raise ValueError(reason)
    if _nothing_to_launch(q, k, max_seqlen_q, max_seqlen_k):  # no row sees a key
        if saved is not None:  # what the forward writes for such rows
            saved.out_low.zero_()
            saved.row_offset.fill_(float("inf"))
            saved.row_log2_sum.zero_()
        return out.zero_(), lse.fill_(float("inf"))
    q4, k4, v4, o4 = _batch_views(q, k, v, out)
    batch, heads, head_dim = cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2]
    library = loader.library_for(q.device)
    variant = variants.fwd_variant(DTYPE_NAMES[q.dtype], head_dim)
    q_blocks = -(-int(max_seqlen_q) // variant.block_rows)
    args = FwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), *_strides(q4, k4, v4, o4),
                   0, lse.stride(0), int(max_seqlen_q), int(max_seqlen_k), head_dim,
                   _causal_code(is_causal, True), _softmax_scale(head_dim, scale) * LOG2_E, q_blocks)
    if saved is not None:
        _set_saved_forward(args, saved)
    _set_problem(args, q4, k4, None, cu_seqlens_q, cu_seqlens_k)
    buffers = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *(saved or ()))
    uncovered = _uncovered(q.shape[0], None if covered is None else covered.q)
    out[uncovered].zero_()
    lse[:, uncovered].fill_(float("inf"))
    with _device_guard(q.device):
        _launch(library, variant, (q_blocks * variant.d_chunks, heads, batch), args, buffers)
    return out, lse


def flash_attention_varlen_backward(dout, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                    max_seqlen_k: int, is_causal: bool = False, scale: float | None = None, *,
                                    out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """(dq, dk, dv), packed like q, k and v, from flash_attention_varlen_forward's lse (and, from a
    training forward, its out and BackwardStats: one dQ sweep instead of two). Rows no entry covers
    get zero gradients."""
    covered = check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    reason = varlen_refusal(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if reason is None and (dout.shape != q.shape or dout.dtype != q.dtype or dout.stride(-1) != 1):
        reason = "dout must match the query's shape and dtype, contiguous in head_dim"
    if reason is None and (lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32
                           or not lse.is_contiguous()):
        reason = "lse must be the varlen forward's contiguous float32 (heads, total_q) log-sum-exp"
    reason = reason or _backward_stats_refusal(out, saved, q, lse)
    if reason is not None:
        raise ValueError(reason)
    dout = packed_kernel_layout(dout)
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if _nothing_to_launch(q, k, max_seqlen_q, max_seqlen_k):
        return tuple(grad.zero_() for grad in grads)
    dq, dk, dv = grads
    dq[_uncovered(q.shape[0], None if covered is None else covered.q)].zero_()
    for grad in (dk, dv):
        grad[_uncovered(k.shape[0], None if covered is None else covered.k)].zero_()
    views = _batch_views(q, k, v, dout, *grads)
    if saved is not None:
        out = _batch_views(out)[0]
    _launch_backward(views[3], *views[:3], lse, *views[4:], _causal_code(is_causal, True), scale, None,
                     cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), (0, lse.stride(0)), out,
                     saved, cu_seqlens_q, cu_seqlens_k)
    return grads
