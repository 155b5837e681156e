"""The expected speed of the kernels on each RDNA GPU the static estimator models, beside published
measurements of other kernels, as the lab's data file that `python -m rdna_fa_lab bench` shows without
an RDNA GPU.

    python -m bench.expected_speed            # writes rdna_fa_lab/expected_speed.json
    python -m bench.expected_speed --check    # exit 1 when that file is not what the records give

Every figure of ours is a static estimate, not a measurement. The forward: the speed model in named cycle
terms (rdna_fa_lab/speed_model.py) on the forward record's counts (bench/estimate_gfx1100.py ->
bench/results/forward_estimate_gfx1100.json), at the two ends of its stall band (bench/speed_model.py ->
speed_model.json), at the models' shapes (masked_estimate.json's `shapes` give them) and at the published
kernels' shapes. The backward: the same model and band on the backward's traced paths
(bench/estimate_gfx1100_backward.py -> backward_estimate_gfx1100.json). The published figures are other
kernels' measurements: the calibration record's own (estimator_calibration.json, the kernels the stall
band is fitted on) and those of DESIGN.md section 3 listed in PUBLISHED below.

The file's `provenance` names the estimators (sha256 of each module and script), the records (sha256 and the commit
that last wrote each) and the code objects the estimates were made from (sha256, source hash); the bench
compares those with the code objects it ships. It reads the records rather than running the estimators
because they take minutes and llvm-objdump; regenerate the records first (their scripts' docstrings say
how), then run this. tests/bench/test_expected_speed.py regenerates the file from the records and
compares, so it cannot drift from them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from bench import speed_model
from rdna_fa_lab import throughput_estimate

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
OUTPUT = REPO / "rdna_fa_lab" / "expected_speed.json"
SCHEMA = 1

ESTIMATORS = ("rdna_fa_lab/throughput_estimate.py", "rdna_fa_lab/backward_throughput_estimate.py",
              "rdna_fa_lab/masked_throughput_estimate.py", "bench/estimate_gfx1100.py",
              "bench/estimate_gfx1100_backward.py", "bench/estimate_masked.py", "bench/estimate_external.py",
              "rdna_fa_lab/speed_model.py", "bench/speed_model.py", "bench/expected_speed.py")
FORWARD = "bench/results/forward_estimate_gfx1100.json"
BACKWARD = "bench/results/backward_estimate_gfx1100.json"
SHAPES = "bench/results/masked_estimate.json"
CALIBRATION = "bench/results/estimator_calibration.json"
SPEED_MODEL = "bench/results/speed_model.json"
RECORDS = (FORWARD, BACKWARD, SHAPES, CALIBRATION, SPEED_MODEL)

# The models' shapes of masked_estimate.json's `shapes` (no mask), in the order shown: (its name, label,
# tokens: bench/estimate_masked.py's SHAPES; build() checks them against the record's useful FLOPs).
WORKLOADS = (("SD1.5", "SD1.5 self-attention, 512 px", 4096), ("SDXL", "SDXL self-attention, 1024 px", 4096),
             ("Flux", "Flux joint attention, 1024 px", 4608),
             ("Wan 2.x self-attention", "Wan 2.x self-attention", 32760))
BACKWARD_HEAD_DIMS = (40, 64, 80, 128, 160)

# Published measurements without a code object built here (DESIGN.md section 3, "Measured attention
# figures (published, 2026)"; README's table of the models' shapes). tflops: [low, high].
PUBLISHED = (
    {"target": "gfx1100", "pass": "forward", "kernel": "PyTorch SDPA (AOTriton)", "dtype": "f16", "head_dim": 128,
     "shape": None, "tflops": [66.0, 67.0], "where": "DESIGN.md section 3: published without a reproducible shape"},
    {"target": "gfx1100", "pass": "forward", "kernel": "CK WMMA kernel (ROCm/flash-attention, navi branch)",
     "dtype": "f16", "head_dim": 64, "shape": [4, 32, 4096, 64], "tflops": [42.1, 47.6],
     "where": "ROCm/flash-attention issue #27 (README, table of the models' shapes)"},
    {"target": "gfx1100", "pass": "backward", "kernel": "Triton (2024)", "dtype": "f16", "head_dim": None,
     "shape": None, "tflops": [24.9, 24.9], "where": "DESIGN.md section 3: best published gfx1100 backward"},
    {"target": "gfx1201", "pass": "forward", "kernel": "AOTriton 0.14 FlyDSL", "dtype": "f16", "head_dim": 128,
     "shape": [1, 8, 4096, 128], "tflops": [92.5, 92.5],
     "where": "DESIGN.md section 3: AOTriton 0.14's gfx1201 tuning files (in PyTorch's SDPA once a torch build "
              "pins AOTriton 0.14)"},
    {"target": "gfx1201", "pass": "forward", "kernel": "FlyDSL (ROCm/aiter PR #4188)", "dtype": "bf16", "head_dim": 128,
     "shape": [1, 24, 4096, 128], "tflops": [99.8, 99.8], "where": "README, table of the models' shapes"},
    {"target": "gfx1201", "pass": "forward", "kernel": "PyTorch SDPA, torch 2.14 (AOTriton 0.13b)", "dtype": None,
     "head_dim": 128, "shape": None, "tflops": [66.0, 69.0], "where": "DESIGN.md section 3"},
    {"target": "gfx1201", "pass": "backward", "kernel": "AOTriton 0.14 FlyDSL (dK/dV + dQ)", "dtype": None,
     "head_dim": 128, "shape": [1, 8, 4096, 128], "tflops": [53.0, 60.0], "where": "DESIGN.md section 3"},
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(relative: str) -> dict:
    return json.loads((REPO / relative).read_text(encoding="utf-8"))


def last_commit(relative: str) -> str | None:
    """The commit that last changed a file (None outside a git checkout, or for a file never committed)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", relative], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out or None


