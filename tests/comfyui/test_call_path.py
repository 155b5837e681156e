"""The path of a ComfyUI attention call's query, from the node's override to the kernel launch: a
structural bound on the Python functions it passes through (tests/call_path.py), with the launch really
made, on the CPU interpreter of the gfx1100 code object."""

from __future__ import annotations

import pytest
import torch

import rdna_flash_attn

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from rdna_fa_lab.stand_in import stand_in_gpu  # noqa: E402

from ..call_path import query_path  # noqa: E402

MAX_STOPS = 15  # the first call plans every check at the entry; a repeated one finds its plan cached


def test_a_comfyui_call_reaches_the_launch_within_15_stops(node_package):
    from comfy.ldm.modules import attention

    options = {}
    node_package.model_patch.install_override(options, node_package.routing.RoutingOptions())
    override = options["optimized_attention_override"]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2 * 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    outputs = []

    def host_call():
        outputs.append(attention.optimized_attention(q, k, v, 2, transformer_options=options))

    with stand_in_gpu("gfx1100") as gpu:
        paths = [query_path(host_call, q, entry=override.__code__, library=gpu) for _ in range(2)]
    for path in paths:
        assert path.launched and len(path.stops) <= MAX_STOPS, path.summary()
    assert rdna_flash_attn.stats()["kernel"] == 2
    assert [launch[0] for launch in gpu.launches] == ["rdna_fa_fwd_bf16_d64"] * 2
    expected = attention.optimized_attention(q, k, v, 2, transformer_options={})
    torch.testing.assert_close(outputs[0].float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(outputs[0], outputs[1])
