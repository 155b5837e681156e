"""torch's context parallelism (its ring templates) on 2 gloo processes, with the shipped code objects run
by the CPU interpreter serving the aten flash ops (tests/sequence_parallel/context_parallel_ranks.py),
against one attention over the whole sequence by FlashAttention-2's criterion (the forward within 2x the
error of the same attention computed in the input dtype against fp64; each gradient within 2x that
attention's gradient error plus the roundings summing partial gradients adds); every chunk on the kernels."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from ..ring_checks import check_against_one_attention
from ..seeds import case_seed

REPO_ROOT = Path(__file__).resolve().parents[2]
RANKS = 2

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None,
                       reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)"),
    pytest.mark.skipif(not hasattr(torch.library, "get_kernel"),
                       reason="serving the aten ops needs torch.library.get_kernel (PyTorch 2.9 or newer)"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("context_parallel")
    env = {name: value for name, value in os.environ.items() if not name.startswith("RDNA_FA_")}
    env.update(PYTHONPATH=str(REPO_ROOT))
    results = folder / "results.pt"
    child = subprocess.run([sys.executable, "-m", "tests.sequence_parallel.context_parallel_ranks", str(results),
                            str(case_seed("context parallel")), "gfx1201"], env=env, cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(results)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_context_parallel_runs_on_the_code_objects(ranks, causal):
    q, k, v, dout = ranks["inputs"]
    result = ranks["results"][causal]
    for launches, kernel_calls, fallbacks in (counts.tolist() for counts in result["launches_kernel_calls_fallbacks"]):
        # each chunk call: its forward launch, and dQ and dK/dV for its backward
        assert fallbacks == 0 and kernel_calls > 0 and launches == 3 * kernel_calls // 2
    # torch's ring sums each rank's chunk gradient as the op returns it (bfloat16) and casts the sum
    check_against_one_attention(result["out"], [result[name] for name in "qkv"], q, k, v, dout, causal, RANKS + 1)
