#!/usr/bin/env python3
"""Static throughput estimate of the 8-bit forward ("8-bit QK+PV", kernels/fa_fwd8.h) on gfx1201, next to
the exact kernel of the same head dim, and what its quantizing pass costs (issue 24).

Not a measurement. The kernel's key-tile loop goes through bench/estimate_gfx1100.py's reading of the
disassembly and its model unchanged, with one addition: an 8-bit WMMA costs half a 16-bit one on gfx12
(AMD's matrix instruction calculator: 8 cycles against 16). The calibration factor is the forward's.

The quantizing pass (ops/quantized.py) is memory-bound: its cost here is the bytes it moves over the
9070 XT's 640 GB/s, uncalibrated and optimistic (every byte at full DRAM bandwidth, no launch gaps).
Two figures: the bytes today's pass of torch operations moves (every aten op's inputs and outputs,
counted by running it on the CPU), and the least a fused pass would move (Q, K and V read twice for
their statistics and codes, the 8-bit codes and scales written once).

    python3 bench/estimate_8bit.py prebuilt/rdna_fa_gfx1201.hsaco --json bench/results/estimate_8bit.json \\
        --md bench/results/estimate_8bit.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import estimate_gfx1100 as estimator  # noqa: E402

from rdna_flash_attn.ops import quantized  # noqa: E402
from rdna_flash_attn.runtime import variants  # noqa: E402
from rdna_flash_attn.runtime.codeobject import load_code_object  # noqa: E402
from rdna_flash_attn.tools.report import find_objdump, occupancy  # noqa: E402

HEAD_DIMS, DTYPES = (40, 64, 80, 128, 160), ("f16", "bf16")
SPEEDUP_TARGET, PUBLISHED_FP8 = 1.7, 117.0  # issue 24: over the exact kernel at d128; best RDNA4 fp8 figure
PASS_TOKENS = 1024  # the pass's bytes scale with tokens; counted at this length, scaled to SEQ


class _ByteCounter(TorchDispatchMode):
    """Bytes every aten op reads and writes (its tensor arguments and results)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))):
            if isinstance(value, torch.Tensor):
                self.bytes += value.numel() * value.element_size()
        return out


def torch_pass_bytes(d: int, dtype: str) -> float:
    """Bytes today's pass moves per (batch, head) at SEQ tokens, from a count at PASS_TOKENS."""
    tdtype = torch.float16 if dtype == "f16" else torch.bfloat16
    q, k, v = (torch.randn(1, 1, PASS_TOKENS, d).to(tdtype) for _ in range(3))
    with _ByteCounter() as counter:
        quantized.quantize_inputs(q, k, v, 0.1, variants.fwd8_variant(dtype, d))
    return counter.bytes * estimator.SEQ / PASS_TOKENS


def fused_pass_bytes(d: int) -> float:
    """The least a fused pass moves per (batch, head): 16-bit Q once, K and V twice (mean, then codes),
    8-bit codes written once (scales are a few per 16 tokens: left out)."""
    return estimator.SEQ * d * (2 + 2 * 2 * 2 + 3 * 1)


def pass_seconds(pass_bytes: float, hw: estimator.Hardware) -> float:
    return pass_bytes * estimator.BATCH_HEADS / (hw.dram_gbs * 1e9)


