"""cu_seqlens and max_seqlen of packed batches: every public varlen entry (ops, the dispatcher, the
flash-attn API and its packed forms) rejects unsound offsets before anything runs, with a ValueError
naming the argument, on the kernels and on the fallback alike; the values are read once per tensor
and version; rows past the last offset come back as zeros."""

from __future__ import annotations

import re

import pytest
import torch

from rdna_flash_attn.dispatch import router
from rdna_flash_attn.integrations import flash_attn_interface as fa
from rdna_flash_attn.ops import attention as ops, plans
from rdna_flash_attn.runtime import loader

ROWS = 10  # of the packed q and k below: entries of 4 and 6 rows
GOOD = [0, 4, 10]

# (cu_seqlens values or dtype, max_seqlen, the error's text after the argument's name)
BAD = {
    "non-monotonic": ([0, 7, 5], 10, "is not non-decreasing at index 2 (7 -> 5)"),
    "negative": ([0, -2, 10], 10, "holds a negative offset at index 1 (-2)"),
    "not starting at 0": ([2, 6, 10], 10, "must start at 0, not 2"),
    "beyond the rows": ([0, 4, 12], 10, "ends at 12, beyond the 10 rows of"),
    "max_seqlen too small": (GOOD, 5, "max_seqlen_{side} 5 is smaller than entry 1's 6 {tokens}"),
    "int64": (torch.int64, 10, "must be int32, not torch.int64"),
}


def packed_batch(dtype=torch.float16, heads=2, dim=64, rows=ROWS):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(rows, heads, dim, generator=gen, dtype=dtype) for _ in range(3)]


