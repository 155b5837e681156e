"""DESIGN.md section 5's targets, and the static records a suite run is judged against beside its own
measurements: the static report and the throughput estimates recorded in bench/results/."""

from __future__ import annotations

import json
from pathlib import Path

# DESIGN.md section 5.
TARGETS = (
    {"id": "forward", "what": "forward, RX 7900 XTX, head dim 64/128, 4k tokens",
     "target": ">= 1.2x the best measured gfx1100 figure (SDPA, comfy-kitchen int8: 66-67), i.e. >= 80 TFLOP/s"},
    {"id": "backward", "what": "backward", "target": ">= 1.4x AOTriton 0.14's FlyDSL on gfx1201 (53-60); >= 2x the best "
                                                     "published gfx1100 figure (24.9)"},
    {"id": "memory", "what": "attention working memory", "target": "O(N): output + LSE only, no (Sq x Sk) buffer ever"},
    {"id": "sd15_1024", "what": "SD1.5 1024px UNet step vs SDPA math (ZLUDA default)",
     "target": ">= 1.5x faster, <= 1/3 of the peak VRAM"},
    {"id": "static", "what": "kernel static limits", "target": "no scratch or spills in any variant; LDS <= 64 KiB"},
)


def static_summary(results_dir: Path) -> dict:
    """The static report and the gfx1100 estimates recorded in `results_dir`, condensed; a missing
    file is named in `missing`."""
    summary: dict = {"missing": []}
    report = results_dir / "static_report.json"
    if report.is_file():
        data = json.loads(report.read_text(encoding="utf-8"))
        kernels = data["kernels"]
        summary["static"] = {
            "kernels": len(kernels), "targets": sorted({k["target"] for k in kernels}),
            "max_vgpr": max(k["vgpr"] for k in kernels), "max_lds_bytes": max(k["lds_bytes"] for k in kernels),
            "scratch_bytes": sum(k["scratch_bytes"] for k in kernels),
            "spills": sum(k["vgpr_spills"] + k["sgpr_spills"] for k in kernels),
            "min_waves_per_simd": min(k["waves_per_simd"] for k in kernels), "problems": data["problems"],
        }
    else:
        summary["missing"].append(str(report))
    # Both passes in the speed model's named terms: TFLOP/s at the high-stall and the low-stall end of its band.
    speed = results_dir / "speed_model.json"
    if speed.is_file():
        summary["forward_estimate"] = [
            {"target": g["target"], "dtype": g["dtype"], "head_dim": g["d"], "tflops_pessimistic": g["tflops"]["low"],
             "tflops_optimistic": g["tflops"]["high"], "basis": "speed model"}
            for g in json.loads(speed.read_text(encoding="utf-8"))["forward_grid"]]
    else:
        summary["missing"].append(str(speed))
    backward = results_dir / "backward_estimate_gfx1100.json"
    if backward.is_file():
        summary["backward_estimate"] = [
            {"target": r["target"], "gpu": r["gpu"], "dtype": r["dtype"], "head_dim": r["d"],
             "tflops_pessimistic": r["estimate"]["now"]["tflops"]["low"],
             "tflops_optimistic": r["estimate"]["now"]["tflops"]["high"], "basis": "speed model"}
            for r in json.loads(backward.read_text(encoding="utf-8"))["results"]]
    else:
        summary["missing"].append(str(backward))
    return summary
