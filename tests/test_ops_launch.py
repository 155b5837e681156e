"""ops.flash_attention_forward's prepared launches: every launch's argument block, grid and kernel,
against ones built from scratch for that call, however the calls before it were cached. A CPU
stand-in library records the launches; nothing runs."""

from __future__ import annotations

import math

import pytest
import torch

from rdna_flash_attn.ops import attention as ops, plans
from rdna_flash_attn.runtime import loader as runtime, variants
from rdna_flash_attn.ops.launch_args import BwdArgs, FwdArgs


class RecordingLibrary:
    """What ops needs of a KernelLibrary: launchers, here recording (kernel, grid, argument bytes)."""

    def __init__(self):
        self.launches: list[tuple[str, tuple, bytes]] = []

    def launcher(self, variant, grid, device):
        def launch(args, buffers):
            self.launches.append((variant.symbol, grid, bytes(args)))
        return launch


@pytest.fixture
def library(monkeypatch) -> RecordingLibrary:
    recording = RecordingLibrary()
    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(runtime, "library_for", lambda device: recording)
    return recording


def expected_launch(q, k, v, out, lse, is_causal=False, scale=None) -> tuple[str, tuple, bytes]:
    batch, heads, seq_q, dim = q.shape
    variant = variants.fwd_variant({torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype], dim)
    blocks = -(-seq_q // variant.block_rows)
    scale = 1 / math.sqrt(dim) if scale is None else scale
    args = FwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                   *(s for t in (q, k, v, out) for s in t.stride()[:3]), lse.stride(0), lse.stride(1),
                   seq_q, k.shape[2], dim, int(is_causal), scale * 1.4426950408889634, blocks)
    args.kv_group = heads // k.shape[1]
    return variant.symbol, (blocks * variant.d_chunks, heads, batch), bytes(args)


def tensors(shape=(2, 3, 40, 64), dtype=torch.float16, layout="bhsd", seq_k=None):
    batch, heads, seq, dim = shape
    lengths = (seq, seq_k or seq, seq_k or seq)
    if layout == "bshd":
        return [torch.randn(batch, n, heads, dim, dtype=dtype).transpose(1, 2) for n in lengths]
    return [torch.randn(batch, heads, n, dim, dtype=dtype) for n in lengths]


CALLS = [
    (dict(), dict()),
    (dict(layout="bshd"), dict()),
    (dict(), dict(is_causal=True)),
    (dict(), dict(scale=0.3)),
    (dict(seq_k=77), dict(is_causal=True, scale=0.3)),
    (dict(dtype=torch.bfloat16, shape=(1, 2, 33, 160)), dict()),
]


def test_every_launch_matches_one_built_from_scratch(library):
    for _ in range(2):  # the second round is served from the prepared launches
        for make, kwargs in CALLS:
            q, k, v = tensors(**make)
            out, lse = ops.flash_attention_forward(q, k, v, **kwargs)
            assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
            assert (out.stride(2) > out.stride(1)) == (q.stride(2) > q.stride(1))  # q's memory order
            assert library.launches[-1] == expected_launch(q, k, v, out, lse, **kwargs)
    assert len(library.launches) == 2 * len(CALLS) and len(ops._prepared) == len(CALLS)


def test_misaligned_input_is_refused_after_its_signature_was_prepared(library):
    q, k, v = tensors()
    ops.flash_attention_forward(q, k, v)
    shifted = torch.empty(q.numel() + 4, dtype=q.dtype)[4:].view(q.shape)
    with pytest.raises(ValueError, match="16-byte"):
        ops.flash_attention_forward(shifted, k, v)
    assert len(library.launches) == 1


def test_a_sequence_stride_past_the_32_bit_tile_offsets_is_refused_by_name(library):
    q, k, v = tensors(shape=(1, 1, 2, 8))
    wide = torch.zeros(2**23 + 8, dtype=q.dtype)
    far_apart = wide.as_strided((1, 1, 2, 8), (2**23 + 8, 2**23 + 8, 2**23, 1))
    assert refusal(plans.plan_forward(far_apart, k, v)) == "query sequence stride 8388608 is 2^23 elements or more"
    assert refusal(plans.plan_forward(q, far_apart, v)) == "key sequence stride 8388608 is 2^23 elements or more"
    assert refusal(plans.plan_forward(q, k, far_apart)) == "value sequence stride 8388608 is 2^23 elements or more"
    below = wide.as_strided((1, 1, 2, 8), (2**23 + 8, 2**23 + 8, 2**23 - 8, 1))
    assert refusal(plans.plan_forward(below, below, below)) is None
    # a packed batch's limit is on its tokens' stride
    packed = wide.as_strided((2, 1, 8), (2**23, 8, 1))
    assert refusal(plans.plan_varlen(q[0].transpose(0, 1), packed, packed,
                                     *(torch.tensor([0, 2], dtype=torch.int32),) * 2, 2, 2)) == (
        "key sequence stride 8388608 is 2^23 elements or more")


