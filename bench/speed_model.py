"""The speed model in named cycle terms (rdna_fa_lab/speed_model.py) fitted on published measurements of
other kernels, checked on held-out ones, and our forward kernels against the targets at each anchor's own
shape, with their non-WMMA cycles per 16x64 tile against the budgets. Not a measurement of ours.

    python -m bench.speed_model --json bench/results/speed_model.json --md bench/results/speed_model.md \
        --png bench/results/speed_model.png
    python -m bench.speed_model --check bench/results/speed_model.json   # exit 1 if the record differs

Reads three records: bench/results/estimator_calibration.json (the external kernels' per-wave counts,
tallied from their own instruction streams by bench/estimate_external.py),
bench/results/forward_estimate_gfx1100.json and backward_estimate_gfx1100.json (ours,
bench/estimate_gfx1100.py and bench/estimate_gfx1100_backward.py). The stall allowance is
fitted per ISA on the kernels marked "fit" below; every other measured row is held out. A held-out row
whose kernel has no stream of its own here says whose stream stands in for it. stall_bands() gives that
band to the estimates priced in the same terms: the backward (bench/estimate_gfx1100_backward.py, whose
record this reads back), the masked and packed (bench/estimate_masked.py) and the 8-bit forward
(bench/estimate_8bit.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.estimate_external import published_flops
from rdna_fa_lab import speed_model as sm
from rdna_fa_lab.throughput_estimate import HARDWARE, SIMDS_PER_CU
from rdna_flash_attn.runtime import variants

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "bench" / "results" / "estimator_calibration.json"
FORWARD = REPO / "bench" / "results" / "forward_estimate_gfx1100.json"
BACKWARD = REPO / "bench" / "results" / "backward_estimate_gfx1100.json"

GCNASM_V201 = "https://github.com/carlushuang/gcnasm/pull/32"
GCNASM_V201_README = ("https://github.com/carlushuang/gcnasm/blob/ac57f91e87b99ccaa822a9e5012a5326ff201a5a/"
                      "opus_attn_gfx1201/README_v201_asm.md")
# (label, the calibration record whose counts it uses, shape B x H x S x d, measured TFLOP/s, role, source)
MEASURED = (
    ("gcnasm v201 (assembly)", "gcnasm v201 (hand-written assembly)", (1, 32, 1536, 128), 117.9, "fit",
     f"{GCNASM_V201} table, RX 9070 XT, ROCm 7.2.3, bf16, best of 8"),
    ("gcnasm v153 (HIP)", "gcnasm v153 (HIP)", (4, 32, 4096, 128), 94.8, "fit",
     "https://github.com/carlushuang/gcnasm/pull/30, RX 9070 XT, ROCm 7.2.3, bf16, best of 7"),
    ("aiter Triton fwd_prefill", "aiter Triton flash attention (fwd_prefill)", (2, 16, 8192, 128), 60.84, "fit",
     "https://github.com/ROCm/aiter/pull/2397, RX 7900 XTX, f16 (assumed)"),
    ("gcnasm v153 (HIP)", "gcnasm v153 (HIP)", (1, 32, 2048, 128), 91.6, "held out",
     "https://github.com/carlushuang/gcnasm/pull/29, RX 9070 XT, bf16, verification on"),
    ("gcnasm v66 (v63's stream at 448 rows)", "gcnasm v63, 448 rows (HIP; v66 stand-in)", (1, 32, 2048, 128), 102.8,
     "held out", "https://github.com/carlushuang/gcnasm/pull/24 'BLOCK_M sweep (v66)', RX 9070 XT, bf16"),
    ("gcnasm v66 (v63's stream at 384 rows)", "gcnasm v63, 384 rows (HIP; v66 stand-in)", (1, 8, 4096, 128), 102.0,
     "held out", "https://github.com/carlushuang/gcnasm/pull/24 'BLOCK_M sweep (v66)', RX 9070 XT, bf16"),
    ("gcnasm v66 (v63's stream at 128 rows)", "gcnasm v63, 128 rows (HIP; v66 stand-in)", (1, 32, 2048, 128), 82.3,
     "held out", "https://github.com/carlushuang/gcnasm/pull/24 'BLOCK_M sweep (v66)', RX 9070 XT, bf16"),
    ("gcnasm v88 (v201's stream)", "gcnasm v201 (hand-written assembly)", (1, 32, 1536, 128), 113.5, "held out",
     f"{GCNASM_V201_README}: v88, v201's parent (same loop, more load waits), RX 9070 XT, bf16"),
    ("gcnasm v88 (v201's stream)", "gcnasm v201 (hand-written assembly)", (1, 32, 3072, 128), 106.7, "held out",
     f"{GCNASM_V201_README}, v88 at N=3072"),
    ("gcnasm v88 (v201's stream)", "gcnasm v201 (hand-written assembly)", (1, 32, 6144, 128), 99.7, "held out",
     f"{GCNASM_V201_README}, v88 at N=6144"),
    ("gcnasm v201 (assembly)", "gcnasm v201 (hand-written assembly)", (1, 32, 3072, 128), 106.4, "held out",
     f"{GCNASM_V201_README}, an earlier state of v201 at N=3072"),
    ("gcnasm v201 (assembly)", "gcnasm v201 (hand-written assembly)", (1, 32, 6144, 128), 99.7, "held out",
     f"{GCNASM_V201_README}, an earlier state of v201 at N=6144"),
    ("Triton tutorial _attn_bwd (backward)", "Triton tutorial _attn_bwd (backward)", (4, 48, 16384, 64), 18.24,
     "held out", "lhl's W7900 notes (AUGMXNT/llm-tracker.info-vault), Radeon PRO W7900 (gfx1100), f16, causal"),
    ("Triton tutorial _attn_bwd, 1 stage", "Triton tutorial _attn_bwd, 1 stage (variant)", (4, 48, 16384, 64), 18.24,
     "held out", "the same measurement, against Triton's 1-stage build of the same source"),
)

# Published figures no stream of which is built here (kernel, target, what, shape, TFLOP/s low-high, source).
UNMODELLED = (
    ("AOTriton 0.14 FlyDSL forward", "gfx1201", "forward d64-d192", (1, 8, 4096, None), (90.0, 102.0),
     "AOTriton 0.14's gfx1201 tuning files (measured sweeps); 92.5 at d128 f16"),
    ("AOTriton 0.14 FlyDSL backward (dK/dV + dQ)", "gfx1201", "backward d128, flash-attention's FLOP count",
     (1, 8, 4096, 128), (53.0, 60.0), "AOTriton 0.14's gfx1201 tuning files"),
    ("FlyDSL (aiter PR #4188)", "gfx1201", "forward bf16 d128", (1, 24, 4096, 128), (99.8, 99.8),
     "https://github.com/ROCm/aiter/pull/4188"),
    ("gcnasm v139 (HIP)", "gfx1201", "forward bf16 d128", (4, 32, 4096, 128), (93.5, 93.5),
     "https://github.com/carlushuang/gcnasm/pull/31, RX 9070 XT, best of 7"),
    ("PyTorch SDPA, torch 2.14 (AOTriton 0.13b)", "gfx1201", "forward d128", None, (66.0, 69.0),
     "Boffee/piper-kernels' RX 9070 XT runs"),
    ("Piper int8", "gfx1201", "forward, TFLOP/s-equivalent", None, (131.0, 138.0),
     "Boffee/piper-kernels at MiniMax H3 shapes"),
    ("PyTorch SDPA (AOTriton) / comfy-kitchen int8", "gfx1100", "forward d128", None, (66.0, 67.0),
     "DESIGN.md section 3 (no reproducible shape)"),
    ("CK WMMA (ROCm/flash-attention navi branch)", "gfx1100", "forward f16 d64", (4, 32, 4096, 64), (42.1, 47.6),
     "https://github.com/ROCm/flash-attention/issues/27 (7900 XTX)"),
    ("Triton tutorial forward", "gfx1100", "forward f16 d64 non-causal", (1, 8, 16384, 64), (25.5, 25.5),
     "https://github.com/ROCm/aotriton/issues/16 (7900 XTX, WSL)"),
    ("Triton tutorial backward", "gfx1100", "backward f16 d64 causal", (1, 8, 16384, 64), (24.9, 24.9),
     "https://github.com/ROCm/aotriton/issues/16 (7900 XTX): the best published gfx1100 backward"),
)

# The anchors: published measurements, and our forward at each one's shape where it is published
# (label, target, dtype of ours, shape or None, measured TFLOP/s low-high, source).
ANCHORS = (
    ("gcnasm v201 (assembly)", "gfx1201", "bf16", (1, 32, 1536, 128), (117.9, 117.9), GCNASM_V201),
    ("AOTriton 0.14 FlyDSL, d128 f16", "gfx1201", "f16", (1, 8, 4096, 128), (92.5, 92.5),
     "AOTriton 0.14's gfx1201 tuning files"),
    ("AOTriton 0.14 FlyDSL, d64 (d64-d192 range)", "gfx1201", "f16", (1, 8, 4096, 64), (90.0, 102.0),
     "AOTriton 0.14's gfx1201 tuning files"),
    ("FlyDSL (aiter PR #4188)", "gfx1201", "bf16", (1, 24, 4096, 128), (99.8, 99.8),
     "https://github.com/ROCm/aiter/pull/4188"),
    ("gcnasm v153 (HIP)", "gfx1201", "bf16", (4, 32, 4096, 128), (94.8, 94.8),
     "https://github.com/carlushuang/gcnasm/pull/30"),
    ("PyTorch SDPA, torch 2.14 (AOTriton 0.13b), d128", "gfx1201", "bf16", None, (66.0, 69.0),
     "Boffee/piper-kernels' RX 9070 XT runs"),
    ("aiter Triton fwd_prefill", "gfx1100", "f16", (2, 16, 8192, 128), (60.84, 60.84),
     "https://github.com/ROCm/aiter/pull/2397"),
    ("CK WMMA (ROCm/flash-attention navi branch)", "gfx1100", "f16", (4, 32, 4096, 64), (42.1, 47.6),
     "https://github.com/ROCm/flash-attention/issues/27"),
    ("PyTorch SDPA (AOTriton) / comfy-kitchen int8, d128", "gfx1100", "f16", None, (66.0, 67.0),
     "DESIGN.md section 3 (no reproducible shape)"),
)

# Targets at each anchor's own shape: (target, dtype, d, shape, anchor label, anchor TFLOP/s low-high, ratio).
TARGETS = (
    ("gfx1201", "bf16", 128, (1, 32, 1536, 128), "gcnasm v201, measured", (117.9, 117.9), 1.1),
    ("gfx1201", "f16", 128, (1, 8, 4096, 128), "AOTriton 0.14 FlyDSL", (92.5, 92.5), 1.3),
    ("gfx1201", "f16", 64, (1, 8, 4096, 64), "AOTriton 0.14 FlyDSL (d64-d192 range)", (90.0, 102.0), 1.3),
    ("gfx1100", "f16", 128, (1, 16, 4096, 128), "best measured gfx1100 (SDPA, comfy-kitchen int8)", (66.0, 67.0), 1.2),
    ("gfx1100", "f16", 64, (1, 16, 4096, 64), "best measured gfx1100 (SDPA, comfy-kitchen int8)", (66.0, 67.0), 1.2),
)
# Backward targets: (target, d, anchor label, anchor TFLOP/s low-high, ratio); ours as training runs it.
BACKWARD_TARGETS = (
    ("gfx1201", 128, "AOTriton 0.14 FlyDSL (dK/dV + dQ, 1x8x4096x128)", (53.0, 60.0), 1.4),
    ("gfx1201", 64, "AOTriton 0.14 FlyDSL (dK/dV + dQ, d128's figure)", (53.0, 60.0), 1.4),
    ("gfx1100", 128, "Triton tutorial backward (causal d64, 7900 XTX), the best published gfx1100", (24.9, 24.9), 2.0),
    ("gfx1100", 64, "Triton tutorial backward (causal d64, 7900 XTX), the best published gfx1100", (24.9, 24.9), 2.0),
)

# Budgets in non-WMMA issue cycles per 16x64 tile: (target, d, budget).
BUDGETS = (("gfx1201", 128, 240.0), ("gfx1100", 128, 300.0), ("gfx1100", 64, 250.0))


def external_rows(calibration: dict) -> list[dict]:
    records = {}
    for record in calibration["kernels"]:
        records.setdefault(record["name"], record)
    rows = []
    for label, name, shape, measured, role, source in MEASURED:
        record = records[name]
        hw = HARDWARE[record["target"]]
        batch, heads, seq, d = shape
        row = {"kernel": label, "record": name, "target": record["target"], "shape": list(shape),
               "measured": measured, "role": role, "source": source, "waves_per_simd": record["waves_per_simd"]}
        if "loops" in record:  # a backward: several loops per workgroup
            row["loops"] = [{"loop": loop["loop"], "trips": loop["trips_per_workgroup"],
                             "counts": loop["counts_per_wave_trip"]} for loop in record["loops"]]
            row["workgroups"] = record["model"]["workgroups"]
            row["waves_per_workgroup"] = record["threads"] // 32
            row["flops"] = published_flops({**record, "shape": list(shape)})
        else:
            counts = record["counts_per_wave_trip"]
            waves = record["threads"] // 32
            row.update(counts=counts, keys_per_trip=counts["wmma"] * 128 // d, head_dim=d,
                       tail=sm.launch_tail(hw, record["waves_per_simd"], waves,
                                           batch * heads * math.ceil(seq / record["rows_per_workgroup"])))
        rows.append(row)
    return rows


def backward_tflops(row: dict, stall: float) -> float:
    """A backward's TFLOP/s: every wave of every workgroup spends its loops' cycles on its SIMD (trips x
    cycles per trip, the terms at 64 keys per trip: one trip)."""
    hw = HARDWARE[row["target"]]
    per_wave = sum(loop["trips"] * sum(sm.tile_terms(loop["counts"], hw, row["waves_per_simd"], sm.TILE_KEYS,
                                                     stall).values()) for loop in row["loops"])
    seconds = row["workgroups"] * row["waves_per_workgroup"] * per_wave / (hw.cus * SIMDS_PER_CU * hw.clock_hz)
    return row["flops"] / seconds / 1e12


def implied(row: dict) -> float | None:
    """The stall share the row's measurement implies; None where none up to sm.MAX_STALL slows the model
    to it (another term binds)."""
    hw = HARDWARE[row["target"]]
    if "loops" in row:
        if backward_tflops(row, sm.MAX_STALL) > row["measured"]:
            return None
        lo, hi = -1.0, sm.MAX_STALL
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if backward_tflops(row, mid) > row["measured"] else (lo, mid)
        return round((lo + hi) / 2, 3)
    stall = sm.implied_stall(row["counts"], hw, row["waves_per_simd"], row["keys_per_trip"], row["head_dim"],
                             row["tail"], row["measured"])
    return None if stall is None else round(stall, 3)


def predict(row: dict, band: dict) -> dict:
    hw = HARDWARE[row["target"]]
    if "loops" in row:
        return {"tflops": {"mid": round(backward_tflops(row, band["mid"]), 1),
                           "low": round(backward_tflops(row, band["high"]), 1),
                           "high": round(backward_tflops(row, band["low"]), 1)}}
    return sm.priced(row["counts"], hw, row["waves_per_simd"], row["keys_per_trip"], row["head_dim"], row["tail"],
                     band)


def fit(rows: list[dict]) -> dict:
    """Per ISA: the stall band over its fit rows."""
    bands = {}
    for target in HARDWARE:
        stalls = [row["implied_stall"] for row in rows if row["target"] == target and row["role"] == "fit"]
        bands[target] = {k: round(v, 3) for k, v in sm.band(stalls).items()}
    return bands


def ranking(rows: list[dict]) -> dict:
    """Per target, the forward rows' ordering by the model (band middle) against the measured one."""
    out = {}
    for target in HARDWARE:
        sel = [r for r in rows if r["target"] == target and "loops" not in r]
        tau, concordant, discordant = sm.kendall_tau([r["predicted"]["tflops"]["mid"] for r in sel],
                                                     [r["measured"] for r in sel])
        out[target] = {"kendall_tau": round(tau, 3), "concordant_pairs": concordant, "discordant_pairs": discordant}
    by = {(r["kernel"], tuple(r["shape"])): r for r in rows}
    v201, v153 = by[("gcnasm v201 (assembly)", (1, 32, 1536, 128))], by[("gcnasm v153 (HIP)", (4, 32, 4096, 128))]
    out["v153_behind_v201"] = {"measured": round(v153["measured"] / v201["measured"] - 1, 3),
                               "model": round(v153["predicted"]["tflops"]["mid"] / v201["predicted"]["tflops"]["mid"]
                                              - 1, 3)}
    return out


