"""Masks, packed variable-length batches and grouped key/value heads, through the emulation of both AMD
layers, forward and backward, against fp64.

Criteria as in test_forward.py and test_backward.py: per case the output's max error against fp64 is
at most 2x that of PyTorch's math SDPA in the same dtype, and each gradient's at most 2x that of the
same attention computed in the input dtype plus 1e-5 (FlashAttention-2's criterion); for packed
batches per entry, with flash-attn's bottom-right causal mask. The recorded ratio is the error over
that yardstick's. Set RDNA_FA_PROBLEM_GRID_REPORT=path.json to record the grids' summary.
"""

import json
import os
import random
import time

import pytest
import torch

from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.ops.autograd import flash_attention, flash_attention_varlen
from rdna_flash_attn.runtime import variants

from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype, max_error,
                                             sdpa_math)
from .test_forward import make_inputs

SEQ_LENGTHS = (1, 2, 7, 16, 17, 33, 64, 65, 77, 100, 128, 154, 257, 333)
SD_HEAD_DIMS = (40, 64, 80, 128, 160)
DTYPES = (torch.float16, torch.bfloat16)
MASK_KINDS = ("key_padding_bool", "key_padding_float", "bias", "bool", "strided_bias", "query_rows", "key_bias")
# Values that mask a key out in an additive mask, as hosts write them.
MASK_FILLS = ("-inf", "lowest", -1e4, -1e9)
MASK_FORWARD_CASES, MASK_BACKWARD_CASES = 600, 300  # per layer
VARLEN_FORWARD_CASES, VARLEN_BACKWARD_CASES = 260, 130
GQA_FORWARD_CASES, GQA_BACKWARD_CASES = 120, 60

_results: list[dict] = []


def _head_dim(rng, masked=False):
    if masked:  # masked kernels exist for these (runtime/variants.py)
        return rng.choice((64, 96, 128)) if rng.random() < 0.5 else rng.choice(variants.MASKED_HEAD_DIMS)
    return rng.choice(SD_HEAD_DIMS) if rng.random() < 0.5 else rng.choice(variants.SUPPORTED_HEAD_DIMS)


def _mask_grid(count, seed, backward):
    rng = random.Random(seed)
    return [dict(index=i, backward=backward, dtype=DTYPES[i % 2], head_dim=_head_dim(rng, masked=True),
                 seq_q=rng.choice(SEQ_LENGTHS), seq_k=rng.choice(SEQ_LENGTHS), batch=rng.randint(1, 2),
                 heads=rng.randint(1, 3), layout=rng.choice(("bhsd", "bshd", "strided")),
                 kind=MASK_KINDS[i % len(MASK_KINDS)], fill=rng.choice(MASK_FILLS),
                 mask_dtype=rng.choice(("bool_or_f32", "input")), broadcast=rng.randint(0, 3),
                 scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5)) for i in range(count)]


def _gqa_grid(count, seed, backward):
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        masked = rng.random() < 0.3
        cases.append(dict(index=i, backward=backward, dtype=DTYPES[i % 2], head_dim=_head_dim(rng, masked),
                          seq_q=rng.choice(SEQ_LENGTHS), seq_k=rng.choice(SEQ_LENGTHS), batch=rng.randint(1, 2),
                          kv_heads=rng.randint(1, 2), group=rng.choice((2, 3, 4, 8)),
                          layout=rng.choice(("bhsd", "bshd")), causal=rng.random() < 0.3, masked=masked,
                          scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5)))
    return cases


def _varlen_grid(count, seed, backward):
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        entries = rng.randint(1, 5)
        lengths_q = [rng.choice((0,) + SEQ_LENGTHS) if rng.random() < 0.1 else rng.choice(SEQ_LENGTHS)
                     for _ in range(entries)]
        same = rng.random() < 0.4  # self-attention: the keys are the queries
        lengths_k = list(lengths_q) if same else [rng.choice(SEQ_LENGTHS) for _ in range(entries)]
        heads = rng.randint(1, 3)
        cases.append(dict(index=i, backward=backward, dtype=DTYPES[i % 2], head_dim=_head_dim(rng),
                          lengths_q=lengths_q, lengths_k=lengths_k, heads=heads * rng.choice((1, 1, 2)),
                          kv_heads=heads, causal=rng.random() < 0.4,
                          scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5)))
    return cases


