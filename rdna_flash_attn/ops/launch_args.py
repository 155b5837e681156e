"""Kernel argument blocks, field for field as the kernels declare them (kernels/fa_fwd.h, fa_bwd.h, fa_fwd8.h,
quant8.h).

A change here or there is an ABI change: bump variants.ABI_VERSION with it. The codes for `causal` and
`mask_kind` are kernels/sequence.h's.
"""

import ctypes

# Fields both blocks have, in this order: the row statistics' strides and the problem's shape.
_SHAPE_FIELDS = [
    ("lse_stride_b", ctypes.c_int64),
    ("lse_stride_h", ctypes.c_int64),
    ("seqlen_q", ctypes.c_int32),
    ("seqlen_k", ctypes.c_int32),
    ("head_dim", ctypes.c_int32),
    ("causal", ctypes.c_int32),
    ("scale_log2", ctypes.c_float),
]
# Both blocks' fields since ABI 2: the mask, packed batches, grouped key/value heads.
_PROBLEM_FIELDS = [
    ("mask", ctypes.c_void_p),
    *((f"mask_stride_{d}", ctypes.c_int64) for d in "bhqk"),
    ("cu_seqlens_q", ctypes.c_void_p),
    ("cu_seqlens_k", ctypes.c_void_p),
    ("mask_kind", ctypes.c_int32),
    ("kv_group", ctypes.c_int32),
]

# ABI 5: added to a workgroup's grid y and z indices, for grids launched in slices of at most 65535.
_SLICE_FIELDS = [("head0", ctypes.c_int32), ("batch0", ctypes.c_int32)]


class FwdArgs(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "lse")),
        *((f"{t}_stride_{d}", ctypes.c_int64) for t in "qkvo" for d in "bhs"),
        *_SHAPE_FIELDS,
        ("q_blocks", ctypes.c_int32),
        *_PROBLEM_FIELDS,
        # ABI 3: what a training forward saves for the backward (null otherwise)
        ("o_low", ctypes.c_void_p),
        ("row_offset", ctypes.c_void_p),
        ("row_log2_sum", ctypes.c_void_p),
        *_SLICE_FIELDS,
    ]


class BwdArgs(ctypes.Structure):
    """One block for the dQ and dK/dV kernels (kernels/fa_bwd.h)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "k", "v", "dout", "lse", "delta", "dq", "dk", "dv")),
        *((f"{t}_stride_{d}", ctypes.c_int64) for t in ("q", "k", "v", "do", "dq", "dk", "dv") for d in "bhs"),
        *_SHAPE_FIELDS,
        ("scale", ctypes.c_float),
        ("blocks", ctypes.c_int32),
        *_PROBLEM_FIELDS,
        ("row_log2_sum", ctypes.c_void_p),
        # ABI 3: what the training forward saved (null otherwise)
        ("out", ctypes.c_void_p),
        ("out_low", ctypes.c_void_p),
        *((f"out_stride_{d}", ctypes.c_int64) for d in "bhs"),
        ("lse_to_log2", ctypes.c_float),
        *_SLICE_FIELDS,
    ]


# kernels/sequence.h's Causal and MaskKind.
NOT_CAUSAL, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2
MASK_NONE, MASK_BOOL, MASK_F16, MASK_BF16, MASK_F32 = 0, 1, 2, 3, 4


class Fwd8Args(ctypes.Structure):
    """The 8-bit forward's block (kernels/fa_fwd8.h): 16-bit Q, which the kernel quantizes, and K and V
    quantized by the pass in the kernel's own layout."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        *((f"q_stride_{d}", ctypes.c_int64) for d in "bhs"),
        *((name, ctypes.c_void_p) for name in ("k8", "k_scale", "vt8", "v_scale", "v_mean", "o")),
        *((f"o_stride_{d}", ctypes.c_int64) for d in "bhs"),
        *((name, ctypes.c_int32) for name in ("heads", "kv_heads", "seqlen_q", "seqlen_k", "k_rows", "head_dim")),
        ("scale_log2", ctypes.c_float),
    ]


class Quant8Args(ctypes.Structure):
    """The 8-bit forward's quantizing pass (kernels/quant8.h): 16-bit K and V in, Fwd8Args' buffers out."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("k", "v")),
        *((f"{t}_stride_{d}", ctypes.c_int64) for t in "kv" for d in "bhs"),
        *((name, ctypes.c_void_p) for name in ("k8", "k_scale", "vt8", "k_mean", "v_mean", "v_scale")),
        *((name, ctypes.c_int32) for name in ("kv_heads", "seqlen_k", "k_rows", "head_dim")),
    ]
