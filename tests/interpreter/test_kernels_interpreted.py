"""The shipped AMD code objects themselves, executed instruction by instruction on the CPU
(rdna_fa_lab.interpreter), forward and backward, against an fp64 reference.

Criterion (the GPU tests' own, rdna_fa_lab/attention_reference.py): max error vs fp64 at most 2x that of
PyTorch's math SDPA in the same dtype, on fresh random inputs, outputs poisoned beforehand.

CI runs CI_CASES: every kernel variant class the launcher picks, on both gfx1100 and gfx1201, f16
and bf16, ragged and causal off-square shapes, BSHD and strided layouts. The full sweep (every
case on both targets and both dtypes) runs by hand:

    RDNA_FA_INTERPRETER_FULL=1 python -m pytest -q tests/interpreter
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype,
                                             grads_sdpa_math, max_error, rising_scores, sdpa_math)
from rdna_flash_attn.runtime import artifacts, loader as runtime, variants
from rdna_flash_attn.ops import attention as ops, plans, quantized

from .. import edge_grid as grid
from ..seeds import case_seed
from ..test_quantized import dequantized_attention, reference_q_codes, reference_quantize

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from rdna_fa_lab.interpreter import InterpretedLibrary  # noqa: E402

TARGETS = ("gfx1100", "gfx1201")
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}

# (head dim, seq_q, seq_k, causal, layout): head dims reach every forward class (4x64, 4x32, 2x32,
# two chunks, 512) and every dQ / dK-dV class (64, 128, 144, 160, 320, 384, 512; and SD1.5's 80: K and V
# held in registers, 16-query tiles; and 40, short of its padded 48, where dQ's Q and dO repeat their
# last columns and rows: RepeatingRows in kernels/tiles.h).
FORWARD_SHAPES = (
    (40, 77, 130, False, "bshd"),
    (64, 64, 64, False, "bhsd"),
    (128, 17, 77, True, "strided"),
    (160, 130, 17, True, "bhsd"),
    (256, 1, 33, False, "bshd"),
    (320, 17, 17, True, "bhsd"),
    (384, 33, 20, False, "strided"),
    (512, 20, 40, True, "bshd"),
)
BACKWARD_SHAPES = (
    (64, 77, 17, True, "bshd"),
    (128, 17, 77, True, "bhsd"),
    (144, 33, 20, False, "strided"),
    (160, 1, 33, False, "bhsd"),
    (320, 17, 17, True, "bshd"),
    (384, 9, 20, False, "bhsd"),
    (512, 20, 9, True, "bhsd"),
    (80, 33, 40, True, "bshd"),
    (40, 33, 50, False, "strided"),
)


def _ci_cases(shapes):
    """Each shape once, alternating target and dtype, so both targets and dtypes meet every class."""
    combos = list(itertools.product(TARGETS, DTYPES))
    return [(*combos[(i + j) % len(combos)], *shape) for i, shape in enumerate(shapes) for j in (0, 1)]


FULL = os.environ.get("RDNA_FA_INTERPRETER_FULL") == "1"
FORWARD_CASES = [(t, d, *s) for t in TARGETS for d in DTYPES for s in FORWARD_SHAPES] if FULL else _ci_cases(FORWARD_SHAPES)
# Every other case with the training forward's saved statistics (one dQ sweep), the rest from the lse alone.
BACKWARD_CASES = [(*case, ("two sweeps", "one sweep")[i % 2]) for i, case in enumerate(
    [(t, d, *s) for t in TARGETS for d in DTYPES for s in BACKWARD_SHAPES] if FULL else _ci_cases(BACKWARD_SHAPES))]

_libraries: dict[str, InterpretedLibrary] = {}


def library(target: str) -> InterpretedLibrary:
    if target not in _libraries:
        try:
            _libraries[target] = InterpretedLibrary(artifacts.prebuilt_artifact(target))
        except artifacts.ArtifactError as error:
            pytest.skip(str(error))
    return _libraries[target]


def make_inputs(seq, head_dim, dtype, layout, generator, batch=2, heads=2):
    """A (B, H, S, D) CPU view in the requested memory layout; 'strided' is a slice of a wider buffer."""
    if layout == "bhsd":
        return torch.randn(batch, heads, seq, head_dim, dtype=dtype, generator=generator)
    if layout == "bshd":
        return torch.randn(batch, seq, heads, head_dim, dtype=dtype, generator=generator).transpose(1, 2)
    wide = torch.randn(batch, seq, heads + 1, head_dim + 8, dtype=dtype, generator=generator)
    return wide[:, :, 1:, 8:].transpose(1, 2)


def _case_id(case):
    return "-".join(str(part) for part in case)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=_case_id)
def test_forward_code_object_matches_fp64(case):
    target, dtype_name, head_dim, seq_q, seq_k, causal, layout = case
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(case_seed(case))
    q = make_inputs(seq_q, head_dim, dtype, layout, generator)
    k, v = (make_inputs(seq_k, head_dim, dtype, layout, generator) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32)
    with runtime.explicit_library(library(target)):
        ops.flash_attention_forward(q, k, v, causal, out=out, lse=lse)
    ref, ref_lse = attention_fp64(q, k, v, causal)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    error, baseline = max_error(out, ref), max_error(sdpa_math(q, k, v, causal), ref)
    assert error <= 2 * baseline, f"error {error:.3e} > 2 x SDPA math's {baseline:.3e}"
    finite = torch.isfinite(ref_lse)  # causal off-square: rows with no key have lse -inf
    assert max_error(lse[finite], ref_lse[finite]) < 1e-3 * max(1.0, math.log(seq_k))


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=_case_id)
def test_backward_code_object_matches_fp64(case):
    target, dtype_name, head_dim, seq_q, seq_k, causal, layout, sweeps = case
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(case_seed(case[:-1]))
    q, dout = (make_inputs(seq_q, head_dim, dtype, layout, generator) for _ in range(2))
    k, v = (make_inputs(seq_k, head_dim, dtype, layout, generator) for _ in range(2))
    saved = ops.backward_stats_like(q) if sweeps == "one sweep" else None
    with runtime.explicit_library(library(target)):
        out, lse = ops.flash_attention_forward(q, k, v, causal, saved=saved)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, causal, out=out if saved else None, saved=saved)
    reference = grads_fp64(q, k, v, dout, causal)
    baseline = grads_input_dtype(q, k, v, dout, causal)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, reference, baseline):
        assert torch.isfinite(grad).all(), f"{name}: non-finite"
        error, bound = max_error(grad, ref), backward_bound(max_error(base, ref))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


@pytest.mark.parametrize("head_dim", (40, 128))
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("target", TARGETS)
def test_a_training_forward_saves_the_remainder_and_row_statistics(target, dtype_name, head_dim):
    """What the one-sweep dQ reads (ops.attention.BackwardStats): out + out_low holds the forward's float32
    output to many more bits than out alone, and row_offset + row_log2_sum is the lse in base 2. One key
    tile, so the kernels' probabilities are those of the final row maximum, as recomputed here; medians,
    as a probability that rounds the other way here shifts its whole row."""
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(head_dim)
    q = make_inputs(33, head_dim, dtype, "bshd", generator)
    k, v = (make_inputs(50, head_dim, dtype, "strided", generator) for _ in range(2))
    saved = ops.backward_stats_like(q)
    with runtime.explicit_library(library(target)):
        out, lse = ops.flash_attention_forward(q, k, v, saved=saved)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(head_dim)
    probabilities = torch.exp(scores - scores.amax(-1, keepdim=True)).to(dtype).double()  # rounded as the kernels do
    out32 = probabilities @ v.double() / probabilities.sum(-1, keepdim=True)
    low = saved.out_low.double()
    assert (low.abs() <= out.double().abs() * torch.finfo(dtype).eps / 2).all(), "out_low is no rounding remainder"
    coarse, fine = ((t - out32).abs().median().item() for t in (out.double(), out.double() + low))
    assert fine <= coarse / 16, f"out + out_low is off by {fine:.2e}, out by {coarse:.2e}"
    torch.testing.assert_close(saved.row_offset + saved.row_log2_sum, lse * ops.LOG2_E, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overflow_key", (100, 140), ids=("a-tile-follows", "in-the-last-tile"))
@pytest.mark.parametrize("target", TARGETS)
def test_a_score_overflowing_with_the_scale_gives_nan_as_sdpa(target, overflow_key):
    """One key's score is finite, its product with the softmax scale (4) is not: SDPA's rows are NaN, and
    so are the kernel's, whether a key tile follows the one holding it (d128 skips O's rescale where no
    row meets a new maximum) or not; and so are every gradient, dV included (the backward's exponent cap
    would make its probabilities finite)."""
    generator = torch.Generator().manual_seed(overflow_key)
    q = torch.zeros(1, 2, 17, 128, dtype=torch.bfloat16)
    q[..., 0] = 1.7e19
    k, v = (torch.randn(1, 2, 150, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
    k[..., overflow_key, 0] = 1.7e19
    dout = torch.randn(q.shape, generator=generator).to(torch.bfloat16)
    with runtime.explicit_library(library(target)):
        out, lse = ops.flash_attention_forward(q, k, v, False, 4.0)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, False, 4.0)
    assert torch.isnan(sdpa_math(q, k, v, False, 4.0)).all(), "precondition: SDPA gives NaN here"
    assert all(g.isnan().all() for g in grads_sdpa_math(q, k, v, dout, False, 4.0)), "precondition"
    assert torch.isnan(out).all()
    assert all(grad.isnan().all() for grad in grads)


def _key_padding(batch, seq_k, dtype, generator):
    """(B, 1, 1, Sk) additive mask with ragged key lengths, the last entry's keys all masked."""
    lengths = torch.randint(1, seq_k + 1, (batch,), generator=generator)
    lengths[-1] = 0
    keep = torch.arange(seq_k)[None, :] < lengths[:, None]
    return torch.zeros(batch, 1, 1, seq_k, dtype=dtype).masked_fill(~keep[:, None, None, :], float("-inf"))