MASK_GRID = _mask_grid(MASK_FORWARD_CASES, 41, False) + _mask_grid(MASK_BACKWARD_CASES, 42, True)
GQA_GRID = _gqa_grid(GQA_FORWARD_CASES, 43, False) + _gqa_grid(GQA_BACKWARD_CASES, 44, True)
VARLEN_GRID = _varlen_grid(VARLEN_FORWARD_CASES, 45, False) + _varlen_grid(VARLEN_BACKWARD_CASES, 46, True)


def _fill_value(fill, dtype):
    if fill == "-inf":
        return float("-inf")
    if fill == "lowest":
        return torch.finfo(dtype).min
    return max(fill, torch.finfo(dtype).min)


def make_mask(case, q_dtype, generator):
    """A mask of the case's kind in a shape broadcastable to (B, H, Sq, Sk), some rows fully masked."""
    batch, heads, seq_q, seq_k = case["batch"], case["heads"], case["seq_q"], case["seq_k"]
    kind = case["kind"]
    is_bool = kind in ("key_padding_bool", "bool", "query_rows")
    dtype = torch.bool if is_bool else (torch.float32 if case["mask_dtype"] == "bool_or_f32" else q_dtype)

    def uniform(*shape):
        return torch.rand(shape, device="cuda", generator=generator)

    if kind.startswith("key_padding"):
        # Ragged key lengths per batch entry, one of them possibly 0 (every row fully masked).
        lengths = (uniform(batch) * (seq_k + 1)).long()
        keep = torch.arange(seq_k, device="cuda")[None, :] < lengths[:, None]  # (B, Sk)
        # Broadcast shapes hosts use: (B, 1, 1, Sk), and for one batch entry (1, Sk) or (1, 1, Sk).
        shape = ((1, seq_k), (1, 1, seq_k))[case["broadcast"] % 2] if batch == 1 and case["broadcast"] >= 2 else None
        keep = keep.reshape(shape or (batch, 1, 1, seq_k))
    elif kind == "query_rows":
        keep = uniform(batch, 1, seq_q, 1) < 0.8  # a row's keys all masked or all kept: broadcast over keys
    else:
        # key_bias: one bias per key, broadcast over queries (what the kernels stage once per key tile)
        rows = 1 if kind == "key_bias" else seq_q
        shape = (batch if case["broadcast"] & 1 else 1, heads if case["broadcast"] & 2 else 1, rows, seq_k)
        if kind == "bool":
            keep = uniform(*shape) < 0.7
            keep[..., : max(1, seq_q // 5), :] &= uniform(*shape[:2], 1, 1) < 0.5  # some rows fully masked
        else:
            if kind == "strided_bias":  # a slice of a wider, transposed buffer: no unit stride anywhere
                wide = (torch.randn(*shape[:2], seq_k + 5, seq_q + 3, device="cuda", generator=generator) * 3).to(dtype)
                bias = wide[..., 2 : 2 + seq_k, 1 : 1 + seq_q].transpose(-1, -2)
            else:
                bias = (torch.randn(shape, device="cuda", generator=generator) * 3).to(dtype)
            return bias.masked_fill_(uniform(*shape) < 0.15, _fill_value(case["fill"], dtype))
    if is_bool:
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device="cuda").masked_fill(~keep, _fill_value(case["fill"], dtype))


def _record(grid, layer, case, start, errors):
    record = dict(grid=grid, layer=layer, **{key: str(value) for key, value in case.items()},
                  seconds=time.perf_counter() - start)
    for name, (error, baseline) in errors.items():
        yardstick = "sdpa_math" if name == "out" else "input_dtype"
        record[f"{name}_error"], record[f"{name}_{yardstick}_error"] = error, baseline
        record[f"{name}_ratio"] = error / max(baseline, 1e-12)
    _results.append(record)
    for name, (error, baseline) in errors.items():
        # An exact zero baseline (one visible key: dk is exactly 0) leaves only rounding of zero.
        bound = max(2 * baseline, 1e-6) if name == "out" else backward_bound(baseline)
        assert error <= bound, f"{name}: {error:.3e} > {bound:.3e}"


def _check(grid, layer, case, q, k, v, attn_mask, causal, bottom_right):
    """Forward (and for backward cases the three gradients) of flash_attention against fp64."""
    start = time.perf_counter()
    scale = case["scale"]
    if not case["backward"]:
        out, lse = ops.flash_attention_forward(q, k, v, causal, scale, attn_mask=attn_mask, bottom_right=bottom_right)
        ref, ref_lse = attention_fp64(q, k, v, causal, scale, attn_mask, bottom_right)
        assert torch.isfinite(out).all(), "non-finite output"
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen), "lse is +inf exactly where a row sees no key"
        # A row whose keys all carry huge finite biases (-1e9, a dtype's lowest) has an lse near them,
        # which the kernels hold at their bias floor (-2^30 / log2(e), sequence.h): its output, not
        # its lse, is what SDPA defines.
        ordinary = seen & (ref_lse > -1e8)
        if ordinary.any():
            assert max_error(lse[ordinary], ref_lse[ordinary]) < 2e-3 * max(1.0, ref_lse[ordinary].abs().max().item())
        baseline = sdpa_math(q, k, v, causal, scale, attn_mask, bottom_right)
        _record(grid, layer, case, start, {"out": (max_error(out, ref), max_error(baseline, ref))})
        return
    generator = torch.Generator(device="cuda").manual_seed(case["index"] + 99)
    dout = torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=generator)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention(*leaves, causal, scale, attn_mask=attn_mask, bottom_right=bottom_right)
    grads = torch.autograd.grad(out, leaves, dout)
    again = torch.autograd.grad(flash_attention(*leaves, causal, scale, attn_mask=attn_mask,
                                                bottom_right=bottom_right), leaves, dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "gradients not bitwise reproducible"
    reference = grads_fp64(q, k, v, dout, causal, scale, attn_mask, bottom_right)
    baseline = grads_input_dtype(q, k, v, dout, causal, scale, attn_mask, bottom_right)
    errors = {}
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, reference, baseline):
        assert grad.shape == ref.shape and torch.isfinite(grad).all(), f"{name} shape or finiteness"
        errors[name] = (max_error(grad, ref), max_error(base, ref))
    _record(grid, layer, case, start, errors)


