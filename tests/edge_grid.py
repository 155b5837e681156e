"""The edge grid: every kernel family at the shapes where tiles degenerate, with the checks a result
cannot show by itself. Run on the shipped code objects by the CPU interpreter (tests/interpreter/
test_edge_grid.py, in CI, its LDS race, bounds and wait checks on) and on the NVIDIA emulation of both
layers (tests/gpu/test_edge_grid_gpu.py, with compute-sanitizer in bench/gpu_kernel_checks.sh).

Each case checks:
- every output element is written: outputs and the kernels' scratch buffers are allocated poisoned
  (NaN), so an element no workgroup writes stays NaN;
- inputs are unchanged: every byte of each input's storage, gaps of strided layouts included;
- the values: the forward within 2x math SDPA's max error against fp64, each gradient within
  FlashAttention-2's bound; a row that sees no key gives zeros and an lse of +inf.

The shapes: Sq or Sk = 1; a tile (64 rows) +-1; workgroups without a key tile (causal bottom-right with
Sq > Sk, packed entries without keys) and without a query tile (packed entries without queries); causal
top-left and bottom-right with Sq < Sk and Sq > Sk; head dims at the padding boundaries of every kernel
class; grouped heads, 1 to 8 query heads per key/value head; fully masked rows; mask values at the edges
of float32; scores near their dtype's range; 8-bit tiles +-1; a mask whose rows span past 2^31 elements.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch

from rdna_flash_attn.ops import attention as ops, plans, quantized

from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype,
                                             grads_sdpa_math, max_error, sdpa_math)

DTYPES = (torch.float16, torch.bfloat16)

# (seq_q, seq_k, causal): None, "top_left" (SDPA's) or "bottom_right" (flash-attn's)
DENSE_SHAPES = (
    (1, 1, None),
    (1, 65, "top_left"),
    (65, 1, "bottom_right"),  # every workgroup but the last without a key tile
    (80, 8, "bottom_right"),  # the first workgroup without a key tile
    (63, 64, "bottom_right"),
    (64, 63, "top_left"),
    (65, 64, "bottom_right"),
    (64, 65, None),
    (17, 70, "top_left"),
    (70, 17, "top_left"),
    (8, 80, "bottom_right"),
    (129, 20, "bottom_right"),  # two whole workgroups without a key tile
)
# The padding boundaries: 8 in d16, 24 in d32, 40 in d48, 72 in d80, 136 in d144, and the big classes.
DENSE_HEAD_DIMS = (8, 24, 40, 64, 72, 128, 136, 160, 256, 512, 16, 80)
# (kv heads, query heads per kv head, seq_q, seq_k)
GROUPED_SHAPES = ((1, 2, 65, 63), (2, 3, 1, 64), (1, 4, 64, 1), (1, 5, 17, 65), (1, 8, 63, 17), (2, 1, 65, 65))
GROUPED_HEAD_DIMS = (64, 40, 128, 16, 80, 160)
# (mask kind, seq_q, seq_k)
MASKED_SHAPES = tuple((kind, *shape) for kind, shape in zip(
    itertools.cycle(("bool", "bias", "key_padding")), ((1, 1), (1, 65), (65, 1), (63, 64), (64, 65), (65, 63))))
MASKED_HEAD_DIMS = (40, 64, 128, 8, 160, 72)
MASK_EDGE_VALUES = (float("nan"), 3e38, float("inf"), -3e38, 1e9)
# (queries per entry, keys per entry, causal): entries without keys or without queries, tiles +-1
VARLEN_SHAPES = (
    ((9, 4), (0, 5), True),
    ((80,), (8,), True),
    ((0, 65, 1), (64, 0, 63), False),
    ((63, 1, 65), (65, 64, 1), True),
    ((1, 0), (1, 1), False),
)
VARLEN_HEAD_DIMS = (64, 40, 128, 512, 80)
EIGHT_BIT_SHAPES = ((1, 1), (1, 63), (65, 64), (17, 65))
# (dtype, magnitude of Q and K): as large as SDPA's math in the dtype keeps finite
# bf16 at head dims whose kernels round huge tiles in a branch (64) and round every score (168, 200)
HUGE_SCORES = ((torch.bfloat16, 3e4, 64), (torch.bfloat16, 3e4, 168), (torch.bfloat16, 3e4, 200),
               (torch.float16, 25.0, 64))


def case_id(case) -> str:
    return "-".join(str(part).removeprefix("torch.") for part in case)


def _poisoned(allocate):
    def poisoned(*args, **kwargs):
        t = allocate(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return poisoned


@contextlib.contextmanager
def poisoned_allocations():
    """Every floating-point tensor torch allocates uninitialised meanwhile starts as NaN."""
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    try:
        for name, allocate in originals.items():
            setattr(torch, name, _poisoned(allocate))
        yield
    finally:
        for name, allocate in originals.items():
            setattr(torch, name, allocate)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


@contextlib.contextmanager
def checked(launch_context, *inputs: torch.Tensor):
    """The block's launches inside launch_context() with poisoned allocations, and every input's storage
    byte for byte the same afterwards."""
    before = [_storage_bytes(t) for t in inputs if t is not None]
    with launch_context(), poisoned_allocations():
        yield
    after = [_storage_bytes(t) for t in inputs if t is not None]
    for i, (old, new) in enumerate(zip(before, after)):
        assert torch.equal(old, new), f"input {i} was written"


def _random(shape, dtype, generator, device, scale=1.0):
    return (scale * torch.randn(shape, generator=generator)).to(dtype).to(device)


def _bhsd(batch, heads, seq, dim, dtype, generator, device, layout="bhsd"):
    if layout == "bshd":
        return _random((batch, seq, heads, dim), dtype, generator, device).transpose(1, 2)
    return _random((batch, heads, seq, dim), dtype, generator, device)


def check_forward(out, lse, q, k, v, causal, mask=None, bottom_right=False):
    error, baseline = forward_errors(out, lse, q, k, v, causal, mask, bottom_right)
    assert error <= 2 * baseline, f"error {error:.3e} > 2 x SDPA math's {baseline:.3e}"


def forward_errors(out, lse, q, k, v, causal, mask=None, bottom_right=False):
    """The output's max error against float64 and SDPA math's, once every check that takes no bound passed."""
    ref, ref_lse = attention_fp64(q, k, v, causal, None, mask, bottom_right)
    assert not torch.isnan(out).any(), "an output element was not written"
    error, baseline = max_error(out, ref), max_error(sdpa_math(q, k, v, causal, None, mask, bottom_right), ref)
    seen = torch.isfinite(ref_lse)
    assert (lse[~seen] == float("inf")).all(), "a row without keys needs lse +inf"
    assert (out.double()[~seen] == 0).all(), "a row without keys gives zeros"
    if seen.any():
        assert max_error(lse[seen], ref_lse[seen]) < 1e-3 * max(1.0, math.log(k.shape[2]))
    return error, baseline


def check_backward(grads, q, k, v, dout, causal, mask=None, bottom_right=False):
    for name, (error, baseline) in backward_errors(grads, q, k, v, dout, causal, mask, bottom_right).items():
        bound = backward_bound(baseline)
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


def backward_errors(grads, q, k, v, dout, causal, mask=None, bottom_right=False) -> dict:
    """Per gradient, its max error against float64 and the input-dtype attention's."""
    reference = grads_fp64(q, k, v, dout, causal, None, mask, bottom_right)
    baseline = grads_input_dtype(q, k, v, dout, causal, None, mask, bottom_right)
    errors = {}
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, reference, baseline):
        assert not torch.isnan(grad).any(), f"{name}: an element was not written"
        errors[name] = max_error(grad, ref), max_error(base, ref)
    return errors


