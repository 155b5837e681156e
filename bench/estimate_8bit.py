"""Static throughput estimate of the 8-bit forward ("8-bit QK+PV", kernels/fa_fwd8.h) on gfx1201, next to
the exact kernel of the same head dim, with and without its quantizing pass (kernels/quant8.h; issue 24).

Not a measurement. The attention kernel's key-tile loop goes through the forward estimate's reading of
the disassembly (rdna_fa_lab/throughput_estimate.py) and is priced like the exact forward, in the speed
model's named cycle terms (rdna_fa_lab/speed_model.py) at the middle and ends of its stall band, an 8-bit
WMMA at the tuning table's 8-bit rate (gfx12: twice the 16-bit one). Where the kernel skips O's rescale
on tiles without a new row maximum, that block counts on the forward's share of the tiles
(throughput_estimate.rescaled_tile_share).

K and V's quantizing pass is memory-bound (a few VALU operations per value against 5 bytes): it is
reported beside the kernel as a bandwidth cost, the bytes its two launches read and write over the GPU's
DRAM bandwidth (hardware table), an optimistic figure (full bandwidth, no launch gap), and the two added
per call. The kernel quantizes Q itself: it reads 16-bit Q rows where it read 8-bit ones, once per
workgroup, outside the key-tile loop the model counts.

    python3 -m bench.estimate_8bit prebuilt/rdna_fa_gfx1201.hsaco --json bench/results/estimate_8bit.json \\
        --md bench/results/estimate_8bit.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.speed_model import ours_at, stall_bands
from rdna_fa_lab import speed_model as sm, throughput_estimate
from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import BATCH_HEADS, HARDWARE, SEQ

SPEEDUP_TARGET, PUBLISHED_FP8 = 1.7, 117.0  # issue 24: over the exact kernel at d128; best RDNA4 fp8 figure


def priced(row: dict, exact: dict, stall_band: dict) -> dict:
    """One 8-bit kernel at SEQ tokens and BATCH_HEADS: the kernel alone in the named terms, its quantizing
    pass as bytes over DRAM bandwidth, their sum per call, and the exact kernel of the same dtype and head
    dim at the same shape; times and speeds at the band's middle and ends."""
    hw = HARDWARE[row["target"]]
    d, counts, waves_per_simd = row["d"], row["counts_per_wave_tile"], row["waves_per_simd"]
    tail = sm.launch_tail(hw, waves_per_simd, row["waves"], row["workgroups"])
    flops = 4.0 * SEQ * SEQ * d * BATCH_HEADS
    kernel_s = {end: flops / (sm.tflops(sum(sm.tile_terms(counts, hw, waves_per_simd, row["block_n"],
                                                            stall_band[end]).values()), hw, d, tail) * 1e12)
                for end in sm.ENDS}
    pass_s = throughput_estimate.pass_seconds(row["pass_bytes_per_head"], hw)
    kernel = sm.priced(counts, hw, waves_per_simd, row["block_n"], d, tail, stall_band)
    exact_tflops = ours_at(exact, (1, BATCH_HEADS, SEQ, d), stall_band)["tflops"]
    per_call = sm.figure_band({end: flops / (kernel_s[end] + pass_s) / 1e12 for end in sm.ENDS})
    return {
        "kernel_alone": {**kernel, "tail": round(tail, 3), "ms": {end: round(kernel_s[end] * 1e3, 3) for end in sm.ENDS}},
        "quantizing_pass": {"bytes_per_head": row["pass_bytes_per_head"], "dram_gbs": hw.dram_gbs,
                            "ms": round(pass_s * 1e3, 3)},
        "per_call": {"ms": {end: round((kernel_s[end] + pass_s) * 1e3, 3) for end in sm.ENDS}, "tflops": per_call},
        "exact_tflops": exact_tflops,
        "speedup_kernel": round(kernel["tflops"]["mid"] / exact_tflops["mid"], 2),
        "speedup_per_call": round(per_call["mid"] / exact_tflops["mid"], 2),
    }


def _band_text(figures: dict) -> str:
    return f"{figures['mid']:g} ({figures['low']:g}–{figures['high']:g})"


