"""The forward kernel through the emulation of both AMD layers, against an fp64 reference.

Criterion (FlashAttention's own): each case's max error against fp64 is at most 2x the error of
PyTorch's math SDPA in the same dtype, on fresh random inputs, with outputs poisoned beforehand.
Set RDNA_FA_GRID_REPORT=path.json to record the grid's summary.
"""

import json
import math
import os
import random
import time

import pytest
import torch

from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.runtime import variants

from rdna_fa_lab.attention_reference import attention_fp64, max_error, rising_scores, sdpa_math

CASES_PER_LAYER = 2000
SEQ_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 77, 100, 127, 128, 129, 154, 231, 256, 257, 333, 512,
               1000, 1024)
LONG_SEQ_LENGTHS = (4097, 4160, 5000)
SD_HEAD_DIMS = (40, 64, 80, 128, 160, 512)
DTYPES = (torch.float16, torch.bfloat16)


def _grid(seed=20261122):
    rng = random.Random(seed)
    cases = []
    for index in range(CASES_PER_LAYER):
        head_dim = rng.choice(SD_HEAD_DIMS) if rng.random() < 0.4 else rng.choice(variants.SUPPORTED_HEAD_DIMS)
        long_case = index % 50 == 0
        seq_q = rng.choice(LONG_SEQ_LENGTHS) if long_case else rng.choice(SEQ_LENGTHS)
        seq_k = rng.choice(LONG_SEQ_LENGTHS) if long_case and index % 100 == 0 else rng.choice(SEQ_LENGTHS)
        batch, heads = (1, 1) if long_case else (rng.randint(1, 3), rng.randint(1, 4))
        cases.append(dict(
            index=index, dtype=DTYPES[index % 2], head_dim=head_dim, seq_q=seq_q, seq_k=seq_k, batch=batch,
            heads=heads, layout=rng.choice(("bhsd", "bshd", "strided")), causal=rng.random() < 0.35,
            scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5)))
    return cases


GRID = _grid()
_results: list[dict] = []


def make_inputs(batch, heads, seq, head_dim, dtype, layout, generator):
    """A (B, H, S, D) view in the requested memory layout; 'strided' is a slice of a wider buffer."""
    if layout == "bhsd":
        base = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device="cuda", generator=generator)
        return base
    if layout == "bshd":
        base = torch.randn(batch, seq, heads, head_dim, dtype=dtype, device="cuda", generator=generator)
        return base.transpose(1, 2)
    base = torch.randn(batch, seq, heads + 1, head_dim + 8, dtype=dtype, device="cuda", generator=generator)
    return base[:, :, 1:, 8:].transpose(1, 2)


def run_case(case, layer):
    generator = torch.Generator(device="cuda").manual_seed(1000 + case["index"] + (0 if layer == "gfx11" else 7))
    shape = case["batch"], case["heads"]
    q = make_inputs(*shape, case["seq_q"], case["head_dim"], case["dtype"], case["layout"], generator)
    k = make_inputs(*shape, case["seq_k"], case["head_dim"], case["dtype"], case["layout"], generator)
    v = make_inputs(*shape, case["seq_k"], case["head_dim"], case["dtype"], case["layout"], generator)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
    ops.flash_attention_forward(q, k, v, case["causal"], case["scale"], out=out, lse=lse)
    ref, ref_lse = attention_fp64(q, k, v, case["causal"], case["scale"])
    baseline = sdpa_math(q, k, v, case["causal"], case["scale"])
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert torch.isfinite(lse).all(), "unwritten or non-finite lse"
    error, baseline_error = max_error(out, ref), max_error(baseline, ref)
    lse_error = max_error(lse, ref_lse)
    return error, baseline_error, lse_error


@pytest.mark.parametrize("case", GRID, ids=lambda c: "{index}-{head_dim}-{seq_q}x{seq_k}-{layout}".format(**c))
def test_forward_matches_fp64(case, emulated_layer):
    start = time.perf_counter()
    error, baseline_error, lse_error = run_case(case, emulated_layer)
    ratio = error / max(baseline_error, 1e-12)
    _results.append(dict(layer=emulated_layer, **{k: str(v) for k, v in case.items()}, error=error,
                         sdpa_math_error=baseline_error, ratio=ratio, lse_error=lse_error,
                         seconds=time.perf_counter() - start))
    assert error <= 2 * baseline_error, f"error {error:.3e} > 2 x SDPA math's {baseline_error:.3e}"
    assert lse_error < 1e-3 * max(1.0, math.log(case["seq_k"]))


