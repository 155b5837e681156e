"""Host work per small attention call (bench/small_calls.py): the launches, other device work,
host-device syncs and Python calls of a 77-token cross-attention, exact and in 8 bits, through the
ComfyUI node and through the patched SDPA, on the CPU stand-in of an RDNA4 GPU. Counts only: a change
that adds a launch, an aten op or a sync to these calls fails here."""

from __future__ import annotations

import pytest
import torch

import rdna_flash_attn
from bench import small_calls
from rdna_fa_lab.stand_in import stand_in_gpu

SHAPE = small_calls.Shape("small-cross", 2, 2, 64, 77, 40)
# (launches, device ops, allocations, syncs) per call. Exact: the forward, its output and lse. 8-bit: the
# accuracy statistics (24 aten ops, one read back), K and V's quantizing pass (stats, codes) and the
# attention; the pass's six buffers and the output.
EXPECTED = {"exact": (1, 0, 2, 0), "8bit-qkpv": (3, 24, 7, 1)}
KERNELS = {"exact": ["rdna_fa_fwd_f16_d48"],
           "8bit-qkpv": ["rdna_fa_quant8_stats_f16_d48", "rdna_fa_quant8_codes_f16_d48", "rdna_fa_fwd8_f16_d48"]}
# Python functions entered per repeated call, torch's Python wrappers included.
MAX_PYTHON_CALLS = {("comfyui", "exact"): 36, ("sdpa", "exact"): 21, ("comfyui", "8bit-qkpv"): 62,
                    ("sdpa", "8bit-qkpv"): 47}


@pytest.mark.parametrize("precision", small_calls.PRECISIONS)
@pytest.mark.parametrize("route", small_calls.ROUTES)
def test_counts_per_small_call(node_package, route, precision):
    q, k, v = small_calls.inputs(SHAPE)
    with stand_in_gpu(small_calls.TARGET, interpret=False) as gpu, rdna_flash_attn.patch_sdpa(), torch.no_grad():
        call = small_calls.route_call(route, precision, SHAPE, q, k, v, node_package)
        call()  # the first call plans
        rdna_flash_attn.reset_stats()
        counted = small_calls.counts(call, gpu)
    assert (counted["launches"], counted["device_ops"], counted["allocations"], counted["syncs"]) == \
        EXPECTED[precision], counted
    assert counted["kernels"] == KERNELS[precision]
    assert counted["python_calls"] <= MAX_PYTHON_CALLS[route, precision], counted
    assert rdna_flash_attn.stats()["kernel_8bit" if precision == "8bit-qkpv" else "kernel"] == 2  # counted twice
