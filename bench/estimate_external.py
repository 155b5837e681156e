"""The static estimator's model, unchanged, run on external attention kernels whose RDNA throughput is
published with its shape: the calibration of rdna_fa_lab/throughput_estimate.py (issue 22).

For each kernel in a JSON list of cases (built here for its target from its public source; see
bench/results/estimator_calibration.md for where each comes from and how it was built), the main
loop is found as the estimator finds ours (`key_tile_loops`: innermost loops with a WMMA and a load), its
instructions are tallied per wave per trip with the estimator's own `tally`, and `model` turns them
into cycles and TFLOP/s with the same constants. The only inputs the code object cannot give are
the launch (threads per workgroup, query rows per workgroup) and the problem shape, which the case
states. FLOPs per trip are the loop's WMMAs x 2·16³ (every product of these kernels is useful: head
dim 128, no padding).

    python3 -m bench.estimate_external bench/results/estimator_calibration_cases.json \
        --json bench/results/estimator_calibration.json --png bench/results/estimator_calibration.png

A backward case (a "backward" entry in the case: Triton's fused-attention tutorial `_attn_bwd`) has
several key loops in one kernel: the dK/dV loop over query blocks and the dQ loop over key blocks, each
twice (a masked loop over the diagonal block, then the unmasked rest). Each loop is tallied and priced by
`model` like a forward main loop; the time per workgroup is the sum over its loops of (trips x cycles
per trip), with trips from the shape and the causal structure (averaged over the workgroups), and the
TFLOP/s count the FLOPs as the published figure counts them (the tutorial's benchmark: 4·B·H·S²·d, x 0.5
causal, x 2.5 backward), so estimate and measurement are comparable. `--reuse` keeps the rows of cases
whose code object is not on this machine from an earlier output (unchanged, refitted).

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
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

from rdna_fa_lab import throughput_estimate
from rdna_fa_lab.resource_report import find_objdump, occupancy
from rdna_fa_lab.throughput_estimate import Insn
from rdna_flash_attn.runtime.codeobject import load_code_object

WMMA_FLOPS = 2 * 16**3


def merge_undecoded(body: list[Insn]) -> list[Insn]:
    """llvm-objdump 19 cannot decode some gfx11 VOP3 encodings of 16-bit moves and conversions on
    register halves (Triton emits v_mov_b16_e64 and v_cvt_f16_f32_e64 with .h/.l operands): it prints
    their first dword as `.long` and decodes the second as an instruction of its own. Each such pair is
    one VALU instruction. The 4-byte VOP1 form of the same conversions (v_cvt_f16_f32_e32 v1.h, v105;
    the tutorial's backward kernel) is printed as one `.long`: one VALU instruction. Anything else
    undecodable is an error."""
    merged, skip = [], None
    for insn in body:
        if insn.addr == skip:
            continue
        if insn.op == ".long":
            word = int(insn.args.split()[0], 16)
            if word >> 25 == 0b0111111:  # VOP1, e.g. v_cvt_f16_f32_e32 v1.h, v105
                if word & 0x1FF == 0xFF:  # src0 a literal: 8 bytes, the second a constant, not an instruction
                    raise RuntimeError(f"undecodable VOP1 with a literal at {insn.addr:#x}: {insn.args}")
                merged.append(Insn(insn.addr, "v_undecoded_vop1", insn.args))
                continue
            if word >> 26 != 0b110101:  # VOP3 (8 bytes)
                raise RuntimeError(f"undecodable instruction at {insn.addr:#x}: {insn.args}")
            merged.append(Insn(insn.addr, "v_undecoded_vop3", insn.args))
            skip = insn.addr + 4
            continue
        merged.append(insn)
    return merged


def main_loop(body: list[Insn]) -> tuple[int, int]:
    """The estimator's key-tile loop with the most WMMAs (a kernel that unrolls its last tile out of the
    loop has that copy outside every loop)."""
    loops = throughput_estimate.key_tile_loops(body)
    if not loops:
        raise RuntimeError("no loop holds a WMMA and a global load")
    return max(loops, key=lambda s: sum(s[0] <= i.addr <= s[1] and i.op.startswith("v_wmma") for i in body))


def scratch_as_global(body: list[Insn]) -> list[Insn]:
    """Register spills (scratch_load/scratch_store, the tutorial backward built by Triton 3.9 spills) go
    through the same vector-memory path and counter (vmcnt) as global loads and stores: the estimator's
    classifier, which knows no scratch instruction, sees them as global_load/global_store of the same
    width. No calibration kernel before it has any."""
    return [Insn(i.addr, "global_" + i.op[len("scratch_"):], i.args) if i.op.startswith("scratch_") else i
            for i in body]


def tutorial_backward_loops(cfg: dict, seq: int, head_dim: int, waves: int) -> list[dict]:
    """The four key loops of the tutorial's `_attn_bwd`, in code order, with the WMMAs one wave issues per
    trip (dots x rows x cols x depth x 2 / 8192 / waves) and the trips per workgroup, averaged over the
    seq / BLOCK_N1 workgroups of a head (workgroup p: its 128-key block p, then every later query block;
    its 128-query block p, then every earlier key block)."""
    n1, m1, m2, n2, slice_ = (cfg[k] for k in ("BLOCK_N1", "BLOCK_M1", "BLOCK_M2", "BLOCK_N2", "BLK_SLICE_FACTOR"))
    # the causal structure below: workgroup p's key block and query block are both block p
    if m2 != n1:
        raise ValueError(f"BLOCK_M2 {m2} != BLOCK_N1 {n1}: the trip counts assume one block size per workgroup")
    pids = range(seq // n1)
    mean = lambda f: sum(map(f, pids)) / len(pids)  # noqa: E731
    wmma = lambda dots, rows, cols: dots * rows * cols * head_dim * 2 // WMMA_FLOPS // waves  # noqa: E731
    return [
        {"loop": "dK/dV, diagonal block (masked)", "rows_per_trip": m1 // slice_,
         "wmma_per_wave_trip": wmma(4, n1, m1 // slice_), "trips_per_workgroup": n1 // (m1 // slice_)},
        {"loop": "dK/dV, later query blocks", "rows_per_trip": m1, "wmma_per_wave_trip": wmma(4, n1, m1),
         "trips_per_workgroup": mean(lambda p: (seq - (p + 1) * n1) // m1)},
        {"loop": "dQ, diagonal block (masked)", "rows_per_trip": n2 // slice_,
         "wmma_per_wave_trip": wmma(3, m2, n2 // slice_), "trips_per_workgroup": m2 // (n2 // slice_)},
        {"loop": "dQ, earlier key blocks", "rows_per_trip": n2, "wmma_per_wave_trip": wmma(3, m2, n2),
         "trips_per_workgroup": mean(lambda p: p * m2 // n2)},
    ]


def published_flops(case: dict) -> float:
    """FLOPs as the tutorial's benchmark counts them: 2·B·H·S²·d per matmul, 2 matmuls, x 0.5 causal,
    x 2.5 backward (2 for the backward, 0.5 for the recomputation)."""
    batch, heads, seq, head_dim = case["shape"]
    flops = 2 * (2.0 * batch * heads * seq * seq * head_dim)
    flops *= 0.5 if case.get("causal") else 1.0
    return flops * (2.5 if case.get("mode") == "bwd" else 1.0)


def estimate_backward(case: dict, body: list[Insn], hw, occ) -> dict:
    """Sum over the kernel's key loops of trips x cycles per trip (model's per-wave-trip cycles, both
    bounds); TFLOP/s with the published FLOP count. The pessimistic bound pays the launch's tail as
    `model` does."""
    batch, heads, seq, head_dim = case["shape"]
    threads, cfg = case["threads"], case["backward"]
    if not case.get("causal"):
        raise ValueError(f"{case['name']}: the backward's loops are priced for the causal tutorial kernel only")
    waves = threads // 32
    spans = sorted(throughput_estimate.key_tile_loops(body))
    loops = tutorial_backward_loops(cfg, seq, head_dim, waves)
    if len(spans) != len(loops):
        raise RuntimeError(f"expected {len(loops)} key loops, found {len(spans)}")
    groups = batch * heads * (seq // cfg["BLOCK_N1"])
    rows, cyc_opt, cyc_pess = [], 0.0, 0.0
    for span, loop in zip(spans, loops):
        counts = throughput_estimate.tally([(i, 1, loop["loop"]) for i in body if span[0] <= i.addr <= span[1]])
        if counts.wmma != loop["wmma_per_wave_trip"]:
            raise RuntimeError(f"{loop['loop']}: {counts.wmma} WMMAs per trip, expected {loop['wmma_per_wave_trip']}")
        m = throughput_estimate.model(counts, hw, SimpleNamespace(waves=waves), occ.waves_per_simd,
                            flops=counts.wmma * WMMA_FLOPS, groups=groups)
        cyc_opt += loop["trips_per_workgroup"] * m["cycles_opt"]
        cyc_pess += loop["trips_per_workgroup"] * m["cycles_pess"]
        tail = m["tail_efficiency"]
        rows.append({**loop, "span": [hex(span[0]), hex(span[1])], "counts_per_wave_trip": asdict(counts),
                     "model": m})
    simd_cycles_s = hw.cus * throughput_estimate.SIMDS_PER_CU * hw.clock_hz
    flops = published_flops(case)
    # every wave of every workgroup spends its loops' cycles on its SIMD
    seconds_opt = groups * waves * cyc_opt / simd_cycles_s
    seconds_pess = groups * waves * cyc_pess / simd_cycles_s / tail
    wmma_flops = groups * waves * sum(r["trips_per_workgroup"] * r["wmma_per_wave_trip"] for r in rows) * WMMA_FLOPS
    factor = throughput_estimate.CALIBRATION[throughput_estimate.target_of(hw)]
    opt, pess = flops / seconds_opt / 1e12, flops / seconds_pess / 1e12
    return {
        "loops": rows,
        "model": {"cycles_opt_per_wave": round(cyc_opt, 1), "cycles_pess_per_wave": round(cyc_pess, 1),
                  "workgroups": groups, "tail_efficiency": tail, "calibration": factor,
                  "flops_counted": flops, "wmma_flops_executed": wmma_flops,
                  "seconds_opt": seconds_opt, "seconds_pess": seconds_pess,
                  "tflops_opt": round(opt * factor, 1), "tflops_pess": round(pess * factor, 1),
                  "tflops_opt_nominal": round(opt, 1), "tflops_pess_nominal": round(pess, 1)},
    }


def estimate(case: dict, root: Path, objdump: str) -> dict:
    path = root / case["code_object"]
    co = load_code_object(path)
    hw = throughput_estimate.HARDWARE[co.target]
    body = scratch_as_global(merge_undecoded(throughput_estimate.disassemble(objdump, path, co.target)[case["kernel"]]))
    kernel = next(k for k in co.kernels if k.name == case["kernel"])
    if "lds_bytes" in case:  # Triton allocates its LDS at launch (metadata "shared"), not in the descriptor
        kernel = replace(kernel, lds_bytes=max(kernel.lds_bytes, case["lds_bytes"]))
    if "backward" in case:
        occ = occupancy(co.target, kernel, case["threads"])
        result = estimate_backward(case, body, hw, occ)
        published = case["published_tflops"]
        return {
            **{k: case[k] for k in ("name", "source", "dtype", "shape", "published_tflops", "published_where", "in_fit")},
            "mode": "bwd", "causal": case.get("causal", False),
            "target": co.target, "gpu": hw.gpu, "kernel": case["kernel"],
            "code_object": {"file": case["code_object"], "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
            "threads": case["threads"], "lds_bytes": kernel.lds_bytes, "vgprs": kernel.vgpr_count,
            "vgpr_spills": kernel.vgpr_spill_count, "scratch_bytes": kernel.scratch_bytes,
            "waves_per_simd": occ.waves_per_simd, "occupancy_limit": occ.limited_by,
            "backward": case["backward"], **result,
            "pessimistic_over_published": round(result["model"]["tflops_pess_nominal"] / published, 3),
            "optimistic_over_published": round(result["model"]["tflops_opt_nominal"] / published, 3),
        }
    span = main_loop(body)
    counts = throughput_estimate.tally([(i, 1, "main loop") for i in body if span[0] <= i.addr <= span[1]])
    batch, heads, seq, head_dim = case["shape"]
    threads = case["threads"]
    occ = occupancy(co.target, kernel, threads)
    groups = batch * heads * math.ceil(seq / case["rows_per_workgroup"])
    modelled = throughput_estimate.model(counts, hw, SimpleNamespace(waves=threads // 32), occ.waves_per_simd,
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
        m = r["model"]
        shape = "x".join(map(str, r["shape"]))
        loops = [lp["counts_per_wave_trip"] for lp in r["loops"]] if "loops" in r else [r["counts_per_wave_trip"]]
        wmma, valu, waits = ("/".join(str(c[k]) for c in loops) for k in ("wmma", "valu", "vmem_rounds"))
        print(f"{r['name']:34} {r['target']:8} {shape:18} {r['waves_per_simd']:>6} {wmma:>5} {valu:>5} "
              f"{waits:>6} {m['tflops_pess_nominal']:>6} {m['tflops_opt_nominal']:>6} {r['published_tflops']:>9} "
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
    axes.set_xlabel("TFLOP/s (forward: 4·B·H·S²·d; backward: the tutorial's count, "
                    "4·B·H·S²·d x 0.5 causal x 2.5)")
    axes.set_title("The static estimator on external kernels vs their published measurements", fontsize=9)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", type=Path, help="JSON list of cases (code_object paths relative to its folder)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--reuse", type=Path, help="earlier --json output: its rows stand in for the cases whose "
                        "code object is not on this machine (same name, shape, kernel and code object file)")
    args = parser.parse_args(argv)
    objdump = find_objdump()
    if objdump is None:
        print("llvm-objdump (>= 19) not found", file=sys.stderr)
        return 2
    cases = json.loads(args.cases.read_text(encoding="utf-8"))
    earlier = json.loads(args.reuse.read_text(encoding="utf-8"))["kernels"] if args.reuse else []
    rows = []
    for case in cases:
        if not (args.cases.parent / case["code_object"]).exists() and args.reuse:
            same = [r for r in earlier if (r["name"], r["shape"], r["kernel"], r["code_object"]["file"]) ==
                    (case["name"], case["shape"], case["kernel"], case["code_object"])]
            if len(same) != 1:
                raise RuntimeError(f"{case['name']}: no code object and no single earlier row")
            print(f"{case['name']} {'x'.join(map(str, case['shape']))}: code object absent, earlier row reused",
                  file=sys.stderr)
            rows.append({k: v for k, v in same[0].items() if k != "residual_under_fit"})
            continue
        rows.append(estimate(case, args.cases.parent, objdump))
    print_table(rows)
    fits = fitted_ratios(rows)
    for target, fit in fits.items():
        print(f"{target}: measured / pessimistic estimate, geometric mean over the {fit['cases_in_fit']} cases in the "
              f"fit: {fit['factor']}; residuals under it: {fit['residuals']}")
    if args.json:
        args.json.write_text(json.dumps({"model_constants": {"vmem_latency": throughput_estimate.VMEM_LATENCY,
                                                             "lds_latency": throughput_estimate.LDS_LATENCY,
                                                             "trans_cycles_pess": throughput_estimate.TRANS_CYCLES_PESS},
                                         "fit": fits, "kernels": rows}, indent=1), encoding="utf-8")
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
