"""Static throughput estimate of the 8-bit forward ("8-bit QK+PV", kernels/fa_fwd8.h) on gfx1201, next to
the exact kernel of the same head dim, with and without its quantizing pass (kernels/quant8.h; issue 24).

Not a measurement. The attention kernel's key-tile loop goes through the forward estimate's reading of
the disassembly and its model unchanged (rdna_fa_lab/throughput_estimate.py), with one addition: an 8-bit
WMMA costs half a 16-bit one on gfx12 (AMD's matrix instruction calculator: 8 cycles against 16). The
calibration factor is the forward's. Where the kernel skips O's rescale on tiles without a new row
maximum, that block counts on the forward's share of the tiles (throughput_estimate.rescaled_tile_share).

K and V's quantizing pass is memory-bound (a few VALU operations per value against 5 bytes): its cost here
is the bytes its two launches move over the 9070 XT's 640 GB/s, an optimistic figure (full DRAM bandwidth,
no launch gap): 16-bit K and V read twice (channel statistics, then codes), their 8-bit codes written once,
and the scales (a float per 16 keys, three per channel). The kernel quantizes Q itself: it reads 16-bit Q
rows where it read 8-bit ones, once per workgroup, outside the key-tile loop the model counts.

    python3 -m bench.estimate_8bit prebuilt/rdna_fa_gfx1201.hsaco --json bench/results/estimate_8bit.json \\
        --md bench/results/estimate_8bit.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rdna_fa_lab import throughput_estimate
from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import BATCH_HEADS, CALIBRATION, HARDWARE, SEQ

SPEEDUP_TARGET, PUBLISHED_FP8 = 1.7, 117.0  # issue 24: over the exact kernel at d128; best RDNA4 fp8 figure


def markdown(rows: list[dict]) -> str:
    hw = HARDWARE["gfx1201"]
    lines = ["# 8-bit forward (\"8-bit QK+PV\") on gfx1201: static estimate (issue 24)", "",
             f"Not measured: `bench/estimate_8bit.py` reads the shipped code object's disassembly through "
             f"`bench/estimate_gfx1100.py`'s model, an 8-bit WMMA at half a 16-bit one's cycles, calibrated "
             f"x{CALIBRATION['gfx1201']} like the forward. {SEQ} tokens, batch x heads "
             f"{BATCH_HEADS}, non-causal; TFLOP/s on 4*Sq*Sk*d (useful d), pessimistic column. K and "
             f"V's quantizing pass (kernels/quant8.h; the kernel quantizes Q itself): its bytes over "
             f"{hw.dram_gbs:g} GB/s (uncalibrated, optimistic).", "",
             "| dtype | d | exact kernel | 8-bit kernel | x exact | 8-bit with its pass | x exact | pass MB per head | bound | waves/SIMD |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["model"]
        lines.append(f"| {r['dtype']} | {r['d']} | {r['exact_tflops_pess']} | {m['tflops_pess']} | {r['speedup_kernel']} | "
                     f"{r['tflops_pess_with_pass']} | {r['speedup_with_pass']} | {r['pass_bytes_per_head'] / 1e6:.2f} | "
                     f"{m['bound_pess']} | {r['waves_per_simd']} |")
    d128 = [r for r in rows if r["d"] == 128]
    lines += ["", f"Issue 24's targets at d128: >= {SPEEDUP_TARGET}x the exact kernel counting the quantization, and "
              f"above {PUBLISHED_FP8:g} TFLOP/s (best published RDNA4 fp8 figure). " + "; ".join(
                  f"{r['dtype']}: kernel {r['speedup_kernel']}x ({r['model']['tflops_pess']} TFLOP/s), with its pass "
                  f"{r['speedup_with_pass']}x ({r['tflops_pess_with_pass']} TFLOP/s)" for r in d128) + ".", "",
              "## Per wave per key tile (8-bit kernel)", "",
              "| dtype | d | WMMA (8-bit) | VALU | TRANS | LDS read B | global load B | cycles simd_pess | latency_bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, cyc = r["counts_per_wave_tile"], r["model"]["cycles"]
        lines.append(f"| {r['dtype']} | {r['d']} | {c['wmma']:g} ({c['wmma_8bit']:g}) | {c['valu']:.4g} | {c['trans']:.4g} | "
                     f"{c['lds_read_bytes']} | {c['global_load_bytes']} | {cyc['simd_pess']:g} | {cyc['latency_bound']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hsaco", type=Path, help="a gfx12 code object (prebuilt/rdna_fa_gfx1201.hsaco)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args(argv)
    objdump = find_objdump()
    if objdump is None:
        print("llvm-objdump (>= 19) not found", file=sys.stderr)
        return 2
    rows = throughput_estimate.analyse_eight_bit(args.hsaco, objdump)
    text = markdown(rows)
    if args.json:
        args.json.write_text(json.dumps({"seq": SEQ, "batch_heads": BATCH_HEADS, "kernels": rows},
                                        indent=1) + "\n")
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
