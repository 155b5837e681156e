"""Static throughput estimate of the attention kernels on RDNA3 (gfx1100) and RDNA4 (gfx1201), read from
their disassembly: the pipe model, the reading of a kernel's instructions, the forward's key tile and the
8-bit forward.

Not a measurement: it counts the instructions of one key-tile iteration of the compiled main loop and
turns them into cycles with the simple pipe model below (bench/results/forward_estimate_gfx1100.md gives
the sources of every constant; bench/estimate_gfx1100.py prints and records it, bench/estimate_external.py
runs it on external kernels and fits its calibration). The counts read here are priced in named cycle
terms by speed_model.py, whose one fitted term is checked on held-out kernels (bench/speed_model.py): the
forward's, and those of the backward (backward_throughput_estimate.py), masked and packed
(masked_throughput_estimate.py) and 8-bit kernels (bench/estimate_gfx1100_backward.py,
bench/estimate_masked.py and bench/estimate_8bit.py print and record them).

A tile's instructions are counted on the share of tiles that run them (tile_runs): O's rescale where the
kernel skips it on tiles without a new row maximum, and in bf16 forwards the test of the tile's maximum
against kHugeScore on every tile, while the rounding of such scores is a cold path that model inputs never
take, counted apart (cold_path_counts).

The 8-bit forward ("8-bit QK+PV", kernels/fa_fwd8.h, gfx1201) goes through the forward's reading
of the key-tile loop; where the kernel skips O's rescale on tiles without a new row maximum, that block
counts on the forward's share of the tiles. K and V's quantizing pass (kernels/quant8.h) is memory-bound:
its cost is the bytes its two launches read and write over the GPU's DRAM bandwidth, an optimistic figure
(full bandwidth, no launch gap).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rdna_flash_attn.runtime import tuning, variants
from rdna_flash_attn.runtime.codeobject import load_code_object
from .resource_report import occupancy

# --- Problem and model constants ---------------------------------------------------------------
SEQ, BATCH_HEADS = 4096, 16  # non-causal self-attention, Sq = Sk
# Stable Diffusion's head dims: 40 (SD1.5), 64 (SDXL), 80, 128, 160, 512 (VAE mid-block). Dims that
# are no multiple of 16 run in the next padded variant; TFLOP/s count only the useful 4*Sq*Sk*d.
HEAD_DIMS, DTYPES = (40, 64, 80, 128, 160, 512), ("f16", "bf16")
EIGHT_BIT_HEAD_DIMS = (40, 64, 80, 128, 160)
# Issue 13 targets, pessimistic column: gfx1100 >= 75 at d64 and >= 90 at d128, >= 60 at d40 (its
# padding to 48 must not eat the gain); gfx1201 >= 110 at d128.
TARGETS = {("gfx1100", 40): 60.0, ("gfx1100", 64): 75.0, ("gfx1100", 128): 90.0, ("gfx1201", 128): 110.0}
SIMDS_PER_CU, CUS_PER_WGP = 2, 2
TRANS_CYCLES_PESS = 4  # SISchedule.td: "F16 or F32 transcendental instructions (these are quarter rate)"
VMEM_LATENCY = 320  # SISchedule.td GFX11SpeedModel WriteVMEM (the compiler's figure, not a measurement)
LDS_LATENCY = 20  # SISchedule.td GFX11SpeedModel WriteLDS


@dataclass(frozen=True)
class Hardware:
    target: str
    gpu: str
    cus: int
    peak_tflops: float  # dense f16 WMMA, DESIGN.md section 3
    flop_per_clk_cu: int  # AMD's FLOPS/clock/CU table for f16 WMMA (RDNA3 512, RDNA4 1024 dense)
    dram_gbs: float
    cache_gbs: float | None  # K/V re-reads hit L2 / Infinity Cache: AMD's 5.3 TB/s GCD-MCD peak; None: unknown
    lds_bytes_clk_cu: int  # assumed 128 (32 banks x 4 B per CU), see the .md
    published_tflops: float  # best measured forward published, d128 (the README's anchors)

    @property
    def isa(self) -> tuning.MatrixIsa:  # the matrix ISA's capabilities: the tuning table's
        return tuning.isa_of(self.target)

    @property
    def operand_copies(self) -> int:
        """How many times a lane's 16x16 16-bit operand holds each value: its VGPRs over the 4 a single copy
        takes (16 x 16 x 2 bytes over 32 lanes); gfx11 duplicates A and B in both half-waves."""
        return self.isa.operand_vgprs // 4

    @property
    def eight_bit_rate(self) -> int:  # 8-bit WMMA (iu8, fp8) issue rate over the 16-bit one
        return self.isa.eight_bit_rate

    @property
    def clock_hz(self) -> float:  # the clock the peak figure implies: 2.50 GHz (7900 XTX), 2.97 (9070 XT)
        return self.peak_tflops * 1e12 / (self.cus * self.flop_per_clk_cu)

    @property
    def wmma_cycles(self) -> float:  # one 16x16x16 WMMA = 8192 FLOP on one SIMD
        return 2 * 16**3 / (self.flop_per_clk_cu / SIMDS_PER_CU)

    def bytes_per_clk_simd(self, gbs: float) -> float:
        return gbs * 1e9 / self.clock_hz / (self.cus * SIMDS_PER_CU)


HARDWARE = {
    "gfx1100": Hardware("gfx1100", "RX 7900 XTX", 96, 122.9, 512, 960, 5300, 128, 67.0),  # SDPA/AOTriton, comfy-kitchen
    "gfx1201": Hardware("gfx1201", "RX 9070 XT", 64, 194.6, 1024, 640, None, 128, 117.9),  # gcnasm v201 assembly, bf16
}

# The calibration (bench/estimate_external.py, bench/results/estimator_calibration.md): this
# model, run unchanged on external kernels whose RDNA throughput is published, over-predicts them.
# Per target, measured / pessimistic estimate (geometric mean over the kernels whose own source was
# measured) multiplies every figure of model() (the forward record's, bench/estimate_gfx1100.py);
# `*_nominal` keep the model's own. The speed model (speed_model.py) fits no such factor. One factor, no mechanism: the
# kernels measured are compute-bound, so the data cannot tell a lower sustained clock from a lower
# WMMA issue rate. CALIBRATION_SOURCE says where each factor comes from.
CALIBRATION = {"gfx1201": 0.729, "gfx1100": 0.644}
CALIBRATION_SOURCE = {
    "gfx1201": "gcnasm v201 (assembly) and v153 (HIP) on an RX 9070 XT, 3 published measurements",
    "gfx1100": "aiter's Triton flash attention on an RX 7900 XTX, 1 published measurement (built by another "
               "Triton than the one measured; heads and dtype inferred)",
}

def target_of(hw: Hardware) -> str:
    return hw.target


# --- Disassembly ---------------------------------------------------------------------------------
_HEADER = re.compile(r"^[0-9a-fA-F]+ <(.+)>:$")
_INSN = re.compile(r"^\s+(\S+)\s*(.*?)\s*//\s*([0-9A-Fa-f]+):")
_TRANS = re.compile(r"^v_(exp|log|rcp|rsq|sqrt|sin|cos)_")
_EIGHT_BIT_WMMA = re.compile(r"^v_wmma_\w+_(iu8|fp8|bf8)")
_WIDTH = re.compile(r"_(2addr_(?:stride64_)?)?[biu](8|16|32|64|96|128)")
# Scheduling hints and cache control: they take no pipe time in this model.
_HINTS = ("s_nop", "s_delay_alu", "s_set_inst_prefetch_distance", "s_clause", "buffer_gl0_inv",
          "global_inv", "global_wb", "s_barrier_signal")


@dataclass(frozen=True)
class Insn:
    addr: int
    op: str
    args: str


def disassemble(objdump: str, path: Path, target: str) -> dict[str, list[Insn]]:
    text = subprocess.run([objdump, "-d", f"--mcpu={target}", str(path)],
                          capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[Insn]] = {}
    body: list[Insn] = []
    for line in text.splitlines():
        if header := _HEADER.match(line):
            body = functions.setdefault(header.group(1), [])
        elif m := _INSN.match(line):
            body.append(Insn(int(m.group(3), 16), m.group(1), m.group(2)))
    return functions


def back_edges(body: list[Insn]) -> list[tuple[int, int]]:
    """(target, branch address) of every backward branch."""
    edges = []
    for i in body:
        if i.op == "s_branch" or i.op.startswith("s_cbranch_"):
            target = branch_target(i)
            if target <= i.addr:
                edges.append((target, i.addr))
    return edges


def lane_bytes(op: str) -> int:
    m = _WIDTH.search(op)
    return (2 if m.group(1) else 1) * int(m.group(2)) // 8


def classify(op: str) -> str:
    if op.startswith("v_wmma"):
        return "wmma"
    if _TRANS.match(op):
        return "trans"
    if op.startswith("v_"):
        return "valu"
    if op.startswith(("ds_load", "ds_read", "ds_bpermute", "ds_permute")):  # permutes cross the LDS too
        return "lds_read"
    if op.startswith(("ds_store", "ds_write")):
        return "lds_write"
    if op.startswith(("global_load", "buffer_load", "flat_load")):
        return "global_load"
    if op.startswith(("global_store", "buffer_store")):
        return "global_store"
    if op in ("s_barrier", "s_barrier_wait"):
        return "barrier"
    if op.startswith(("s_waitcnt", "s_wait_")):
        return "waitcnt"
    if op == "s_branch" or op.startswith("s_cbranch"):
        return "branch"
    if op.startswith(("s_load", "s_buffer_load")):
        return "smem"
    if op in _HINTS:
        return "hint"
    if op.startswith("s_"):
        return "salu"
    raise ValueError(f"unclassified instruction {op}")


# --- One key tile of the main loop ---------------------------------------------------------------


@dataclass(frozen=True)
class InnerLoop:
    role: str
    start: int
    end: int
    trips: int


@dataclass
class TileCounts:
    wmma: int = 0
    wmma_8bit: int = 0  # of which on 8-bit operands (Hardware.eight_bit_rate)
    valu: int = 0  # issues; a VOPD pair is one issue
    vopd: int = 0  # of which dual-issue pairs
    trans: int = 0
    salu: int = 0
    branch: int = 0
    barrier: int = 0
    waitcnt: int = 0
    hint: int = 0  # s_delay_alu, s_nop, prefetch, cache-invalidate: no pipe time in the model
    smem: int = 0
    global_store: int = 0
    lds_read_insts: int = 0
    lds_write_insts: int = 0
    lds_read_bytes: int = 0  # per wave: lane bytes x 32 lanes
    lds_write_bytes: int = 0
    global_load_insts: int = 0
    global_load_bytes: int = 0
    vmem_rounds: int = 0  # waits that drain the vector-memory counter: latencies the wave sits out
    lds_rounds: int = 0  # same for LDS
    valu_by_region: dict = field(default_factory=dict)  # VALU + TRANS issues per inner loop / rest
    valu_mix: list = field(default_factory=list)  # most frequent VALU + TRANS opcodes per tile


def key_tile_loops(body: list[Insn]) -> list[tuple[int, int]]:
    """The key-tile loops: the innermost backward-branch spans that hold a WMMA and a global (or buffer)
    load (the tile's K/V copy). Innermost: since the packed-batch arguments (ABI 2) clang lays the open and the
    masked tile loops out so that a backward branch of one spans the other whole."""
    def holds(span, kind):
        return any(span[0] <= i.addr <= span[1] and classify(i.op) == kind for i in body)

    spans = [span for span in back_edges(body) if holds(span, "wmma") and holds(span, "global_load")]
    return sorted(span for span in spans if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in spans))


def main_loop(body: list[Insn]) -> tuple[int, int]:
    """The loop that runs the interior key tiles.

    Before the masked/open split there was one key-tile loop. Since then the kernel has two: one for
    the tiles every query sees whole (no per-score mask) and one for the tiles that need the mask
    (the last, ragged tile; the causal diagonal). The open loop is the shorter one: the masked loop
    adds the per-score key compares. At 4096 keys, non-causal, every tile is open."""
    main = min(key_tile_loops(body), key=lambda span: sum(span[0] <= i.addr <= span[1] for i in body))
    # A second way back to the tile's start from past its end (a rescale block laid out behind the loop)
    # would leave that code out of every count.
    if any(target == main[0] and addr > main[1] for target, addr in back_edges(body)):
        raise RuntimeError(f"the key-tile loop at {hex(main[0])} has a back edge past its end")
    return main


def k_chunks_per_thread(variant) -> int:
    """16-byte chunks of a K tile the slowest thread copies: TileCopy's K loads in kernels/fa_fwd.h."""
    return -(-variant.block_n * variant.d_pad // 8 // variant.threads)


def vt_pairs_per_thread(variant) -> int:
    """Key pairs of a V^T tile (8 columns each) the slowest thread copies: TileCopy's kVUnits in kernels/fa_fwd.h."""
    return -(-(variant.block_n // 2) * (variant.d_chunk // 8) // variant.threads)


def copy_batches(variant) -> int:
    """Trips of the forward's K/V copy-batch loop: mirrors TileCopy in kernels/fa_fwd.h."""
    return -(-(k_chunks_per_thread(variant) + 2 * vt_pairs_per_thread(variant)) // variant.copy_loads)


def peeled_score_steps(target: str, variant) -> int:
    """S's head-dim steps ahead of its loop in an unmasked kernel: its traits' peeled_score_steps. (The
    masked kernels are priced from interpreter-executed counts: rdna_fa_lab/masked_throughput_estimate.py.)"""
    return variant.traits(target).peeled_score_steps


def inner_loops(body: list[Insn], main: tuple[int, int], variant, peeled_steps: int) -> list[InnerLoop]:
    """The loops inside the key-tile loop, with trip counts from the kernel source.

    Two source shapes are recognised. Up to kernels at 3e5b031 (fa_fwd.h): three single-level loops,
    load_rows for K, load_transposed for V^T, and the head-dim loop. From the batched copy on: the
    head-dim loop (its first `peeled_steps` run ahead of it; the compiler unrolls the rest away at d48 and
    d80, and at d64 where two are peeled) and, only where the copy is split into more than two batches (wide head dims), one loop over the
    batches that holds both the K and the V^T stores; otherwise the copy is unrolled and counted once, like the rest of the
    tile. The WMMA count check in analyse() catches a loop that this misses. The compiler rotates the load loops, so one loop
    can have several backward branches; overlapping spans are merged into one loop."""
    live = live_addresses(body, main)  # a backward branch in code only a non-positive scale runs is no loop
    spans = sorted((s, e) for s, e in back_edges(body)
                   if main[0] <= s and e <= main[1] and (s, e) != main and e in live)
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    key_frags, dim_frags = variant.block_n // 16, variant.d_pad // 16
    # Trips of the slowest wave (it sets the barrier's pace) where the work does not divide evenly.
    old_trips = {"K": k_chunks_per_thread(variant), "V^T": vt_pairs_per_thread(variant)}
    loops = []
    for s, e in merged:
        ops = [i.op for i in body if s <= i.addr <= e]
        wmma = sum(op.startswith("v_wmma") for op in ops)
        if wmma:
            unroll = wmma // key_frags  # head-dim steps per trip (the source asks for #pragma unroll 2)
            loops.append(InnerLoop(f"head-dim loop (unroll {unroll})", s, e, (dim_frags - peeled_steps) // unroll))
        elif any(op.startswith("global_load") for op in ops):
            k_rows = any(op == "ds_store_b128" for op in ops)
            # V^T's stores: pairs of keys in 32 bits, or one key per 16-bit store
            vt = any(op.startswith(("ds_store_b32", "ds_store_2addr_b32", "ds_store_b16")) for op in ops)
            if k_rows and vt:
                loops.append(InnerLoop("K+V^T copy batches -> LDS", s, e, copy_batches(variant)))
            else:
                role = "K" if k_rows else "V^T"
                loops.append(InnerLoop(f"{role} -> LDS" if role == "V^T" else "K rows -> LDS", s, e, old_trips[role]))
    roles = [loop.role.split()[0] for loop in loops]
    shapes = (["K", "V^T", "head-dim"], ["K", "V^T"], ["head-dim"], ["K+V^T", "head-dim"], [])
    if roles not in shapes or len(loops) != len(merged):
        raise RuntimeError(f"unexpected loop structure inside the key-tile loop: {[l.role for l in loops]}")
    return loops


def branch_target(i: Insn) -> int | None:
    """Where a SOPP branch goes (its offset counts dwords after the branch); None for any other instruction."""
    if i.op == "s_branch" or i.op.startswith("s_cbranch_"):
        offset = int(i.args.split()[0]) & 0xFFFF
        return i.addr + 4 + 4 * (offset - ((offset & 0x8000) << 1))
    return None


HUGE_SCORE_LITERAL = "0x4b800000"  # kHugeScore of kernels/fa_fwd.h, 2^24 as an f32 literal


def up_to_jump(body: list[Insn], block: tuple[int, int]) -> list[Insn]:
    """A block's instructions up to a jump over an else the block may end in (laid out behind it)."""
    part = []
    for i in body:
        if block[0] <= i.addr <= block[1]:
            if i.op == "s_branch":
                break
            part.append(i)
    return part


def is_huge_score_rounding(body: list[Insn], block: tuple[int, int]) -> bool:
    """Whether a skipped block is the forward's rounding of scores near their dtype's range (kHugeScore in
    kernels/fa_fwd.h): multiplications and moves (gfx12 keeps the scale in a scalar register) only, up to
    a jump over a zero scale's else. Model inputs never reach it."""
    ops = [i.op for i in up_to_jump(body, block) if classify(i.op) != "hint"]
    return bool(ops) and all(op.startswith(("v_mul_f32", "v_dual_mul_f32", "v_mov_b32", "v_dual_mov_b32", "s_mov_b32"))
                             for op in ops)


def tests_huge_scores(body: list[Insn], block: tuple[int, int]) -> bool:
    """Whether a block holds the test of the tile's maximum against kHugeScore: the bf16 forward runs it on
    every tile with a positive scale (the block a zero scale jumps over)."""
    return any(block[0] <= i.addr <= block[1] and i.op.startswith("v_cmp") and HUGE_SCORE_LITERAL in i.args
               for i in body)


def is_rescale(body: list[Insn], block: tuple[int, int]) -> bool:
    """Whether a skipped block is the forward's O rescale: the factor's one exp2, no WMMA."""
    kinds = [classify(i.op) for i in body if block[0] <= i.addr <= block[1]]
    return kinds.count("trans") == 1 and "wmma" not in kinds


def skipped_blocks(body: list[Insn], main: tuple[int, int], loops: list[InnerLoop]) -> list[tuple[int, int]]:
    """(first, last address) of the code a forward branch on a scalar condition skips in the tile, outside
    the inner loops and inside the key-tile loop (a branch out of the loop is its exit test). Branches
    on an empty exec mask (`s_cbranch_execz`) only guard per-lane work that some lane still runs."""
    blocks = []
    for i in body:
        if main[0] <= i.addr <= main[1] and i.op.startswith(("s_cbranch_scc", "s_cbranch_vcc")) and \
                not any(loop.start <= i.addr <= loop.end for loop in loops):
            target = branch_target(i)
            if i.addr < target <= main[1]:
                blocks.append((i.addr + 4, target - 4))
    return blocks


def rescale_blocks(body: list[Insn], main: tuple[int, int], loops: list[InnerLoop]) -> list[tuple[int, int]]:
    """The O rescale blocks of the tile: skipped blocks with its one exp2, neither the huge-score rounding
    nor the block its test sits in."""
    return [block for block in skipped_blocks(body, main, loops)
            if is_rescale(body, block) and not is_huge_score_rounding(body, block)
            and not tests_huge_scores(body, block)]


def branch_taken_share(body: list[Insn], i: Insn, rescale_share: float | None) -> float:
    """The share of tiles on which a forward branch on a scalar condition is taken, on model inputs: the
    huge-score rounding is skipped (a cold path, priced apart by cold_path_counts), the huge-score test
    is run (a positive scale), and O's rescale runs on `rescale_share` of the tiles. A kernel without the
    skipped rescale passes None; any other conditional block is an error."""
    target = branch_target(i)
    block = (i.addr + 4, target - 4)
    if is_huge_score_rounding(body, block):
        return 1.0
    if tests_huge_scores(body, block):
        return 0.0
    if rescale_share is not None and is_rescale(body, block):
        return 1.0 - rescale_share
    raise RuntimeError(f"unexpected conditional block in the key-tile loop: {tuple(map(hex, block))}")


def decides(i: Insn, main: tuple[int, int], loops: list[InnerLoop]) -> bool:
    """Whether branch_taken_share decides this instruction's path: a forward branch on a scalar condition
    inside the tile, outside its inner loops (whose code runs whole on every trip)."""
    return (i.op.startswith(("s_cbranch_scc", "s_cbranch_vcc"))
            and not any(loop.start <= i.addr <= loop.end for loop in loops)
            and i.addr < branch_target(i) <= main[1])


def live_addresses(body: list[Insn], main: tuple[int, int], rescale_share: float | None = 0.5) -> set[int]:
    """The tile's instructions some path of model inputs reaches (branch_taken_share's paths; branches it
    cannot decide followed both ways). Code that only a zero or negative scale runs (the else of the
    huge-score test, with its own backward branch into O's rescale) is not among them."""
    insns = [i for i in body if main[0] <= i.addr <= main[1]]
    index = {i.addr: n for n, i in enumerate(insns)}
    live, todo = set(), [main[0]]
    while todo:
        addr = todo.pop()
        if addr in live or addr not in index:
            continue
        live.add(addr)
        i = insns[index[addr]]
        target = branch_target(i)
        if i.op == "s_branch":
            todo.append(target)
            continue
        share = None
        if target is not None and i.op.startswith(("s_cbranch_scc", "s_cbranch_vcc")) and i.addr < target <= main[1]:
            try:
                share = branch_taken_share(body, i, rescale_share)
            except RuntimeError:
                share = None
        if target is not None and share != 0.0:
            todo.append(target)
        if share != 1.0 and index[addr] + 1 < len(insns):
            todo.append(insns[index[addr] + 1].addr)
    return live


def tile_runs(body: list[Insn], main: tuple[int, int], loops: list[InnerLoop],
              rescale_share: float | None) -> dict[int, float]:
    """Runs per tile of every instruction of the key-tile loop: one pass in address order carries the share
    of tiles that reach each instruction along forward branches (branch_taken_share); an inner loop runs
    its whole span `trips` times for each tile that enters it."""
    runs: dict[int, float] = {}
    reach = Counter({main[0]: 1.0})
    insns = [i for i in body if main[0] <= i.addr <= main[1]]
    n = 0
    while n < len(insns):
        i = insns[n]
        loop = next((loop for loop in loops if loop.start == i.addr), None)
        if loop is not None:
            inside = [j for j in insns[n:] if j.addr <= loop.end]
            entered = sum(reach[j.addr] for j in inside)
            for j in inside:
                runs[j.addr] = entered * loop.trips
            n += len(inside)
            if n < len(insns):
                reach[insns[n].addr] += entered
            continue
        share_here = reach[i.addr]
        runs[i.addr] = share_here
        target = branch_target(i)
        taken = 0.0
        if i.op == "s_branch" and target > i.addr:
            taken = 1.0
        elif target is not None and decides(i, main, loops):
            taken = branch_taken_share(body, i, rescale_share)
        if taken:
            reach[target] += share_here * taken
        if n + 1 < len(insns):
            reach[insns[n + 1].addr] += share_here * (1.0 - taken)
        n += 1
    return runs


def else_block(body: list[Insn], block: tuple[int, int]) -> tuple[int, int] | None:
    """The code a skipped block jumps over at its end (an if-else: it runs only when the block does not),
    or None."""
    last = next(i for i in body if i.addr == block[1])
    if last.op == "s_branch" and branch_target(last) > last.addr + 4:
        return last.addr + 4, branch_target(last) - 4
    return None


def rescale_runs(body: list[Insn], block: tuple[int, int], share: float) -> dict[int, float]:
    """Runs per tile, by address, of an O rescale block (on `share` of the tiles) and of the else it jumps
    over (on the rest): the masked estimator's weights for the executed trace."""
    other = else_block(body, block) or (0, -1)
    return {i.addr: share if block[0] <= i.addr <= block[1] else 1 - share
            for i in body if block[0] <= i.addr <= block[1] or other[0] <= i.addr <= other[1]}


RESCALE_REGION = "O rescale (a row's maximum rose)"


def region_of(i: Insn, loops: list[InnerLoop], rescale: list[tuple[int, int]]) -> str:
    loop = next((loop for loop in loops if loop.start <= i.addr <= loop.end), None)
    if loop is not None:
        return loop.role
    if any(block[0] <= i.addr <= block[1] for block in rescale):
        return RESCALE_REGION
    return "rest of tile (S init, softmax, P^T, PV)"


def count_tile(body: list[Insn], main: tuple[int, int], loops: list[InnerLoop],
               rescale_share: float | None = None) -> TileCounts:
    """One key tile's instructions per wave, each counted on the share of tiles that runs it (tile_runs).
    rescale_share: the share of tiles that rescale O where the kernel skips the rescale on the others (the
    traits' skips_rescale); a kernel without it passes None. The huge-score rounding (a cold path) is
    counted as never run: cold_path_counts prices it."""
    runs = tile_runs(body, main, loops, rescale_share)
    rescale = [part for block in rescale_blocks(body, main, loops)
               for part in (block, else_block(body, block)) if part is not None]
    items = [(i, runs[i.addr], region_of(i, loops, rescale)) for i in body if runs.get(i.addr)]
    return tally(items)


def cold_path_counts(body: list[Insn], main: tuple[int, int], loops: list[InnerLoop]) -> TileCounts:
    """The instructions of the huge-score rounding, once: what a tile whose scaled maximum reaches
    kHugeScore runs more (bf16 forwards; an empty count elsewhere)."""
    return tally([(i, 1, "huge-score rounding (cold)") for block in skipped_blocks(body, main, loops)
                  if is_huge_score_rounding(body, block) for i in up_to_jump(body, block)])


def rescaled_tile_share(block_n: int, keys: int = SEQ, rows: int = 16) -> float:
    """The share of a wave's key tiles that rescale O (the traits' skips_rescale): those where one
    of the wave's 16 rows meets a new maximum. With keys in random order, drawn independently, tile t of
    a row holds its running maximum with probability 1/t, whatever the scores' distribution; rows taken
    as independent. Scores that trend upwards along the keys rescale more, up to every tile."""
    tiles = keys // block_n
    return sum(1 - (1 - 1 / t) ** rows for t in range(1, tiles + 1)) / tiles


def waits_to_zero(i: Insn) -> tuple[bool, bool]:
    """Whether a wait drains the vector-memory loads and the LDS counter: gfx11 "s_waitcnt vmcnt(0)
    lgkmcnt(0)"; gfx12 "s_wait_loadcnt 0x0", "s_wait_dscnt 0x0", and their combined
    s_wait_loadcnt_dscnt (loads in bits 13:8, LDS in bits 5:0)."""
    if i.op == "s_waitcnt":
        return "vmcnt(0)" in i.args, "lgkmcnt(0)" in i.args
    to_zero = i.args in ("0", "0x0")
    if i.op == "s_wait_loadcnt_dscnt":
        count = int(i.args, 0)
        return (count >> 8) & 0x3F == 0, count & 0x3F == 0
    return i.op == "s_wait_loadcnt" and to_zero, i.op == "s_wait_dscnt" and to_zero


def tally(items) -> TileCounts:
    """Counts of (instruction, times executed, region) triples; regions split the VALU + TRANS issues."""
    c, regions, mix = TileCounts(), Counter(), Counter()
    for i, n, region in items:
        kind = classify(i.op)
        if kind in ("valu", "trans"):
            regions[region] += n
            mix[i.op] += n
        if kind in ("wmma", "valu", "trans", "salu", "branch", "barrier", "waitcnt", "hint", "smem", "global_store"):
            setattr(c, kind, getattr(c, kind) + n)
        c.vopd += n * i.op.startswith("v_dual_")
        c.wmma_8bit += n * bool(_EIGHT_BIT_WMMA.match(i.op))
        if kind in ("lds_read", "lds_write", "global_load"):
            setattr(c, f"{kind}_insts", getattr(c, f"{kind}_insts") + n)
            setattr(c, f"{kind}_bytes", getattr(c, f"{kind}_bytes") + n * 32 * lane_bytes(i.op))
        if kind == "waitcnt":
            vmem_zero, lds_zero = waits_to_zero(i)
            c.vmem_rounds += n * vmem_zero
            c.lds_rounds += n * lds_zero
    c.valu_by_region, c.valu_mix = dict(regions), mix.most_common(12)
    return c


# --- The model -------------------------------------------------------------------------------------


def tail_efficiency(groups: int, resident: int) -> float:
    """The share of the last round's slots a launch of `groups` workgroups fills, `resident` at a time,
    spread over all its rounds (the pessimistic bound pays the last round in full)."""
    return groups / resident / math.ceil(groups / resident)


def model(c: TileCounts, hw: Hardware, variant, waves_per_simd: int, flops: int, groups: int) -> dict:
    """Cycles one SIMD spends per wave per key tile, optimistic and pessimistic, and the TFLOP/s.

    flops: useful FLOP per wave per tile; groups: workgroups of the launch (for the tail)."""
    t = {}
    t["wmma"] = (c.wmma - c.wmma_8bit + c.wmma_8bit / hw.eight_bit_rate) * hw.wmma_cycles
    # WMMA and VALU share the SIMD's issue and datapath (same 512 FLOP/clk/CU peak): they add up.
    t["simd_opt"] = t["wmma"] + c.valu + c.trans  # TRANS runs beside the VALU: one issue cycle each
    t["simd_pess"] = t["wmma"] + c.valu + c.trans * TRANS_CYCLES_PESS
    lds_rate = hw.lds_bytes_clk_cu / SIMDS_PER_CU  # both SIMDs of a CU share its LDS bandwidth
    t["lds_opt"] = (c.lds_read_bytes / hw.operand_copies + c.lds_write_bytes) / lds_rate
    t["lds_pess"] = (c.lds_read_bytes + c.lds_write_bytes) / lds_rate
    # K/V tiles are re-read by all seqlen/block_m workgroups of a head: they hit L2 / Infinity Cache.
    t["global_cache"] = c.global_load_bytes / hw.bytes_per_clk_simd(hw.cache_gbs) if hw.cache_gbs else 0.0
    # Reported as a separate cap, not in either bound: every K/V byte from DRAM, no reuse at all.
    t["global_dram"] = c.global_load_bytes / hw.bytes_per_clk_simd(hw.dram_gbs)
    t["salu"] = c.salu
    # Latency one wave cannot overlap with its own work: each wait-to-zero is a full round trip.
    t["latency"] = c.vmem_rounds * VMEM_LATENCY + c.lds_rounds * LDS_LATENCY
    t["latency_bound"] = (t["simd_pess"] + t["latency"]) / waves_per_simd  # other waves fill the gap
    opt_terms = {k: t[k] for k in ("simd_opt", "lds_opt", "global_cache", "salu")}
    pess_terms = {k: t[k] for k in ("simd_pess", "lds_pess", "global_cache", "salu", "latency_bound")}
    cycles_opt, cycles_pess = max(opt_terms.values()), max(pess_terms.values())

    # Tail: workgroups run in rounds of (resident workgroups); the pessimistic bound pays the last,
    # partly filled round in full.
    resident = hw.cus // CUS_PER_WGP * (waves_per_simd * SIMDS_PER_CU * CUS_PER_WGP // variant.waves)
    tail = tail_efficiency(groups, resident)

    per_cycle = hw.cus * SIMDS_PER_CU * hw.clock_hz / 1e12
    tflops_opt, tflops_pess = flops / cycles_opt * per_cycle, flops / cycles_pess * per_cycle * tail
    factor = CALIBRATION[target_of(hw)]
    return {
        "cycles": {k: round(v, 1) for k, v in t.items()},
        "bound_opt": max(opt_terms, key=opt_terms.get),
        "bound_pess": max(pess_terms, key=pess_terms.get),
        "cycles_opt": round(cycles_opt, 1),
        "cycles_pess": round(cycles_pess, 1),
        "workgroups": groups,
        "resident_workgroups": resident,
        "tail_efficiency": round(tail, 3),
        "flops_per_wave_tile": flops,
        "calibration": factor,
        "tflops_opt": round(tflops_opt * factor, 1),
        "tflops_pess": round(tflops_pess * factor, 1),
        "tflops_opt_nominal": round(tflops_opt, 1),
        "tflops_pess_nominal": round(tflops_pess, 1),
        "tflops_dram_no_reuse_cap": round(flops / t["global_dram"] * per_cycle, 1),
        "wmma_utilization_opt": round(t["wmma"] / cycles_opt, 3),
    }


# --- The forward, per kernel ----------------------------------------------------------------------


def analyse(path: Path, objdump: str) -> list[dict]:
    co = load_code_object(path)
    hw = HARDWARE[co.target]
    functions = disassemble(objdump, path, co.target)
    kernels = {k.name: k for k in co.kernels}
    manifest = path.parent / "manifest.json"  # written by kernels/build.py: ties the numbers to a source
    source_hash = json.loads(manifest.read_text()).get("source_hash") if manifest.exists() else None
    rows = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            variant = variants.fwd_variant(dtype, d)
            body = functions[variant.symbol]
            main = main_loop(body)
            loops = inner_loops(body, main, variant, peeled_score_steps(co.target, variant))
            # A kernel without the skipped rescale block (skips_rescale) rescales every tile.
            share = rescaled_tile_share(variant.block_n) if rescale_blocks(body, main, loops) else 1.0
            counts = count_tile(body, main, loops, share if share < 1.0 else None)
            cold = cold_path_counts(body, main, loops)
            # S^T takes d_pad/16 x block_n/16 WMMAs per tile, O^T d_chunk/16 x block_n/16.
            expected = (variant.d_pad + variant.d_chunk) // 16 * (variant.block_n // 16)
            if counts.wmma != expected:
                raise RuntimeError(f"{variant.symbol}: {counts.wmma} WMMA per tile, expected {expected}")
            occ = occupancy(co.target, kernels[variant.symbol], variant.threads)
            rows.append({
                "target": co.target, "gpu": hw.gpu, "kernel": variant.symbol, "dtype": dtype, "d": d,
                "d_pad": variant.d_pad, "target_tflops_pess": TARGETS.get((co.target, d)),
                "code_object": {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                "source_hash": source_hash},
                "waves": variant.waves, "block_m": variant.block_rows, "block_n": variant.block_n,
                "waves_per_simd": occ.waves_per_simd, "occupancy_limit": occ.limited_by,
                "main_loop": [hex(main[0]), hex(main[1])],
                "rescaled_tile_share": round(share, 4),
                "inner_loops": [{"role": l.role, "span": [hex(l.start), hex(l.end)], "trips": l.trips} for l in loops],
                "counts_per_wave_tile": asdict(counts),
                "cold_path": {"what": "huge-score rounding: a tile whose scaled maximum reaches 2^24 (bf16); "
                                      "no tile of model inputs", "valu": cold.valu, "salu": cold.salu},
                "model": model(counts, hw, variant, occ.waves_per_simd,
                               # 4 * queries * keys * useful d, shared by the d_chunks workgroups
                               # that each recompute S for their share of the output columns
                               flops=4 * 16 * variant.block_n * d // variant.d_chunks,
                               groups=(SEQ // variant.block_rows) * variant.d_chunks * BATCH_HEADS),
            })
    return rows


# --- The 8-bit forward ----------------------------------------------------------------------------


def pass_bytes(d: int) -> dict[str, int]:
    """Bytes K and V's quantizing pass reads and writes per (batch, head) at SEQ tokens (self-attention, one
    K/V head): 16-bit K and V read twice (channel statistics, then codes), their 8-bit codes written once,
    and the scales (a float per FWD8_SCALE_KEYS keys, three per channel)."""
    values = SEQ * d
    scales = 4 * (SEQ // variants.FWD8_SCALE_KEYS + 3 * d)
    return {"read": values * 2 * 2 * 2, "written": values * 2 + scales}


def pass_seconds(bytes_per_head: dict[str, int], hw: Hardware) -> float:
    """The quantizing pass as a bandwidth cost: the bytes of BATCH_HEADS heads over the GPU's DRAM bandwidth,
    at full bandwidth and without a launch gap."""
    return sum(bytes_per_head.values()) * BATCH_HEADS / (hw.dram_gbs * 1e9)


def eight_bit_row(functions, co, kernels, dtype: str, d: int) -> dict:
    """One 8-bit forward kernel's key-tile counts per wave, occupancy and launch (SEQ tokens, BATCH_HEADS)."""
    hw = HARDWARE[co.target]
    variant = variants.fwd8_variant(dtype, d)
    body = functions[variant.symbol]
    main = main_loop(body)
    loops = inner_loops(body, main, variant, peeled_steps=1)  # fa_fwd8.h: S's first step
    counts = count_tile(body, main, loops, rescaled_tile_share(variant.block_n))
    skips_rescale = RESCALE_REGION in counts.valu_by_region
    expected = 2 * variant.d_pad // 16 * (variant.block_n // 16)  # S^T and O^T, both over d_pad
    if counts.wmma != expected or counts.wmma_8bit != expected:
        raise RuntimeError(f"{variant.symbol}: {counts.wmma} WMMA ({counts.wmma_8bit} 8-bit) per tile, "
                           f"expected {expected} 8-bit")
    occ = occupancy(co.target, kernels[variant.symbol], variant.threads)
    return {"target": co.target, "kernel": variant.symbol, "dtype": dtype, "d": d, "d_pad": variant.d_pad,
            "skips_rescale": skips_rescale, "waves_per_simd": occ.waves_per_simd, "occupancy_limit": occ.limited_by,
            "waves": variant.waves, "block_n": variant.block_n,
            "workgroups": (SEQ // variant.block_rows) * BATCH_HEADS,
            "counts_per_wave_tile": {k: v for k, v in vars(counts).items() if k not in ("valu_mix",)},
            "pass_bytes_per_head": pass_bytes(d)}


def analyse_eight_bit(path: Path, objdump: str) -> tuple[list[dict], list[dict]]:
    """The 8-bit forward kernels of a gfx12 code object, and the exact forward kernels (analyse) beside them."""
    co = load_code_object(path)
    if not variants.has_fwd8(co.target):
        raise SystemExit(f"{path}: {co.target} has no 8-bit kernels (gfx12 only)")
    functions = disassemble(objdump, path, co.target)
    kernels = {k.name: k for k in co.kernels}
    rows = [eight_bit_row(functions, co, kernels, dtype, d) for dtype in DTYPES for d in EIGHT_BIT_HEAD_DIMS]
    return rows, analyse(path, objdump)
