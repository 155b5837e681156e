"""The backward kernels through the emulation of both AMD layers, against fp64 gradients.

Three cases in four run through autograd, where the training forward saves O's remainder and its row
statistics and dQ sweeps the keys once; the fourth from the lse alone (two dQ sweeps). Each of dq, dk,
dv must meet FlashAttention-2's own criterion: max error against fp64 at most 2x
that of the same attention computed in the input dtype (flash-attn's attention_ref(upcast=False)),
plus flash-attn's absolute floor of 1e-5 (fresh random inputs per case). The ratio to PyTorch's math SDPA
gradients' error (which upcasts to fp32: a stricter yardstick) is recorded beside it, so the
precision the criterion leaves unused stays visible. Set RDNA_FA_BWD_GRID_REPORT=path.json to record
the grid's summary.
"""

import json
import os
import random
import time

import pytest
import torch

from rdna_flash_attn.runtime import variants
from rdna_flash_attn.ops import attention, plans
from rdna_flash_attn.ops.autograd import flash_attention

from rdna_fa_lab.attention_reference import backward_bound, grads_fp64, grads_input_dtype, grads_sdpa_math, max_error
from .test_forward import make_inputs

CASES_PER_LAYER = 1000
SEQ_LENGTHS = (1, 2, 7, 16, 17, 33, 64, 65, 77, 100, 128, 154, 257, 333, 600)
REQUIRED_HEAD_DIMS = (40, 80, 160, 512)


def _grid(seed=20261123):
    rng = random.Random(seed)
    cases = []
    for index in range(CASES_PER_LAYER):
        head_dim = REQUIRED_HEAD_DIMS[index % 4] if index % 2 else rng.choice(variants.SUPPORTED_HEAD_DIMS)
        seq_k = 77 if index % 10 == 0 else rng.choice(SEQ_LENGTHS)
        cases.append(dict(
            index=index, dtype=(torch.float16, torch.bfloat16)[(index // 2) % 2], head_dim=head_dim,
            seq_q=rng.choice(SEQ_LENGTHS), seq_k=seq_k, batch=rng.randint(1, 2), heads=rng.randint(1, 3),
            layout=rng.choice(("bhsd", "bshd", "strided")), causal=rng.random() < 0.35,
            scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5)))
    return cases


GRID = _grid()
_results: list[dict] = []


def _inputs(case, layer):
    generator = torch.Generator(device="cuda").manual_seed(5000 + case["index"] + (0 if layer == "gfx11" else 3))
    shape = case["batch"], case["heads"]
    q = make_inputs(*shape, case["seq_q"], case["head_dim"], case["dtype"], case["layout"], generator)
    k = make_inputs(*shape, case["seq_k"], case["head_dim"], case["dtype"], case["layout"], generator)
    v = make_inputs(*shape, case["seq_k"], case["head_dim"], case["dtype"], case["layout"], generator)
    dout = torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=generator)
    return q, k, v, dout


def record_gradient(record: dict, name: str, grad, ref, sdpa_math_grad, input_dtype_grad) -> None:
    """The gradient's errors against fp64 (its own, math SDPA's, the input-dtype attention's), the
    FlashAttention-2 bound and both ratios, into `record`."""
    error, sdpa_error, input_dtype_error = (max_error(g, ref) for g in (grad, sdpa_math_grad, input_dtype_grad))
    bound = backward_bound(input_dtype_error)
    record.update({f"{name}_error": error, f"{name}_sdpa_math_error": sdpa_error,
                   f"{name}_input_dtype_error": input_dtype_error, f"{name}_bound": bound,
                   f"{name}_ratio": error / max(sdpa_error, 1e-12), f"{name}_fa2_ratio": error / bound})


