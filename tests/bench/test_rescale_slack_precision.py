"""bench/rescale_slack_precision.py: its CPU model is the shipped forward's arithmetic, and a run writes its
record and plot."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import rescale_slack_precision as study
from rdna_fa_lab.interpreter import InterpretedLibrary
from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.runtime import loader as runtime


def units_in_the_last_place(x: torch.Tensor) -> torch.Tensor:
    """The spacing of x's 16-bit dtype at each element's magnitude (its subnormal spacing near zero)."""
    mantissa_bits, smallest = (10, 2.0 ** -24) if x.dtype == torch.float16 else (7, 2.0 ** -133)
    _, exponent = torch.frexp(x.float())
    return torch.exp2((exponent - 1 - mantissa_bits).double()).clamp_min(smallest)


@pytest.mark.parametrize("target, dtype, head_dim, seq_q, seq_k, causal", [
    ("gfx1201", torch.float16, 64, 33, 130, False), ("gfx1201", torch.bfloat16, 128, 17, 150, True),
    ("gfx1100", torch.float16, 40, 20, 77, False), ("gfx1100", torch.bfloat16, 160, 17, 100, False)])
def test_the_model_is_the_shipped_forwards_arithmetic(target, dtype, head_dim, seq_q, seq_k, causal):
    """With no slack the model gives the shipped code object's output (the CPU interpreter's) bit for bit in
    nearly every element, and the rest within one unit in the last place of their row's largest element (the
    WMMA's summation order)."""
    generator = torch.Generator().manual_seed(head_dim + seq_k)
    q, k, v = (torch.randn(1, 2, n, head_dim, generator=generator).to(dtype) for n in (seq_q, seq_k, seq_k))
    with runtime.explicit_library(InterpretedLibrary.for_target(target)):
        kernel, _ = ops.flash_attention_forward(q, k, v, causal)
    model = study.modelled_forward(q, k, v, causal, 1 / math.sqrt(head_dim), 0)
    difference = (kernel.double() - model.double()).abs()
    assert (difference == 0).double().mean() >= 0.97
    assert (difference <= units_in_the_last_place(kernel.abs().amax(-1, keepdim=True))).all()


def test_a_run_writes_the_record_and_the_plot(tmp_path):
    study.main(["--cases", "4", "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")])
    record = json.loads((tmp_path / "r.json").read_text())
    assert len(record["rows"]) == 4 and set(record["summary"]) == {"0", "8"}
    assert all(set(row["ratio_by_slack"]) == {"0", "8"} for row in record["rows"])
    assert (tmp_path / "r.png").stat().st_size > 0
