"""Static throughput estimate of the masked forward kernels (gfx1100 and gfx1201), next to the
unmasked ones, from the instructions the CPU interpreter executes per key tile (bench/estimate_masked.py
prints and records it).

Not a measurement. The masked kernels choose their bias loads at run time (mask dtype, key stride,
ragged tiles), so the static estimator's reading of one loop body (throughput_estimate.py) would
count every path at once. Here the interpreter runs the shipped code object with Sq = one
workgroup's rows and Sk = 3 and 4 key tiles; the difference of the two runs, per wave and per
instruction address, is exactly what one more key tile executes for that mask. Those counts go
through the estimator's own tally() and are priced like the plain forward, in speed_model.py's named
cycle terms at the ends of its stall band, with the same occupancy and launch (4096 tokens, 16 batch x
heads).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import torch

from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.runtime import artifacts, loader as runtime, variants
from rdna_flash_attn.runtime.codeobject import load_code_object
from . import speed_model as sm, throughput_estimate
from .interpreter import InterpretedLibrary
from .resource_report import occupancy

HEAD_DIMS, DTYPES = (64, 128), ("f16", "bf16")
FORWARD_HEAD_DIMS = (40, *HEAD_DIMS)  # SD1.5's 40 for its shape below (the backward's are HEAD_DIMS)
TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


PADDED_KEYS = 8  # a padding mask's masked keys: the sequence's last ones, inside its last key tile


def _padded_tail(seq_k):
    """True for the kept keys: all but the last PADDED_KEYS, as a prompt padded to its length."""
    return torch.arange(seq_k).view(1, 1, 1, seq_k) < seq_k - PADDED_KEYS


def _scattered(generator, seq_k):
    return torch.rand(1, 1, 1, seq_k, generator=generator) > 0.25


def _additive(keep, dtype):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


KEY_PADDING = "key padding, additive (B,1,1,Sk)"
SCATTERED = "scattered key mask, additive (B,1,1,Sk)"
# case -> (generator, seq_q, seq_k, dtype) -> its mask. A padding mask masks the tail of the keys, so
# one more key tile is one of its kept tiles, which run without the biases (kernels/fa_fwd.h); the
# scattered mask (a quarter of the keys at random) puts a masked key in every tile: what a tile holding
# padded keys costs.
MASK_MAKERS = {
    "none": lambda g, sq, sk, dt: None,
    KEY_PADDING: lambda g, sq, sk, dt: _additive(_padded_tail(sk), dt),
    "key padding, bool (B,1,1,Sk)": lambda g, sq, sk, dt: _padded_tail(sk),
    SCATTERED: lambda g, sq, sk, dt: _additive(_scattered(g, sk), dt),
    "full additive (1,1,Sq,Sk)": lambda g, sq, sk, dt: torch.randn(1, 1, sq, sk, generator=g).to(dt),
    "full bool (1,1,Sq,Sk)": lambda g, sq, sk, dt: torch.rand(1, 1, sq, sk, generator=g) > 0.25,
}
VARLEN = "varlen (packed, cu_seqlens)"
CASES = (*MASK_MAKERS, VARLEN)

# Shapes masked and packed calls take in the models: (name, dtype, d, mask case, batch, heads,
# query lengths, key lengths, length every entry is padded to or None, the masked keys of a padding mask
# as (first, end) or None), one length per batch entry. Flux's joint attention under the T5 mask (512
# text tokens first, a 100-token prompt, then 4096 image tokens), Wan's cross-attention to its 512 T5
# tokens (the same prompt), HunyuanVideo's joint attention (256 text tokens last, the same prompt), an
# SDXL call with a full (Sq, Sk) bias; a packed batch of four prompts of different lengths, as
# flash-attn's varlen callers hand it, against the same batch padded to its longest with a key-padding
# mask (the padded rows computed and thrown away).
PACKED = (4608, 3584, 2560, 1536)
PROMPT = 100  # T5 tokens of the prompt; the rest of the text tokens are padding
SHAPES = (
    ("Flux, T5 key padding", "bf16", 128, KEY_PADDING, 1, 24, (4608,), (4608,), None, (PROMPT, 512)),
    ("Wan 2.x cross-attention, T5 key padding", "bf16", 128, KEY_PADDING, 1, 40, (32760,), (512,), None,
     (PROMPT, 512)),
    ("HunyuanVideo, T5 key padding", "bf16", 128, KEY_PADDING, 1, 24, (16384,), (16384,), None,
     (16128 + PROMPT, 16384)),
    ("SDXL, full additive bias", "f16", 64, "full additive (1,1,Sq,Sk)", 2, 10, (4096,), (4096,), None, None),
    ("packed batch of 4 (varlen)", "bf16", 128, VARLEN, 4, 24, PACKED, PACKED, None, None),
    ("the same batch padded to 4608, key padding", "bf16", 128, KEY_PADDING, 4, 24, PACKED, PACKED, 4608, None),
    # Issue 23's model shapes without a mask, and the shapes the measured kernels of
    # estimator_calibration.md were timed at (docs/performance.md: next to their published figures).
    ("Flux", "bf16", 128, "none", 1, 24, (4608,), (4608,), None, None),
    ("SDXL", "f16", 64, "none", 2, 10, (4096,), (4096,), None, None),
    ("SD1.5", "f16", 40, "none", 2, 8, (4096,), (4096,), None, None),
    ("Wan 2.x self-attention", "bf16", 128, "none", 1, 40, (32760,), (32760,), None, None),
    ("gcnasm v201's (RX 9070 XT: 117.9)", "bf16", 128, "none", 1, 32, (1536,), (1536,), None, None),
    ("gcnasm v153's (RX 9070 XT: 94.8)", "bf16", 128, "none", 4, 32, (4096,), (4096,), None, None),
    ("aiter Triton's (RX 7900 XTX: 60.84)", "f16", 128, "none", 2, 16, (8192,), (8192,), None, None),
)


def runs_masked(case: str) -> bool:
    """Whether `case` runs in a masked kernel variant (a packed batch runs in the unmasked ones)."""
    return case not in ("none", VARLEN)


def masks(kind: str, seq_q: int, seq_k: int, dtype: torch.dtype):
    return MASK_MAKERS[kind](torch.Generator().manual_seed(1), seq_q, seq_k, dtype)


def executed(library: InterpretedLibrary, variant, dtype: str, head_dim: int, case: str, key_tiles: int):
    """Executions per code offset of one forward launch (one workgroup), and its wave count. VARLEN:
    the same problem as a packed batch of one entry."""
    generator = torch.Generator().manual_seed(0)
    seq_k = key_tiles * variant.block_n
    q = torch.randn(1, 1, variant.block_rows, head_dim, generator=generator).to(TORCH_DTYPES[dtype])
    k, v = (torch.randn(1, 1, seq_k, head_dim, generator=generator).to(TORCH_DTYPES[dtype]) for _ in range(2))
    library.traces.clear()
    with runtime.explicit_library(library):
        if case == VARLEN:
            packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (tokens, heads, d)
            ops.flash_attention_varlen_forward(*packed, torch.tensor([0, variant.block_rows], dtype=torch.int32),
                                               torch.tensor([0, seq_k], dtype=torch.int32), variant.block_rows, seq_k)
        else:
            ops.flash_attention_forward(q, k, v, attn_mask=masks(case, variant.block_rows, seq_k, q.dtype))
    trace = library.traces[variant.symbol]
    return trace.by_offset, trace.waves


def tile_counts(library, body, variant, dtype, head_dim, case) -> throughput_estimate.TileCounts:
    """What one more key tile executes per wave, tallied as the static estimator tallies a loop body,
    with O's rescale (where a kernel skips it) run on throughput_estimate.rescaled_tile_share of the tiles, as the
    static estimate counts it, whether or not the fourth tile's random scores met a new maximum."""
    # 3 and 4 key tiles: the bf16 prologue's loop runs as often for both (bench/interpreter_trace_gfx1100.py).
    fewer, waves = executed(library, variant, dtype, head_dim, case, 3)
    more, _ = executed(library, variant, dtype, head_dim, case, 4)
    return _tally_difference(body, fewer, more, waves, _rescale_weights(body, variant, fewer, more, waves))