# (target, dtype, head dim, seq_q, seq_k, what): the kernel paths past ABI 1, forward and backward.
PROBLEM_CASES = (
    ("gfx1100", "f16", 64, 33, 77, "key_padding"),
    ("gfx1201", "bf16", 128, 20, 40, "key_padding"),
    ("gfx1100", "bf16", 96, 17, 33, "bool_mask"),
    ("gfx1201", "f16", 160, 33, 17, "bool_mask"),
    ("gfx1100", "f16", 40, 33, 77, "bias"),  # SD1.5's head dim, a full bias in the inputs' dtype
    ("gfx1201", "bf16", 128, 17, 70, "bias"),
    ("gfx1100", "bf16", 24, 20, 40, "key_padding"),
    ("gfx1100", "f16", 64, 33, 77, "key_bias"),  # one bias per key: staged once per key tile (forward)
    ("gfx1201", "bf16", 128, 17, 70, "key_bias"),
    # key tiles whose biases are all zero (run without them) beside tiles holding padded keys
    ("gfx1100", "bf16", 128, 17, 150, "padded_tail"),
    ("gfx1201", "f16", 64, 33, 150, "padded_tail"),
    # a tile whose only nonzero bias is small, finite and in its second 32 keys
    ("gfx1100", "f16", 64, 17, 150, "lone_bias"),
    ("gfx1201", "bf16", 128, 17, 150, "lone_bias"),
    # scores rising per 64 keys: new row maxima keep coming; falling: tiles skip the rescale
    ("gfx1100", "bf16", 160, 17, 300, "rising"),
    # gfx11 f16 d128 takes its rescale factors from adjacent registers (the traits): each tile loop
    ("gfx1100", "f16", 128, 17, 300, "rising"),
    ("gfx1100", "f16", 128, 17, 150, "key_bias"),
    ("gfx1100", "f16", 128, 17, 150, "bias"),
    ("gfx1201", "f16", 128, 17, 300, "falling"),
    ("gfx1100", "f16", 64, 20, 33, "grouped_heads"),
    ("gfx1201", "bf16", 160, 17, 9, "grouped_heads"),
    ("gfx1100", "bf16", 64, 33, 17, "bottom_right"),
    ("gfx1201", "f16", 40, 9, 20, "bottom_right"),
    # head dims without a masked variant of their own, run in the next larger one
    ("gfx1100", "f16", 72, 20, 33, "key_padding"),  # PixArt's cross-attention, in d96
    ("gfx1201", "bf16", 112, 17, 40, "bool_mask"),  # Sana's, in d128
    ("gfx1100", "bf16", 80, 33, 17, "bias"),  # SD1.5's middle layers with a regional mask, in d96
)