def dense(launch_context, device, dtype, head_dim, seq_q, seq_k, causal, seed):
    generator = torch.Generator().manual_seed(seed)
    q, dout = (_bhsd(1, 2, seq_q, head_dim, dtype, generator, device, "bshd") for _ in range(2))
    k, v = (_bhsd(1, 2, seq_k, head_dim, dtype, generator, device) for _ in range(2))
    is_causal, bottom_right = causal is not None, causal == "bottom_right"
    with checked(launch_context, q, k, v, dout):
        out, lse = ops.flash_attention_forward(q, k, v, is_causal, bottom_right=bottom_right)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, is_causal, bottom_right=bottom_right)
    check_forward(out, lse, q, k, v, is_causal, None, bottom_right)
    check_backward(grads, q, k, v, dout, is_causal, None, bottom_right)


def grouped(launch_context, device, dtype, head_dim, kv_heads, group, seq_q, seq_k, seed):
    generator = torch.Generator().manual_seed(seed)
    q, dout = (_bhsd(1, kv_heads * group, seq_q, head_dim, dtype, generator, device) for _ in range(2))
    k, v = (_bhsd(1, kv_heads, seq_k, head_dim, dtype, generator, device, "bshd") for _ in range(2))
    with checked(launch_context, q, k, v, dout):
        out, lse = ops.flash_attention_forward(q, k, v, True, bottom_right=True)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, True, bottom_right=True)
    check_forward(out, lse, q, k, v, True, None, True)
    check_backward(grads, q, k, v, dout, True, None, True)


