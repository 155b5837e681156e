"""yunchang's own ring and Ulysses attention (yunchang==0.6.4, what xDiT builds on) driven by 2 processes
with gloo on the CPU, `import flash_attn` finding our stand-in: the control flow of both (ring: the
private pair per chunk, outputs merged by lse, the backward from the merged out and lse; Ulysses: the
all-to-alls around flash_attn_func) and our CPU fallback, against one attention over the whole sequence, by
FlashAttention-2's criterion: the forward within 2x the error of the same attention computed in the input
dtype against fp64, each gradient within 2x that attention's gradient error plus the roundings summing
partial gradients adds (attention_reference.summed_backward_bound)."""

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
SHIM_DIR = REPO_ROOT / "rdna_flash_attn" / "integrations" / "flash_attn_shim"

# Roundings of a gradient to bfloat16 beyond one attention's: yunchang's ring adds each rank's chunk
# gradient as flash-attn returns it (bfloat16) and casts the sum; Ulysses runs one attention per head group.
ROUNDINGS = {"ring": 2 + 1, "ulysses": 0}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("yunchang") is None,
                                reason="yunchang is not installed (dev/test.sh installs yunchang==0.6.4 --no-deps)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What rank 0 of the two processes saved."""
    folder = tmp_path_factory.mktemp("yunchang")
    env = {name: value for name, value in os.environ.items() if not name.startswith("RDNA_FA_")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, (REPO_ROOT, SHIM_DIR))), RDNA_FA_CACHE_DIR=str(folder / "cache"))
    results = folder / "results.pt"
    child = subprocess.run([sys.executable, "-m", "tests.sequence_parallel.yunchang_ranks", str(results),
                            str(case_seed("yunchang"))], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(results)


def test_yunchang_imports_the_stand_in(ranks):
    assert Path(ranks["flash_attn"]).is_relative_to(SHIM_DIR) and ranks["flash_attn_version"] == "2.8.3"
    assert ranks["yunchang"] == "0.6.4"


@pytest.mark.parametrize("function", ["ring", "ulysses"])
@pytest.mark.parametrize("causal", [False, True])
def test_yunchang_on_two_processes_matches_one_attention(ranks, function, causal):
    q, k, v, dout = (t.transpose(1, 2) for t in ranks["inputs"])  # (batch, heads, tokens, head dim)
    result = {name: t.transpose(1, 2) for name, t in ranks["results"][function, causal].items()}
    check_against_one_attention(result["out"], [result[name] for name in "qkv"], q, k, v, dout, causal,
                                ROUNDINGS[function])