def our_row(forward: dict, target: str, dtype: str, d: int) -> dict:
    return next(r for r in forward["kernels"] if r["target"] == target and r["dtype"] == dtype and r["d"] == d)


def ours_at(record: dict, shape, band: dict) -> dict:
    """Our forward kernel at a shape: its terms at the band's middle and its TFLOP/s at the middle and ends."""
    hw = HARDWARE[record["target"]]
    variant = variants.fwd_variant(record["dtype"], record["d"])
    batch, heads, seq, _ = shape
    groups = batch * heads * math.ceil(seq / variant.block_rows) * variant.d_chunks
    tail = sm.launch_tail(hw, record["waves_per_simd"], variant.waves, groups)
    counts = record["counts_per_wave_tile"]
    out = sm.priced(counts, hw, record["waves_per_simd"], variant.block_n, record["d"] / variant.d_chunks, tail, band)
    return {**out, "tail": round(tail, 3), "counts": counts, "waves_per_simd": record["waves_per_simd"],
            "keys_per_trip": variant.block_n, "head_dim": record["d"] / variant.d_chunks}


def targets_table(forward: dict, bands: dict) -> list[dict]:
    rows = []
    for target, dtype, d, shape, anchor, anchor_tflops, ratio in TARGETS:
        ours = ours_at(our_row(forward, target, dtype, d), shape, bands[target])
        goal = [round(ratio * x, 1) for x in anchor_tflops]
        rows.append({"target": target, "dtype": dtype, "d": d, "shape": list(shape), "anchor": anchor,
                     "anchor_tflops": list(anchor_tflops), "ratio": ratio, "goal_tflops": goal,
                     "ours_tflops": ours["tflops"], "met_at_mid": [ours["tflops"]["mid"] >= g for g in goal],
                     "terms": ours["terms"], "cycles": ours["cycles"], "non_wmma": ours["non_wmma"]})
    return rows


