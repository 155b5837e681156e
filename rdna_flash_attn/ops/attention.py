"""The forward and backward kernels' launches on plans (plans.py), which checked the arguments once: a
launch checks nothing again. And ops' own entry points, for callers outside the dispatcher, which plan a
call and launch it, raising ValueError where the plan refuses it."""

from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple

import torch

from ..runtime import artifacts, device as devices, loader, variants
from ..runtime.loader import KernelUnavailable
from . import plans
from .launch_args import BwdArgs, FwdArgs, MASK_NONE
from .plans import DTYPE_NAMES, LOG2_E, MASK_KINDS, MAX_GRID_YZ, ForwardPlan, PackedRows, VarlenPlan

__all__ = ["KernelUnavailable", "BackwardStats", "backward_stats_like", "check_cu_seqlens", "artifact_info",
           "forward_launcher", "launch_forward", "launch_backward", "launch_varlen_forward", "launch_varlen_backward",
           "flash_attention_forward", "flash_attention_backward", "launch_backward_from_output",
           "flash_attention_varlen_forward", "flash_attention_varlen_backward", "kernel_layout", "packed_kernel_layout",
           "output_like"]


def _set_problem(args, q, k, mask: torch.Tensor | None, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """The fields both argument blocks share past ABI 1: the mask (a (B, H, Sq, Sk) view, plans.broadcast_mask),
    the head grouping, the packed batch."""
    args.kv_group = q.shape[1] // k.shape[1]
    if mask is not None:
        args.mask, args.mask_kind = mask.data_ptr(), MASK_KINDS[mask.dtype]
        args.mask_stride_b, args.mask_stride_h, args.mask_stride_q, args.mask_stride_k = mask.stride()
    else:
        args.mask, args.mask_kind = None, MASK_NONE
    if cu_seqlens_q is not None:
        # Every entry of a packed batch starts from the same base, at its cu_seqlens row.
        args.cu_seqlens_q, args.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        for field, _ in args._fields_:
            if field.endswith("_stride_b") and not field.startswith(("lse", "mask")):
                setattr(args, field, 0)


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t (4-D) itself when the kernels can read it as it is, else a compact copy (only for odd views
    such as a gradient arriving with a storage offset)."""
    return t if plans.readable(t) else t.clone(memory_format=torch.contiguous_format)


def packed_kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """kernel_layout for a packed (total, heads, dim) tensor, judged on the kernels' (1, heads, total,
    dim) view, where the sequence stride is the tokens' own."""
    return t if plans.readable(plans.batch_views(t)[0]) else t.clone(memory_format=torch.contiguous_format)


def artifact_info(device: torch.device) -> dict:
    """What the library launches for `device` would run (an explicit one first): for records."""
    library = loader.library_for(torch.device(device))
    artifact: artifacts.Artifact = library.artifact
    return {"target": artifact.target, "path": str(artifact.path), "sha256": artifact.sha256,
            "emulated": artifact.emulated, "code_object_version": artifact.code_object_version,
            "runtime_version": library.runtime_version}