def _rescale_weights(body, variant, fewer: Counter, more: Counter, waves: int) -> dict[int, float]:
    """Executions per tile and wave, by code offset, of each tile loop's O rescale block (and of the else it
    jumps over) on rescaled_tile_share of the tiles, in the loops the added tile went through. Not the bf16
    kernels' huge-score blocks (throughput_estimate.rescale_blocks), and not code no model input reaches (a
    zero scale's else inside the block's span: throughput_estimate.live_addresses)."""
    share, base, weights = throughput_estimate.rescaled_tile_share(variant.block_n), body[0].addr, {}
    for span in throughput_estimate.key_tile_loops(body):
        live = throughput_estimate.live_addresses(body, span)
        for block in throughput_estimate.rescale_blocks(body, span, []):
            branch = block[0] - 4 - base  # the 4-byte branch that skips the block
            trips = (more[branch] - fewer[branch]) / waves
            runs_per_tile = throughput_estimate.rescale_runs(body, block, share)
            weights |= {addr - base: runs * trips for addr, runs in runs_per_tile.items() if addr in live}
    return weights


BACKWARD_CASES = ("none", KEY_PADDING, "full additive (1,1,Sq,Sk)")


def backward_tile(library, body, kind: str, dtype: str, head_dim: int, case: str) -> throughput_estimate.TileCounts:
    """What one more streamed tile (keys for dQ, both sweeps; queries for dK/dV) executes per wave."""
    variant = variants.bwd_variant(kind, dtype, head_dim, masked=runs_masked(case))
    rows = variant.waves * 16
    runs = []
    for tiles in (3, 4):
        seq_q, seq_k = (rows, tiles * variant.block_tile) if kind == "dq" else (tiles * variant.block_tile, rows)
        generator = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, 1, n, head_dim, generator=generator).to(TORCH_DTYPES[dtype])
                         for n in (seq_q, seq_k, seq_k, seq_q))
        mask = masks(case, seq_q, seq_k, q.dtype)
        with runtime.explicit_library(library):
            _, lse = ops.flash_attention_forward(q, k, v, attn_mask=mask)
            library.traces.clear()
            ops.flash_attention_backward(dout, q, k, v, lse, attn_mask=mask)
        trace = library.traces[variant.symbol]
        runs.append((trace.by_offset, trace.waves))
    (fewer, waves), (more, _) = runs
    return _tally_difference(body, fewer, more, waves)