def _mask(kind, seq_q, seq_k, dtype, generator, device):
    """Masks with rows that see no key: a bool mask, a full additive bias, a key-padding mask with an
    entry whose keys are all masked."""
    if kind == "bool":
        mask = torch.rand(2, 2, seq_q, seq_k, generator=generator) < 0.6
        mask[:, :, ::3] = False
    elif kind == "bias":
        mask = torch.randn(2, 1, seq_q, seq_k, generator=generator).to(dtype)
        mask[:, :, 1::4] = float("-inf")
    else:
        keep = torch.arange(seq_k)[None, :] < torch.tensor([seq_k - 1, 0])[:, None]
        mask = torch.zeros(2, 1, 1, seq_k).masked_fill(~keep[:, None, None, :], float("-inf"))
    return mask.to(device)


def masked(launch_context, device, dtype, head_dim, kind, seq_q, seq_k, seed):
    generator = torch.Generator().manual_seed(seed)
    q, dout = (_bhsd(2, 2, seq_q, head_dim, dtype, generator, device, "bshd") for _ in range(2))
    k, v = (_bhsd(2, 2, seq_k, head_dim, dtype, generator, device) for _ in range(2))
    mask = _mask(kind, seq_q, seq_k, dtype, generator, device)
    with checked(launch_context, q, k, v, dout, mask):
        out, lse = ops.flash_attention_forward(q, k, v, attn_mask=mask)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, attn_mask=mask)
    check_forward(out, lse, q, k, v, False, mask)
    check_backward(grads, q, k, v, dout, False, mask)


def mask_edge_value(launch_context, device, value):
    """One key of one row at the value, one row all -inf: NaN rows, one-hot rows and zero rows where
    SDPA's float32 math gives them, the other rows within the forward's rule; gradients NaN where SDPA's
    float64 gradients are (a NaN row makes every dK and dV NaN), and within the backward's rule where
    none is."""
    generator = torch.Generator().manual_seed(7)
    q, dout = (_bhsd(1, 1, 20, 64, torch.float16, generator, device) for _ in range(2))
    k, v = (_bhsd(1, 1, 70, 64, torch.float16, generator, device) for _ in range(2))
    mask = torch.zeros(1, 1, 20, 70, device=device)
    mask[..., 1, 66] = value
    mask[..., 3, :] = float("-inf")
    with checked(launch_context, q, k, v, dout, mask):
        out, lse = ops.flash_attention_forward(q, k, v, attn_mask=mask)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                                                attn_mask=mask.cpu())
    out = out.cpu()
    assert torch.equal(out.isnan(), expected.isnan()), "NaN rows differ from SDPA's"
    rows = ~expected.isnan().any(-1)
    assert max_error(out[rows], expected[rows]) <= 2e-3
    expected_grads = grads_sdpa_math(*(t.double().cpu() for t in (q, k, v, dout)), attn_mask=mask.double().cpu())
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert torch.equal(grad.isnan().cpu(), ref.isnan().cpu()), f"{name}: NaN elements differ from SDPA's"
    if not any(ref.isnan().any() for ref in expected_grads):
        check_backward(grads, q, k, v, dout, False, mask)


def varlen(launch_context, device, dtype, head_dim, lengths_q, lengths_k, causal, seed):
    generator = torch.Generator().manual_seed(seed)
    heads = 2
    q, dout = (_random((sum(lengths_q), heads, head_dim), dtype, generator, device) for _ in range(2))
    k, v = (_random((sum(lengths_k), heads, head_dim), dtype, generator, device) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device) for lengths in (lengths_q, lengths_k))
    lengths = (max(lengths_q), max(lengths_k))
    with checked(launch_context, q, k, v, dout, cu_q, cu_k):
        out, lse = ops.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, *lengths, causal)
        grads = ops.flash_attention_varlen_backward(dout, q, k, v, lse, cu_q, cu_k, *lengths, causal)
    # The precision rules bound a call's max error by the reference's over the same call: over every entry
    # of the packed batch together (an entry of one row holds too few values for SDPA's max error to bound
    # anything).
    forward, backward = [(0.0, 0.0)], {name: [(0.0, 0.0)] for name in ("dq", "dk", "dv")}
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows, keys = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
        entry = [t[span].transpose(0, 1).unsqueeze(0) for t, span in ((q, rows), (k, keys), (v, keys))]
        entry_out = out[rows].transpose(0, 1).unsqueeze(0)
        entry_lse = lse[:, rows].unsqueeze(0)
        if lengths_k[b] == 0:
            assert (entry_out == 0).all() and (entry_lse == float("inf")).all(), "an entry without keys"
            assert all((grad[span] == 0).all() for grad, span in zip(grads, (rows, keys, keys)))
            continue
        if lengths_q[b] == 0:
            assert all((grad[keys] == 0).all() for grad in grads[1:]), "keys no query sees get zero gradients"
            continue
        forward.append(forward_errors(entry_out, entry_lse, *entry, causal, None, True))
        entry_grads = [grad[span].transpose(0, 1).unsqueeze(0) for grad, span in zip(grads, (rows, keys, keys))]
        entry_dout = dout[rows].transpose(0, 1).unsqueeze(0)
        for name, errors in backward_errors(entry_grads, *entry, entry_dout, causal, None, True).items():
            backward[name].append(errors)
    error, baseline = map(max, zip(*forward))
    assert error <= 2 * baseline, f"error {error:.3e} > 2 x SDPA math's {baseline:.3e}"
    for name, errors in backward.items():
        error, bound = max(e for e, _ in errors), backward_bound(max(b for _, b in errors))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