@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
@pytest.mark.parametrize("case", PROBLEM_CASES, ids=_case_id)
def test_masked_grouped_and_bottom_right_code_objects_match_fp64(case, backward):
    target, dtype_name, head_dim, seq_q, seq_k, what = case
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(case_seed(case))
    kv_heads = 1 if what == "grouped_heads" else 2
    q, dout = (make_inputs(seq_q, head_dim, dtype, "bshd", generator) for _ in range(2))
    k, v = (make_inputs(seq_k, head_dim, dtype, "bhsd", generator, heads=kv_heads) for _ in range(2))
    mask = None
    if what == "key_padding":
        mask = _key_padding(2, seq_k, torch.float32 if dtype_name == "f16" else dtype, generator)
    elif what == "bias":
        mask = torch.randn(1, 2, seq_q, seq_k, generator=generator).to(dtype)
    elif what == "key_bias":
        mask = (3 * torch.randn(2, 1, 1, seq_k, generator=generator)).to(dtype)
        mask[..., -5:] = float("-inf")
    elif what == "padded_tail":
        keep = torch.arange(seq_k)[None, :] < torch.tensor([seq_k - 7, 70])[:, None]
        mask = torch.zeros(2, 1, 1, seq_k, dtype=dtype).masked_fill(~keep[:, None, None, :], float("-inf"))
    elif what == "lone_bias":
        mask = torch.zeros(2, 1, 1, seq_k, dtype=dtype)
        mask[..., 100] = 2.0
        mask[1, ..., -7:] = float("-inf")
    elif what in ("rising", "falling"):
        rise = 3.0 if what == "rising" else -3.0
        q, k = rising_scores(2, 2, seq_q, seq_k, head_dim, rise, dtype, generator, device="cpu")
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # bshd, as the other cases' Q
    elif what == "bool_mask":
        mask = torch.rand(1, 2, seq_q, seq_k, generator=generator) < 0.7
        mask[0, 0, :3] = False  # rows that see no key give zeros
    causal, bottom_right = what == "bottom_right", what == "bottom_right"
    problem = dict(attn_mask=mask, bottom_right=bottom_right)
    saved = ops.backward_stats_like(q) if backward else None  # a training forward: one dQ sweep
    with runtime.explicit_library(library(target)):
        out, lse = ops.flash_attention_forward(q, k, v, causal, saved=saved, **problem)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, causal, out=out, saved=saved, **problem) \
            if backward else None
    if not backward:
        ref, _ = attention_fp64(q, k, v, causal, None, mask, bottom_right)
        error, baseline = max_error(out, ref), max_error(sdpa_math(q, k, v, causal, None, mask, bottom_right), ref)
        assert torch.isfinite(out).all() and error <= 2 * baseline, f"error {error:.3e} vs SDPA math's {baseline:.3e}"
        return
    reference = grads_fp64(q, k, v, dout, causal, None, mask, bottom_right)
    baseline = grads_input_dtype(q, k, v, dout, causal, None, mask, bottom_right)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, reference, baseline):
        assert grad.shape == ref.shape and torch.isfinite(grad).all(), f"{name}: shape or non-finite"
        error, bound = max_error(grad, ref), backward_bound(max_error(base, ref))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


