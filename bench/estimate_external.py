#!/usr/bin/env python3
"""The static estimator's model, unchanged, run on external attention kernels whose RDNA throughput is
published with its shape: the calibration of bench/estimate_gfx1100.py (issue 22).

For each kernel in a JSON list of cases (built here for its target from its public source; see
bench/results/estimator_calibration.md for where each comes from and how it was built), the main
loop is found as the estimator finds ours (`key_tile_loops`: innermost loops with a WMMA and a load), its
instructions are tallied per wave per trip with the estimator's own `tally`, and `model` turns them
into cycles and TFLOP/s with the same constants. The only inputs the code object cannot give are
the launch (threads per workgroup, query rows per workgroup) and the problem shape, which the case
states. FLOPs per trip are the loop's WMMAs x 2·16³ (every product of these kernels is useful: head
dim 128, no padding).

    python3 bench/estimate_external.py bench/results/estimator_calibration_cases.json \
        --json bench/results/estimator_calibration.json --png bench/results/estimator_calibration.png

What it cannot show: anything the kernels do outside the main loop (prologue, epilogue: small at
these lengths), and effects the model lacks for every kernel alike (clock under load, cache misses,
partial waits that leave loads in flight are not counted as latency).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import estimate_gfx1100 as estimator  # noqa: E402
from rdna_flash_attn.runtime.codeobject import load_code_object  # noqa: E402
from rdna_flash_attn.tools.report import find_objdump, occupancy  # noqa: E402

WMMA_FLOPS = 2 * 16**3


def merge_undecoded(body: list[estimator.Insn]) -> list[estimator.Insn]:
    """llvm-objdump 19 cannot decode some gfx11 VOP3 encodings of 16-bit moves and conversions on
    register halves (Triton emits v_mov_b16_e64 and v_cvt_f16_f32_e64 with .h/.l operands): it prints
    their first dword as `.long` and decodes the second as an instruction of its own. Each such pair is
    one VALU instruction; anything else undecodable is an error."""
    merged, skip = [], None
    for insn in body:
        if insn.addr == skip:
            continue
        if insn.op == ".long":
            if (int(insn.args.split()[0], 16) >> 26) != 0b110101:  # VOP3 (8 bytes)
                raise RuntimeError(f"undecodable instruction at {insn.addr:#x}: {insn.args}")
            merged.append(estimator.Insn(insn.addr, "v_undecoded_vop3", insn.args))
            skip = insn.addr + 4
            continue
        merged.append(insn)
    return merged


def main_loop(body: list[estimator.Insn]) -> tuple[int, int]:
    """The estimator's key-tile loop with the most WMMAs (a kernel that unrolls its last tile out of the
    loop has that copy outside every loop)."""
    loops = estimator.key_tile_loops(body)
    if not loops:
        raise RuntimeError("no loop holds a WMMA and a global load")
    return max(loops, key=lambda s: sum(s[0] <= i.addr <= s[1] and i.op.startswith("v_wmma") for i in body))


def estimate(case: dict, root: Path, objdump: str) -> dict:
    path = root / case["code_object"]
    co = load_code_object(path)
    hw = estimator.HARDWARE[co.target]
    body = merge_undecoded(estimator.disassemble(objdump, path, co.target)[case["kernel"]])
    kernel = next(k for k in co.kernels if k.name == case["kernel"])
    span = main_loop(body)
    counts = estimator.tally([(i, 1, "main loop") for i in body if span[0] <= i.addr <= span[1]])
    batch, heads, seq, head_dim = case["shape"]
    threads = case["threads"]
    occ = occupancy(co.target, kernel, threads)
    groups = batch * heads * math.ceil(seq / case["rows_per_workgroup"])
    modelled = estimator.model(counts, hw, SimpleNamespace(waves=threads // 32), occ.waves_per_simd,
                               flops=counts.wmma * WMMA_FLOPS, groups=groups)
    published = case["published_tflops"]
    return {
        **{k: case[k] for k in ("name", "source", "dtype", "shape", "published_tflops", "published_where", "in_fit")},
        "target": co.target, "gpu": hw.gpu, "kernel": case["kernel"],
        "code_object": {"file": case["code_object"], "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
        "threads": threads, "rows_per_workgroup": case["rows_per_workgroup"],
        "waves_per_simd": occ.waves_per_simd, "occupancy_limit": occ.limited_by,
        "main_loop": [hex(span[0]), hex(span[1])], "counts_per_wave_trip": asdict(counts), "model": modelled,
        "pessimistic_over_published": round(modelled["tflops_pess_nominal"] / published, 3),
        "optimistic_over_published": round(modelled["tflops_opt_nominal"] / published, 3),
    }


def fitted_ratios(rows: list[dict]) -> dict[str, dict]:
    """Per target: the geometric mean of measured / pessimistic estimate over the cases `in_fit` (the
    kernels whose own source was measured; a stand-in is only checked against the fit), the one factor
    that makes the model reproduce them best in log terms, and every case's residual under it."""
    fits = {}
    for target in dict.fromkeys(r["target"] for r in rows):
        cases = [r for r in rows if r["target"] == target]
        ratios = [r["published_tflops"] / r["model"]["tflops_pess_nominal"] for r in cases if r["in_fit"]]
        factor = math.exp(sum(map(math.log, ratios)) / len(ratios))
        for r in cases:
            r["residual_under_fit"] = round(r["published_tflops"] / r["model"]["tflops_pess_nominal"] / factor - 1, 3)
        fits[target] = {"factor": round(factor, 3), "cases_in_fit": len(ratios),
                        "residuals": {f"{r['name']} {'x'.join(map(str, r['shape']))}": r["residual_under_fit"]
                                      for r in cases}}
    return fits


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':34} {'target':8} {'shape':18} {'W/SIMD':>6} {'WMMA':>5} {'VALU':>5} {'waits0':>6} "
          f"{'pess':>6} {'opt':>6} {'published':>9} {'pess/pub':>8} {'opt/pub':>7}")
    for r in rows:
        c, m = r["counts_per_wave_trip"], r["model"]
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['name']:34} {r['target']:8} {shape:18} {r['waves_per_simd']:>6} {c['wmma']:>5} {c['valu']:>5} "
              f"{c['vmem_rounds']:>6} {m['tflops_pess_nominal']:>6} {m['tflops_opt_nominal']:>6} {r['published_tflops']:>9} "
              f"{r['pessimistic_over_published']:>8} {r['optimistic_over_published']:>7}")


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 0.9 * len(rows) + 1.8))
    axes = figure.add_subplot()
    names = [f"{r['name']}\n{r['target']}, {'x'.join(map(str, r['shape']))}" for r in rows]
    y = range(len(rows))
    axes.barh([i - 0.27 for i in y], [r["published_tflops"] for r in rows], height=0.27, color="tab:red",
              label="published measurement")
    axes.barh(list(y), [r["model"]["tflops_pess_nominal"] for r in rows], height=0.27, color="tab:blue",
              label="estimate before calibration, pessimistic")
    axes.barh([i + 0.27 for i in y], [r["model"]["tflops_pess"] for r in rows], height=0.27, color="tab:green",
              label="estimate after calibration, pessimistic")
    axes.set_yticks(list(y), names, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("TFLOP/s (4·B·H·S²·d)")
    axes.set_title("The static estimator on external kernels vs their published measurements", fontsize=9)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", type=Path, help="JSON list of cases (code_object paths relative to its folder)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    objdump = find_objdump()
    if objdump is None:
        print("llvm-objdump (>= 19) not found", file=sys.stderr)
        return 2
    cases = json.loads(args.cases.read_text(encoding="utf-8"))
    rows = [estimate(case, args.cases.parent, objdump) for case in cases]
    print_table(rows)
    fits = fitted_ratios(rows)
    for target, fit in fits.items():
        print(f"{target}: measured / pessimistic estimate, geometric mean over the {fit['cases_in_fit']} cases in the "
              f"fit: {fit['factor']}; residuals under it: {fit['residuals']}")
    if args.json:
        args.json.write_text(json.dumps({"model_constants": {"vmem_latency": estimator.VMEM_LATENCY,
                                                             "lds_latency": estimator.LDS_LATENCY,
                                                             "trans_cycles_pess": estimator.TRANS_CYCLES_PESS},
                                         "fit": fits, "kernels": rows}, indent=1), encoding="utf-8")
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