def mask_rows_past_2_31(launch_context, device, mask_dtype, seq_k, seed):
    """A (300, seq_k) mask, broadcast over batch and heads, whose rows lie 2^23 elements apart in a (300, 2^23)
    buffer (2.5 GB in bool, 5 GB in float16): its last rows are past element 2^31. The forward and dQ kernels
    count its 32-bit offsets from a wave's first query (MaskView::rows_from), the dK/dV kernels from their
    launch's first query, so the backward launches them per 256 queries (plans.mask_rows_per_launch) and
    sums the slices in float32. Judged against the same mask laid out densely."""
    seq_q, generator = 300, torch.Generator().manual_seed(seed)
    q, dout = (_random((2, 2, seq_q, 64), torch.float16, generator, device) for _ in range(2))
    k, v = (_random((2, 2, seq_k, 64), torch.float16, generator, device) for _ in range(2))
    buffer = torch.zeros(seq_q, 2**23, dtype=mask_dtype, device=device)
    values = torch.rand(seq_q, seq_k, generator=generator).to(device)
    buffer[:, :seq_k] = values > 0.3 if mask_dtype == torch.bool else (values * 8 - 4).to(mask_dtype)
    mask = buffer[:, :seq_k]
    del buffer
    assert mask.stride(0) * (seq_q - 1) >= 2**31
    with launch_context():
        plan = plans.plan_forward(q, k, v, attn_mask=mask, backward=True)
        assert plans.mask_rows_per_launch(plan.mask, seq_q) == 256
        out, lse = ops.flash_attention_forward(q, k, v, attn_mask=mask)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, attn_mask=mask)
    dense = mask.contiguous()
    del mask, plan
    check_forward(out, lse, q, k, v, False, dense)
    check_backward(grads, q, k, v, dout, False, dense)


def eight_bit(launch_context, device, seq_q, seq_k, seed):
    """The quantizing passes and the 8-bit forward: every output written, inputs unchanged, and the result
    that of attention (cosine similarity; the mode's own accuracy bar is tests/bench/
    test_quantized_attention_accuracy.py's)."""
    generator = torch.Generator().manual_seed(seed)
    q = _bhsd(1, 2, seq_q, 64, torch.float16, generator, device)
    k, v = (_bhsd(1, 1, seq_k, 64, torch.float16, generator, device, "bshd") for _ in range(2))
    with checked(launch_context, q, k, v):
        out = quantized.quantized_attention_forward(q, k, v)
    ref, _ = attention_fp64(q, k, v)
    assert not torch.isnan(out).any(), "an output element was not written"
    cosine = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0)
    assert cosine > 0.99, f"cosine similarity {cosine:.4f}"


def huge_scores(launch_context, device, dtype, magnitude, head_dim):
    """Scaled scores near 2^32 (bf16 Q and K at 3e4), where SDPA's rounded scores still give a one-hot
    softmax: ours must too, with no overflow of the probabilities and no NaN."""
    generator = torch.Generator().manual_seed(3)
    q, k = (_bhsd(1, 2, seq, head_dim, torch.float32, generator, device) * magnitude for seq in (33, 70))
    q, k = q.to(dtype), k.to(dtype)
    v = _bhsd(1, 2, 70, head_dim, dtype, generator, device)
    with checked(launch_context, q, k, v):
        out, lse = ops.flash_attention_forward(q, k, v)
    ref, ref_lse = attention_fp64(q, k, v)
    sdpa = sdpa_math(q, k, v)
    assert torch.isfinite(sdpa).all(), "precondition: SDPA's math is finite here"
    error, baseline = max_error(out, ref), max_error(sdpa, ref)
    assert error <= 2 * baseline + 2 * torch.finfo(dtype).eps, f"error {error:.3e}, SDPA math's {baseline:.3e}"
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-6)