@pytest.mark.parametrize("target,dtype_name,head_dim,kv_heads", (("gfx1100", "f16", 64, 2), ("gfx1201", "bf16", 128, 1)))
def test_dkdv_launches_by_query_slices_where_mask_offsets_pass_32_bits(target, dtype_name, head_dim, kv_heads,
                                                                       monkeypatch):
    """A mask whose element offsets from the first query pass the kernels' 32 bits gets its dK/dV in one
    launch per 64 queries (plans.mask_rows_per_launch), summed in float32: here the limit is lowered so
    that 150 queries of a 40-key bias take three launches (64, 64, 22), grouped heads included: every
    gradient within FlashAttention-2's bound. A causal call cannot be sliced (its diagonal follows from
    the lengths) and is refused."""
    dtype, seq_q, seq_k = DTYPES[dtype_name], 150, 40
    generator = torch.Generator().manual_seed(case_seed((target, dtype_name, head_dim, kv_heads)))
    q, dout = (make_inputs(seq_q, head_dim, dtype, "bshd", generator) for _ in range(2))
    k, v = (make_inputs(seq_k, head_dim, dtype, "bhsd", generator, heads=kv_heads) for _ in range(2))
    mask = torch.randn(1, 2, seq_q, seq_k, generator=generator).to(dtype)
    mask[0, 1, 5, :30] = float("-inf")
    monkeypatch.setattr(plans, "MASK_OFFSETS", 65 * seq_k)
    assert plans.mask_rows_per_launch(mask, seq_q) == 64
    interpreted = library(target)
    launches = []

    def counted(variant, grid, args, buffers, run=interpreted.launch):
        launches.append(variant.symbol)
        run(variant, grid, args, buffers)
    monkeypatch.setattr(interpreted, "launch", counted)
    saved = ops.backward_stats_like(q)
    with runtime.explicit_library(interpreted):
        out, lse = ops.flash_attention_forward(q, k, v, attn_mask=mask, saved=saved)
        grads = ops.flash_attention_backward(dout, q, k, v, lse, attn_mask=mask, out=out, saved=saved)
        with pytest.raises(ValueError, match="split only non-causal"):
            ops.flash_attention_backward(dout, q, k, v, lse, True, attn_mask=mask)
    assert sum("dkdv" in symbol for symbol in launches) == 3, launches
    grid.check_backward(grads, q, k, v, dout, False, mask)