def refusal(plan) -> str | None:
    """The reason of a plan that is a refusal, None for a plan."""
    return plan.reason if isinstance(plan, plans.Refusal) else None


def test_a_sequence_past_the_kernels_32_bit_row_indices_is_refused_by_name(library):
    """Row indices plus a tile stay below 2^31 (the kernels' ints)."""
    q, k, v = tensors(shape=(1, 1, 2, 8))
    limit = 2**31 - 1024
    for length, refused in ((limit, False), (limit + 1, True)):
        long = torch.zeros(8, dtype=q.dtype).as_strided((1, 1, length, 8), (0, 0, 0, 1))  # no memory behind it
        for args in ((long, k, v), (q, long, long)):
            assert (refusal(plans.plan_forward(*args)) == "sequence longer than 2^31 - 1024") == refused
    offsets = torch.tensor([0, 2], dtype=torch.int32)
    packed = q[0].transpose(0, 1)
    assert refusal(plans.plan_varlen(packed, packed, packed, offsets, offsets, limit + 1, 2)) == \
        "max_seqlen_q or max_seqlen_k is negative or above 2^31 - 1024"
    assert refusal(plans.plan_varlen(packed, packed, packed, offsets, offsets, limit, limit)) is None


def test_a_gradient_with_a_sequence_stride_past_the_tile_offsets_is_copied_not_refused():
    wide = torch.zeros(2**23 + 8, dtype=torch.float16)
    far_apart = wide.as_strided((1, 1, 2, 8), (2**23 + 8, 2**23 + 8, 2**23, 1))
    compact = ops.kernel_layout(far_apart)
    assert compact.stride(2) == 8 and torch.equal(compact, far_apart)


def test_packed_tensors_are_judged_on_their_tokens_stride():
    wide = torch.zeros(2**23 + 16, dtype=torch.float16)
    head_major = wide.as_strided((2, 2, 8), (8, 2**23, 1))  # (tokens, heads, dim), heads 2^23 apart
    assert ops.packed_kernel_layout(head_major) is head_major
    tokens_far_apart = wide.as_strided((2, 2, 8), (2**23, 8, 1))
    compact = ops.packed_kernel_layout(tokens_far_apart)
    assert compact.stride(0) == 16 and torch.equal(compact, tokens_far_apart)


def test_the_packed_backward_hands_the_kernels_a_gradient_they_can_reach(library, monkeypatch):
    launched = {}
    monkeypatch.setattr(ops, "_launch_gradients", lambda dout, *rest: launched.setdefault("dout", dout))
    q = torch.zeros(2, 1, 8, dtype=torch.float16)
    dout = torch.arange(2**23 + 8, dtype=torch.float16).as_strided((2, 1, 8), (2**23, 8, 1))
    lengths = torch.tensor([0, 2], dtype=torch.int32)
    ops.flash_attention_varlen_backward(dout, q, q, q, torch.zeros(1, 2), lengths, lengths, 2, 2)
    seen = launched["dout"]
    assert seen.shape == (1, 1, 2, 8) and seen.stride(2) < plans.MAX_SEQ_STRIDE
    assert torch.equal(seen[0].transpose(0, 1), dout)


def test_outputs_are_not_held_to_the_read_tiles_stride_limit(library):
    q, k, v = tensors(shape=(1, 1, 2, 8))
    out = torch.zeros(2**23 + 8, dtype=q.dtype).as_strided(q.shape, (2**23 + 8, 2**23 + 8, 2**23, 1))
    ops._check_output(q, out, None)  # written with 64-bit addresses: no ValueError


