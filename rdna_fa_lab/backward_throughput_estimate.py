"""Static throughput estimate of the backward kernels on RDNA3 (gfx1100) and RDNA4 (gfx1201), read from
their disassembly (bench/estimate_gfx1100_backward.py prints and records it).

Not a measurement. Priced like the forward, in speed_model.py's named cycle terms at the ends of its
stall band (fitted on published kernels: bench/speed_model.py), each path's iteration as one tile; what
differs is the counting: the backward main loops hold uniform branches (dQ: sweep 0 / 1; dK/dV: make_dk), so
one iteration is traced through the control-flow graph per path instead of summing a span; no main loop
branches on the causal flag, and where dQ runs the tiles every query sees
whole in a loop of their own, that loop is the one counted (main_loop); dK/dV's query fragments branch on
whether any lane tests its scores, which none does in the estimate's calls (lane_vote). See
bench/results/backward_estimate_gfx1100.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from rdna_flash_attn.runtime import variants
from rdna_flash_attn.runtime.codeobject import load_code_object
from .resource_report import occupancy
from . import speed_model as sm
from .throughput_estimate import (BATCH_HEADS, DTYPES, HARDWARE, SEQ, SIMDS_PER_CU, Insn, branch_target, disassemble,
                                  tally, target_of)

# The backward's targets are at d64 and d128; SD1.5's 40, 80 and 160 are reported beside them,
# on useful FLOPs (d40 runs padded to 48).
HEAD_DIMS = (40, 64, 80, 128, 160)

FRAG, THREADS_PER_WAVE = 16, 32
COPY_BATCH = 2  # global loads per trip of the LDS copy loops: kCopyBatch in kernels/tiles.h


# --- Control-flow graph ----------------------------------------------------------------------------


class Cfg:
    """Basic blocks, successors, dominators and natural loops of one kernel."""

    def __init__(self, body: list[Insn]):
        self.body, self.index = body, {i.addr: n for n, i in enumerate(body)}
        leaders = {body[0].addr} | {t for i in body if (t := branch_target(i)) is not None}
        leaders |= {body[n + 1].addr for n, i in enumerate(body[:-1]) if branch_target(i) is not None}
        self.blocks: dict[int, list[Insn]] = {}
        for i in body:
            if i.addr in leaders:
                block = self.blocks.setdefault(i.addr, [])
            block.append(i)
        self.succ: dict[int, list[int]] = {}
        for start, insns in self.blocks.items():
            last, n = insns[-1], self.index[insns[-1].addr]
            fall = [body[n + 1].addr] if n + 1 < len(body) and last.op not in ("s_branch", "s_endpgm") else []
            target = branch_target(last)
            self.succ[start] = fall + ([target] if target is not None else [])
        reached, stack = {body[0].addr}, [body[0].addr]  # drop padding that only aligns a loop
        while stack:
            for s in self.succ[stack.pop()]:
                if s not in reached:
                    reached.add(s)
                    stack.append(s)
        self.blocks = {b: insns for b, insns in self.blocks.items() if b in reached}
        self.succ = {b: s for b, s in self.succ.items() if b in reached}
        self.dom = self._dominators()
        self.loops: dict[int, set[int]] = {}  # header -> blocks
        for b, succs in self.succ.items():
            for h in succs:
                if h in self.dom[b]:  # back edge b -> h
                    self.loops.setdefault(h, {h}).update(self._reaching(b, h))

    def _dominators(self) -> dict[int, set[int]]:
        entry, every = self.body[0].addr, set(self.blocks)
        pred = {b: [p for p, s in self.succ.items() if b in s] for b in self.blocks}
        dom = {b: ({b} if b == entry else set(every)) for b in self.blocks}
        changed = True
        while changed:
            changed = False
            for b in self.blocks:
                if b != entry and pred[b]:
                    new = {b} | set.intersection(*(dom[p] for p in pred[b]))
                    changed |= new != dom[b]
                    dom[b] = new
        return dom

    def _reaching(self, tail: int, header: int) -> set[int]:
        pred = {b: [p for p, s in self.succ.items() if b in s] for b in self.blocks}
        seen, stack = {header, tail}, [tail] if tail != header else []  # a one-block loop is itself
        while stack:
            for p in pred[stack.pop()]:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        return seen

    def ops(self, blocks: set[int]) -> list[str]:
        return [i.op for b in blocks for i in self.blocks[b]]

    def innermost(self, block: int) -> int | None:
        holding = [h for h, blocks in self.loops.items() if block in blocks]
        return min(holding, key=lambda h: len(self.loops[h])) if holding else None


# --- Tracing one main-loop iteration ------------------------------------------------------------------


def loop_trips(cfg: Cfg, main: int, v, target: str) -> dict[int, int]:
    """Trip count of every loop inside the main loop, by its content, from kernels/fa_bwd.h + tiles.h."""
    dim_frags, chunk_frags = v.d_pad // FRAG, v.d_chunk // FRAG
    trips = {}
    for h, blocks in cfg.loops.items():
        if h == main or not blocks < cfg.loops[main]:
            continue
        ops = cfg.ops(blocks)
        inner_wmma = any(g != h and g in blocks and blocks > cfg.loops[g] and
                         any(op.startswith("v_wmma") for op in cfg.ops(cfg.loops[g])) for g in cfg.loops)
        resident_k = v.kind == "dkdv" and v.traits(target).resident_k
        if inner_wmma or (resident_k and any(op.startswith("v_wmma") for op in ops)):
            # dK/dV: the 16-query fragment loop (#pragma unroll 1); with K held in registers the
            # head-dim loop inside it is unrolled completely
            trips[h] = v.block_tile // FRAG
        elif any(op.startswith("v_wmma") for op in ops):  # head-dim loop: dim_unroll's trips
            trips[h] = (dim_frags - peeled_steps(v, target)) // dim_unroll(v, target)
        elif any(op.startswith("ds_store") and op != "ds_store_b128" for op in ops):
            # load_transposed (32-bit or 16-bit stores): (rows / 2) key pairs x (cols / 8), a thread's
            # share; the wave of thread 0 takes the most trips, and every wave waits for it at the barrier
            trips[h] = transposed_trips(v, chunk_frags)
        elif "ds_store_b128" in ops:  # load_rows: rows x d/8 16-byte chunks per thread, a batch a trip
            trips[h] = row_loads(v, dim_frags) // row_batch(v, dim_frags)
        else:
            raise RuntimeError(f"{v.symbol}: unrecognised loop at {h:#x}: {Counter(ops).most_common(5)}")
        if trips[h] < 1:
            raise RuntimeError(f"{v.symbol}: loop at {h:#x} has {trips[h]} trips")
    return trips


def peeled_steps(v, target: str) -> int:
    """Head-dim steps ahead of the loop: the dQ kernel's traits' peeled_steps; the dK/dV kernels peel none."""
    return v.traits(target).peeled_steps if v.kind == "dq" else 0


def dim_unroll(v, target: str) -> int:
    """The head-dim loop's unroll factor: the traits' loop_unroll (dQ: every step where Q and dO are held, no
    loop left) or dim_unroll (dK/dV)."""
    choices = v.traits(target)
    return choices.loop_unroll if v.kind == "dq" else choices.dim_unroll


def row_loads(v, dim_frags: int) -> int:
    """load_rows' 16-byte loads per thread (kLoads in kernels/tiles.h). The zero-filling copies (dQ's,
    split dK/dV's) batch them, rounded up to whole batches here: a partial last batch's guarded load is
    counted as issued, as the trace takes every lane branch. Fused dK/dV's (REPEAT_EDGES) issue all of
    them in one batch."""
    batch = row_batch(v, dim_frags)
    return -(-_row_loads_exact(v, dim_frags) // batch) * batch


def _row_loads_exact(v, dim_frags: int) -> int:
    return -(-v.block_tile * dim_frags * 2 // v.threads)


def row_batch(v, dim_frags: int) -> int:
    """load_rows' loads per batch (kBatch in kernels/tiles.h): all of them with REPEAT_EDGES (fused dK/dV),
    else up to COPY_BATCH."""
    loads = _row_loads_exact(v, dim_frags)
    return loads if v.kind == "dkdv" and v.fused else min(loads, COPY_BATCH)


def transposed_trips(v, chunk_frags: int) -> int:
    """load_transposed's trips for the threads of the first wave: (rows / 2) x (cols / 8) items."""
    return -(-(v.block_tile // 2 * chunk_frags * 2) // v.threads)


def flag_of(block: list[Insn]) -> str | None:
    """The register the block's closing uniform branch tests ('!' if negated), from the last write of what
    it tests: 's_and[_not1]_b32 vcc_lo, exec_lo, sN' (vcc branches), 's_and_saveexec_b32 sM, sN' (exec),
    or a 0/1 flag the compiler keeps in a VGPR: 'v_cmp_{eq,ne}_u32_e32 vcc_lo, 1, vN'."""
    tests = "vcc_lo" if "vcc" in block[-1].op else "exec_lo"
    for i in reversed(block[:-1]):
        args = [a.strip() for a in i.args.split(",")]
        if i.op == "s_and_saveexec_b32" and tests == "exec_lo":
            return args[1]
        if args[0] == tests:
            if i.op in ("s_and_b32", "s_and_not1_b32") and args[1] == "exec_lo":
                return ("!" if i.op == "s_and_not1_b32" else "") + args[2]
            if i.op in ("v_cmp_eq_u32_e32", "v_cmp_ne_u32_e32") and args[1] == "1" and args[2].startswith("v"):
                return ("!" if i.op == "v_cmp_ne_u32_e32" else "") + args[2]
            return None
    return None


def lane_vote(block: list[Insn]) -> bool:
    """Whether the block closes with dK/dV's `any_lane(first_s > 0)` (kernels/fa_bwd.h): a vcc branch on
    the lane compare 'v_cmp_lt_i32_e32 vcc_lo, 0, vN', whose mask over a full exec is the ballot."""
    if block[-1].op not in ("s_cbranch_vccz", "s_cbranch_vccnz"):
        return False
    for i in reversed(block[:-1]):
        args = [a.strip() for a in i.args.split(",")]
        if args[0] == "vcc_lo":
            return i.op == "v_cmp_lt_i32_e32" and args[1] == "0"
    return False


def score_test_votes(cfg: Cfg, main: int) -> list[int]:
    """The main loop's blocks that close with dK/dV's vote (lane_vote)."""
    return [b for b in cfg.loops[main] if len(cfg.succ[b]) == 2 and lane_vote(cfg.blocks[b])]


_SGPR = re.compile(r"^(s\d+|vcc_lo|vcc_hi)$")


def valu_sgpr_writes(i: Insn) -> list[str]:
    """SGPRs a vector instruction writes: a VOP3 compare's lane mask ('v_cmp_gt_i32_e64 s4, ...'), a
    readlane's value, a carry-out ('v_add_co_u32 v1, s5, ...')."""
    if not i.op.startswith("v_"):
        return []
    args = [a.strip() for a in i.args.split(",")]
    dsts = args[:1] + (args[1:2] if "_co_" in i.op or i.op.startswith(("v_div_scale", "v_mad_u64", "v_mad_i64")) else [])
    return [a for a in dsts if _SGPR.match(a)]


def in_row_copy_loop(cfg: Cfg, block: int, main: int) -> bool:
    """Whether `block` lies in a load_rows loop (16-byte LDS stores) inside the main loop."""
    loop = cfg.innermost(block)
    return loop not in (None, main) and "ds_store_b128" in cfg.ops(cfg.loops[loop])


def trace(cfg: Cfg, main: int, trips: dict[int, int], flags: dict[str, bool]) -> Counter:
    """Times each instruction runs in one main-loop iteration: all lanes active (every divergent block
    runs), inner loops run their trip counts, uniform branches follow the given SGPR flag values, and
    dK/dV's vote on testing the scores (lane_vote) goes the way no lane tests: every query fragment sees
    all of its wave's keys in the estimate's non-causal calls without padded keys."""
    given, flags, runs, visits, entered, pc = set(flags), dict(flags), Counter(), Counter(), {}, main
    limit = 4 * len(cfg.loops[main]) * max([1, *trips.values()]) ** 2  # above any real iteration (nesting <= 2)
    while not (pc == main and visits[main]):
        visits[pc] += 1
        if visits.total() > limit:
            raise RuntimeError("flags that never leave an inner loop")
        if pc in trips and entered.get(pc) is None:
            entered[pc] = visits[pc] - 1
        for h in [h for h in entered if entered[h] is not None and pc not in cfg.loops[h]]:
            entered[h] = None  # left loop h: the next visit of its header is a new entry
        block = cfg.blocks[pc]
        for i in block:
            runs[i.addr] += 1
            args = [a.strip() for a in i.args.split(",")]
            if i.op.startswith("s_") and args[0] not in given:  # track the compiler's phi flags
                if i.op == "s_mov_b32" and args[1] in ("-1", "0"):
                    flags[args[0]] = args[1] == "-1"
                elif i.op == "s_cselect_b32" and args[1:3] == ["-1", "0"] and in_row_copy_loop(cfg, pc, main):
                    # load_rows' "b + n < kLoads" in an odd batch count: counted as issued, every trip
                    flags[args[0]] = True
                else:
                    flags.pop(args[0], None)
            for reg in valu_sgpr_writes(i):  # a lane mask written over a phi flag's register
                if reg not in given:
                    flags.pop(reg, None)
        succ, last = cfg.succ[pc], block[-1]
        if len(succ) == 1:
            pc = succ[0]
            continue
        loop = cfg.innermost(pc)
        inside = [s in cfg.loops[loop] for s in succ] if loop is not None else [True, True]
        if inside != [True, True] and loop == main:  # the main loop's exit: stay
            pc = succ[inside.index(True)]
        elif inside != [True, True]:  # an inner loop's exit test
            tested_at_bottom = pc != loop or loop in succ  # a one-block loop tests at its bottom too
            done = visits[loop] - entered[loop] > trips[loop] - tested_at_bottom
            pc = succ[inside.index(not done)]
        elif last.op in ("s_cbranch_execz", "s_cbranch_execnz"):  # divergent unless exec came from a flag
            reg = flag_of(block)
            active = flags.get(reg, True)
            pc = succ[1] if (last.op == "s_cbranch_execz") != active else succ[0]
        else:
            reg = flag_of(block)
            if reg is None and lane_vote(block):
                vcc = False  # no lane tests a score (see above)
            elif last.op not in ("s_cbranch_vccz", "s_cbranch_vccnz") or reg is None or reg.lstrip("!") not in flags:
                raise RuntimeError(f"unhandled branch {last.op} at {last.addr:#x}")
            else:
                vcc = flags[reg.lstrip("!")] != reg.startswith("!")
            pc = succ[1] if (last.op == "s_cbranch_vccnz") == vcc else succ[0]
        if pc not in cfg.loops[main]:
            raise RuntimeError(f"trace left the main loop at {last.addr:#x}")
    return runs


# --- Paths and expected counts ----------------------------------------------------------------------------


def paths(v, hw) -> dict[str, tuple[int, int]]:
    """Per path, (WMMA, global loads) per wave per main-loop iteration, from the source; the trace must match.
    A 16x16 operand read straight from global memory takes 16 bytes per lane per copy: two loads on gfx11,
    whose WMMA wants each operand in both half-waves, one on gfx12."""
    dim, out, tile = v.d_pad // FRAG, v.d_chunk // FRAG, v.block_tile
    operand = hw.operand_copies * dim  # one operand's loads over the head dim
    rows = row_loads(v, dim)  # load_rows: one 16-byte load each
    trans = 2 * transposed_trips(v, out)  # load_transposed: two loads per trip
    if v.kind == "dq":  # per key tile: K, V rows; the Q and dO operands unless held or staged once
        target = target_of(hw)
        once = v.traits(target).held_qdo or v.traits(target).staged_qdo
        base = rows * 2 + (0 if once else 2 * operand)
        return {"sweep 0 (delta)": (2 * dim * tile // FRAG, base),
                "sweep 1 (dQ)": (2 * dim * tile // FRAG + out * tile // FRAG, base + trans)}
    # per query tile: Q rows, lse + delta + row sums (ABI 2), then per fragment the K (and V) operands
    # not held in registers
    frags = tile // FRAG
    stats = 3
    if v.fused:  # S and dP once, then dV and dK: Q, dO rows and both transposed chunks; K and V held
        # in registers or staged in LDS (unmasked: a masked fused kernel past d48 re-reads V)
        return {"dK+dV": (frags * (2 * dim + 2 * out), 2 * rows + 2 * trans + stats)}
    choices = v.traits(target_of(hw))
    k_loads = 0 if choices.resident_k else operand
    v_loads = 0 if choices.resident_v else operand
    return {"dV": (frags * (dim + out), rows + trans + stats + frags * k_loads),
            "dK": (frags * (2 * dim + out), 2 * rows + trans + stats + frags * (k_loads + v_loads))}


def tile_loops(cfg: Cfg) -> dict[int, set[int]]:
    """The loops with a barrier (the LDS tile copy) that hold WMMAs, header -> blocks: the tile loops and
    the loops around them (dQ's sweeps, dK/dV's grouped heads)."""
    return {h: blocks for h, blocks in cfg.loops.items()
            if {"s_barrier", "s_barrier_wait"} & set(cfg.ops(blocks))  # gfx11, gfx12
            and any(op.startswith("v_wmma") for op in cfg.ops(blocks))}


def main_loop(cfg: Cfg) -> int:
    """The loop that runs the tiles every query sees whole (dK/dV: query tiles; dQ: key tiles).

    The innermost tile_loops run the tiles. dK/dV has one. dQ has two where the traits' open_key_tiles
    holds: one for the tiles every query sees whole and one for the tiles whose scores are each tested (the
    ragged last tile, the causal diagonal); the first is the shorter one, without the tests. At 4096 tokens, non-causal,
    every tile is of the first kind. The one-sweep dQ's delta, once per wave before them, is in neither."""
    loops = tile_loops(cfg)
    innermost = [h for h, blocks in loops.items() if not any(o != h and loops[o] < blocks for o in loops)]
    if len(innermost) not in (1, 2):
        raise RuntimeError(f"expected one or two tile loops, found {len(innermost)}")
    return min(innermost, key=lambda h: len(cfg.ops(cfg.loops[h])))


def load_guards(cfg: Cfg, main: int, regs: list[str]) -> dict[str, bool]:
    """Flags that only decide whether a global load runs (the bounds tests `row < seqlen`, `col < head_dim`
    of an operand read from global memory, uniform per wave, possibly and-ed with a path flag), each
    with the value that runs the load. An unrolled head-dim loop tests one per load: tried together,
    they keep the flag combinations few."""
    guards, other = {}, set()
    for b in cfg.loops[main]:
        if len(cfg.succ[b]) != 2 or not (r := flag_of(cfg.blocks[b])) or r.lstrip("!") not in regs:
            continue
        reg, block = r.lstrip("!"), cfg.blocks[b]
        loads = [any(i.op.startswith("global_load") for i in cfg.blocks[s]) for s in cfg.succ[b]]
        wmma = any(i.op.startswith("v_wmma") for s in cfg.succ[b] for i in cfg.blocks[s])
        op = block[-1].op
        if wmma or loads.count(True) != 1 or op not in ("s_cbranch_vccz", "s_cbranch_vccnz", "s_cbranch_execz"):
            other.add(reg)
            continue
        to_second = loads.index(True) == 1  # as trace() branches: to succ[1] iff ...
        if op == "s_cbranch_execz":  # ... (op == execz) != active
            value = to_second is False
        else:  # ... (op == vccnz) == vcc, with vcc = flag != negated
            value = ((op == "s_cbranch_vccnz") == to_second) != r.startswith("!")
        if guards.setdefault(reg, value) != value:
            other.add(reg)
    return {r: value for r, value in guards.items() if r not in other}


def count_path(cfg: Cfg, main: int, trips: dict[int, int], v, expect: tuple[int, int]):
    """Tries every value of the uniform flags the main loop tests; exactly one count must match."""
    votes = score_test_votes(cfg, main)
    if len(votes) > (v.kind == "dkdv"):
        raise RuntimeError(f"{v.symbol}: {len(votes)} branches read as dK/dV's score-test vote")
    written = {i.args.split(",")[0].strip() for b in cfg.loops[main] for i in cfg.blocks[b] if i.op.startswith("s_")
               and not (i.op == "s_mov_b32" and i.args.split(",")[1].strip() in ("-1", "0"))}
    regs = sorted({r.lstrip("!") for b in cfg.loops[main] if len(cfg.succ[b]) == 2
                   and (r := flag_of(cfg.blocks[b])) and r.lstrip("!") not in written})
    guards = load_guards(cfg, main, regs)
    if len(guards) > 4:  # an unrolled head-dim loop: its loads all run or are all skipped
        regs = [r for r in regs if r not in guards]
        settings = [guards, {r: not value for r, value in guards.items()}]
    else:
        settings = [{}]
    where = {i.addr: region(cfg, trips, i) for b in cfg.loops[main] for i in cfg.blocks[b]}
    found = {}
    for values, fixed in itertools.product(itertools.product((False, True), repeat=len(regs)), settings):
        try:
            runs = trace(cfg, main, trips, {**fixed, **dict(zip(regs, values))})
        except RuntimeError:  # a flag combination the loop cannot take (e.g. an untested phi flag)
            continue
        insns = [(i, runs[i.addr], where[i.addr]) for i in cfg.body if runs[i.addr]]
        c = tally(insns)
        if (c.wmma, c.global_load_insts) == expect:
            found[json.dumps(asdict(c), sort_keys=True)] = (c, {**fixed, **dict(zip(regs, values))}, insns)
    if not found:
        raise RuntimeError(f"{v.symbol}: no trace matches {expect} (flags {regs})")
    # Flags the expected counts leave open are lane masks (e.g. key < seqlen): all lanes active, as
    # in the forward estimate, i.e. the longest trace.
    return max(found.values(), key=lambda f: sum(n for _, n, _ in f[2]))


def region(cfg: Cfg, trips: dict[int, int], i: Insn) -> str:
    """Where an instruction sits, for the VALU breakdown: its innermost inner loop, or 'rest'."""
    block = max(b for b in cfg.blocks if b <= i.addr)
    loops = [h for h in trips if block in cfg.loops[h]]
    if not loops:
        return "rest"
    h = min(loops, key=lambda h: len(cfg.loops[h]))
    if any(g != h and g in cfg.loops[h] for g in trips):
        return "fragment loop"
    return "head-dim loop" if any(op.startswith("v_wmma") for op in cfg.ops(cfg.loops[h])) else "LDS copy loops"


# --- Time of a full backward --------------------------------------------------------------------------------


def launch_cycles(v, hw, waves_per_simd: int, counts: dict, stall: float) -> dict[str, float]:
    """One launch at SEQ x SEQ, BATCH_HEADS at stall share `stall`: the SIMD cycles of each named term,
    summed over every wave-iteration and over the launch's tail (its last round of workgroups, partly
    filled, paid in full).

    Every wave runs SEQ / block_tile iterations of each of its paths (dQ: both sweeps; dK/dV: half the
    workgroups take dV, half dK, unless one workgroup makes both); a path's iteration is priced as one
    tile of speed_model.tile_terms."""
    groups = SEQ // v.block_rows * v.jobs_per_block * BATCH_HEADS
    share = 1 if v.kind == "dq" or v.fused else 0.5  # dQ waves run both paths; split dK/dV waves one of the two
    wave_iters = groups * v.waves * share * SEQ // v.block_tile
    tail = sm.launch_tail(hw, waves_per_simd, v.waves, groups)
    cycles = dict.fromkeys(sm.TERMS, 0.0)
    for c in counts.values():
        if c is None:
            continue
        for k, x in sm.tile_terms(asdict(c), hw, waves_per_simd, sm.TILE_KEYS, stall).items():
            cycles[k] += x * wave_iters / tail
    return cycles


def backward(rows: dict, hw, stall: float, scenario=lambda kind, name, c: c) -> dict[str, dict[str, float]]:
    """Both launches' cycles per named term for one (dtype, d) at one stall share; scenario edits the
    counts (None drops a path)."""
    return {kind: launch_cycles(r["variant"], hw, r["waves_per_simd"],
                                {n: scenario(kind, n, c) for n, c in r["counts"].items()}, stall)
            for kind, r in rows.items()}


TWO_SWEEPS = "two dQ sweeps (from the lse alone)"
BOTH = "both"


def training(kind, name, c):
    """Training (autograd): the forward saved O's remainder and its row statistics, so dQ skips sweep 0
    (which stays in the code object for callers with only the lse)."""
    return None if name == "sweep 0 (delta)" else c


def changes(head_dim_loop: dict):
    """The changes still open, as count edits to the training path (None drops a path)."""

    def operands_resident(kind, name, c):  # Q, dO (dQ) / K, V (dK/dV) kept in LDS, not re-read from global
        h = head_dim_loop[kind][name]
        return replace(c, global_load_insts=c.global_load_insts - h.global_load_insts,
                       global_load_bytes=c.global_load_bytes - h.global_load_bytes,
                       vmem_rounds=c.vmem_rounds - h.vmem_rounds,
                       lds_read_insts=c.lds_read_insts + h.global_load_insts,
                       lds_read_bytes=c.lds_read_bytes + h.global_load_bytes)

    return {"Q/dO, K/V operands from LDS": operands_resident}


def delta_read_seconds(hw, d: int) -> float:
    """The one-sweep dQ's prologue, rowsum(dO * (O + O_low)): reads 2 + 2 + 2 bytes per element at DRAM
    speed, counted as if nothing overlapped it."""
    return SEQ * d * 6 * BATCH_HEADS / (hw.dram_gbs * 1e9)


# --- Driver -------------------------------------------------------------------------------------------------


def priced(rows: dict, hw, d: int, flops: float, stall_band: dict[str, float], scenario,
           delta_read: bool) -> dict:
    """One scenario of the backward at SEQ x SEQ, BATCH_HEADS: TFLOP/s and milliseconds at the band's middle
    and ends, and its named terms at the middle in SIMD cycles per 16x64 tile of the attention matrix over
    both launches (they add up to the cycles, and the cycles to the time). The one-sweep dQ's prologue read
    (delta_read_seconds) is part of the global term."""
    simd_clk = hw.cus * SIMDS_PER_CU * hw.clock_hz
    tiles = SEQ * SEQ * BATCH_HEADS / (sm.TILE_ROWS * sm.TILE_KEYS)
    by_end, launches = {}, {}
    for end in sm.ENDS:
        launches[end] = backward(rows, hw, stall_band[end], scenario)
        terms = {k: sum(launch[k] for launch in launches[end].values()) for k in sm.TERMS}
        terms["global"] += delta_read_seconds(hw, d) * simd_clk if delta_read else 0.0
        by_end[end] = terms
    seconds = {end: sum(by_end[end].values()) / simd_clk for end in sm.ENDS}
    mid = by_end["mid"]
    return {"tflops": sm.figure_band({end: flops / seconds[end] / 1e12 for end in sm.ENDS}),
            "ms": {end: round(seconds[end] * 1e3, 3) for end in ("mid", "low", "high")},
            "terms": sm.rounded({k: v / tiles for k, v in mid.items()}),
            "cycles": round(sum(mid.values()) / tiles, 1),
            "share": {kind: round(sum(launch.values()) / sum(mid.values()), 3)
                      for kind, launch in launches["mid"].items()}}


def analyse(path: Path, objdump: str, stall_band: dict[str, float]) -> list[dict]:
    """Every (dtype, head dim) of a code object's backward at the target's stall band (low, mid, high
    stall share: bench/speed_model.stall_bands)."""
    co = load_code_object(path)
    hw = HARDWARE[co.target]
    functions = disassemble(objdump, path, co.target)
    kernels = {k.name: k for k in co.kernels}
    results = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            rows, hd = {}, {}
            for kind in ("dq", "dkdv"):
                v = variants.bwd_variant(kind, dtype, d)
                cfg = Cfg(functions[v.symbol])
                main = main_loop(cfg)
                trips = loop_trips(cfg, main, v, co.target)
                counts, flags, loops = {}, {}, {}
                for name, expect in paths(v, hw).items():
                    counts[name], flags[name], insns = count_path(cfg, main, trips, v, expect)
                    loops[name] = tally([x for x in insns if x[2] == "head-dim loop"])
                occ = occupancy(co.target, kernels[v.symbol], v.threads)
                rows[kind] = {"variant": v, "waves_per_simd": occ.waves_per_simd, "counts": counts,
                              "flags": flags, "limited_by": occ.limited_by, "main": hex(main),
                              "trips": {hex(h): t for h, t in trips.items()}}
                hd[kind] = loops
            flops = 10 * SEQ * SEQ * d * BATCH_HEADS  # backward = 2.5 x forward
            edits = {kind: changes(hd) for kind in rows}
            scenarios = {"now": training, TWO_SWEEPS: lambda kind, name, c: c}
            for label in edits["dq"]:
                scenarios[label] = (lambda kind, name, c, label=label, edits=edits:
                                    None if training(kind, name, c) is None else edits[kind][label](kind, name, c))

            def all_of_them(kind, name, c, edits=edits):
                c = training(kind, name, c)
                for edit in edits[kind].values():
                    c = edit(kind, name, c) if c is not None else None
                return c
            scenarios[BOTH] = all_of_them
            scen = {label: priced(rows, hw, d, flops, stall_band, scenario, delta_read=label != TWO_SWEEPS)
                    for label, scenario in scenarios.items()}
            results.append({
                "target": co.target, "gpu": hw.gpu, "dtype": dtype, "d": d, "flops": flops,
                "code_object": {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
                "kernels": {kind: {"symbol": r["variant"].symbol, "block_tile": r["variant"].block_tile,
                                   "d_chunk": r["variant"].d_chunk, "jobs_per_block": r["variant"].jobs_per_block,
                                   "waves_per_simd": r["waves_per_simd"], "occupancy_limit": r["limited_by"],
                                   "main_loop_header": r["main"], "inner_loop_trips": r["trips"],
                                   "flags_per_path": r["flags"],
                                   "counts_per_wave_iteration": {n: asdict(c) for n, c in r["counts"].items()},
                                   "terms_per_wave_iteration": {
                                       n: sm.rounded(sm.tile_terms(asdict(c), hw, r["waves_per_simd"], sm.TILE_KEYS,
                                                                   stall_band["mid"]))
                                       for n, c in r["counts"].items()}}
                            for kind, r in rows.items()},
                "estimate": scen,
            })
    return results