def eight_bit_row(functions, co, kernels, dtype: str, d: int) -> dict:
    hw = estimator.HARDWARE[co.target]
    variant = variants.fwd8_variant(dtype, d)
    body = functions[variant.symbol]
    main = estimator.main_loop(body)
    loops = estimator.inner_loops(body, main, variant)
    counts = estimator.count_tile(body, main, loops)
    expected = 2 * variant.d_pad // 16 * (variant.block_n // 16)  # S^T and O^T, both over d_pad
    if counts.wmma != expected or counts.wmma_8bit != expected:
        raise RuntimeError(f"{variant.symbol}: {counts.wmma} WMMA ({counts.wmma_8bit} 8-bit) per tile, "
                           f"expected {expected} 8-bit")
    occ = occupancy(co.target, kernels[variant.symbol], variant.threads)
    model = estimator.model(counts, hw, variant, occ.waves_per_simd, flops=4 * 16 * variant.block_n * d,
                            groups=(estimator.SEQ // variant.block_rows) * estimator.BATCH_HEADS)
    flops = 4.0 * estimator.SEQ * estimator.SEQ * d * estimator.BATCH_HEADS
    attention_s = flops / (model["tflops_pess"] * 1e12)
    with_pass = {name: round(flops / (attention_s + pass_seconds(b, hw)) / 1e12, 1)
                 for name, b in (("torch_pass", torch_pass_bytes(d, dtype)), ("fused_pass", fused_pass_bytes(d)))}
    return {"kernel": variant.symbol, "dtype": dtype, "d": d, "d_pad": variant.d_pad,
            "waves_per_simd": occ.waves_per_simd, "occupancy_limit": occ.limited_by,
            "counts_per_wave_tile": {k: v for k, v in vars(counts).items() if k not in ("valu_mix",)},
            "model": model, "tflops_pess_with_pass": with_pass,
            "pass_bytes_per_head": {"torch_pass": torch_pass_bytes(d, dtype), "fused_pass": fused_pass_bytes(d)}}


def analyse(path: Path, objdump: str) -> list[dict]:
    co = load_code_object(path)
    if not variants.has_fwd8(co.target):
        raise SystemExit(f"{path}: {co.target} has no 8-bit kernels (gfx12 only)")
    functions = estimator.disassemble(objdump, path, co.target)
    kernels = {k.name: k for k in co.kernels}
    exact = {(r["dtype"], r["d"]): r for r in estimator.analyse(path, objdump)}
    rows = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            row = eight_bit_row(functions, co, kernels, dtype, d)
            row["exact_tflops_pess"] = exact[(dtype, d)]["model"]["tflops_pess"]
            row["speedup_kernel"] = round(row["model"]["tflops_pess"] / row["exact_tflops_pess"], 2)
            row["speedup_with_fused_pass"] = round(row["tflops_pess_with_pass"]["fused_pass"] / row["exact_tflops_pess"], 2)
            row["speedup_with_torch_pass"] = round(row["tflops_pess_with_pass"]["torch_pass"] / row["exact_tflops_pess"], 2)
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    hw = estimator.HARDWARE["gfx1201"]
    lines = ["# 8-bit forward (\"8-bit QK+PV\") on gfx1201: static estimate (issue 24)", "",
             f"Not measured: `bench/estimate_8bit.py` reads the shipped code object's disassembly through "
             f"`bench/estimate_gfx1100.py`'s model, an 8-bit WMMA at half a 16-bit one's cycles, calibrated "
             f"x{estimator.CALIBRATION['gfx1201']} like the forward. {estimator.SEQ} tokens, batch x heads "
             f"{estimator.BATCH_HEADS}, non-causal; TFLOP/s on 4*Sq*Sk*d (useful d), pessimistic column. The "
             f"quantizing pass: bytes over {hw.dram_gbs:g} GB/s (uncalibrated, optimistic).", "",
             "| dtype | d | exact kernel | 8-bit kernel | x exact | + fused pass (bound) | x exact | + today's torch pass | x exact | bound | waves/SIMD |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["model"]
        lines.append(f"| {r['dtype']} | {r['d']} | {r['exact_tflops_pess']} | {m['tflops_pess']} | {r['speedup_kernel']} | "
                     f"{r['tflops_pess_with_pass']['fused_pass']} | {r['speedup_with_fused_pass']} | "
                     f"{r['tflops_pess_with_pass']['torch_pass']} | {r['speedup_with_torch_pass']} | "
                     f"{m['bound_pess']} | {r['waves_per_simd']} |")
    d128 = [r for r in rows if r["d"] == 128]
    lines += ["", f"Issue 24's targets at d128: >= {SPEEDUP_TARGET}x the exact kernel counting the quantization, and "
              f"above {PUBLISHED_FP8:g} TFLOP/s (best published RDNA4 fp8 figure). " + "; ".join(
                  f"{r['dtype']}: kernel {r['speedup_kernel']}x, with a fused pass {r['speedup_with_fused_pass']}x "
                  f"({r['tflops_pess_with_pass']['fused_pass']} TFLOP/s), with today's pass {r['speedup_with_torch_pass']}x"
                  for r in d128) + ".", "",
              "## Per wave per key tile (8-bit kernel)", "",
              "| dtype | d | WMMA (8-bit) | VALU | TRANS | LDS read B | global load B | cycles simd_pess | latency_bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, cyc = r["counts_per_wave_tile"], r["model"]["cycles"]
        lines.append(f"| {r['dtype']} | {r['d']} | {c['wmma']} ({c['wmma_8bit']}) | {c['valu']} | {c['trans']} | "
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
    rows = analyse(args.hsaco, objdump)
    text = markdown(rows)
    if args.json:
        args.json.write_text(json.dumps({"seq": estimator.SEQ, "batch_heads": estimator.BATCH_HEADS, "kernels": rows},
                                        indent=1) + "\n")
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