def _ends(figures: dict) -> list[float]:
    """A speed model figure as [high-stall end, low-stall end] of its band."""
    return [figures["low"], figures["high"]]


def _forward(forward: dict, target: str, dtype: str, shape, stall_band: dict) -> list[float]:
    """The speed model's forward at a shape: [high-stall end, low-stall end] of its band."""
    record = speed_model.our_row(forward, target, dtype, shape[3])
    return _ends(speed_model.ours_at(record, shape, stall_band)["tflops"])


def _code_objects(forward: dict, backward: dict, shapes: dict) -> dict:
    """target -> the code object every record was made from; an error if the records disagree."""
    found: dict[str, dict] = {}
    seen = [(k["target"], k["code_object"]) for k in forward["kernels"]]
    seen += [(r["target"], r["code_object"]) for r in backward["results"]]
    seen += [(Path(c["file"]).stem.removeprefix("rdna_fa_"), c) for c in shapes["code_objects"]]
    for target, code_object in seen:
        entry = found.setdefault(target, {"sha256": code_object["sha256"], "source_hash": None})
        if entry["sha256"] != code_object["sha256"]:
            raise SystemExit(f"the records were made from different {target} code objects: "
                             f"{entry['sha256']} and {code_object['sha256']}: regenerate them")
        entry["source_hash"] = entry["source_hash"] or code_object.get("source_hash")
    return found


def _published(calibration: dict, target: str, forward: dict, stall_band: dict) -> list[dict]:
    """The measurements of other kernels on `target`: those the calibration fits (their own source built
    and measured on that GPU) and PUBLISHED's; `ours`: our forward at the same shape and dtype, where both
    are published."""
    rows = []
    for kernel in calibration["kernels"]:
        if kernel["target"] != target or not kernel["in_fit"]:
            continue
        backward = "backward" in kernel["name"]
        rows.append({"target": target, "pass": "backward" if backward else "forward", "kernel": kernel["name"],
                     "dtype": kernel["dtype"], "head_dim": kernel["shape"][-1], "shape": kernel["shape"],
                     "tflops": [kernel["published_tflops"]] * 2, "where": kernel["published_where"], "ours": None})
    rows += [dict(row, ours=None) for row in PUBLISHED if row["target"] == target]
    for row in rows:
        dtype = (row["dtype"] or "").split(" ")[0]
        if row["pass"] == "forward" and row["shape"] and dtype in throughput_estimate.DTYPES:
            row["ours"] = _forward(forward, target, dtype, row["shape"], stall_band)
    return rows


