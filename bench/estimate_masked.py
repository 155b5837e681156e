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

from bench.speed_model import stall_bands
from rdna_fa_lab import speed_model as sm
from rdna_fa_lab.masked_throughput_estimate import PROMPT, analyse, analyse_backward, shape_rows
from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import BATCH_HEADS, SEQ
from rdna_flash_attn.runtime.codeobject import load_code_object

KEY_PADDING_TARGET = 0.97  # issue 20: a key-padding mask within 3 % of the unmasked kernel (band's middle)


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


def _band_text(figures: dict) -> str:
    return f"{figures['mid']:g} ({figures['low']:g}–{figures['high']:g})"


def _terms_text(terms: dict) -> str:
    return " | ".join(f"{terms[k]:g}" for k in sm.TERMS)


def _bands_text(bands: dict) -> str:
    return "; ".join(f"{t} {b['low']:g}–{b['high']:g} (middle {b['mid']:g})" for t, b in bands.items())


def markdown(rows: list[dict], sources: list[tuple[Path, str]], bands: dict) -> str:
    lines = ["# Masked forward: static estimate (interpreter-executed counts), not a measurement", "",
             f"{SEQ} tokens, {BATCH_HEADS} batch x heads, non-causal; TFLOP/s on 4*Sq*Sk*d. "
             "Per key tile and wave, the instructions the CPU interpreter executed for each mask "
             "(bench/estimate_masked.py), priced in the speed model's named cycle terms "
             "(rdna_fa_lab/speed_model.py) at the middle of its stall band, the band's ends in brackets; stall "
             f"band (share of the non-WMMA work, bench/results/speed_model.md): {_bands_text(bands)}. Terms: "
             "cycles per 16x64 tile and SIMD at the band's middle; they add up to the cycles. Target (issue 20): "
             f"a key-padding mask at >= {KEY_PADDING_TARGET:.0%} of the unmasked kernel at the band's middle.", "",
             "Code objects: " + ", ".join(f"`{p}` (sha256 {h[:16]}...)" for p, h in sources), "",
             "| target | dtype | d | mask | kernel | W/SIMD | VALU | WMMA | global loads | vmem waits to 0 | "
             "TFLOP/s: middle (low–high) | vs unmasked | cycles | " + " | ".join(sm.TERMS) + " |",
             "|" + "---|" * 21]
    for r in rows:
        c = r["counts_per_wave_tile"]
        lines.append(f"| {r['target']} | {r['dtype']} | {r['d']} | {r['mask']} | {r['kernel']} | {r['waves_per_simd']} | "
                     f"{c['valu']:g} | {c['wmma']:g} | {c['global_load_insts']:g} | {c['vmem_rounds']:g} | "
                     f"{_band_text(r['tflops'])} | {r['vs_unmasked']:.2f} | {r['cycles']:g} | {_terms_text(r['terms'])} |")
    return "\n".join(lines) + "\n"


def shapes_markdown(priced: list[dict]) -> str:
    lines = ["", "## At the models' shapes", "",
             "The per-tile counts above priced for whole launches (`shape_rows`): partly filled last query and "
             "key tiles computed in full, TFLOP/s on useful FLOPs (4 Sq Sk d per entry and head) at the stall "
             "band's middle (its ends in brackets). "
             "A packed batch (varlen) launches max(Sq) / block_rows workgroups per entry and head; those past an "
             "entry's length return at once and are not counted here. Under a key-padding mask the tiles "
             f"holding a masked key (a {PROMPT}-token prompt's T5 padding, or an entry's padding) are priced as "
             "the scattered mask's tiles, the others as the padding mask's kept tiles; the terms (cycles per "
             "16x64 tile and SIMD, band's middle) are the mix of the launch's tiles.", "",
             "| shape | target | dtype | d | mask | B x H | Sq / Sk | useful GFLOP | useful share of the tiles | "
             "tiles with masked keys | TFLOP/s: middle (low–high) | cycles | " + " | ".join(sm.TERMS) + " |",
             "|" + "---|" * 21]
    for r in priced:
        lengths = ("/".join(map(str, r["lengths_q"])) if r["lengths_q"] == r["lengths_k"]
                   else f"{'/'.join(map(str, r['lengths_q']))} / {'/'.join(map(str, r['lengths_k']))}")
        lines.append(f"| {r['shape']} | {r['target']} | {r['dtype']} | {r['d']} | {r['mask']} | {r['batch']} x "
                     f"{r['heads']} | {lengths} | {r['useful_gflop']:g} | {r['useful_share_of_tiles']:.3f} | "
                     f"{r['tiles_with_masked_keys']:.3f} | {_band_text(r['tflops'])} | {r['cycles']:g} | "
                     f"{_terms_text(r['terms'])} |")
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
    bands = stall_bands()
    rows, backward = [], []
    for number, path in enumerate(args.hsaco, 1):
        print(f"[{number}/{len(args.hsaco)}] interpreting {path}", file=sys.stderr, flush=True)
        rows += analyse(path, objdump, bands[load_code_object(path).target])
        backward += analyse_backward(path, objdump)
    sources = [(p, hashlib.sha256(p.read_bytes()).hexdigest()) for p in args.hsaco]
    priced = shape_rows(rows, bands)
    text = markdown(rows, sources, bands) + shapes_markdown(priced) + backward_markdown(backward)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"code_objects": [{"file": str(p), "sha256": h} for p, h in sources],
                                         "key_padding_target": KEY_PADDING_TARGET, "stall_band": bands,
                                         "rows": rows,
                                         "shapes": priced, "backward": backward}, indent=1))
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
