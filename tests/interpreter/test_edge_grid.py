"""The edge grid (tests/edge_grid.py) on the shipped code objects, run by the CPU interpreter: its LDS race
check sees one wave write or read LDS bytes another wave wrote with no barrier between, its bounds check
sees every load and store outside the launch's tensors, and its wait check sees a register read or
overwritten before the s_waitcnt / s_wait_*cnt that retires the load writing it. Each shape runs once per
target, with head dims and dtypes cycling so that every one meets both targets.

What it cannot prove: the interpreter runs a workgroup's waves one after another between barriers, so
timing-dependent hazards of real hardware beyond the wait counters stay unseen, and so do code paths no
case reaches.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from rdna_flash_attn.runtime import loader as runtime, variants

from .. import edge_grid as grid
from ..seeds import case_seed
from .test_kernels_interpreted import TARGETS, library

CPU = torch.device("cpu")


def on(target: str):
    """The launch context running `target`'s code object on the interpreter."""
    return functools.partial(runtime.explicit_library, library(target))


def _spread(shapes, head_dims):
    """Each shape once per target, with head dims and dtypes cycling."""
    dims = itertools.cycle(head_dims)
    return [(target, grid.DTYPES[(i + j) % 2], next(dims), *shape)
            for i, shape in enumerate(shapes) for j, target in enumerate(TARGETS)]


def _seed(case) -> int:
    return case_seed(grid.case_id(case))


@pytest.mark.parametrize("case", _spread(grid.DENSE_SHAPES, grid.DENSE_HEAD_DIMS), ids=grid.case_id)
def test_dense_forward_and_backward(case):
    grid.dense(on(case[0]), CPU, *case[1:], seed=_seed(case))


@pytest.mark.parametrize("case", _spread(grid.GROUPED_SHAPES, grid.GROUPED_HEAD_DIMS), ids=grid.case_id)
def test_grouped_heads(case):
    grid.grouped(on(case[0]), CPU, *case[1:], seed=_seed(case))


@pytest.mark.parametrize("case", _spread(grid.MASKED_SHAPES, grid.MASKED_HEAD_DIMS), ids=grid.case_id)
def test_masks_with_fully_masked_rows(case):
    grid.masked(on(case[0]), CPU, *case[1:], seed=_seed(case))


@pytest.mark.parametrize("value", grid.MASK_EDGE_VALUES, ids=str)
@pytest.mark.parametrize("target", TARGETS)
def test_mask_edge_values_give_sdpas_rows(target, value):
    grid.mask_edge_value(on(target), CPU, value)


@pytest.mark.parametrize("case", _spread(grid.VARLEN_SHAPES, grid.VARLEN_HEAD_DIMS), ids=grid.case_id)
def test_packed_entries_without_queries_or_keys(case):
    grid.varlen(on(case[0]), CPU, *case[1:], seed=_seed(case))


@pytest.mark.parametrize("seq_q,seq_k", grid.EIGHT_BIT_SHAPES)
def test_8bit_passes_and_forward(seq_q, seq_k):
    if not variants.has_fwd8("gfx1201"):
        pytest.skip("no 8-bit variants")
    grid.eight_bit(on("gfx1201"), CPU, seq_q, seq_k, seed=seq_q * 100 + seq_k)


@pytest.mark.parametrize("dtype,magnitude,head_dim", grid.HUGE_SCORES, ids=str)
@pytest.mark.parametrize("target", TARGETS)
def test_scores_near_the_dtypes_range(target, dtype, magnitude, head_dim):
    grid.huge_scores(on(target), CPU, dtype, magnitude, head_dim)


@pytest.mark.parametrize("target", TARGETS)
def test_a_mask_whose_rows_span_past_2_31_elements(target):
    grid.mask_rows_past_2_31(on(target), CPU, torch.bool, 64, case_seed((target, "mask past 2^31")))