def _case_id(case):
    return f"{'bwd' if case['backward'] else 'fwd'}-{case['index']}-{case['head_dim']}"


@pytest.mark.parametrize("case", MASK_GRID, ids=_case_id)
def test_masks_match_fp64(case, emulated_layer):
    generator = torch.Generator(device="cuda").manual_seed(7000 + case["index"] + 1000 * case["backward"])
    shape = case["batch"], case["heads"]
    q, k, v = (make_inputs(*shape, seq, case["head_dim"], case["dtype"], case["layout"], generator)
               for seq in (case["seq_q"], case["seq_k"], case["seq_k"]))
    _check("mask", emulated_layer, case, q, k, v, make_mask(case, case["dtype"], generator), False, False)


# Key-padding masks whose tiles test the forward's per-tile choice (fa_fwd.h): a tile whose biases are
# all zero runs without them, so one nonzero bias among zeros, a tile of -0.0, a kept tile beside a
# padded one and a fully padded tile must each give what SDPA gives. Keys 0..299: tiles of 64 (or 32).
KEY_TILE_MASKS = {
    "one small bias in a zero tile": lambda bias: bias.index_fill_(-1, torch.tensor([200], device="cuda"), 0.25),
    "a tile of -0.0, then padding": lambda bias: bias.index_fill_(-1, torch.arange(64, 128, device="cuda"), -0.0)
    .index_fill_(-1, torch.arange(290, 300, device="cuda"), float("-inf")),
    "padded tiles between kept ones": lambda bias: bias.index_fill_(-1, torch.arange(100, 260, device="cuda"),
                                                                    float("-inf")),
}


@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
@pytest.mark.parametrize("head_dim", (64, 128, 160))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", KEY_TILE_MASKS)
def test_key_padding_tiles_with_and_without_biases(pattern, dtype, head_dim, backward, emulated_layer):
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (make_inputs(2, 2, seq, head_dim, dtype, "bhsd", generator) for seq in (77, 300, 300))
    bias = KEY_TILE_MASKS[pattern](torch.zeros(2, 1, 1, 300, dtype=dtype, device="cuda"))
    case = dict(index=0, backward=backward, scale=None, pattern=pattern, dtype=dtype, head_dim=head_dim)
    _check("key_tiles", emulated_layer, case, q, k, v, bias, False, False)
    if not backward:  # the same keys as a bool mask
        _check("key_tiles", emulated_layer, case, q, k, v, bias == 0, False, False)


