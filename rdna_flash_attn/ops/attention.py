"""Tensor-level entry to the kernels: the checks that keep bad input off the GPU, and the launch.

Tensors are (batch, heads, seq, head_dim) views with unit stride in head_dim; both (B, H, S, D) and
(B, S, H, D) memory layouts run as they are, with no copy, padding or transpose on the host.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..runtime import artifacts, device as devices, loader, variants
from ..runtime.loader import KernelUnavailable
from .launch_args import BwdArgs, FwdArgs

__all__ = ["KernelUnavailable", "forward_refusal", "artifact_info", "forward_launch",
           "flash_attention_forward", "flash_attention_backward", "kernel_layout"]

_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_SUPPORTED_HEAD_DIMS = frozenset(variants.SUPPORTED_HEAD_DIMS)
_VECTOR_ELEMS = 8  # the kernels move 16-byte vectors of 16-bit values
_MAX_GRID_YZ = 65535
_MAX_SEQLEN = 2**31 - 1024
LOG2_E = 1.4426950408889634  # the kernels take the softmax scale in base 2
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
KERNEL_DEVICE_TYPE = "cuda"  # ROCm and ZLUDA builds of torch name AMD GPUs "cuda" as well


def forward_refusal(q, k, v, is_causal: bool = False, scale: float | None = None) -> str | None:
    """Why the forward kernel cannot take these arguments, or None. Metadata only, no GPU work."""
    tensors = (("query", q), ("key", k), ("value", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D; the kernels take 4-D (batch, heads, seq, head_dim)"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported (float16 or bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "query, key and value have different dtypes"
    on_kernel_device = q.device.type == KERNEL_DEVICE_TYPE or loader.explicit_library_for(q.device) is not None
    if not on_kernel_device or k.device != q.device or v.device != q.device:
        return "query, key and value must be on one GPU"
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        return "batch sizes differ"
    if q.shape[1] != k.shape[1] or q.shape[1] != v.shape[1]:
        return "head counts differ (grouped-query attention is not supported)"
    if k.shape[2] != v.shape[2]:
        return "key and value have different sequence lengths"
    head_dim = q.shape[3]
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        return "query, key and value head dims differ"
    if head_dim not in _SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} is not supported (multiples of 8 up to 256, or 320, 384, 512)"
    if q.numel() == 0 or k.numel() == 0:
        return "empty tensor"
    if max(q.shape[2], k.shape[2]) > _MAX_SEQLEN:
        return "sequence longer than 2^31"
    if q.shape[0] > _MAX_GRID_YZ or q.shape[1] > _MAX_GRID_YZ:
        return "batch or heads above 65535"
    for name, t in tensors:
        reason = _layout_refusal(name, t)
        if reason:
            return reason
    if scale is not None and not math.isfinite(scale):
        return "softmax scale is not finite"
    return None


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


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it as it is, else a compact copy (only for odd views such
    as a gradient arriving with a storage offset)."""
    return t if _layout_refusal("", t) is None else t.clone(memory_format=torch.contiguous_format)


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


def _softmax_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _device_guard(device: torch.device):
    """The GPU made current for a launch; nothing to do for an explicitly chosen CPU library."""
    return devices.device_guard(device) if device.type == "cuda" else contextlib.nullcontext()


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [stride for t in tensors for stride in t.stride()[:3]]


