"""The backward pricing of bench/estimate_external.py (the held-out tutorial `_attn_bwd` case): trip counts
from the shape and causal structure, WMMAs per trip from the block sizes, and the FLOPs as the tutorial's
benchmark counts them. Pure arithmetic: no code object, no objdump."""

from bench import estimate_external

CFG = {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "BLK_SLICE_FACTOR": 2}


def test_backward_loops_cover_the_causal_triangle_once_each():
    seq, d, waves = 16384, 64, 4
    loops = estimate_external.tutorial_backward_loops(CFG, seq, d, waves)
    assert [lp["wmma_per_wave_trip"] for lp in loops] == [32, 64, 24, 48]
    assert [lp["trips_per_workgroup"] for lp in loops] == [8, 254.0, 8, 254.0]
    # dK/dV: per workgroup, 128 keys x (its diagonal block + every later query row) = the causal
    # triangle plus the diagonal blocks' upper halves; the same for dQ
    blocks = seq // CFG["BLOCK_N1"]
    rows_dkdv = blocks * sum(lp["trips_per_workgroup"] * lp["rows_per_trip"] for lp in loops[:2])
    rows_dq = blocks * sum(lp["trips_per_workgroup"] * lp["rows_per_trip"] for lp in loops[2:])
    triangle = seq * (seq + CFG["BLOCK_N1"]) / 2 / CFG["BLOCK_N1"]  # query rows per key block, summed
    assert rows_dkdv == rows_dq == triangle


def test_published_flops_follow_the_tutorial_benchmark():
    case = {"shape": [4, 48, 16384, 64], "mode": "bwd", "causal": True}
    assert estimate_external.published_flops(case) == 2.5 * 0.5 * 2 * (2.0 * 4 * 48 * 16384 ** 2 * 64)
    assert estimate_external.published_flops({"shape": [2, 16, 8192, 128]}) == 4.0 * 2 * 16 * 8192 ** 2 * 128