@pytest.mark.parametrize("case", GQA_GRID, ids=_case_id)
def test_grouped_heads_match_fp64(case, emulated_layer):
    generator = torch.Generator(device="cuda").manual_seed(8000 + case["index"] + 1000 * case["backward"])
    batch, kv_heads = case["batch"], case["kv_heads"]
    heads = kv_heads * case["group"]
    q = make_inputs(batch, heads, case["seq_q"], case["head_dim"], case["dtype"], case["layout"], generator)
    k, v = (make_inputs(batch, kv_heads, case["seq_k"], case["head_dim"], case["dtype"], case["layout"], generator)
            for _ in range(2))
    mask = None
    if case["masked"]:
        mask = make_mask(dict(case, heads=heads, kind="bias", broadcast=3, fill="-inf", mask_dtype="input"),
                         case["dtype"], generator)
    _check("gqa", emulated_layer, case, q, k, v, mask, case["causal"] and mask is None, False)


def _packed(lengths, heads, head_dim, dtype, generator):
    total = sum(lengths)
    return torch.randn(total, heads, head_dim, dtype=dtype, device="cuda", generator=generator)


def _offsets(lengths):
    return torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)


@pytest.mark.parametrize("case", VARLEN_GRID, ids=_case_id)
def test_varlen_matches_fp64_per_entry(case, emulated_layer):
    start = time.perf_counter()
    generator = torch.Generator(device="cuda").manual_seed(9000 + case["index"] + 1000 * case["backward"])
    lengths_q, lengths_k = case["lengths_q"], case["lengths_k"]
    q = _packed(lengths_q, case["heads"], case["head_dim"], case["dtype"], generator)
    k, v = (_packed(lengths_k, case["kv_heads"], case["head_dim"], case["dtype"], generator) for _ in range(2))
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    causal, scale = case["causal"], case["scale"]
    leaves = tuple(t.detach().requires_grad_(case["backward"]) for t in (q, k, v))
    out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, scale)
    dout = torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=generator)
    grads = torch.autograd.grad(out, leaves, dout) if case["backward"] else None
    errors: dict[str, list[float]] = {}

    def worst(name, error, baseline):
        previous = errors.get(name, (0.0, 0.0))
        errors[name] = (max(previous[0], error), max(previous[1], baseline))

    for b, (start_q, start_k) in enumerate(zip(cu_q[:-1].tolist(), cu_k[:-1].tolist())):
        rows = slice(start_q, start_q + lengths_q[b])
        keys = slice(start_k, start_k + lengths_k[b])
        if lengths_q[b] == 0:
            continue
        entry = [t[rows if i == 0 else keys].transpose(0, 1).unsqueeze(0) for i, t in enumerate((q, k, v))]
        if not case["backward"]:
            ref, ref_lse = attention_fp64(*entry, causal, scale, bottom_right=True)
            base = sdpa_math(*entry, causal, scale, bottom_right=True)
            got = out[rows].transpose(0, 1).unsqueeze(0)
            assert torch.isfinite(got).all()
            worst("out", max_error(got, ref), max_error(base, ref))
            seen = torch.isfinite(ref_lse[0])
            if seen.any():
                assert max_error(lse[:, rows][seen], ref_lse[0][seen]) < 2e-3 * max(1.0, ref_lse.abs().max().item())
            continue
        entry_dout = dout[rows].transpose(0, 1).unsqueeze(0)
        reference = grads_fp64(*entry, entry_dout, causal, scale, bottom_right=True)
        baseline = grads_input_dtype(*entry, entry_dout, causal, scale, bottom_right=True)
        for name, grad, ref, base, span in zip(("dq", "dk", "dv"), grads, reference, baseline, (rows, keys, keys)):
            worst(name, max_error(grad[span].transpose(0, 1).unsqueeze(0), ref), max_error(base, ref))
    _record("varlen", emulated_layer, case, start, errors)


@pytest.fixture(scope="module", autouse=True)
def grid_report():
    yield
    path = os.environ.get("RDNA_FA_PROBLEM_GRID_REPORT")
    if path and _results:
        summary = {}
        for grid in ("mask", "key_tiles", "gqa", "varlen"):
            for direction in ("False", "True"):
                rows = [r for r in _results if r["grid"] == grid and r["backward"] == direction]
                if not rows:
                    continue
                ratios = [value for r in rows for key, value in r.items() if key.endswith("_ratio")]
                summary[f"{grid}_{'backward' if direction == 'True' else 'forward'}"] = dict(
                    cases=len(rows), worst_ratio=max(ratios), seconds=sum(r["seconds"] for r in rows))
        summary.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(path, "w") as file:
            json.dump(dict(summary=summary, cases=_results), file)