def offsets(values=GOOD, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def bad_arguments(case: str, side: str):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, expected message) with `side` bad."""
    values, max_seqlen, message = BAD[case]
    bad = offsets(dtype=values) if isinstance(values, torch.dtype) else offsets(values)
    cu = {"q": offsets(), "k": offsets()}
    limits = {"q": 10, "k": 10}
    cu[side], limits[side] = bad, max_seqlen
    tokens = "queries" if side == "q" else "keys"
    if "max_seqlen" in message:
        expected = message.format(side=side, tokens=tokens)
    else:
        expected = f"cu_seqlens_{side} {message}" + (f" {side}" if "rows of" in message else "")
    return cu["q"], cu["k"], limits["q"], limits["k"], expected


class RecordingLibrary:
    """A kernel library for CPU tensors that records launches and runs none."""

    device_type = "cpu"

    def __init__(self):
        self.launches = []

    def launch(self, variant, grid, args, buffers):
        self.launches.append(variant)


@pytest.fixture
def recording():
    with loader.explicit_library(RecordingLibrary()) as library:
        yield library


def ops_forward(q, k, v, *arguments):
    return ops.flash_attention_varlen_forward(q, k, v, *arguments)


def ops_backward(q, k, v, *arguments):
    lse = torch.zeros(q.shape[1], q.shape[0])
    return ops.flash_attention_varlen_backward(torch.randn_like(q), q, k, v, lse, *arguments)


def dispatcher(q, k, v, *arguments):
    return router.varlen_attention_or_reason(q, k, v, *arguments)


def flash_attn(q, k, v, *arguments):
    return fa.flash_attn_varlen_func(q, k, v, *arguments)


def flash_attn_with_window(q, k, v, *arguments):  # entry by entry through the dense path
    return fa.flash_attn_varlen_func(q, k, v, *arguments, window_size=(2, 2))


def flash_attn_kvpacked(q, k, v, *arguments):
    return fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), *arguments)


ENTRIES = [ops_forward, ops_backward, dispatcher, flash_attn, flash_attn_with_window, flash_attn_kvpacked]


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.__name__)
def test_bad_offsets_are_refused_by_name_on_the_kernels(fake_gpu, recording, entry, case, side):
    q, k, v = packed_batch()
    *arguments, expected = bad_arguments(case, side)
    with pytest.raises(ValueError) as error:
        entry(q, k, v, *arguments)
    assert str(error.value) == expected
    assert not recording.launches and fake_gpu.varlen_launches == 0 and router.stats()["kernel"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # refused by device, then by dtype
@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("entry", [dispatcher, flash_attn, flash_attn_with_window, flash_attn_kvpacked],
                         ids=lambda entry: entry.__name__)
def test_bad_offsets_are_refused_by_name_where_a_fallback_would_run(entry, case, side, dtype):
    q, k, v = packed_batch(dtype)
    *arguments, expected = bad_arguments(case, side)
    with pytest.raises(ValueError) as error:
        entry(q, k, v, *arguments)
    assert str(error.value) == expected
    assert router.stats()["fallback"] == 0


@pytest.mark.parametrize("case", list(BAD))
def test_the_qkvpacked_form_names_its_own_arguments(fake_gpu, case):
    q, k, v = packed_batch()
    cu, _, max_seqlen, _, expected = bad_arguments(case, "q")
    with pytest.raises(ValueError) as error:
        fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, max_seqlen)
    assert str(error.value) == (expected.replace("cu_seqlens_q", "cu_seqlens").replace("max_seqlen_q", "max_seqlen")
                                .replace("rows of q", "rows of qkv").replace("queries", "tokens"))


def test_other_malformed_arguments_are_refused_by_name():
    q, k, _ = packed_batch()
    cases = [
        ((offsets(), [0, 4, 10], 10, 10), "cu_seqlens_k must be a tensor of batch + 1 int32 offsets, not list"),
        ((offsets([0]), offsets([0]), 10, 10),
         "cu_seqlens_q must be 1-D with batch + 1 >= 2 offsets, not of shape (1,)"),
        ((offsets(), offsets([0, 10]), 10, 10),
         "cu_seqlens_q and cu_seqlens_k must hold the same batch + 1 offsets, not 3 and 2"),
        ((offsets(), offsets(), 10, -1), "max_seqlen_k must not be negative (-1)"),
    ]
    for arguments, expected in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            ops.check_cu_seqlens(q, k, *arguments)


def test_sound_offsets_pass_and_say_what_rows_they_cover():
    q, k, _ = packed_batch()
    assert ops.check_cu_seqlens(q, k, offsets(), offsets([0, 4, 9]), 6, 6) == ops.PackedRows(10, 9)
    assert ops.check_cu_seqlens(q, k, offsets([0, 0, 0]), offsets([0, 0, 0]), 0, 0) == ops.PackedRows(0, 0)
    assert ops.check_cu_seqlens(q, k, offsets(), offsets(), torch.tensor(6), 99) == ops.PackedRows(10, 10)


@pytest.fixture
def reads(monkeypatch) -> list:
    """The offsets ops reads from a tensor (each read is a device-to-host copy on a GPU)."""
    seen = []
    summarise = ops._summarise_offsets

    def counted(values):
        seen.append(values.tolist())
        return summarise(values)

    monkeypatch.setattr(ops, "_summarise_offsets", counted)
    return seen


def test_a_tensor_is_read_once_however_many_calls_take_it(fake_gpu, reads):
    q, k, v = packed_batch()
    cu_q, cu_k = offsets(), offsets([0, 5, 10])
    for _ in range(3):  # a model's layers: one cu_seqlens for all
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 5)
        fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu_q, 6)
    assert reads == [GOOD, [0, 5, 10]] and fake_gpu.varlen_launches == 6


def test_a_bad_tensor_is_refused_at_every_call_from_one_read(reads):
    q, k, v = packed_batch()
    cu = offsets([0, 7, 5])
    for _ in range(2):
        with pytest.raises(ValueError, match="cu_seqlens_q is not non-decreasing"):
            fa.flash_attn_varlen_func(q, k, v, cu, offsets(), 10, 10)
    assert reads == [[0, 7, 5]]


def test_a_tensor_written_in_place_is_read_again(fake_gpu, reads):
    q, k, v = packed_batch()
    cu = offsets()
    fa.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6)
    cu[1] = 11
    with pytest.raises(ValueError, match=r"^cu_seqlens_q is not non-decreasing at index 2 \(11 -> 10\)$"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6)
    cu[1] = 3
    with pytest.raises(ValueError, match="^max_seqlen_q 6 is smaller than entry 1's 7 queries$"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6)
    fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert reads == [GOOD, [0, 11, 10], [0, 3, 10]] and fake_gpu.varlen_launches == 2


def test_a_freed_tensor_leaves_nothing_behind(reads):
    q, k, _ = packed_batch()
    cu = offsets()
    ops.check_cu_seqlens(q, k, cu, cu, 6, 6)
    key = id(cu)
    assert key in ops._offsets_read
    del cu
    assert key not in ops._offsets_read


def test_inference_tensors_have_no_version_and_are_read_at_every_call(reads):
    q, k, _ = packed_batch()
    with torch.inference_mode():
        cu = offsets()
        ops.check_cu_seqlens(q, k, cu, cu, 6, 6)
        cu[1] = 11
        with pytest.raises(ValueError, match="cu_seqlens_q is not non-decreasing"):
            ops.check_cu_seqlens(q, k, cu, cu, 6, 6)
    assert reads == [GOOD, GOOD, [0, 11, 10]]


def test_values_are_trusted_where_they_cannot_be_read(monkeypatch, reads):
    q, k, _ = packed_batch()
    read_before, bad = offsets(), offsets([0, 7, 5])
    assert ops.check_cu_seqlens(q, k, read_before, read_before, 6, 6) == ops.PackedRows(10, 10)
    monkeypatch.setattr(ops, "_capturing_graph", lambda device: True)
    assert ops.check_cu_seqlens(q, k, read_before, read_before, 6, 6) == ops.PackedRows(10, 10)  # remembered
    with pytest.raises(ValueError, match="max_seqlen_q 5 is smaller"):
        ops.check_cu_seqlens(q, k, read_before, read_before, 5, 6)
    assert ops.check_cu_seqlens(q, k, bad, bad, 6, 6) is None
    monkeypatch.setattr(ops, "_capturing_graph", lambda device: False)
    monkeypatch.setattr(plans, "is_compiling", lambda: True)
    assert ops.check_cu_seqlens(q, k, read_before, bad, 6, 6) is None
    with pytest.raises(ValueError, match="cu_seqlens_k must be int32"):  # metadata is still checked
        ops.check_cu_seqlens(q, k, read_before, offsets(dtype=torch.int64), 6, 6)
    assert reads == [GOOD]


@pytest.fixture
def poisoned(monkeypatch):
    """Uninitialised float tensors hold NaN, as they may on a GPU."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