def output_like(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of q's shape, dtype and device, in q's memory order."""
    size, stride = plans.output_layout(q.shape, q.stride())
    return torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)


def _check_output(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None) -> None:
    """ValueError unless the given out and lse suit a forward on q (outputs are written with 64-bit
    addresses: no limit on their sequence stride)."""
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError("out must have the query's shape, dtype and device")
        _check_layout("out", out)
    if lse is not None:
        if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device or lse.stride(2) != 1:
            raise ValueError("lse must be float32 (batch, heads, seq_q), contiguous in seq_q, on the query's device")


def _check_layout(name: str, t: torch.Tensor) -> None:
    problem = plans.layout_problem(name, t.stride(), plans.aligned(t))
    if problem:
        raise ValueError(problem)


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


def _check_stats(out: torch.Tensor | None, saved: BackwardStats | None, like: torch.Tensor, lse: torch.Tensor,
                 out_stride: tuple[int, ...]) -> None:
    """ValueError unless out and saved can go with a call on `like`-shaped output of `out_stride` and this
    lse (whose shape and strides are all that is read of it)."""
    if saved is None:
        return
    if not isinstance(saved, BackwardStats) or not all(isinstance(t, torch.Tensor) for t in saved):
        raise ValueError("saved must be a BackwardStats of tensors (see backward_stats_like)")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError("out is not a tensor")
    if out is not None and (out.shape != like.shape or out.dtype != like.dtype or out.device != like.device):
        raise ValueError("out must have the query's shape, dtype and device")
    low = saved.out_low
    if low.shape != like.shape or low.dtype != like.dtype or low.device != like.device:
        raise ValueError("saved.out_low must have the query's shape, dtype and device")
    if low.stride() != out_stride:  # the kernels share them
        raise ValueError("saved.out_low must have the output's strides")
    for name, t in (("out", out), ("saved.out_low", low)):
        if t is not None:
            _check_layout(name, t.unsqueeze(0) if t.dim() == 3 else t)
    for name in ("row_offset", "row_log2_sum"):
        t = getattr(saved, name)
        if t.shape != lse.shape or t.dtype != torch.float32 or t.device != like.device or t.stride() != lse.stride():
            raise ValueError(f"saved.{name} must be float32 like the lse, with its shape and strides")


def _check_backward_stats(out: torch.Tensor | None, saved: BackwardStats | None, like: torch.Tensor,
                          lse: torch.Tensor) -> None:
    """_check_stats for a backward, which takes the training forward's out and saved together or neither."""
    if (out is None) != (saved is None):
        raise ValueError("out and saved go together (the training forward's output and BackwardStats)")
    _check_stats(out, saved, like, lse, None if out is None else out.stride())


def _set_saved_forward(args, saved: BackwardStats) -> None:
    """The training forward's extra outputs (out_low with the output's strides)."""
    args.o_low, args.row_offset, args.row_log2_sum = (t.data_ptr() for t in saved)


def _device_guard(device: torch.device):
    """The GPU made current for a launch; nothing to do for an explicitly chosen CPU library."""
    return devices.device_guard(device) if device.type == "cuda" else contextlib.nullcontext()


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()[:3]]


def _grid_slices(grid: tuple[int, int, int]) -> list[tuple[tuple[int, int, int], int, int]]:
    """(grid, head0, batch0) per launch covering `grid`: at most MAX_GRID_YZ workgroups along y and z
    each, the kernels adding head0 and batch0 to their y and z indices."""
    x, heads, batch = grid
    return [((x, min(MAX_GRID_YZ, heads - head0), min(MAX_GRID_YZ, batch - batch0)), head0, batch0)
            for batch0 in range(0, batch, MAX_GRID_YZ) for head0 in range(0, heads, MAX_GRID_YZ)]


def _launcher(library: loader.KernelLibrary, variant, grid: tuple[int, int, int], device: torch.device):
    """launch(args, buffers) of `variant` over `grid`: the library's own launcher, or one per slice of a
    grid past MAX_GRID_YZ along y or z (args.head0 and args.batch0 set for each)."""
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


# --- the forward ----------------------------------------------------------------------------------------


def forward_launcher(plan: ForwardPlan, device: torch.device):
    """launch(args, buffers) of `plan`'s kernel over its grid on `device`'s library (an explicit one
    first), with the kernel and stream lookups made now: for a caller that launches one plan often."""
    return _launcher(loader.library_for(device), plan.variant, plan.grid, device)


def launch_forward(plan: ForwardPlan, q, k, v, *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   saved: BackwardStats | None = None, launcher=None):
    """(out, lse) of `plan`'s kernel on the q, k and v it was planned for: out like q in q's memory
    order, lse (batch, heads, seq_q) float32 natural-log log-sum-exp (+inf for a row that sees no key;
    its output is zeros, as SDPA gives). out and lse are written in place where given; `saved` (a
    training forward's BackwardStats) is written for the backward. `launcher`: forward_launcher's, kept
    by the caller; else one is made for this launch."""
    device = q.device
    args = FwdArgs.from_buffer_copy(plan.args)  # a copy per call: launches may run on several threads
    if out is None:
        out = torch.empty_strided(plan.out_size, plan.out_stride, dtype=plan.dtype, device=device)
    else:
        args.o_stride_b, args.o_stride_h, args.o_stride_s = out.stride()[:3]
    if lse is None:
        lse = torch.empty(plan.lse_size, dtype=torch.float32, device=device)
    else:
        args.lse_stride_b, args.lse_stride_h = lse.stride(0), lse.stride(1)
    args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.o, args.lse = out.data_ptr(), lse.data_ptr()
    if plan.mask is not None:
        args.mask = plan.mask.data_ptr()
    if saved is not None:
        _set_saved_forward(args, saved)
    (launcher or forward_launcher(plan, device))(args, (q, k, v, out, lse, plan.mask, *(saved or ())))
    return out, lse


