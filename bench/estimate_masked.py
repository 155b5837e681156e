"""Static throughput estimate of the masked forward kernels (gfx1100 and gfx1201), next to the
unmasked ones, from the instructions the CPU interpreter executes per key tile: printed and recorded as
JSON and Markdown. Not a measurement; how one more key tile's instructions are counted and priced:
rdna_fa_lab/masked_throughput_estimate.py.

    python3 -m bench.estimate_masked prebuilt/rdna_fa_gfx1100.hsaco prebuilt/rdna_fa_gfx1201.hsaco \
        --json bench/results/masked_estimate.json --md bench/results/masked_estimate.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from rdna_fa_lab.masked_throughput_estimate import PROMPT, analyse, analyse_backward, shape_rows
from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import BATCH_HEADS, CALIBRATION, SEQ

KEY_PADDING_TARGET = 0.97  # issue 20: a key-padding mask within 3 % of the unmasked kernel (pessimistic)


def backward_markdown(rows: list[dict]) -> str:
    lines = ["", "## Backward (f16): executed instructions per wave and streamed tile", "",
             "dQ: one more key tile (both of its sweeps); dK/dV: one more query tile; a tile's keys or queries "
             "in the column 'rows' (kernels of one head dim may stream tiles of different sizes). "
             "Counts only, no model.", "",
             "| target | d | kernel | mask | rows | VALU | TRANS | WMMA | loads | vmem waits to 0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts_per_wave_tile"]
        lines.append(f"| {r['target']} | {r['d']} | {r['kernel']} | {r['mask']} | {r['tile_rows']} | {c['valu']:g} | "
                     f"{c['trans']:g} | {c['wmma']:g} | {c['global_load_insts']:g} | {c['vmem_rounds']:g} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], sources: list[tuple[Path, str]]) -> str:
    lines = ["# Masked forward: static estimate (interpreter-executed counts), not a measurement", "",
             f"{SEQ} tokens, {BATCH_HEADS} batch x heads, non-causal; TFLOP/s on 4*Sq*Sk*d. "
             "Per key tile and wave, the instructions the CPU interpreter executed for each mask "
             "(bench/estimate_masked.py), priced by bench/estimate_gfx1100.py's model, calibrated (x"
             + ", x".join(f"{factor} on {target}" for target, factor in CALIBRATION.items())
             + ": bench/results/estimator_calibration.md). Target (issue 20): a "
             f"key-padding mask at >= {KEY_PADDING_TARGET:.0%} of the unmasked kernel, pessimistic column.", "",
             "Code objects: " + ", ".join(f"`{p}` (sha256 {h[:16]}...)" for p, h in sources), "",
             "| target | dtype | d | mask | kernel | W/SIMD | VALU | WMMA | global loads | vmem waits to 0 | "
             "bound (pess) | pess | opt | vs unmasked (pess) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, m = r["counts_per_wave_tile"], r["model"]
        lines.append(f"| {r['target']} | {r['dtype']} | {r['d']} | {r['mask']} | {r['kernel']} | {r['waves_per_simd']} | "
                     f"{c['valu']:g} | {c['wmma']:g} | {c['global_load_insts']:g} | {c['vmem_rounds']:g} | "
                     f"{m['bound_pess']} | {m['tflops_pess']} | {m['tflops_opt']} | {r['vs_unmasked_pess']:.2f} |")
    return "\n".join(lines) + "\n"


def shapes_markdown(priced: list[dict]) -> str:
    lines = ["", "## At the models' shapes", "",
             "The per-tile counts above priced for whole launches (`shape_rows`): partly filled last query and "
             "key tiles computed in full, TFLOP/s on useful FLOPs (4 Sq Sk d per entry and head), calibrated. "
             "A packed batch (varlen) launches max(Sq) / block_rows workgroups per entry and head; those past an "
             "entry's length return at once and are not counted here. Under a key-padding mask the tiles "
             f"holding a masked key (a {PROMPT}-token prompt's T5 padding, or an entry's padding) are priced as "
             "the scattered mask's tiles, the others as the padding mask's kept tiles.", "",
             "| shape | target | dtype | d | mask | B x H | Sq / Sk | useful GFLOP | useful share of the tiles | "
             "tiles with masked keys | pess | opt |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in priced:
        lengths = ("/".join(map(str, r["lengths_q"])) if r["lengths_q"] == r["lengths_k"]
                   else f"{'/'.join(map(str, r['lengths_q']))} / {'/'.join(map(str, r['lengths_k']))}")
        lines.append(f"| {r['shape']} | {r['target']} | {r['dtype']} | {r['d']} | {r['mask']} | {r['batch']} x "
                     f"{r['heads']} | {lengths} | {r['useful_gflop']:g} | {r['useful_share_of_tiles']:.3f} | "
                     f"{r['tiles_with_masked_keys']:.3f} | "
                     f"{r['tflops_pess']} | {r['tflops_opt']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hsaco", nargs="+", type=Path, help="code objects (gfx1100, gfx1201)")
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument("--md", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    objdump = find_objdump()
    if objdump is None:
        print("llvm-objdump (>= 19) not found", file=sys.stderr)
        return 2
    rows, backward = [], []
    for number, path in enumerate(args.hsaco, 1):
        print(f"[{number}/{len(args.hsaco)}] interpreting {path}", file=sys.stderr, flush=True)
        rows += analyse(path, objdump)
        backward += analyse_backward(path, objdump)
    sources = [(p, hashlib.sha256(p.read_bytes()).hexdigest()) for p in args.hsaco]
    priced = shape_rows(rows)
    text = markdown(rows, sources) + shapes_markdown(priced) + backward_markdown(backward)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"code_objects": [{"file": str(p), "sha256": h} for p, h in sources],
                                         "key_padding_target": KEY_PADDING_TARGET, "rows": rows,
                                         "shapes": priced, "backward": backward}, indent=1))
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
