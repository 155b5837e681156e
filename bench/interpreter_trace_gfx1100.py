#!/usr/bin/env python3
"""Executed instruction counts of the forward kernel (the CPU interpreter's trace) against the
static estimator's reconstruction of one key tile, for gfx1100 d64/d128.

Timing-free: the interpreter runs the code object with Sq = one workgroup's rows and Sk = 3 and 4
key tiles; the difference of the two runs, per wave, is exactly what one more key tile executes.
Those counts are classified with the estimator's own classify(), so the columns mean the same.

    python3 bench/interpreter_trace_gfx1100.py prebuilt/rdna_fa_gfx1100.hsaco \
        --md bench/results/interpreter_trace_gfx1100.md --json bench/results/interpreter_trace_gfx1100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import estimate_gfx1100 as estimator  # noqa: E402

from rdna_flash_attn.runtime import artifacts, loader as runtime, variants  # noqa: E402
from rdna_flash_attn.ops import attention as ops  # noqa: E402
from rdna_flash_attn.interpreter import InterpretedLibrary  # noqa: E402
from rdna_flash_attn.tools.report import find_objdump  # noqa: E402

KINDS = ("wmma", "valu", "trans", "salu", "branch", "barrier", "waitcnt", "hint", "lds_read", "lds_write",
         "global_load", "global_store", "smem")


def executed(library: InterpretedLibrary, dtype: str, head_dim: int, key_tiles: int) -> tuple[Counter, int]:
    """Executed mnemonics of one forward launch (one workgroup), and its wave count."""
    variant = variants.fwd_variant(dtype, head_dim)
    torch_dtype = torch.float16 if dtype == "f16" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, variant.block_rows, head_dim, dtype=torch_dtype, generator=generator)
    k, v = (torch.randn(1, 1, key_tiles * variant.block_n, head_dim, dtype=torch_dtype, generator=generator)
            for _ in range(2))
    library.traces.clear()
    with runtime.explicit_library(library):
        ops.flash_attention_forward(q, k, v)
    trace = library.traces[variant.symbol]
    return trace.mnemonics(), trace.waves


def per_tile(library, dtype, head_dim) -> dict[str, float]:
    # 3 and 4 key tiles (Sk = 192, 256): the bf16 prologue has a loop of one pass per power of two
    # below Sk, and both lengths need the same number (2 and 3 tiles would not: 128 -> 192 adds one).
    fewer, waves = executed(library, dtype, head_dim, 3)
    more, _ = executed(library, dtype, head_dim, 4)
    kinds = Counter()
    for name in set(fewer) | set(more):
        kinds[estimator.classify(name)] += more[name] - fewer[name]
    kinds["vopd"] = sum(more[n] - fewer[n] for n in set(fewer) | set(more) if n.startswith("v_dual_"))
    return {kind: kinds[kind] / waves for kind in (*KINDS, "vopd")}


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
    static_rows = {(r["dtype"], r["d"]): r for r in estimator.analyse(args.code_object, find_objdump())}
    rows = []
    for dtype in ("f16", "bf16"):
        for d in (64, 128):
            rows.append({"dtype": dtype, "d": d, "kernel": variants.fwd_variant(dtype, d).symbol,
                         "executed": per_tile(library, dtype, d), "static": static(static_rows[(dtype, d)])})
    result = {"code_object": {"file": str(args.code_object), "sha256": artifact.sha256}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    lines = [f"| kernel | {' | '.join(KINDS)} | vopd |", "|---|" + "---|" * (len(KINDS) + 1)]
    for r in rows:
        cells = []
        for kind in (*KINDS, "vopd"):
            e, s = r["executed"][kind], r["static"].get(kind, 0)
            cells.append(f"{e:g}" if e == s else f"**{e:g}** / {s:g}")
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