# Plans of flash_attention_forward's calls without a mask, given outputs or statistics, by signature
# (_launch_signature), with their launchers: a repeated call skips every check and lookup.
_prepared: dict[tuple, tuple[ForwardPlan, object]] = {}
_MAX_CACHED_SIGNATURES = 4096  # far above any model's count of attention shapes; a bound against leaks


def forget_launches() -> None:
    """Drop the prepared launches (their libraries and devices are looked up again)."""
    _prepared.clear()


def flash_attention_forward(q, k, v, is_causal: bool = False, scale: float | None = None,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                            attn_mask: torch.Tensor | None = None, bottom_right: bool = False,
                            saved: BackwardStats | None = None):
    """(out, lse) of the forward kernel (launch_forward), planned here: ValueError for arguments the
    kernels do not take (plans.plan_forward), before any library loads.

    `attn_mask`: SDPA's (see plans.mask_view). `bottom_right`: a causal mask aligned to the bottom-right
    corner (flash-attn's) rather than SDPA's top-left; the same when seq_q == seq_k. `out` and `lse`
    may be given to be written in place. `saved` (training; BackwardStats like out and a contiguous
    lse, see backward_stats_like) is written for flash_attention_backward. A call without a mask,
    outputs or `saved` whose signature was planned before, with 16-byte aligned inputs, reuses that
    plan and its launcher."""
    signature = None
    if (out is None and lse is None and attn_mask is None and not bottom_right and type(q) is torch.Tensor
            and (scale is None or type(scale) is float) and saved is None):
        signature = _launch_signature(q, k, v, is_causal, scale)
        prepared = _prepared.get(signature) if signature is not None else None
        if prepared is not None:
            return launch_forward(prepared[0], q, k, v, launcher=prepared[1])
    plan = plans.planned(plans.plan_forward(q, k, v, is_causal, scale, attn_mask, bottom_right=bottom_right))
    _check_output(q, out, lse)
    if saved is not None:
        _check_stats(out, saved, q, lse if lse is not None else torch.empty(q.shape[:3], device="meta"),
                     out.stride() if out is not None else plan.out_stride)
    launcher = forward_launcher(plan, q.device)
    if signature is not None:
        if len(_prepared) >= _MAX_CACHED_SIGNATURES:
            _prepared.clear()
        _prepared[signature] = plan, launcher
    return launch_forward(plan, q, k, v, out=out, lse=lse, saved=saved, launcher=launcher)


def _launch_signature(q, k, v, is_causal, scale) -> tuple | None:
    """Everything plan_forward and the launch read, for tensors whose storage is 16-byte aligned
    (alignment is per call, not per signature); None for anything else."""
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    try:
        if q.device.type != plans.KERNEL_DEVICE_TYPE:  # an explicit library's launches (the interpreter) are not kept
            return None
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            return None
        return (q.device, q.dtype, k.dtype, v.dtype, q.layout, k.layout, v.layout, q.shape, k.shape, v.shape,
                q.stride(), k.stride(), v.stride(), k.device, v.device, bool(is_causal), scale,
                loader.emulated_layer())
    except (RuntimeError, NotImplementedError):  # nested or storage-less tensors: the full checks judge
        return None


# --- the backward ---------------------------------------------------------------------------------------