def _kernel_grads(q, k, v, dout, causal, scale):
    """Through autograd: the training forward saves its statistics and dQ sweeps the keys once."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, causal, scale)
    return torch.autograd.grad(out, (q, k, v), dout)


def _kernel_grads_two_sweeps(q, k, v, dout, causal, scale):
    """From the lse alone (flash-attn's `_flash_attn_backward` callers): dQ sums delta in a first sweep."""
    q, k, v, dout = (attention.kernel_layout(t) for t in (q, k, v, dout))
    _, lse = attention.flash_attention_forward(q, k, v, causal, scale)
    return attention.flash_attention_backward(dout, q, k, v, lse, causal, scale)


@pytest.mark.parametrize("case", GRID, ids=lambda c: "{index}-{head_dim}-{seq_q}x{seq_k}-{layout}".format(**c))
def test_backward_matches_fp64(case, emulated_layer):
    start = time.perf_counter()
    q, k, v, dout = _inputs(case, emulated_layer)
    two_sweeps = case["index"] % 4 == 3
    grads = (_kernel_grads_two_sweeps if two_sweeps else _kernel_grads)(q, k, v, dout, case["causal"], case["scale"])
    reference = grads_fp64(q, k, v, dout, case["causal"], case["scale"])
    baseline = grads_sdpa_math(q, k, v, dout, case["causal"], case["scale"])
    input_dtype = grads_input_dtype(q, k, v, dout, case["causal"], case["scale"])
    record = dict(layer=emulated_layer, dq_sweeps=2 if two_sweeps else 1,
                  **{key: str(value) for key, value in case.items()})
    for name, grad, ref, base, low in zip(("dq", "dk", "dv"), grads, reference, baseline, input_dtype):
        assert grad.dtype == case["dtype"] and grad.shape == ref.shape
        assert torch.isfinite(grad).all(), f"{name} not finite"
        record_gradient(record, name, grad, ref, base, low)
    record["seconds"] = time.perf_counter() - start
    _results.append(record)
    for name in ("dq", "dk", "dv"):
        assert record[f"{name}_error"] <= record[f"{name}_bound"], \
            f"{name}: {record[f'{name}_error']:.3e} > {record[f'{name}_bound']:.3e}"


@pytest.fixture(scope="module", autouse=True)
def grid_report():
    yield
    path = os.environ.get("RDNA_FA_BWD_GRID_REPORT")
    if path and _results:
        worst = {name: max(_results, key=lambda r: r[f"{name}_fa2_ratio"]) for name in ("dq", "dk", "dv")}
        worst_sdpa = {name: max(r[f"{name}_ratio"] for r in _results) for name in ("dq", "dk", "dv")}
        summary = dict(cases=len(_results), seconds=sum(r["seconds"] for r in _results),
                       criterion="FlashAttention-2: error <= 2 x input-dtype attention's error + 1e-5",
                       worst_fa2_ratio={name: r[f"{name}_fa2_ratio"] for name, r in worst.items()},
                       worst_sdpa_math_ratio=worst_sdpa, worst_case=worst,
                       device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(path, "w") as file:
            json.dump(dict(summary=summary, cases=_results), file)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (160, True), (512, False)])
def test_backward_is_bitwise_deterministic(emulated_layer, head_dim, causal):
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q = make_inputs(2, 3, 333, head_dim, torch.bfloat16, "bshd", generator)
    k = make_inputs(2, 3, 257, head_dim, torch.bfloat16, "bshd", generator)
    v = make_inputs(2, 3, 257, head_dim, torch.bfloat16, "bshd", generator)
    dout = torch.randn(q.shape, dtype=q.dtype, device="cuda", generator=generator)
    first = _kernel_grads(q, k, v, dout, causal, None)
    for _ in range(4):
        again = _kernel_grads(q, k, v, dout, causal, None)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_gradients_keep_input_layouts(emulated_layer):
    generator = torch.Generator(device="cuda").manual_seed(11)
    q = make_inputs(1, 2, 40, 64, torch.float16, "bshd", generator)
    k = make_inputs(1, 2, 77, 64, torch.float16, "bhsd", generator)
    dq, dk, dv = _kernel_grads(q, k, k, torch.randn_like(q), False, None)
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == k.stride()


@pytest.mark.parametrize("head_dim, masked", [(48, False), (64, False), (128, False), (64, True), (128, True)])
def test_the_widest_sequence_stride_admitted_gives_the_compact_inputs_gradients(emulated_layer, head_dim, masked):
    """The tile copies address rows as 32-bit byte offsets from the tile's first row (kernels/tiles.h): at
    the largest sequence stride the dispatch admits (2^23 - 8 elements, 16 MiB between rows), a 64-row
    tile's offsets reach about 2^30 bytes. d48's copies take each lane's offset over the whole tile (its
    threads do not cover whole rows); d64 and d128 step rows in the uniform base; the masked kernels
    include gfx11's d128 dK/dV, which keeps 64-bit addresses. The gradients must be those of the same
    values laid out compactly, bit for bit (the addressing changes no arithmetic). 300 rows: the rows
    left past a tile's start reach past 2^32 bytes, so a clamp of the rows to the sequence (the fused
    dK/dV copies' repeated edges) must stay within the tile."""
    stride = plans.MAX_SEQ_STRIDE - 8
    seq = 300  # whole 64-row tiles and a tail
    generator = torch.Generator(device="cuda").manual_seed(head_dim)

    def wide(values):
        rows = torch.empty((seq, stride), dtype=values.dtype, device="cuda")
        rows[:, :head_dim] = values
        return rows[:, :head_dim].unsqueeze(0).unsqueeze(0)

    compact = [torch.randn((seq, head_dim), dtype=torch.float16, device="cuda", generator=generator)
               for _ in range(4)]
    q, k, v, dout = (wide(t) for t in compact)
    assert q.stride(2) == stride and isinstance(plans.plan_forward(q, k, v), plans.ForwardPlan)
    mask = (torch.arange(seq, device="cuda") < seq - 9).view(1, 1, 1, seq) if masked else None

    def grads(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(flash_attention(q, k, v, True, None, attn_mask=mask), (q, k, v), dout)

    expected = grads(*(t.view(1, 1, seq, head_dim) for t in compact))
    got = grads(q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