def markdown(rows: list[dict], stall_band: dict) -> str:
    hw = HARDWARE["gfx1201"]
    lines = ["# 8-bit forward (\"8-bit QK+PV\") on gfx1201: static estimate (issue 24)", "",
             "Not measured: `bench/estimate_8bit.py` reads the shipped code object's disassembly and prices its "
             "key tile in the speed model's named cycle terms (`rdna_fa_lab/speed_model.py`), an 8-bit WMMA at "
             f"1/{hw.eight_bit_rate} of a 16-bit one's cycles; TFLOP/s at the middle of the stall band (share "
             f"of the non-WMMA work {stall_band['low']:g}–{stall_band['high']:g}, middle {stall_band['mid']:g}: "
             "bench/results/speed_model.md), its ends in brackets. "
             f"{SEQ} tokens, batch x heads {BATCH_HEADS}, non-causal; TFLOP/s on 4*Sq*Sk*d (useful d). K and "
             "V's quantizing pass (kernels/quant8.h; the kernel quantizes Q itself), a bandwidth cost: the bytes it "
             f"reads and writes over {hw.dram_gbs:g} GB/s (full bandwidth, no launch gap); per call: the kernel and "
             "its pass.", "",
             "| dtype | d | exact kernel | 8-bit kernel | x exact | kernel ms | pass MB read / written per head | "
             "pass ms | per call ms | per call TFLOP/s | x exact | waves/SIMD |",
             "|" + "---|" * 12]
    for r in rows:
        k, q, c = r["kernel_alone"], r["quantizing_pass"], r["per_call"]
        lines.append(f"| {r['dtype']} | {r['d']} | {_band_text(r['exact_tflops'])} | {_band_text(k['tflops'])} | "
                     f"{r['speedup_kernel']} | {k['ms']['mid']:g} ({k['ms']['low']:g}–{k['ms']['high']:g}) | "
                     f"{q['bytes_per_head']['read'] / 1e6:.2f} / {q['bytes_per_head']['written'] / 1e6:.2f} | "
                     f"{q['ms']:g} | {c['ms']['mid']:g} ({c['ms']['low']:g}–{c['ms']['high']:g}) | "
                     f"{_band_text(c['tflops'])} | {r['speedup_per_call']} | {r['waves_per_simd']} |")
    d128 = [r for r in rows if r["d"] == 128]
    lines += ["", f"Issue 24's targets at d128: >= {SPEEDUP_TARGET}x the exact kernel counting the quantization, and "
              f"above {PUBLISHED_FP8:g} TFLOP/s (best published RDNA4 fp8 figure). " + "; ".join(
                  f"{r['dtype']}: kernel {r['speedup_kernel']}x ({_band_text(r['kernel_alone']['tflops'])} TFLOP/s), per "
                  f"call with its pass {r['speedup_per_call']}x ({_band_text(r['per_call']['tflops'])} TFLOP/s)"
                  for r in d128) + ".", "",
              "## The 8-bit kernel's terms (cycles per 16x64 tile and SIMD, band's middle)", "",
              "| dtype | d | WMMA (8-bit) per wave and key tile | cycles | " + " | ".join(sm.TERMS) + " |",
              "|" + "---|" * (4 + len(sm.TERMS))]
    for r in rows:
        c, k = r["counts_per_wave_tile"], r["kernel_alone"]
        lines.append(f"| {r['dtype']} | {r['d']} | {c['wmma']:g} ({c['wmma_8bit']:g}) | {k['cycles']:g} | "
                     + " | ".join(f"{k['terms'][t]:g}" for t in sm.TERMS) + " |")
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
    eight_bit, exact = throughput_estimate.analyse_eight_bit(args.hsaco, objdump)
    stall_band = stall_bands()[eight_bit[0]["target"]]
    by_kernel = {(r["dtype"], r["d"]): r for r in exact}
    rows = [{**row, **priced(row, by_kernel[(row["dtype"], row["d"])], stall_band)} for row in eight_bit]
    text = markdown(rows, stall_band)
    if args.json:
        args.json.write_text(json.dumps({"seq": SEQ, "batch_heads": BATCH_HEADS, "stall_band": stall_band,
                                         "kernels": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