def budgets_table(forward: dict, bands: dict) -> list[dict]:
    """Per budget: today's non-WMMA cycles per 16x64 tile in named terms (f16 and bf16), the issue's own
    accounting beside them (VALU + 4 x TRANS), what the band's middle would need for the target, and whether
    the WMMAs and transcendentals alone already exceed the target's cycles."""
    rows = []
    for target, d, budget in BUDGETS:
        hw = HARDWARE[target]
        goal = next(max(ratio * x for x in anchor) for t, _, dd, _, _, anchor, ratio in TARGETS
                    if t == target and dd == d)
        shape = next(s for t, _, dd, s, *_ in TARGETS if t == target and dd == d)
        for dtype in ("f16", "bf16"):
            record = our_row(forward, target, dtype, d)
            ours = ours_at(record, shape, bands[target])
            c = record["counts_per_wave_tile"]
            scale = sm.TILE_KEYS / ours["keys_per_trip"]
            needed = {end: round(sm.non_wmma_budget(goal, c, hw, ours["waves_per_simd"], ours["keys_per_trip"],
                                                    ours["head_dim"], ours["tail"], bands[target][end]), 1)
                      for end in ("low", "mid", "high")}
            floor = sm.wmma_and_trans_floor(c, hw, ours["keys_per_trip"])
            rows.append({
                "target": target, "d": d, "dtype": dtype, "budget": budget, "goal_tflops": round(goal, 1),
                "non_wmma": ours["non_wmma"],
                "named": {k: ours["terms"][k] for k in sm.ISSUE_TERMS},
                "issue_accounting_valu_plus_4_trans": round((c["valu"] + 4 * c["trans"]) * scale, 1),
                "cold_path_cycles": round((record["cold_path"]["valu"] + record["cold_path"]["salu"]) * scale, 1),
                "non_wmma_for_goal": needed,
                "cycles_for_goal": round(sm.cycles_at(goal, hw, ours["head_dim"], ours["tail"]), 1),
                "wmma_plus_trans_floor": round(floor, 1),
                "beyond_physics": floor > sm.cycles_at(goal, hw, ours["head_dim"], ours["tail"]),
            })
    return rows