@pytest.mark.parametrize("target", TARGETS)
def test_varlen_code_objects_match_fp64_per_entry(target):
    """A packed batch of three entries (one without queries), forward and backward, causal bottom-right."""
    dtype = torch.float16 if target == "gfx1100" else torch.bfloat16
    generator = torch.Generator().manual_seed(11)
    lengths_q, lengths_k = [17, 0, 5], [9, 20, 33]
    heads, head_dim = 2, 64
    q, dout = (torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype, generator=generator) for _ in range(2))
    k, v = (torch.randn(sum(lengths_k), heads, head_dim, dtype=dtype, generator=generator) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    saved = ops.backward_stats_like(q, varlen=True)  # a training forward: one dQ sweep
    with runtime.explicit_library(library(target)):
        out, lse = ops.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), True,
                                                      saved=saved)
        grads = ops.flash_attention_varlen_backward(dout, q, k, v, lse, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    True, out=out, saved=saved)
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        entry = [t[span].transpose(0, 1).unsqueeze(0) for t, span in ((q, rows), (k, keys), (v, keys))]
        ref, _ = attention_fp64(*entry, True, bottom_right=True)
        got = out[rows].transpose(0, 1).unsqueeze(0)
        assert max_error(got, ref) <= 2 * max_error(sdpa_math(*entry, True, bottom_right=True), ref)
        entry_dout = dout[rows].transpose(0, 1).unsqueeze(0)
        reference = grads_fp64(*entry, entry_dout, True, bottom_right=True)
        baseline = grads_input_dtype(*entry, entry_dout, True, bottom_right=True)
        for grad, span, ref, base in zip(grads, (rows, keys, keys), reference, baseline):
            error = max_error(grad[span].transpose(0, 1).unsqueeze(0), ref)
            assert error <= backward_bound(max_error(base, ref))


@pytest.mark.parametrize("dtype_name,head_dim,seq_q,seq_k,sign", [("f16", 40, 33, 70, 1), ("bf16", 128, 17, 64, -1),
                                                              ("f16", 128, 20, 250, 1), ("bf16", 128, 20, 250, -1)])
