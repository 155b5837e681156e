"""Static throughput estimate of the backward kernels on RDNA3 (gfx1100) and RDNA4 (gfx1201), read from
their disassembly: printed, recorded as JSON, plotted. Not a measurement; how one main-loop iteration
is traced: rdna_fa_lab/backward_throughput_estimate.py and bench/results/backward_estimate_gfx1100.md;
priced in the speed model's named cycle terms at each end of its stall band (bench/speed_model.py fits it).

    python3 -m bench.estimate_gfx1100_backward prebuilt/rdna_fa_gfx1100.hsaco prebuilt/rdna_fa_gfx1201.hsaco \
        --json bench/results/backward_estimate_gfx1100.json --png bench/results/backward_estimate_gfx1100.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.speed_model import stall_bands
from rdna_flash_attn.runtime.codeobject import load_code_object
from rdna_fa_lab.backward_throughput_estimate import analyse
from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import BATCH_HEADS, SEQ

TARGET_TFLOPS, PUBLISHED_TFLOPS = 35.0, 25.0  # DESIGN.md section 5; best published 7900 XTX backward


def print_report(results: list[dict]) -> None:
    for r in results:
        print(f"\n{r['target']} {r['dtype']} d{r['d']}: {r['flops'] / 1e9:.0f} GFLOP (10*Sq*Sk*D*BH)")
        for kind, k in r["kernels"].items():
            print(f"  {k['symbol']}: tile {k['block_tile']}, W/SIMD {k['waves_per_simd']} ({k['occupancy_limit']}), "
                  f"loops {k['inner_loop_trips']}")
            for name, c in k["counts_per_wave_iteration"].items():
                terms = k["terms_per_wave_iteration"][name]
                print(f"    {name:16} flags {k['flags_per_path'][name]}\n      WMMA {c['wmma']} VALU {c['valu']} "
                      f"(VOPD {c['vopd']}) TRANS {c['trans']} SALU {c['salu']} LDS r {c['lds_read_insts']}/"
                      f"{c['lds_read_bytes']} B w {c['lds_write_insts']}/{c['lds_write_bytes']} B global "
                      f"{c['global_load_insts']}/{c['global_load_bytes']} B waits vmem {c['vmem_rounds']} lds "
                      f"{c['lds_rounds']}; VALU+TRANS {c['valu_by_region']}")
                print("      cycles at the band's middle: " + " ".join(f"{a} {b:g}" for a, b in terms.items())
                      + f" => {sum(terms.values()):.1f}")
        for label, s in r["estimate"].items():
            t, ms = s["tflops"], s["ms"]
            print(f"  {label:36} {t['mid']:5} ({t['low']} - {t['high']}) TFLOP/s  ({ms['mid']} ms, {ms['low']} - "
                  f"{ms['high']}; share {s['share']})")


def plot(results: list[dict], bands: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({r["target"] for r in results})
    fig, axes = plt.subplots(1, len(targets), figsize=(7.5 * len(targets), 5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        sel = [r for r in results if r["target"] == target]
        figures = [r["estimate"]["now"]["tflops"] for r in sel]
        ax.bar(range(len(sel)), [f["mid"] for f in figures], width=0.6, color="tab:blue",
               yerr=[[f["mid"] - f["low"] for f in figures], [f["high"] - f["mid"] for f in figures]], capsize=3,
               label="stall band's middle (bars: its ends)")
        for xi, f in enumerate(figures):
            ax.text(xi, f["high"] + 0.5, f"{f['mid']:g}", ha="center", fontsize=8)
        if target == "gfx1100":
            ax.axhline(TARGET_TFLOPS, color="tab:green", ls="--", label=f"target {TARGET_TFLOPS:g}")
            ax.axhline(PUBLISHED_TFLOPS, color="tab:red", ls=":", label=f"best published ~{PUBLISHED_TFLOPS:g}")
        ax.set_xticks(range(len(sel)), [f"{r['dtype']} d{r['d']}" for r in sel])
        ax.set_ylim(0, max(TARGET_TFLOPS, *(f["high"] for f in figures)) * 1.3)
        ax.set_ylabel("TFLOP/s (backward = 10·Sq·Sk·D)")
        ax.set_title(f"Backward (dQ + dK/dV), {target} {sel[0]['gpu']}, {SEQ} tokens, batch*heads {BATCH_HEADS}, "
                     f"non-causal:\nspeed model, stall {bands[target]['low']:g}-{bands[target]['high']:g} of the "
                     "non-WMMA work, not measured", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
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
    bands = stall_bands()
    results = []
    for path in args.hsaco:
        results += analyse(path, objdump, bands[load_code_object(path).target])
    print_report(results)
    if args.json:
        args.json.write_text(json.dumps({"seq": SEQ, "batch_heads": BATCH_HEADS, "stall_band": bands,
                                         "target_tflops": TARGET_TFLOPS,
                                         "published_tflops": PUBLISHED_TFLOPS, "results": results}, indent=1))
    if args.png:
        plot(results, bands, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