def trans_sensitivity(calibration: dict, forward: dict) -> list[dict]:
    """The fit and our targets' figures again with transcendentals at TRANS_CYCLES_SENSITIVITY (gfx11: 4
    cycles, as if they blocked the VALU), the stall band refitted on the same forward rows."""
    rows = [r for r in external_rows(calibration) if r["role"] == "fit"]
    out = []
    for target, hw in HARDWARE.items():
        price = sm.TRANS_CYCLES_SENSITIVITY[hw.isa.name]
        stalls = [sm.implied_stall(r["counts"], hw, r["waves_per_simd"], r["keys_per_trip"], r["head_dim"], r["tail"],
                                   r["measured"], price) for r in rows if r["target"] == target]
        stall_band = sm.band(stalls)
        for t_target, dtype, d, shape, *_ in TARGETS:
            if t_target != target:
                continue
            record = our_row(forward, target, dtype, d)
            ours = ours_at(record, shape, stall_band)
            figures = sm.priced(ours["counts"], hw, ours["waves_per_simd"], ours["keys_per_trip"], ours["head_dim"],
                                ours["tail"], stall_band, price)
            out.append({"target": target, "dtype": dtype, "d": d, "trans_cycles": price,
                        "stall_band": {k: round(v, 3) for k, v in stall_band.items()},
                        "non_wmma": figures["non_wmma"], "tflops": figures["tflops"]})
    return out