def _tally_difference(body, fewer: Counter, more: Counter, waves: int,
                      weights: dict[int, float] | None = None) -> throughput_estimate.TileCounts:
    """Executions per wave that one more tile adds, per instruction; `weights` replaces them by offset."""
    by_address = {i.addr - body[0].addr: i for i in body}
    runs = {offset: (more[offset] - fewer[offset]) / waves for offset in set(more) | set(fewer)} | (weights or {})
    return throughput_estimate.tally([(by_address[offset], n, "tile") for offset, n in runs.items() if n])


def analyse_backward(path: Path, objdump: str) -> list[dict]:
    """Executed counts per streamed tile of the backward kernels (f16): no throughput model here,
    backward_throughput_estimate.py models the unmasked backward."""
    co = load_code_object(path)
    functions = throughput_estimate.disassemble(objdump, path, co.target)
    library = InterpretedLibrary(artifacts.Artifact(co.target, path, hashlib.sha256(path.read_bytes()).hexdigest(),
                                                    emulated=False))
    rows = []
    for d in HEAD_DIMS:
        for kind in ("dq", "dkdv"):
            for case in BACKWARD_CASES:
                variant = variants.bwd_variant(kind, "f16", d, masked=runs_masked(case))
                c = backward_tile(library, functions[variant.symbol], kind, "f16", d, case)
                rows.append({"target": co.target, "d": d, "kernel": variant.symbol, "mask": case,
                             "tile_rows": variant.block_tile, "counts_per_wave_tile": {
                    k: round(getattr(c, k), 2) for k in ("wmma", "valu", "trans", "salu", "global_load_insts",
                                                          "vmem_rounds")}})
    return rows