@pytest.fixture(scope="module", autouse=True)
def grid_report():
    yield
    path = os.environ.get("RDNA_FA_GRID_REPORT")
    if path and _results:
        worst = max(_results, key=lambda r: r["ratio"])
        summary = dict(cases=len(_results), worst_ratio=worst["ratio"], worst_case=worst,
                       failures=sum(r["error"] > 2 * r["sdpa_math_error"] for r in _results),
                       seconds=sum(r["seconds"] for r in _results),
                       device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(path, "w") as file:
            json.dump(dict(summary=summary, cases=_results), file)


def test_64_bit_offsets(emulated_layer):
    """Batch 1 of K/V lies past 2^31 elements of one buffer: 32-bit offsets would wrap."""
    head_dim, seq_k = 64, 77
    elements = 2**31 + 4 * seq_k * head_dim
    buffer = torch.empty(elements, dtype=torch.float16, device="cuda").normal_()
    batch_stride = (elements - seq_k * head_dim) // 8 * 8
    k = buffer.as_strided((2, 1, seq_k, head_dim), (batch_stride, 0, head_dim, 1))
    q = torch.randn(2, 1, 50, head_dim, dtype=torch.float16, device="cuda")
    out, _ = ops.flash_attention_forward(q, k, k)
    ref, _ = attention_fp64(q, k, k)
    assert max_error(out, ref) <= 2 * max_error(sdpa_math(q, k, k), ref)


@pytest.mark.parametrize("seq_q, seq_k", [(64, 118_800), (118_800, 77)])
def test_video_length_sequences(emulated_layer, seq_q, seq_k):
    """WAN-scale token counts (832x480x81 frames at 2x2 patches and more) in (B, S, H, D) layout."""
    generator = torch.Generator(device="cuda").manual_seed(seq_q)
    q = make_inputs(1, 2, seq_q, 128, torch.bfloat16, "bshd", generator)
    k = make_inputs(1, 2, seq_k, 128, torch.bfloat16, "bshd", generator)
    v = make_inputs(1, 2, seq_k, 128, torch.bfloat16, "bshd", generator)
    out, lse = ops.flash_attention_forward(q, k, v)
    ref, ref_lse = attention_fp64(q, k, v)
    assert max_error(out, ref) <= 2 * max_error(sdpa_math(q, k, v), ref)
    assert max_error(lse, ref_lse) < 1e-3 * math.log(seq_k)


def test_output_keeps_query_layout(emulated_layer):
    generator = torch.Generator(device="cuda").manual_seed(3)
    q = make_inputs(2, 3, 40, 64, torch.float16, "bshd", generator)
    out, _ = ops.flash_attention_forward(q, q, q)
    assert out.stride() == q.stride()
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("seq_k", [300, 1000])
def test_bfloat16_values_near_the_top_of_the_range(emulated_layer, seq_k):
    """V near the largest bfloat16 values, a few hundred keys: the unnormalised float32 output sum
    (about seq_k x 2e36 with even weights) must not overflow where SDPA's math path stays finite."""
    generator = torch.Generator(device="cuda").manual_seed(seq_k)
    shape = 1, 2, seq_k, 64
    q = torch.randn(1, 2, 50, 64, device="cuda", generator=generator).mul(0.1).bfloat16()
    k = torch.randn(*shape, device="cuda", generator=generator).mul(0.1).bfloat16()
    v = torch.rand(*shape, device="cuda", generator=generator).add(0.5).mul(2e36).bfloat16()
    out, lse = ops.flash_attention_forward(q, k, v)
    baseline = sdpa_math(q, k, v)
    ref, ref_lse = attention_fp64(q, k, v)
    assert torch.isfinite(baseline).all(), "precondition: SDPA math is finite here"
    assert torch.isfinite(out).all(), "finite inputs, finite SDPA output, non-finite kernel output"
    assert max_error(out, ref) <= 2 * max_error(baseline, ref)
    assert max_error(lse, ref_lse) < 1e-3 * math.log(seq_k)


@pytest.mark.parametrize("mask", ["none", "key padding", "bias"])
@pytest.mark.parametrize("rise", [-3.0, 3.0])
@pytest.mark.parametrize("head_dim", [128, 160])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_maxima_met_late_or_never(emulated_layer, mask, rise, head_dim, dtype):
    """Scores falling by 3 (base 2) per 64 keys: the first tile holds every row's maximum and the wave
    skips the rescale of every later one (the traits' skips_rescale: head dims 128-160, 64- and 32-key
    tiles); rising by 3: new maxima keep coming, every 64 keys at least. bf16 V near the top of its
    range, so that a missed or doubled rescale cannot hide. Each mask runs its own tile loop (key
    biases staged per tile, or read per score)."""
    generator = torch.Generator(device="cuda").manual_seed(int(rise) + head_dim + len(mask))
    seq_k = 600
    q, k = rising_scores(2, 2, 50, seq_k, head_dim, rise, dtype, generator)
    if dtype == torch.bfloat16:
        v = torch.rand(2, 2, seq_k, head_dim, device="cuda", generator=generator).add(0.5).mul(2e38).bfloat16()
    else:
        v = torch.randn(2, 2, seq_k, head_dim, device="cuda", generator=generator, dtype=dtype)
    attn_mask = None
    if mask == "key padding":
        attn_mask = torch.zeros(2, 1, 1, seq_k, device="cuda", dtype=dtype)
        attn_mask[0, ..., -5:] = float("-inf")
    elif mask == "bias":
        attn_mask = torch.randn(1, 2, 50, seq_k, device="cuda", generator=generator).to(dtype)
    out, lse = ops.flash_attention_forward(q, k, v, attn_mask=attn_mask)
    baseline = sdpa_math(q, k, v, attn_mask=attn_mask)
    ref, ref_lse = attention_fp64(q, k, v, attn_mask=attn_mask)
    assert torch.isfinite(baseline).all(), "precondition: SDPA math is finite here"
    assert torch.isfinite(out).all(), "finite inputs, finite SDPA output, non-finite kernel output"
    assert max_error(out, ref) <= 2 * max_error(baseline, ref)
    assert max_error(lse, ref_lse) < 1e-3 * math.log(seq_k)


@pytest.mark.parametrize("mask", ["none", "key padding", "bias"])
@pytest.mark.parametrize("overflow_key", [100, 140], ids=("a-tile-follows", "in-the-last-tile"))
@pytest.mark.parametrize("head_dim", [64, 128, 160])
def test_a_score_overflowing_with_the_scale_gives_nan_as_sdpa(emulated_layer, mask, overflow_key, head_dim):
    """One key's score is finite in bf16, its product with the scale (4) is not: SDPA's rows are NaN, and
    so are the kernel's, whether a key tile follows the one holding that key or not, with the rescale
    skip (d128, d160) and without it (d64), in every tile loop."""
    generator = torch.Generator(device="cuda").manual_seed(overflow_key + head_dim)
    q = torch.zeros(1, 2, 17, head_dim, device="cuda", dtype=torch.bfloat16)
    q[..., 0] = 1.7e19
    k, v = (torch.randn(1, 2, 150, head_dim, device="cuda", generator=generator).bfloat16() for _ in range(2))
    k[..., overflow_key, 0] = 1.7e19
    attn_mask = None
    if mask == "key padding":
        attn_mask = torch.zeros(1, 1, 1, 150, device="cuda", dtype=torch.bfloat16)
        attn_mask[..., -3:] = float("-inf")
    elif mask == "bias":
        attn_mask = torch.randn(1, 2, 17, 150, device="cuda", generator=generator).bfloat16()
    out, _ = ops.flash_attention_forward(q, k, v, attn_mask=attn_mask, scale=4.0)
    assert torch.isnan(sdpa_math(q, k, v, False, 4.0, attn_mask=attn_mask)).all(), "precondition: SDPA gives NaN"
    assert torch.isnan(out).all()


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_and_zero_scale(emulated_layer, scale, causal, dtype):
    """The kernel takes row maxima of the raw scores and folds a negative scale into Q; a zero scale
    must still give masked keys zero weight. 77 keys: an open tile and a masked one."""
    generator = torch.Generator(device="cuda").manual_seed(77)
    q, k, v = (make_inputs(2, 2, 77, 72, dtype, "bhsd", generator) for _ in range(3))
    out, lse = ops.flash_attention_forward(q, k, v, causal, scale)
    ref, ref_lse = attention_fp64(q, k, v, causal, scale)
    assert max_error(out, ref) <= 2 * max_error(sdpa_math(q, k, v, causal, scale), ref)
    assert max_error(lse, ref_lse) < 1e-3 * math.log(77)