def anchors_table(forward: dict, bands: dict) -> list[dict]:
    rows = []
    for label, target, dtype, shape, measured, source in ANCHORS:
        ours = None
        if shape is not None:
            ours = ours_at(our_row(forward, target, dtype, shape[3]), shape, bands[target])["tflops"]
        rows.append({"anchor": label, "target": target, "dtype": dtype, "shape": list(shape) if shape else None,
                     "measured": list(measured), "source": source, "ours_tflops": ours})
    return rows


def forward_grid(forward: dict, bands: dict) -> list[dict]:
    """Every forward kernel of the record at its own shape (16 batch x heads, 4096 tokens)."""
    rows = []
    for record in forward["kernels"]:
        shape = (1, forward["constants"]["batch_heads"], forward["constants"]["seq"], record["d"])
        ours = ours_at(record, shape, bands[record["target"]])
        rows.append({"target": record["target"], "dtype": record["dtype"], "d": record["d"], "shape": list(shape),
                     "tflops": ours["tflops"], "non_wmma": ours["non_wmma"], "terms": ours["terms"]})
    return rows


def backward_table(backward: dict, bands: dict) -> list[dict]:
    """Our training backward (the backward record's "now", priced in the named terms by
    backward_throughput_estimate at these bands) against the targets."""
    if backward["stall_band"] != bands:
        raise SystemExit(f"{BACKWARD} was priced at another stall band: run bench/estimate_gfx1100_backward.py")
    rows = []
    for target, d, anchor, anchor_tflops, ratio in BACKWARD_TARGETS:
        for dtype in ("f16", "bf16"):
            record = next(r for r in backward["results"] if (r["target"], r["d"], r["dtype"]) == (target, d, dtype))
            now = record["estimate"]["now"]
            goal = [round(ratio * x, 1) for x in anchor_tflops]
            rows.append({"target": target, "d": d, "dtype": dtype, "anchor": anchor, "anchor_tflops": list(anchor_tflops),
                         "ratio": ratio, "goal_tflops": goal, "ours_tflops": now["tflops"],
                         "met_at_mid": [now["tflops"]["mid"] >= g for g in goal], "terms": now["terms"]})
    return rows