def test_8bit_code_objects_match_their_reference(dtype_name, head_dim, seq_q, seq_k, sign):
    """gfx1201's 8-bit path (K and V's quantizing pass, kernels/quant8.h, and the forward, fa_fwd8.h, which
    quantizes Q) as shipped: the pass writes the torch reference's codes and scales (a code may sit one
    step away where the kernel's float32 channel mean rounds differently), and the output's error against
    fp64 is within 10 % of the same arithmetic's in float64 from the reference's codes (P's roundings
    against the running maximum differ from the model's). A negative scale (sign -1) is folded into Q's
    codes."""
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(head_dim * 1000 + seq_k)
    q = 2 * torch.randn(1, 4, seq_q, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(1, 2, seq_k, head_dim, generator=generator).to(dtype) for _ in range(2))
    k[:, :, 64:192] *= 0.1  # quieter keys: of 250 keys' four tiles the middle two meet no new row maximum,
    # and from d128 up the kernel skips O's rescale on them
    variant = variants.fwd8_variant(dtype_name, head_dim)
    scale = sign / math.sqrt(head_dim)
    with runtime.explicit_library(library("gfx1201")):
        inputs = quantized.quantize_inputs(k, v, variant)
        out = quantized.quantized_attention_forward(q, k, v, scale=scale)
    for name, ours, theirs in zip(quantized.QuantizedInputs._fields, inputs, reference_quantize(k, v, variant)):
        if ours.dtype == torch.float32:
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), name
        else:
            differ = int((ours != theirs).sum())
            assert differ <= max(1, ours.numel() // 1000), (name, differ)
    reference, _ = attention_fp64(q, k, v, scale=scale)
    kernel_error = float((out.double() - reference).abs().sum() / reference.abs().sum())
    model = dequantized_attention(reference_q_codes(q, scale, variant), inputs, seq_k, head_dim).to(dtype)
    model_error = float((model.double() - reference).abs().sum() / reference.abs().sum())
    assert kernel_error <= 1.1 * model_error + 1e-4, (kernel_error, model_error)


def test_8bit_negative_scale_equals_negated_queries_bit_for_bit():
    """A negative scale is folded into Q's codes (quantize_q_rows, fa_fwd8.h), and int8 codes are symmetric:
    gfx1201's shipped 8-bit forward gives (q, -s) exactly what it gives (-q, s). Three key tiles, the last
    masked."""
    generator = torch.Generator().manual_seed(5)
    q = (2 * torch.randn(1, 2, 16, 64, generator=generator)).half()
    k, v = (torch.randn(1, 2, 150, 64, generator=generator).half() for _ in range(2))
    scale = 1 / math.sqrt(64)
    with runtime.explicit_library(library("gfx1201")):
        negative_scale = quantized.quantized_attention_forward(q, k, v, scale=-scale)
        negated_queries = quantized.quantized_attention_forward(-q, k, v, scale=scale)
    assert torch.isfinite(negative_scale).all()
    assert torch.equal(negative_scale, negated_queries)


def test_8bit_code_object_keeps_huge_scores_finite():
    """Row maxima near 2^20 in log2 units on gfx1201's shipped 8-bit forward. Each exponent there is one fma
    of the unrounded score, up to half an ulp (0.0625 at 2^20) above the rounded row maximum, so P's bias
    must leave that room: an fp8 conversion of a value above 464 gives NaN. Two key tiles, the second
    masked."""
    generator = torch.Generator().manual_seed(12)
    q, k = (1000 * torch.randn(1, 1, rows, 64, generator=generator) for rows in (16, 70))
    v = torch.randn(1, 1, 70, 64, generator=generator)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    with runtime.explicit_library(library("gfx1201")):
        out = quantized.quantized_attention_forward(q, k, v)
    reference, _ = attention_fp64(q, k, v)
    assert torch.isfinite(out).all()
    cosine = float(out.double().flatten() @ reference.flatten() / (out.double().norm() * reference.norm()))
    assert cosine >= 0.99
