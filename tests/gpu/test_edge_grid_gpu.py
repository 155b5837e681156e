"""The edge grid (tests/edge_grid.py) on the NVIDIA emulation of both layers, every case in both dtypes;
compute-sanitizer's racecheck and memcheck run beside it (bench/gpu_kernel_checks.sh). And tensors past
2^31 elements, which the interpreter cannot hold: long Q, and long K and V.

How the kernels keep addresses 64-bit where they must: a (batch, head) base is formed in 64 bits from the
64-bit strides of the argument block; within it, a tile's rows are addressed as 32-bit offsets from the
tile's first row, which the plans keep below 2^31 bytes (ops/plans.py's MAX_SEQ_STRIDE: a sequence
stride below 2^23 elements, 64 rows a tile), and row indices are 32-bit ints below 2^31 - 1024
(MAX_SEQLEN). An attention mask's elements are 32-bit offsets: in the forward and dQ kernels from a
wave's first query (16 rows), whose own address is formed in 64 bits; in dK/dV from the launch's first
query, the backward launching dK/dV per slice of the queries where they would pass 2^31
(ops/plans.py's mask_view and mask_rows_per_launch). The outputs are written through 64-bit addresses.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from rdna_flash_attn.ops import attention as ops

from .. import edge_grid as grid
from .conftest import GPU
from rdna_fa_lab.attention_reference import attention_fp64, max_error, sdpa_math

launch_here = contextlib.nullcontext  # the emulated layer's kernels run on the GPU's own tensors


@pytest.mark.parametrize("dtype", grid.DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", grid.DENSE_HEAD_DIMS)
@pytest.mark.parametrize("shape", grid.DENSE_SHAPES, ids=grid.case_id)
def test_dense_forward_and_backward(emulated_layer, shape, head_dim, dtype):
    grid.dense(launch_here, GPU, dtype, head_dim, *shape, seed=head_dim)


@pytest.mark.parametrize("dtype", grid.DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", grid.GROUPED_HEAD_DIMS)
@pytest.mark.parametrize("shape", grid.GROUPED_SHAPES, ids=grid.case_id)
def test_grouped_heads(emulated_layer, shape, head_dim, dtype):
    grid.grouped(launch_here, GPU, dtype, head_dim, *shape, seed=head_dim)


@pytest.mark.parametrize("dtype", grid.DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", grid.MASKED_HEAD_DIMS)
@pytest.mark.parametrize("shape", grid.MASKED_SHAPES, ids=grid.case_id)
def test_masks_with_fully_masked_rows(emulated_layer, shape, head_dim, dtype):
    grid.masked(launch_here, GPU, dtype, head_dim, *shape, seed=head_dim)


@pytest.mark.parametrize("value", grid.MASK_EDGE_VALUES, ids=str)
def test_mask_edge_values_give_sdpas_rows(emulated_layer, value):
    grid.mask_edge_value(launch_here, GPU, value)


@pytest.mark.parametrize("dtype", grid.DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", grid.VARLEN_HEAD_DIMS)
@pytest.mark.parametrize("shape", grid.VARLEN_SHAPES, ids=grid.case_id)
def test_packed_entries_without_queries_or_keys(emulated_layer, shape, head_dim, dtype):
    grid.varlen(launch_here, GPU, dtype, head_dim, *shape, seed=head_dim)


@pytest.mark.parametrize("seq_q,seq_k", grid.EIGHT_BIT_SHAPES)
def test_8bit_passes_and_forward(emulated_layer, seq_q, seq_k):
    if emulated_layer != "gfx12":
        pytest.skip("8-bit attention is gfx12's")
    grid.eight_bit(launch_here, GPU, seq_q, seq_k, seed=seq_q * 100 + seq_k)


@pytest.mark.parametrize("dtype,magnitude,head_dim", grid.HUGE_SCORES, ids=str)
def test_scores_near_the_dtypes_range(emulated_layer, dtype, magnitude, head_dim):
    grid.huge_scores(launch_here, GPU, dtype, magnitude, head_dim)


@pytest.mark.parametrize("long_side", ("queries", "keys"))
def test_tensors_past_2_31_elements_forward_and_backward(emulated_layer, long_side):
    """(1, 2^20 + 64, 16, 128) bf16 in BSHD: 2^31 + 131072 elements, 4 GiB, on the long side, whose last
    rows lie past element 2^31 (sequence stride 2048); the other side has 64 rows. Checked on sampled rows
    against fp64 (the whole reference would not fit), and the long side's gradients on its last rows."""
    heads, head_dim, long, short = 16, 128, 2**20 + 64, 64
    generator = torch.Generator(device=GPU).manual_seed(5)

    def make(rows):
        return torch.randn(1, rows, heads, head_dim, generator=generator, device=GPU,
                           dtype=torch.bfloat16).transpose(1, 2)

    seq_q, seq_k = (long, short) if long_side == "queries" else (short, long)
    q, k, v, dout = make(seq_q), make(seq_k), make(seq_k), make(seq_q)
    assert max(t.numel() for t in (q, k, v)) > 2**31
    out, lse = ops.flash_attention_forward(q, k, v)
    rows = torch.tensor([0, 1, seq_q // 2, seq_q - 2, seq_q - 1], device=GPU)
    q_rows = q[:, :, rows]
    ref = attention_fp64(q_rows, k, v)[0]
    error, baseline = max_error(out[:, :, rows], ref), max_error(sdpa_math(q_rows, k, v), ref)
    assert error <= 2 * baseline, f"error {error:.3e} > 2 x SDPA math's {baseline:.3e}"
    del out
    dq, dk, dv = ops.flash_attention_backward(dout, q, k, v, lse)
    tail = slice(long - 64, long)
    if long_side == "queries":  # a query row's dq depends on its own row alone
        q_tail = q[:, :, tail].double().requires_grad_()
        (ref_dq,) = torch.autograd.grad(attention_fp64(q_tail, k, v)[0], q_tail, dout[:, :, tail].double())
        assert max_error(dq[:, :, tail], ref_dq) <= 2e-2 * ref_dq.abs().max().item()
    else:  # every query sees the last keys: dV = P^T dO there
        probs = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / head_dim**0.5, -1)
        ref_dv = probs[..., tail].transpose(-1, -2) @ dout.double()
        assert max_error(dv[:, :, tail], ref_dv) <= 2e-2 * ref_dv.abs().max().item()
        assert torch.isfinite(dk[:, :, tail]).all()


@pytest.mark.parametrize("dtype", (torch.bool, torch.float16), ids=str)
def test_masks_whose_rows_span_past_2_31_elements_forward_and_backward(emulated_layer, dtype):
    grid.mask_rows_past_2_31(launch_here, GPU, dtype, 700, seed=11)


@pytest.mark.parametrize("batch,heads,kv_heads", ((70000, 1, 1), (1, 70000, 35000)), ids=("batch", "heads"))
def test_batch_or_heads_past_65535_launch_in_slices(emulated_layer, batch, heads, kv_heads):
    """A grid takes at most 65535 workgroups along heads and batch: larger calls launch in slices, each
    entry exact, those of the last slice included (the grouped query heads of a sliced launch find their
    key/value head from the absolute head index)."""
    generator = torch.Generator(device=GPU).manual_seed(9)

    def make(h, seq):
        return torch.randn(batch, h, seq, 64, generator=generator, device=GPU, dtype=torch.float16)

    q, dout = make(heads, 17), make(heads, 17)
    k, v = make(kv_heads, 20), make(kv_heads, 20)
    out, lse = ops.flash_attention_forward(q, k, v, True, bottom_right=True)
    grads = ops.flash_attention_backward(dout, q, k, v, lse, True, bottom_right=True)
    for index in (0, 65534, 65535, max(batch, heads) - 1):
        b, h = (index, slice(None)) if batch > 1 else (0, slice(index - index % 2, index - index % 2 + 2))
        kv = slice(None) if batch > 1 else slice(h.start // 2, h.start // 2 + 1)
        entry = [t[b:b + 1, hs] for t, hs in ((q, h), (k, kv), (v, kv))]
        grid.check_forward(out[b:b + 1, h], lse[b:b + 1, h], *entry, True, None, True)
        grid.check_backward([grads[0][b:b + 1, h], grads[1][b:b + 1, kv], grads[2][b:b + 1, kv]], *entry,
                            dout[b:b + 1, h], True, None, True)