def fitted(calibration: dict) -> tuple[list[dict], dict]:
    """The measured rows with the stall share each implies, and the per-ISA band fitted on them."""
    rows = external_rows(calibration)
    for row in rows:
        row["implied_stall"] = implied(row)
    return rows, fit(rows)


def stall_bands() -> dict:
    """Per target, the stall band the estimators price with: fitted on the calibration record's kernels."""
    return fitted(json.loads(CALIBRATION.read_text()))[1]


def build(calibration: dict, forward: dict, backward: dict) -> dict:
    rows, bands = fitted(calibration)
    for row in rows:
        row["predicted"] = predict(row, bands[row["target"]])
        mid = row["predicted"]["tflops"]
        row["residual"] = round(row["measured"] / mid["mid"] - 1, 3)
        row["in_band"] = mid["low"] - 0.05 <= row["measured"] <= mid["high"] + 0.05  # figures kept to 0.1
        for key in ("counts", "loops"):
            row.pop(key, None)
    return {
        "constants": {"trans_cycles": sm.TRANS_CYCLES, "trans_cycles_sensitivity": sm.TRANS_CYCLES_SENSITIVITY,
                      "tile": [sm.TILE_ROWS, sm.TILE_KEYS],
                      "wmma_cycles": {t: hw.wmma_cycles for t, hw in HARDWARE.items()},
                      "clock_hz": {t: hw.clock_hz for t, hw in HARDWARE.items()}},
        "stall_band": bands,
        "kernels": rows,
        "ranking": ranking(rows),
        "unmodelled": [{"kernel": k, "target": t, "what": w, "shape": list(s) if s else None, "tflops": list(v),
                        "source": src} for k, t, w, s, v, src in UNMODELLED],
        "targets": targets_table(forward, bands),
        "forward_grid": forward_grid(forward, bands),
        "anchors": anchors_table(forward, bands),
        "budgets": budgets_table(forward, bands),
        "trans_sensitivity": trans_sensitivity(calibration, forward),
        "backward": backward_table(backward, bands),
    }


def _met_text(goal: list[float], met: list[bool]) -> str:
    """Whether the band's middle meets the goal, per end of a goal given as a range."""
    if len(set(goal)) == 1:
        return "yes" if met[0] else "no"
    return "; ".join(f"{g:g}: {'yes' if m else 'no'}" for g, m in zip(goal, met))


def _band_text(figures: dict) -> str:
    return f"{figures['mid']:g} ({figures['low']:g}–{figures['high']:g})"