# What speed_model.tile_terms reads of a tile's counts, and the instruction counts shown beside them.
RECORDED_COUNTS = ("wmma", "wmma_8bit", "valu", "trans", "salu", "branch", "waitcnt", "global_load_insts",
                   "global_load_bytes", "lds_read_insts", "lds_read_bytes", "lds_write_insts", "lds_write_bytes",
                   "vmem_rounds", "lds_rounds")


def head_dim_share(variant, d: int) -> float:
    """The useful head dim one workgroup's tile computes: its share of d."""
    return d / variant.d_chunks


def analyse(path: Path, objdump: str, stall_band: dict[str, float]) -> list[dict]:
    """Every mask case of the forward kernels of one code object, at 4096 tokens and 16 batch x heads,
    priced at the target's stall band (low, mid, high stall share: bench/speed_model.stall_bands)."""
    data = path.read_bytes()
    co = load_code_object(path)
    hw = throughput_estimate.HARDWARE[co.target]
    functions = throughput_estimate.disassemble(objdump, path, co.target)
    kernels = {k.name: k for k in co.kernels}
    library = InterpretedLibrary(artifacts.Artifact(co.target, path, hashlib.sha256(data).hexdigest(), emulated=False))
    rows = []
    for dtype in DTYPES:
        for d in FORWARD_HEAD_DIMS:
            for case in CASES:
                variant = variants.fwd_variant(dtype, d, masked=runs_masked(case))
                counts = tile_counts(library, functions[variant.symbol], variant, dtype, d, case)
                recorded = {k: round(getattr(counts, k), 2) for k in RECORDED_COUNTS}
                occ = occupancy(co.target, kernels[variant.symbol], variant.threads)
                groups = (throughput_estimate.SEQ // variant.block_rows) * variant.d_chunks * throughput_estimate.BATCH_HEADS
                tail = sm.launch_tail(hw, occ.waves_per_simd, variant.waves, groups)
                rows.append({
                    "target": co.target, "dtype": dtype, "d": d, "mask": case, "kernel": variant.symbol,
                    "block_n": variant.block_n, "waves_per_simd": occ.waves_per_simd, "counts_per_wave_tile": recorded,
                    "tail": round(tail, 3),
                    **sm.priced(recorded, hw, occ.waves_per_simd, variant.block_n, head_dim_share(variant, d), tail,
                                stall_band),
                })
            none = next(r for r in rows if r["target"] == co.target and r["dtype"] == dtype and r["d"] == d
                        and r["mask"] == "none")
            for r in rows[-len(CASES):]:
                r["vs_unmasked"] = round(r["tflops"]["mid"] / none["tflops"]["mid"], 3)
    return rows


def _biased_tiles(run_k: int, block_n: int, masked_keys: tuple[int, int] | None) -> int:
    """Key tiles of a padding mask that hold a masked key (they add the biases); the rest run plain."""
    if masked_keys is None:
        return 0
    first, end = masked_keys[0], min(masked_keys[1], run_k)
    return -(-end // block_n) - first // block_n if first < end else 0


def _row(rows: list[dict], target: str, dtype: str, d: int, mask: str) -> dict:
    return next(r for r in rows if (r["target"], r["dtype"], r["d"], r["mask"]) == (target, dtype, d, mask))


def shape_rows(rows: list[dict], stall_bands: dict, shapes=SHAPES) -> list[dict]:
    """SHAPES priced with the per-tile counts of `rows` at each target's stall band: every workgroup of the
    launch runs its key tiles at the tile's cycles in the named terms, the partly filled last query and key
    tiles computed in full (they count as work, not as useful FLOPs), the launch's tail from its own
    workgroup count. Under a padding mask, tiles holding a masked key (an entry's padding, or the shape's
    masked keys) are priced as the scattered mask's tiles. FLOPs are the useful ones, 4 * Sq * Sk * d per
    entry and head; the terms, per 16x64 tile and SIMD at the band's middle, are the mix of the launch's
    tiles."""
    priced = []
    for name, dtype, d, case, batch, heads, lengths_q, lengths_k, padded_to, masked_keys in shapes:
        for target in sorted({r["target"] for r in rows}):
            variant = variants.fwd_variant(dtype, d, masked=runs_masked(case))
            hw, plain = throughput_estimate.HARDWARE[target], _row(rows, target, dtype, d, case)
            biased_row = _row(rows, target, dtype, d, SCATTERED) if case == KEY_PADDING else plain
            tiles = biased = groups = useful = 0
            for length_q, length_k in zip(lengths_q * batch if len(lengths_q) == 1 else lengths_q,
                                          lengths_k * batch if len(lengths_k) == 1 else lengths_k):
                run_q, run_k = (padded_to, padded_to) if padded_to else (length_q, length_k)
                blocks = -(-run_q // variant.block_rows) * variant.d_chunks * heads
                groups += blocks
                tiles += blocks * -(-run_k // variant.block_n)
                masked = (length_k, padded_to) if padded_to and length_k < padded_to else masked_keys
                biased += blocks * _biased_tiles(run_k, variant.block_n, masked if case == KEY_PADDING else None)
                useful += 4 * length_q * length_k * d * heads
            tail = sm.launch_tail(hw, plain["waves_per_simd"], variant.waves, groups)
            terms = {}
            for end in sm.ENDS:
                plain_terms, biased_terms = (
                    sm.tile_terms(r["counts_per_wave_tile"], hw, r["waves_per_simd"], variant.block_n,
                                  stall_bands[target][end]) for r in (plain, biased_row))
                terms[end] = {k: ((tiles - biased) * plain_terms[k] + biased * biased_terms[k]) / tiles for k in sm.TERMS}
            # every wave of a workgroup runs each of its key tiles (block_n keys: a 64-key tile's share)
            wave_tiles = tiles * variant.waves
            seconds = {end: wave_tiles * sum(terms[end].values()) * variant.block_n / sm.TILE_KEYS
                       / (hw.cus * throughput_estimate.SIMDS_PER_CU * hw.clock_hz) / tail for end in sm.ENDS}
            priced.append({"shape": name, "target": target, "dtype": dtype, "d": d, "mask": case,
                           "batch": batch, "heads": heads, "lengths_q": list(lengths_q), "lengths_k": list(lengths_k),
                           "padded_to": padded_to, "masked_keys": masked_keys,
                           "tiles_with_masked_keys": round(biased / tiles, 3),
                           "useful_gflop": round(useful / 1e9, 1), "workgroups": groups, "tail": round(tail, 3),
                           "useful_share_of_tiles": round(useful / (wave_tiles * row_flops(variant, d)), 3),
                           "terms": sm.rounded(terms["mid"]), "cycles": round(sum(terms["mid"].values()), 1),
                           "tflops": sm.figure_band({end: useful / seconds[end] / 1e12 for end in sm.ENDS})})
    return priced


def row_flops(variant, d: int) -> int:
    """Useful FLOPs of one wave's key tile: its 16 query rows against block_n keys, its share of d."""
    return 4 * 16 * variant.block_n * d // variant.d_chunks