class _ForwardLaunch:
    """What a forward launch needs that depends only on the call's signature (device, library, dtype,
    shapes, strides, causality, scale): the kernel, its grid, the output's layout and an argument
    block with everything but the five pointers filled in. Built once per signature, after the full
    checks passed."""

    __slots__ = ("launcher", "args", "device", "dtype", "out_size", "out_stride", "lse_size")

    def __init__(self, library: loader.KernelLibrary, q, k, v, is_causal: bool, scale: float | None):
        batch, heads, seq_q, head_dim = q.shape
        variant = variants.fwd_variant(_DTYPES[q.dtype], head_dim)
        q_blocks = -(-seq_q // variant.block_rows)
        self.device, self.dtype = q.device, q.dtype
        self.out_size, self.out_stride = output_layout(q)
        self.lse_size = (batch, heads, seq_q)  # contiguous: strides (heads * seq_q, seq_q, 1)
        self.launcher = library.launcher(variant, (q_blocks * variant.d_chunks, heads, batch), q.device)
        self.args = FwdArgs(0, 0, 0, 0, 0, *_strides(q, k, v), *self.out_stride[:3], heads * seq_q, seq_q,
                            seq_q, k.shape[2], head_dim, int(bool(is_causal)),
                            _softmax_scale(head_dim, scale) * LOG2_E, q_blocks)

    def __call__(self, q, k, v):
        out = torch.empty_strided(self.out_size, self.out_stride, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_size, dtype=torch.float32, device=self.device)
        args = FwdArgs.from_buffer_copy(self.args)  # a copy per call: launches may run on several threads
        args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        args.o, args.lse = out.data_ptr(), lse.data_ptr()
        self.launcher(args, (q, k, v, out, lse))
        return out, lse


_forward_launches: dict[tuple, _ForwardLaunch] = {}
_MAX_CACHED_SIGNATURES = 4096  # far above any model's count of attention shapes; a bound against leaks


def forget_launches() -> None:
    """Drop the prepared launches (their libraries and devices are looked up again)."""
    _forward_launches.clear()


def forward_launch(q, k, v, is_causal: bool = False, scale: float | None = None) -> _ForwardLaunch:
    """A prepared forward launch: launch(q, k, v) -> (out, lse) on tensors of this call's signature
    (device, dtypes, shapes, strides, 16-byte aligned storage) skips every check and lookup. The
    dispatcher keeps one per cached route. Raises ValueError for input the kernels refuse."""
    reason = forward_refusal(q, k, v, is_causal, scale)
    if reason is not None:
        raise ValueError(reason)
    return _ForwardLaunch(loader.library_for(q.device), q, k, v, is_causal, scale)


def flash_attention_forward(q, k, v, is_causal: bool = False, scale: float | None = None,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out, lse): out like q, lse (batch, heads, seq_q) float32 natural-log log-sum-exp.

    `out` and `lse` may be given to be written in place. A call whose signature passed the checks
    before, with 16-byte aligned inputs, reuses that launch: no checks, lookups or packing again."""
    signature = None
    if out is None and lse is None and type(q) is torch.Tensor and (scale is None or type(scale) is float):
        signature = _launch_signature(q, k, v, is_causal, scale)
        launch = _forward_launches.get(signature) if signature is not None else None
        if launch is not None:
            return launch(q, k, v)
    reason = forward_refusal(q, k, v, is_causal, scale) or _output_refusal(q, out, lse)
    if reason is not None:  # before the library loads: bad arguments are named whatever the device
        raise ValueError(reason)
    launch = _ForwardLaunch(loader.library_for(q.device), q, k, v, is_causal, scale)
    if out is None and lse is None:
        if signature is not None:
            if len(_forward_launches) >= _MAX_CACHED_SIGNATURES:
                _forward_launches.clear()
            _forward_launches[signature] = launch
        return launch(q, k, v)
    args = FwdArgs.from_buffer_copy(launch.args)
    args.q, args.k, args.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    args.o, args.lse = out.data_ptr(), lse.data_ptr()
    args.o_stride_b, args.o_stride_h, args.o_stride_s = out.stride()[:3]
    args.lse_stride_b, args.lse_stride_h = lse.stride(0), lse.stride(1)
    launch.launcher(args, (q, k, v, out, lse))
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


def flash_attention_backward(dout, q, k, v, lse, is_causal: bool = False, scale: float | None = None):
    """(dq, dk, dv) in the inputs' dtypes and memory orders, from the forward's lse.

    Two launches: dQ per query block, which also writes delta = rowsum(P * dP), then dK/dV per key
    block. No workgroup writes memory another one reads or writes within a launch, so the result is
    bitwise reproducible."""
    reason = forward_refusal(q, k, v, is_causal, scale) or forward_refusal(dout, k, v)
    if reason is None and dout.shape != q.shape:
        reason = "dout must match the query's shape"
    if reason is None and (lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous()):
        reason = "lse must be the forward's contiguous float32 (batch, heads, seq_q) log-sum-exp"
    if reason is not None:
        raise ValueError(reason)
    library = loader.library_for(q.device)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    dtype = _DTYPES[q.dtype]
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    delta = torch.empty_like(lse)  # same layout as lse: the kernels share its strides
    softmax_scale = _softmax_scale(head_dim, scale)
    args = BwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr(), delta.data_ptr(),
                   dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), *_strides(q, k, v, dout, dq, dk, dv),
                   lse.stride(0), lse.stride(1), seq_q, seq_k, head_dim, int(bool(is_causal)),
                   softmax_scale * LOG2_E, softmax_scale, 0)
    dq_kernel = variants.bwd_variant("dq", dtype, head_dim)
    dkdv = variants.bwd_variant("dkdv", dtype, head_dim)
    buffers = (q, k, v, dout, lse, delta, dq, dk, dv)
    with _device_guard(q.device):
        args.blocks = -(-seq_q // dq_kernel.block_rows)
        library.launch(dq_kernel, (args.blocks * dq_kernel.jobs_per_block, heads, batch), args, buffers)
        args.blocks = -(-seq_k // dkdv.block_rows)
        library.launch(dkdv, (args.blocks * dkdv.jobs_per_block, heads, batch), args, buffers)
    return dq, dk, dv