def test_rows_past_the_last_offset_are_zeros_and_zero_gradients(recording, poisoned, monkeypatch):
    q, k, v = packed_batch()
    cu_q, cu_k = offsets([0, 3, 8]), offsets([0, 4, 7])
    out, lse = ops.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 4)
    assert not out[8:].any() and (lse[:, 8:] == float("inf")).all()
    dq, dk, dv = ops.flash_attention_varlen_backward(torch.randn_like(q), q, k, v, lse, cu_q, cu_k, 5, 4)
    assert not dq[8:].any() and not dk[7:].any() and not dv[7:].any()
    assert len(recording.launches) == 3
    # Offsets not read (a CUDA graph's capture): every row is cleared before the kernels write theirs.
    monkeypatch.setattr(ops, "_capturing_graph", lambda device: True)
    unread = offsets([0, 3, 8])
    out, lse = ops.flash_attention_varlen_forward(q, k, v, unread, unread, 5, 5)
    assert not out.any() and (lse == float("inf")).all()


def test_the_code_objects_leave_rows_past_the_last_offset_as_zeros(poisoned):
    pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad (requirements-dev.txt)")
    from rdna_fa_lab.interpreter import InterpretedLibrary

    q, k, v = packed_batch(heads=1, rows=12)
    cu_q, cu_k = offsets([0, 3, 8]), offsets([0, 5, 9])
    with loader.explicit_library(InterpretedLibrary.for_target("gfx1100")):
        out, lse = ops.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 5)
        dq, dk, dv = ops.flash_attention_varlen_backward(torch.randn_like(q), q, k, v, lse, cu_q, cu_k, 5, 5)
    assert not out[8:].any() and (lse[:, 8:] == float("inf")).all()
    assert not dq[8:].any() and not dk[9:].any() and not dv[9:].any()
    for rows, keys in ((slice(0, 3), slice(0, 5)), (slice(3, 8), slice(5, 9))):
        entry = (t[span].transpose(0, 1).float() for t, span in ((q, rows), (k, keys), (v, keys)))
        expected = torch.nn.functional.scaled_dot_product_attention(*entry).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), expected, atol=2e-3, rtol=2e-3)
        assert torch.isfinite(dq[rows]).all() and torch.isfinite(dk[keys]).all()