def test_the_stride_limit_keeps_every_tiles_offsets_within_32_bits():
    """Tile copies (kernels/tiles.h, TileCopy in fa_fwd.h) offset a tile's rows from its base by up to
    (rows - 1) strides, and by (threads / 16-byte chunks per row - 1) on the per-thread path: both must
    stay below 2^31 bytes at the largest stride the dispatch lets in (the offset is first formed as an
    int)."""
    tiles = [(v.symbol, max(v.block_n, v.block_rows), v.threads, v.d_pad) for v in variants.FWD_VARIANTS]
    tiles += [(v.symbol, v.block_tile, v.threads, v.d_pad) for v in variants.BWD_VARIANTS]
    for symbol, tile_rows, threads, d_pad in tiles:
        rows = max(tile_rows, threads // max(1, d_pad // 8))
        assert (rows * plans.MAX_SEQ_STRIDE + d_pad) * 2 < 2**31, symbol


def test_every_masked_forward_tile_suits_its_per_wave_bias_check():
    """kernels/fa_fwd.h's key-bias check has each lane read block_n / 32 adjacent staged biases (one, in
    lanes below block_n, at 16): a block_n of 48 or 80 would leave keys unread."""
    for variant in variants.FWD_VARIANTS:
        if variant.masked:
            assert variant.block_n == 16 or variant.block_n % 32 == 0, variant.symbol


def test_given_out_and_lse_are_written_where_they_lie(library):
    q, k, v = tensors(layout="bshd")
    ops.flash_attention_forward(q, k, v)
    out = torch.empty(2, 3, 40, 64, dtype=q.dtype)  # BHSD although q is BSHD
    lse = torch.empty(2, 3, 48, dtype=torch.float32)[..., :40]
    written = ops.flash_attention_forward(q, k, v, out=out, lse=lse)
    assert written[0] is out and written[1] is lse
    assert library.launches[-1] == expected_launch(q, k, v, out, lse)


def test_a_bad_out_is_named_before_any_library_is_loaded(monkeypatch):
    def unavailable(device):
        raise ops.KernelUnavailable("no code object for this GPU")

    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(runtime, "library_for", unavailable)
    q, k, v = tensors()
    with pytest.raises(ValueError, match="out must"):
        ops.flash_attention_forward(q, k, v, out=torch.empty(1, dtype=q.dtype), lse=torch.empty(2, 3, 40))


def test_a_training_forward_passes_its_statistics_and_skips_the_prepared_launch(library):
    q, k, v = tensors(layout="bshd")
    ops.flash_attention_forward(q, k, v)
    saved = ops.backward_stats_like(q)
    assert saved.out_low.stride() == ops.output_like(q).stride()
    ops.flash_attention_forward(q, k, v, saved=saved)
    args = FwdArgs.from_buffer_copy(library.launches[-1][2])
    assert (args.o_low, args.row_offset, args.row_log2_sum) == tuple(t.data_ptr() for t in saved)
    assert FwdArgs.from_buffer_copy(library.launches[0][2]).o_low is None  # inference writes nothing more


@pytest.mark.parametrize("breakage, message", [
    (lambda q, out, saved: (out, None), "out and saved go together"),
    (lambda q, out, saved: (out, tuple(saved)), "saved must be a BackwardStats"),
    (lambda q, out, saved: (out, saved._replace(out_low=q.new_empty(2, 40, 3, 64).transpose(1, 2))),
     "saved.out_low must have the output's strides"),  # (B, S, H, D) memory under a (B, H, S, D) output
    (lambda q, out, saved: (out, saved._replace(row_offset=saved.row_offset.double())), "saved.row_offset"),
])
def test_bad_saved_statistics_are_named_before_any_library_is_loaded(monkeypatch, breakage, message):
    def unavailable(device):
        raise ops.KernelUnavailable("no code object for this GPU")

    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(runtime, "library_for", unavailable)
    q, k, v = tensors()
    out, saved = breakage(q, ops.output_like(q), ops.backward_stats_like(q))
    lse = torch.empty(q.shape[:3])
    with pytest.raises(ValueError, match=message):
        ops.flash_attention_backward(torch.randn_like(q), q, k, v, lse, out=out, saved=saved)



class SliceRecordingLibrary:
    """Records each launch's grid and the slice offsets in its argument block, through the forward's
    prepared launchers and through library.launch (the backward's and the packed forward's)."""

    def __init__(self):
        self.launches: list[tuple[tuple, int, int]] = []

    def launcher(self, variant, grid, device):
        return lambda args, buffers: self.launches.append((grid, args.head0, args.batch0))

    def launch(self, variant, grid, args, buffers):
        self.launches.append((grid, args.head0, args.batch0))


@pytest.mark.parametrize("heads,batch", ((1, 65536), (70000, 1), (65540, 70000)))
def test_grids_past_65535_launch_in_slices_covering_every_workgroup_once(heads, batch):
    """The hardware takes at most 65535 workgroups along a grid's y (heads) and z (batch): larger grids
    run as slices whose argument blocks name their first head and batch (the kernels' head0, batch0)."""
    recording = SliceRecordingLibrary()
    variant = variants.fwd_variant("f16", 64)
    grid = (3, heads, batch)
    ops._launcher(recording, variant, grid, torch.device("cpu"))(FwdArgs(), ())
    forward = list(recording.launches)
    recording.launches.clear()
    ops._launch(recording, variant, grid, BwdArgs(), ())
    assert recording.launches == forward
    covered = 0
    for (x, ys, zs), head0, batch0 in forward:
        assert x == 3 and 0 < ys <= 65535 and 0 < zs <= 65535
        assert head0 % 65535 == 0 and batch0 % 65535 == 0 and head0 + ys <= heads and batch0 + zs <= batch
        covered += ys * zs
    assert covered == heads * batch and len({(h, b) for _, h, b in forward}) == len(forward)


def test_batch_and_heads_past_65535_are_taken(library):
    q = torch.zeros(1, 1, 1, 64, dtype=torch.float16)
    for shape in ((70000, 1, 1, 64), (1, 70000, 1, 64)):
        assert refusal(plans.plan_forward(*(t.expand(shape) for t in (q, q, q)))) is None
