"""Executed instruction counts of the forward kernel (the CPU interpreter's trace) against the
static estimator's reconstruction of one key tile, for gfx1100 d64/d128.

Timing-free: the interpreter runs the code object with Sq = one workgroup's rows and Sk = 3 and 4
key tiles; the difference of the two runs, per wave, is exactly what one more key tile executes (O's
rescale, where the kernel skips it, weighted as the estimator weights it). Those counts are tallied
with the estimator's own tally(), so the columns mean the same.

    python3 -m bench.interpreter_trace_gfx1100 prebuilt/rdna_fa_gfx1100.hsaco \
        --md bench/results/interpreter_trace_gfx1100.md --json bench/results/interpreter_trace_gfx1100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from rdna_fa_lab import masked_throughput_estimate, throughput_estimate
from rdna_fa_lab.interpreter import InterpretedLibrary
from rdna_fa_lab.resource_report import find_objdump
from rdna_flash_attn.runtime import artifacts, variants

KINDS = ("wmma", "valu", "trans", "salu", "branch", "barrier", "waitcnt", "hint", "lds_read", "lds_write",
         "global_load", "global_store", "smem")


def per_tile(library, functions, dtype, head_dim) -> dict[str, float]:
    """One more key tile's executions per wave (masked_throughput_estimate.tile_counts: 3 and 4 key
    tiles, O's rescale where a kernel skips it on the estimator's share of the tiles)."""
    variant = variants.fwd_variant(dtype, head_dim)
    body = functions[variant.symbol]
    counts = masked_throughput_estimate.tile_counts(library, body, variant, dtype, head_dim, "none")
    return static({"counts_per_wave_tile": asdict(counts)})


def static(row: dict) -> dict[str, float]:
    c = row["counts_per_wave_tile"]
    return {**{k: c.get(k, 0) for k in KINDS if k in c}, "vopd": c["vopd"],
            "lds_read": c["lds_read_insts"], "lds_write": c["lds_write_insts"],
            "global_load": c["global_load_insts"], "global_store": c["global_store"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("code_object", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = args.code_object.read_bytes()
    artifact = artifacts.Artifact("gfx1100", args.code_object, hashlib.sha256(data).hexdigest(), emulated=False)
    library = InterpretedLibrary(artifact)
    objdump = find_objdump()
    functions = throughput_estimate.disassemble(objdump, args.code_object, "gfx1100")
    static_rows = {(r["dtype"], r["d"]): r for r in throughput_estimate.analyse(args.code_object, objdump)}
    rows = []
    for dtype in ("f16", "bf16"):
        for d in (64, 128):
            rows.append({"dtype": dtype, "d": d, "kernel": variants.fwd_variant(dtype, d).symbol,
                         "executed": per_tile(library, functions, dtype, d), "static": static(static_rows[(dtype, d)])})
    result = {"code_object": {"file": str(args.code_object), "sha256": artifact.sha256}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    lines = [f"| kernel | {' | '.join(KINDS)} | vopd |", "|---|" + "---|" * (len(KINDS) + 1)]
    for r in rows:
        cells = []
        for kind in (*KINDS, "vopd"):
            e, s = r["executed"][kind], r["static"].get(kind, 0)
            cells.append(f"{e:g}" if abs(e - s) < 1e-9 else f"**{e:g}** / {s:g}")
        lines.append(f"| {r['kernel']} | {' | '.join(cells)} |")
    table = "\n".join(lines)
    print(table)
    if args.md:
        text = args.md.read_text() if args.md.exists() else ""
        marker = "<!-- table -->"
        args.md.write_text(text.split(marker)[0] + marker + "\n" + table + "\n" + marker + text.split(marker)[2]
                           if text.count(marker) == 2 else table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