def markdown(result: dict) -> str:
    bands = result["stall_band"]
    lines = ["# Speed model in named cycle terms: fit, held-out residuals, targets, budgets", "",
             "Not a measurement of ours: `python -m bench.speed_model` (model: `rdna_fa_lab/speed_model.py`). Terms per "
             "16x64 tile and SIMD: WMMA at the instruction's rate, VALU, transcendentals (gfx11 "
             f"{sm.TRANS_CYCLES['gfx11']:g} cycle, gfx12 {sm.TRANS_CYCLES['gfx12']:g}), SALU, a stall allowance on "
             "the non-WMMA work, waits, LDS and cache bandwidth. Stall band per ISA (share of the non-WMMA work), "
             "fitted on the rows marked fit: " + "; ".join(
                 f"{t} {b['low']:g}–{b['high']:g} (middle {b['mid']:g})" for t, b in bands.items()) + ".", "",
             "## Fit and held-out residuals", "",
             "TFLOP/s at the band's middle (its high and low stall ends in brackets); residual = measured / middle − 1.",
             "", "| kernel | target | shape | role | measured | model | residual | in band | stall it implies | source |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["kernels"]:
        lines.append(f"| {r['kernel']} | {r['target']} | {'x'.join(map(str, r['shape']))} | {r['role']} | "
                     f"{r['measured']:g} | {_band_text(r['predicted']['tflops'])} | {100 * r['residual']:+.1f} % | "
                     f"{'yes' if r['in_band'] else 'no'} | "
                     f"{'none up to ' + format(sm.MAX_STALL, 'g') if r['implied_stall'] is None else r['implied_stall']} | "
                     f"{r['source']} |")
    rk = result["ranking"]
    lines += ["", "Ranking (forward rows, band middle against measured): " + "; ".join(
        f"{t} Kendall tau {rk[t]['kendall_tau']:g} ({rk[t]['concordant_pairs']} pairs in order, "
        f"{rk[t]['discordant_pairs']} out of order)" for t in HARDWARE) +
        f". v153 behind v201: measured {100 * rk['v153_behind_v201']['measured']:+.1f} %, model "
        f"{100 * rk['v153_behind_v201']['model']:+.1f} %.", "",
        "## Published figures without a stream built here (not modelled)", "",
        "| kernel | target | what | shape | TFLOP/s | source |", "|---|---|---|---|---|---|"]
    for u in result["unmodelled"]:
        shape = "x".join("d" if x is None else str(x) for x in u["shape"]) if u["shape"] else "not published"
        low, high = u["tflops"]
        lines.append(f"| {u['kernel']} | {u['target']} | {u['what']} | {shape} | "
                     f"{low:g}{'' if low == high else f'–{high:g}'} | {u['source']} |")
    lines += ["", "## Our forward kernels against the targets, at each anchor's shape", "",
              "| target | dtype | d | shape | anchor | goal | ours: middle (low–high) | met at the middle | "
              "wmma | valu | trans | salu | stall | waits | lds | global |", "|" + "---|" * 16]
    for t in result["targets"]:
        goal = "–".join(f"{g:g}" for g in dict.fromkeys(t["goal_tflops"]))
        terms = " | ".join(f"{t['terms'][k]:g}" for k in sm.TERMS)
        lines.append(f"| {t['target']} | {t['dtype']} | {t['d']} | {'x'.join(map(str, t['shape']))} | {t['anchor']} "
                     f"{'–'.join(f'{a:g}' for a in dict.fromkeys(t['anchor_tflops']))} x{t['ratio']:g} | {goal} | "
                     f"{_band_text(t['ours_tflops'])} | {_met_text(t['goal_tflops'], t['met_at_mid'])} | {terms} |")
    lines += ["", "## Our forward at the anchors' shapes", "", "| anchor | target | shape | measured | ours, dtype: middle "
              "(low–high) | source |", "|" + "---|" * 6]
    for a in result["anchors"]:
        shape = "x".join(map(str, a["shape"])) if a["shape"] else "not published"
        ours = f"{a['dtype']}: {_band_text(a['ours_tflops'])}" if a["ours_tflops"] else "–"
        lines.append(f"| {a['anchor']} | {a['target']} | {shape} | {'–'.join(f'{m:g}' for m in dict.fromkeys(a['measured']))} "
                     f"| {ours} | {a['source']} |")
    lines += ["", "## Every forward kernel at 16 batch x heads, 4096 tokens", "",
              "| target | dtype | d | ours: middle (low–high) | " + " | ".join(sm.TERMS) + " |", "|" + "---|" * 12]
    for g in result["forward_grid"]:
        lines.append(f"| {g['target']} | {g['dtype']} | {g['d']} | {_band_text(g['tflops'])} | "
                     + " | ".join(f"{g['terms'][k]:g}" for k in sm.TERMS) + " |")
    lines += ["", "## Non-WMMA budgets per 16x64 tile", "",
              "Today's non-WMMA issue cycles (VALU + TRANS at the ISA's price + SALU) against the budget, the issue's own "
              "accounting (VALU + 4 x TRANS), what the goal needs at the band's middle (and at its low and high stall "
              "ends), and the WMMA + TRANS floor against the goal's cycles.", "",
              "| target | d | dtype | budget | today | valu | trans | salu | VALU + 4 TRANS | needed for the goal: middle (low–high stall) | goal's cycles | WMMA + TRANS alone | beyond "
              "physics | cold path (huge-score rounding) |", "|" + "---|" * 14]
    for b in result["budgets"]:
        need = b["non_wmma_for_goal"]
        lines.append(f"| {b['target']} | {b['d']} | {b['dtype']} | {b['budget']:g} | {b['non_wmma']:g} | "
                     f"{b['named']['valu']:g} | {b['named']['trans']:g} | {b['named']['salu']:g} | "
                     f"{b['issue_accounting_valu_plus_4_trans']:g} | "
                     f"{need['mid']:g} ({need['high']:g}–{need['low']:g}) | {b['cycles_for_goal']:g} | "
                     f"{b['wmma_plus_trans_floor']:g} | {'yes' if b['beyond_physics'] else 'no'} | "
                     f"{b['cold_path_cycles']:g} |")
    lines += ["", "## Our backward (as training runs it) in the named terms, against the targets", "",
              "16 batch x heads, 4096 tokens, TFLOP/s in flash-attention's count (2.5x the forward's); terms: SIMD "
              "cycles per 16x64 tile of the attention matrix over both launches, at the band's middle, the dQ "
              "prologue's read of dO and O in the global term (bench/estimate_gfx1100_backward.py).", "",
              "| target | d | dtype | anchor | goal | ours: middle (low–high) | met at the middle | "
              + " | ".join(sm.TERMS) + " |", "|" + "---|" * 15]
    for b in result["backward"]:
        goal = "–".join(f"{g:g}" for g in dict.fromkeys(b["goal_tflops"]))
        lines.append(f"| {b['target']} | {b['d']} | {b['dtype']} | {b['anchor']} x{b['ratio']:g} | {goal} | "
                     f"{_band_text(b['ours_tflops'])} | {_met_text(b['goal_tflops'], b['met_at_mid'])} | "
                     + " | ".join(f"{b['terms'][k]:g}" for k in sm.TERMS) + " |")
    lines += ["", "## Sensitivity: transcendentals at the sensitivity price", "",
              "The stall band refitted on the same fit rows with TRANS priced at "
              + ", ".join(f"{isa} {c:g}" for isa, c in sm.TRANS_CYCLES_SENSITIVITY.items())
              + " cycles, and our kernels at the targets' shapes again.", "",
              "| target | dtype | d | trans cycles | stall band | non-WMMA | ours: middle (low–high) |", "|" + "---|" * 7]
    for t in result["trans_sensitivity"]:
        b = t["stall_band"]
        lines.append(f"| {t['target']} | {t['dtype']} | {t['d']} | {t['trans_cycles']:g} | {b['low']:g}–{b['high']:g} | "
                     f"{t['non_wmma']:g} | {_band_text(t['tflops'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6))
    for r in result["kernels"]:
        p = r["predicted"]["tflops"]
        color = "tab:blue" if r["role"] == "fit" else "tab:orange"
        ax1.errorbar(r["measured"], p["mid"], yerr=[[p["mid"] - p["low"]], [p["high"] - p["mid"]]], fmt="o",
                     color=color, capsize=3)
        ax1.annotate(f"{r['kernel']} {r['shape'][2]}", (r["measured"], p["mid"]), fontsize=6)
    lim = [0, 140]
    ax1.plot(lim, lim, color="gray", lw=1)
    ax1.set_xlim(lim), ax1.set_ylim(lim)
    ax1.set_xlabel("measured TFLOP/s (published)")
    ax1.set_ylabel("model TFLOP/s (stall band middle, bars: band ends)")
    ax1.set_title("fit (blue) and held out (orange)", fontsize=9)
    labels, x = [], 0
    for t in result["targets"]:
        p = t["ours_tflops"]
        ax2.bar(x, p["mid"], color="tab:blue", yerr=[[p["mid"] - p["low"]], [p["high"] - p["mid"]]], capsize=3)
        ax2.hlines(t["goal_tflops"], x - 0.4, x + 0.4, color="tab:green", ls="--")
        ax2.hlines(t["anchor_tflops"], x - 0.4, x + 0.4, color="tab:red", ls=":")
        labels.append(f"{t['target']} {t['dtype']} d{t['d']}\n{'x'.join(map(str, t['shape']))}")
        x += 1
    ax2.set_xticks(range(len(labels)), labels, fontsize=7)
    ax2.set_ylabel("TFLOP/s (model, not measured)")
    ax2.set_title("ours at each anchor's shape: anchor (red dotted), goal (green dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--check", type=Path, help="exit 1 when this record is not what the inputs give")
    args = parser.parse_args(argv)
    result = build(*(json.loads(path.read_text()) for path in (CALIBRATION, FORWARD, BACKWARD)))
    text = json.dumps(result, indent=1) + "\n"
    if args.check:
        if args.check.read_text() != text:
            print(f"{args.check} is not what the records give: run python -m bench.speed_model", file=sys.stderr)
            return 1
        return 0
    print(markdown(result))
    if args.json:
        args.json.write_text(text)
    if args.md:
        args.md.write_text(markdown(result))
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