def launch_backward(dout, q, k, v, lse, is_causal: bool = False, scale: float | None = None, *,
                    attn_mask: torch.Tensor | None = None, bottom_right: bool = False,
                    out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """(dq, dk, dv) in the inputs' dtypes and memory orders, from the forward's lse, for arguments a
    plan took; dk and dv have the key/value heads (summed over each one's query heads in a fixed order).

    Two launches: dQ per query block, which also writes delta = rowsum(P * dP), then dK/dV per key
    block. With the forward's `out` and `saved` (see flash_attention_forward) delta comes from them
    and dQ sweeps the keys once; without them, twice. No workgroup writes memory another one reads or
    writes within a launch, so the result is bitwise reproducible."""
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    _launch_gradients(dout, q, k, v, lse, dq, dk, dv, plans.causal_code(is_causal, bottom_right), scale, attn_mask,
                      q.shape[0], q.shape[2], k.shape[2], (lse.stride(0), lse.stride(1)), out, saved)
    # A NaN row (its lse NaN) makes every dK and dV of its (batch, head) NaN in SDPA's and flash-attn's
    # arithmetic. The kernels cap each exponent (fa_bwd.h kMaxExponent), and the cap turns the unmasked
    # kernels' NaN offset into a finite one: mark those heads here, without a sync.
    nan_kv_heads = lse.isnan().any(-1).view(k.shape[0], k.shape[1], -1).any(-1)[:, :, None, None]
    dk.masked_fill_(nan_kv_heads, float("nan"))
    dv.masked_fill_(nan_kv_heads, float("nan"))
    return dq, dk, dv


def flash_attention_backward(dout, q, k, v, lse, is_causal: bool = False, scale: float | None = None, *,
                             attn_mask: torch.Tensor | None = None, bottom_right: bool = False,
                             out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """launch_backward, its arguments checked here first: ValueError for those the kernels do not take."""
    plans.planned(plans.plan_forward(q, k, v, is_causal, scale, attn_mask, backward=True))
    plans.planned(plans.plan_forward(dout, k, v))
    if dout.shape != q.shape:
        raise ValueError("dout must match the query's shape")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError("lse must be the forward's contiguous float32 (batch, heads, seq_q) log-sum-exp")
    _check_backward_stats(out, saved, q, lse)
    return launch_backward(dout, q, k, v, lse, is_causal, scale, attn_mask=attn_mask, bottom_right=bottom_right,
                           out=out, saved=saved)


def launch_backward_from_output(dout, q, k, v, out, lse, is_causal: bool = False, scale: float | None = None, *,
                                attn_mask: torch.Tensor | None = None, bottom_right: bool = False):
    """(dq, dk, dv) as launch_backward gives them, with the probabilities taken from the given lse and
    delta = rowsum(dout * out) from the given out, as flash-attn's backward computes them. Ring attention
    passes the out and lse merged over every key/value chunk, and each chunk's call then gets that chunk's
    share of the gradients (the kernels' own sums would normalise over the chunk's keys alone). lse:
    float32 (batch, heads, seq_q) natural log, any strides; a row whose lse is infinite (flash-attn's +inf,
    or -inf) saw no key and gets zero gradients, and a NaN lse gives NaN gradients (that row's dQ, every dK
    and dV of its (batch, head)), as flash-attn's exponent of it does. out: q's shape, readable as the
    kernels read q."""
    # The training forward's statistics, rebuilt from out and lse: offsets in base 2, the sums folded in.
    row_offset = torch.where(torch.isinf(lse), float("inf"), lse.float() * LOG2_E).contiguous()
    out_low = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).zero_()
    saved = BackwardStats(out_low, row_offset, torch.zeros_like(row_offset))
    return launch_backward(dout, q, k, v, row_offset, is_causal, scale, attn_mask=attn_mask, bottom_right=bottom_right,
                           out=out, saved=saved)


def _launch_gradients(dout, q, k, v, lse, dq, dk, dv, causal: int, scale, attn_mask, batch: int, seq_q: int,
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
    softmax_scale = plans.softmax_scale(head_dim, scale)
    args = BwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), row_offsets.data_ptr(),
                   delta.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), *_strides(q, k, v, dout, dq, dk, dv),
                   *lse_strides, seq_q, seq_k, head_dim, causal, softmax_scale * LOG2_E, softmax_scale, 0)
    args.row_log2_sum, args.lse_to_log2 = row_log2_sum.data_ptr(), lse_to_log2
    if saved is not None:
        args.out, args.out_low = out.data_ptr(), saved.out_low.data_ptr()
        args.out_stride_b, args.out_stride_h, args.out_stride_s = out.stride()[:3]
    mask = None if attn_mask is None else plans.broadcast_mask(attn_mask, (batch, heads, seq_q, seq_k))
    _set_problem(args, q, k, mask, cu_seqlens_q, cu_seqlens_k)
    masked = mask is not None
    dq_kernel = variants.bwd_variant("dq", dtype, head_dim, masked)
    dkdv = variants.bwd_variant("dkdv", dtype, head_dim, masked)
    stats = (out, saved.out_low) if saved is not None else ()
    buffers = (q, k, v, dout, row_offsets, delta, dq, dk, dv, attn_mask, cu_seqlens_q, cu_seqlens_k, row_log2_sum,
               *stats)
    with _device_guard(q.device):
        args.blocks = -(-seq_q // dq_kernel.block_rows)
        _launch(library, dq_kernel, (args.blocks * dq_kernel.jobs_per_block, heads, batch), args, buffers)
        args.blocks = -(-seq_k // dkdv.block_rows)
        grid = (args.blocks * dkdv.jobs_per_block, kv_heads, batch)
        rows = seq_q if mask is None else plans.mask_rows_per_launch(mask, seq_q)
        if rows < seq_q:
            _launch_dkdv_by_query_slices(library, dkdv, grid, args, buffers, rows, seq_q, mask.element_size(), dk, dv)
        else:
            _launch(library, dkdv, grid, args, buffers)


def _launch_dkdv_by_query_slices(library: loader.KernelLibrary, variant, grid: tuple[int, int, int], args: BwdArgs,
                                 buffers: tuple, rows: int, seq_q: int, mask_element_bytes: int, dk, dv) -> None:
    """The dK/dV launch once per `rows` queries, for a mask whose offsets from the first query pass the
    kernels' 32 bits (plans.mask_rows_per_launch): each slice's gradients, in dk's and dv's dtype, are
    summed in float32 in query order and rounded once more at the end. Non-causal calls only."""
    dk_sum, dv_sum = torch.zeros_like(dk, dtype=torch.float32), torch.zeros_like(dv, dtype=torch.float32)
    dk_slice = torch.empty_strided(dk.shape, dk.stride(), dtype=dk.dtype, device=dk.device)
    dv_slice = torch.empty_strided(dv.shape, dv.stride(), dtype=dv.dtype, device=dv.device)
    part = BwdArgs.from_buffer_copy(args)
    part.dk, part.dv = dk_slice.data_ptr(), dv_slice.data_ptr()
    element_bytes = dk.element_size()  # Q, dO and dK share the kernels' 16-bit dtype
    for first in range(0, seq_q, rows):
        part.seqlen_q = min(rows, seq_q - first)
        part.q = args.q + first * args.q_stride_s * element_bytes
        part.dout = args.dout + first * args.do_stride_s * element_bytes
        part.mask = args.mask + first * args.mask_stride_q * mask_element_bytes
        # The row statistics lie one float32 per query, rows contiguous.
        part.lse, part.delta, part.row_log2_sum = (address + first * 4 for address in
                                                   (args.lse, args.delta, args.row_log2_sum))
        _launch(library, variant, grid, part, (*buffers, dk_slice, dv_slice))
        dk_sum += dk_slice
        dv_sum += dv_slice
    dk.copy_(dk_sum)
    dv.copy_(dv_sum)


# --- packed variable-length batches (flash-attn's varlen layout) ---------------------------------------


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
    if plans.is_compiling() or offsets.device.type == "meta":
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


def _nothing_to_launch(q, k, plan: VarlenPlan) -> bool:
    return q.shape[0] == 0 or k.shape[0] == 0 or plan.max_seqlen_q == 0 or plan.max_seqlen_k == 0


def launch_varlen_forward(plan: VarlenPlan, q, k, v, cu_seqlens_q, cu_seqlens_k, *,
                          saved: BackwardStats | None = None):
    """(out, lse) for a packed batch `plan` took: entry b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
    of q (total_q, heads, head_dim), its keys those of k and v (total_k, kv_heads, head_dim). out is
    like q; lse is (heads, total_q) float32, flash-attn's varlen layout. A causal mask is aligned to
    each entry's bottom-right corner (flash-attn's); rows past cu_seqlens_q[-1] get zeros and an lse of
    +inf, as rows that see no key. `saved` (training; BackwardStats like q and the lse) is written for
    the backward."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if _nothing_to_launch(q, k, plan):  # no row sees a key
        if saved is not None:  # what the forward writes for such rows
            saved.out_low.zero_()
            saved.row_offset.fill_(float("inf"))
            saved.row_log2_sum.zero_()
        return out.zero_(), lse.fill_(float("inf"))
    q4, k4, v4, o4 = plans.batch_views(q, k, v, out)
    batch, heads, head_dim = cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2]
    library = loader.library_for(q.device)
    variant = variants.fwd_variant(DTYPE_NAMES[q.dtype], head_dim)
    q_blocks = -(-plan.max_seqlen_q // variant.block_rows)
    args = FwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), *_strides(q4, k4, v4, o4),
                   0, lse.stride(0), plan.max_seqlen_q, plan.max_seqlen_k, head_dim,
                   plans.causal_code(plan.is_causal, True), plans.softmax_scale(head_dim, plan.scale) * LOG2_E,
                   q_blocks)
    if saved is not None:
        _set_saved_forward(args, saved)
    _set_problem(args, q4, k4, None, cu_seqlens_q, cu_seqlens_k)
    buffers = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *(saved or ()))
    uncovered = _uncovered(q.shape[0], None if plan.covered is None else plan.covered.q)
    out[uncovered].zero_()
    lse[:, uncovered].fill_(float("inf"))
    with _device_guard(q.device):
        _launch(library, variant, (q_blocks * variant.d_chunks, heads, batch), args, buffers)
    return out, lse


def launch_varlen_backward(plan: VarlenPlan, dout, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, *,
                           out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """(dq, dk, dv), packed like q, k and v, from launch_varlen_forward's lse (and, from a training
    forward, its out and BackwardStats: one dQ sweep instead of two). Rows no entry covers get zero
    gradients. dout as the kernels read it (packed_kernel_layout)."""
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if _nothing_to_launch(q, k, plan):
        return tuple(grad.zero_() for grad in grads)
    dq, dk, dv = grads
    covered = plan.covered
    dq[_uncovered(q.shape[0], None if covered is None else covered.q)].zero_()
    for grad in (dk, dv):
        grad[_uncovered(k.shape[0], None if covered is None else covered.k)].zero_()
    views = plans.batch_views(q, k, v, dout, *grads)
    if saved is not None:
        out = plans.batch_views(out)[0]
    _launch_gradients(views[3], *views[:3], lse, *views[4:], plans.causal_code(plan.is_causal, True), plan.scale, None,
                      cu_seqlens_q.shape[0] - 1, plan.max_seqlen_q, plan.max_seqlen_k, (0, lse.stride(0)), out,
                      saved, cu_seqlens_q, cu_seqlens_k)
    return grads


def plan_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                scale: float | None = None) -> VarlenPlan:
    """The plan of a packed batch for ops' own entry points: its offsets checked (check_cu_seqlens), then
    its tensors (plans.plan_varlen); ValueError for either."""
    covered = check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return plans.planned(plans.plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                           scale, covered))


def flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                   is_causal: bool = False, scale: float | None = None, *,
                                   saved: BackwardStats | None = None):
    """launch_varlen_forward, planned here (plan_packed): ValueError for arguments the kernels do not take."""
    plan = plan_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    if saved is not None:
        _check_stats(None, saved, q, torch.empty((q.shape[1], q.shape[0]), device="meta"),
                     torch.empty_like(q, memory_format=torch.contiguous_format, device="meta").stride())
    return launch_varlen_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, saved=saved)


def flash_attention_varlen_backward(dout, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                    max_seqlen_k: int, is_causal: bool = False, scale: float | None = None, *,
                                    out: torch.Tensor | None = None, saved: BackwardStats | None = None):
    """launch_varlen_backward, its arguments checked here first: ValueError for those the kernels do not take."""
    plan = plan_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    if dout.shape != q.shape or dout.dtype != q.dtype or dout.stride(-1) != 1:
        raise ValueError("dout must match the query's shape and dtype, contiguous in head_dim")
    if lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError("lse must be the varlen forward's contiguous float32 (heads, total_q) log-sum-exp")
    _check_backward_stats(out, saved, q, lse)
    return launch_varlen_backward(plan, packed_kernel_layout(dout), q, k, v, lse, cu_seqlens_q, cu_seqlens_k, out=out,
                                  saved=saved)