def build() -> dict:
    """The data file's content, from the records."""
    forward, backward, shapes, calibration, speed = (_load(r) for r in RECORDS)
    code_objects = _code_objects(forward, backward, shapes)
    gpus = {}
    for target, hw in throughput_estimate.HARDWARE.items():
        stall_band = speed["stall_band"][target]
        shape_rows = {s["shape"]: s for s in shapes["shapes"] if s["target"] == target and s["mask"] == "none"}
        workloads = []
        for name, label, tokens in WORKLOADS:
            s = shape_rows[name]
            if abs(4 * s["batch"] * s["heads"] * tokens**2 * s["d"] / 1e9 - s["useful_gflop"]) > 0.05:
                raise SystemExit(f"{SHAPES}: {name} is not {tokens} tokens any more: update WORKLOADS")
            shape = [s["batch"], s["heads"], tokens, s["d"]]
            workloads.append({"workload": label, "dtype": s["dtype"], "head_dim": s["d"], "shape": shape,
                              "tflops": _forward(forward, target, s["dtype"], shape, stall_band)})
        gpus[target] = {
            "gpu": hw.gpu,
            "peak_tflops": hw.peak_tflops,
            "speed_model": {"stall_band": [stall_band["low"], stall_band["high"]],
                            "fitted_on": [k["kernel"] for k in speed["kernels"]
                                          if k["target"] == target and k["role"] == "fit"]},
            "forward_workloads": workloads,
            "forward_by_head_dim": [{"dtype": g["dtype"], "head_dim": g["d"],
                                     "tflops": _ends(g["tflops"])}
                                    for g in speed["forward_grid"] if g["target"] == target],
            "backward_by_head_dim": [{"dtype": r["dtype"], "head_dim": r["d"],
                                      "tflops": _ends(r["estimate"]["now"]["tflops"])}
                                     for r in backward["results"]
                                     if r["target"] == target and r["d"] in BACKWARD_HEAD_DIMS],
            "published": _published(calibration, target, forward, stall_band),
        }
    return {
        "schema": SCHEMA,
        "what": "static estimate of the kernels' throughput on RDNA GPUs: a model of the code objects' "
                "instructions, fitted on published measurements of other kernels; not a measurement",
        "units": "TFLOP/s on useful FLOPs: forward 4*B*H*Sq*Sk*d, backward 2.5x that",
        "band": "[low, high]: the speed model at the high and the low end of its stall band, forward and backward",
        "by_head_dim": f"{forward['constants']['seq']} tokens, batch x heads {forward['constants']['batch_heads']}, "
                       "non-causal; the backward as training runs it (one dQ sweep)",
        "not_estimated": "gfx1101-gfx1103, gfx1150-gfx1152, gfx1200: the estimator models the RX 7900 XTX (gfx1100) "
                         "and the RX 9070 XT (gfx1201) only",
        "provenance": {
            "generated_by": "python -m bench.expected_speed",
            "estimators": {name: _sha256(REPO / name) for name in ESTIMATORS},
            "records": {name: {"sha256": _sha256(REPO / name), "commit": last_commit(name)} for name in RECORDS},
            "code_objects": code_objects,
        },
        "gpus": gpus,
    }


def text(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=f"compare with {OUTPUT.relative_to(REPO)}, write nothing")
    parser.add_argument("--out", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO)}")
    args = parser.parse_args(argv)
    content = text(build())
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == content
        print(f"{args.out}: {'up to date' if same else 'differs from the records: python -m bench.expected_speed'}")
        return 0 if same else 1
    args.out.write_text(content, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
