"""Static throughput estimate of the forward kernel on RDNA3 (gfx1100) and RDNA4 (gfx1201), read from its
disassembly (rdna_fa_lab/throughput_estimate.py): printed per kernel, recorded as JSON, plotted.

Not a measurement: it counts the instructions of one key-tile iteration of the compiled main loop
and turns them into cycles with a simple pipe model (see bench/results/forward_estimate_gfx1100.md for
the sources of every constant).

    python3 -m bench.estimate_gfx1100 /tmp/est/rdna_fa_gfx1100.hsaco /tmp/est/rdna_fa_gfx1201.hsaco \
        --json bench/results/forward_estimate_gfx1100.json --png bench/results/forward_estimate_gfx1100.png
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import (BATCH_HEADS, CALIBRATION, CALIBRATION_SOURCE, HARDWARE, LDS_LATENCY, SEQ,
                                             TRANS_CYCLES_PESS, VMEM_LATENCY, analyse)


def print_report(rows: list[dict]) -> None:
    for hw_target in dict.fromkeys(r["target"] for r in rows):
        hw = HARDWARE[hw_target]
        print(f"\n{hw_target} ({hw.gpu}): clock {hw.clock_hz / 1e9:.2f} GHz implied by {hw.peak_tflops} TFLOP/s, "
              f"WMMA 16x16x16 = {hw.wmma_cycles:g} SIMD cycles; TFLOP/s calibrated x{CALIBRATION[hw_target]} "
              f"({CALIBRATION_SOURCE[hw_target]}), the model's own in the JSON's *_nominal")
        for r in (r for r in rows if r["target"] == hw_target):
            c, m = r["counts_per_wave_tile"], r["model"]
            loops = ", ".join(f"{l['role']} x{l['trips']}" for l in r["inner_loops"])
            print(f"\n  {r['kernel']}  waves/SIMD {r['waves_per_simd']} ({r['occupancy_limit']}); "
                  f"main loop {r['main_loop'][0]}-{r['main_loop'][1]}; inner: {loops}")
            print(f"    per wave per key tile: WMMA {c['wmma']}  VALU {c['valu']} (VOPD {c['vopd']})  "
                  f"TRANS {c['trans']}  SALU {c['salu']}  branch {c['branch']}  barrier {c['barrier']}  "
                  f"waitcnt {c['waitcnt']}  hints {c['hint']}")
            print(f"    LDS read {c['lds_read_insts']} insts / {c['lds_read_bytes']} B, write "
                  f"{c['lds_write_insts']} / {c['lds_write_bytes']} B; global load {c['global_load_insts']} / "
                  f"{c['global_load_bytes']} B; rounds vmem {c['vmem_rounds']} lds {c['lds_rounds']}")
            print("    VALU+TRANS by region: " + ", ".join(f"{k} {v}" for k, v in c["valu_by_region"].items()))
            print("    VALU+TRANS mix: " + ", ".join(f"{op} {n}" for op, n in c["valu_mix"]))
            print("    cycles/SIMD: " + "  ".join(f"{k} {v:g}" for k, v in m["cycles"].items()))
            print(f"    => optimistic {m['cycles_opt']:g} cyc ({m['bound_opt']}) {m['tflops_opt']} TFLOP/s; "
                  f"pessimistic {m['cycles_pess']:g} cyc ({m['bound_pess']}, tail x{m['tail_efficiency']}) "
                  f"{m['tflops_pess']} TFLOP/s; no-reuse DRAM cap {m['tflops_dram_no_reuse_cap']} TFLOP/s")
    print(f"\n{'target':8} {'d':>4} {'kernel':22} {'W/SIMD':>6} {'pess':>6} {'opt':>6} {'DRAMcap':>8} {'target':>7}"
          f"  TFLOP/s on 4*Sq*Sk*d (best published gfx1100 {HARDWARE['gfx1100'].published_tflops:g})")
    for r in rows:
        m, goal = r["model"], r["target_tflops_pess"]
        met = "" if goal is None else f">={goal:g} " + ("met" if m["tflops_pess"] >= goal else "MISSED")
        print(f"{r['target']:8} {r['d']:>4} {r['kernel']:22} {r['waves_per_simd']:>6} {m['tflops_pess']:>6} "
              f"{m['tflops_opt']:>6} {m['tflops_dram_no_reuse_cap']:>8} {met}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(len(targets), 1, figsize=(13, 5.5 * len(targets)), squeeze=False)
    bars = (("tflops_pess", "pessimistic", "tab:blue"), ("tflops_opt", "optimistic", "tab:cyan"),
            ("tflops_dram_no_reuse_cap", "cap if K/V never hit in cache", "lightgray"))
    for ax, target in zip(axes[:, 0], targets):
        hw, sel = HARDWARE[target], [r for r in rows if r["target"] == target]
        for k, (key, label, color) in enumerate(bars):
            x = [i + (k - 1) * 0.27 for i in range(len(sel))]
            values = [r["model"][key] for r in sel]
            ax.bar(x, values, width=0.27, color=color, label=label)
            for xi, value in zip(x, values):
                ax.text(xi, value + 1, f"{value:g}", ha="center", fontsize=7)
        ax.axhline(hw.peak_tflops, color="black", lw=1, label=f"peak {hw.peak_tflops:g}")
        goals = [(i, r["target_tflops_pess"]) for i, r in enumerate(sel) if r["target_tflops_pess"]]
        for n, (i, goal) in enumerate(goals):  # a target applies to its own bars only
            ax.hlines(goal, i - 0.45, i + 0.45, color="tab:green", ls="--",
                      label="target (pessimistic)" if n == 0 else None)
        ax.axhline(hw.published_tflops, color="tab:red", ls=":", label=f"best published {hw.published_tflops:g}")
        ax.set_xticks(range(len(sel)), [f"{r['dtype']} d{r['d']}" + (f" (pad {r['d_pad']})" if r["d_pad"] != r["d"] else "")
                                        for r in sel], fontsize=7)
        ax.set_ylim(0, hw.peak_tflops * 1.08)
        ax.set_ylabel("TFLOP/s (4·Sq·Sk·d, useful d)")
        ax.set_title(f"{target} {hw.gpu}: static estimate, calibrated (x{CALIBRATION[target]}: "
                     f"{CALIBRATION_SOURCE[target]}), not measured", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.suptitle(f"Forward, {SEQ} tokens, batch*heads {BATCH_HEADS}, non-causal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hsaco", nargs="+", type=Path, help="code objects (gfx1100 and optionally gfx1201)")
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument("--png", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    objdump = find_objdump()
    if objdump is None:
        print("llvm-objdump (>= 19) not found", file=sys.stderr)
        return 2
    rows = [row for path in args.hsaco for row in analyse(path, objdump)]
    print_report(rows)
    if args.json:
        constants = {"seq": SEQ, "batch_heads": BATCH_HEADS, "trans_cycles_pess": TRANS_CYCLES_PESS,
                     "vmem_latency": VMEM_LATENCY, "lds_latency": LDS_LATENCY,
                     "hardware": {k: {**asdict(v), "clock_hz": v.clock_hz, "wmma_cycles": v.wmma_cycles,
                                      "operand_copies": v.operand_copies, "eight_bit_rate": v.eight_bit_rate}
                                  for k, v in HARDWARE.items()}}
        args.json.write_text(json.dumps({"constants": constants, "kernels": rows}, indent=1))
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
