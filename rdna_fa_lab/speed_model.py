"""The speed model in named cycle terms: what one SIMD spends on a 16-query x 64-key tile of attention,
read from a kernel's per-wave instruction counts (throughput_estimate.tally), fitted and checked on
published measurements of other kernels (bench/speed_model.py records the fit, the held-out residuals
and our kernels against the targets).

Terms, in cycles of one SIMD per wave and 16x64 tile, at the clock the GPU's peak WMMA figure implies:

- wmma: each 16x16x16 WMMA at the instruction's rate (AMD's FLOPS/clock/CU: 32 cycles on gfx11, 16 on
  gfx12; 8-bit ones at the tuning table's eight_bit_rate). No factor touches it: with nothing else to do
  a kernel would reach the GPU's peak.
- valu: vector issues (a VOPD pair is one issue).
- trans: transcendentals, priced per ISA (TRANS_CYCLES): gfx11 issues them to their own unit beside the
  VALU (LLVM's SISchedule.td, GFX11SpeedModel: WriteTrans32 on HWTransVALU, a resource apart from
  HWVALU), about one issue cycle each, 4 as a sensitivity; gfx12's measured ~3.5 cycles, nearly serial.
- salu: scalar instructions and branches, one issue cycle each.
- stall: the allowance on the non-WMMA work (valu + trans + salu) for what the counts cannot see:
  dependency latency between VALU instructions, a WMMA holding the SIMD's datapath, missed dual issue.
  A share of that work, fitted per ISA as a band (lowest to highest share the fit kernels need).
- waits: memory and LDS latency one wave sits out at waits to zero (VMEM_LATENCY, LDS_LATENCY), beyond
  what the SIMD's other waves fill with their own work.
- lds, global: LDS bandwidth (a gfx11 operand's duplicate half read as a broadcast) and cache
  bandwidth time beyond everything above: zero unless that pipe, not the SIMD, binds.

The terms add up to the tile's cycles; TFLOP/s follow from the useful FLOPs of the tile and the share of
the launch's last round of workgroups that is filled (throughput_estimate.tail_efficiency).
"""

from __future__ import annotations

import math

from .throughput_estimate import LDS_LATENCY, SIMDS_PER_CU, VMEM_LATENCY, Hardware, tail_efficiency

TILE_ROWS, TILE_KEYS = 16, 64
TRANS_CYCLES = {"gfx11": 1.0, "gfx12": 3.5}
TRANS_CYCLES_SENSITIVITY = {"gfx11": 4.0, "gfx12": 3.5}
MAX_STALL = 20.0  # the largest stall share implied_stall looks for
ISSUE_TERMS = ("valu", "trans", "salu")  # the non-WMMA work the stall allowance is a share of
TERMS = ("wmma", "valu", "trans", "salu", "stall", "waits", "lds", "global")


def tile_terms(counts: dict, hw: Hardware, waves_per_simd: int, keys_per_trip: int, stall: float,
               trans_cycles: float | None = None) -> dict[str, float]:
    """The named terms of one 16x64 tile: `counts` per wave and trip of `keys_per_trip` keys (16 query rows
    per wave), scaled to 64 keys."""
    scale = TILE_KEYS / keys_per_trip
    eight_bit = counts.get("wmma_8bit", 0)
    t = {"wmma": (counts["wmma"] - eight_bit + eight_bit / hw.eight_bit_rate) * hw.wmma_cycles,
         "valu": float(counts["valu"]),
         "trans": counts["trans"] * (TRANS_CYCLES[hw.isa.name] if trans_cycles is None else trans_cycles),
         "salu": float(counts["salu"] + counts["branch"])}
    t["stall"] = stall * sum(t[k] for k in ISSUE_TERMS)
    busy = t["wmma"] + sum(t[k] for k in ISSUE_TERMS) + t["stall"]
    latency = counts["vmem_rounds"] * VMEM_LATENCY + counts["lds_rounds"] * LDS_LATENCY
    t["waits"] = max(0.0, (busy + latency) / waves_per_simd - busy)
    lds_rate = hw.lds_bytes_clk_cu / SIMDS_PER_CU  # both SIMDs of a CU share its LDS
    lds = (counts["lds_read_bytes"] / hw.operand_copies + counts["lds_write_bytes"]) / lds_rate
    t["lds"] = max(0.0, lds - busy - t["waits"])
    cache = counts["global_load_bytes"] / hw.bytes_per_clk_simd(hw.cache_gbs) if hw.cache_gbs else 0.0
    t["global"] = max(0.0, cache - busy - t["waits"] - t["lds"])
    return {k: t[k] * scale for k in TERMS}


def non_wmma(terms: dict[str, float]) -> float:
    """The tile's non-WMMA issue cycles before the stall allowance: the budgets' measure."""
    return sum(terms[k] for k in ISSUE_TERMS)


def tflops(cycles: float, hw: Hardware, head_dim: int, tail: float = 1.0) -> float:
    """TFLOP/s of a launch whose SIMDs spend `cycles` per 16x64 tile of useful head dim `head_dim`."""
    flops = 4 * TILE_ROWS * TILE_KEYS * head_dim
    return flops / cycles * hw.cus * SIMDS_PER_CU * hw.clock_hz / 1e12 * tail


def cycles_at(measured_tflops: float, hw: Hardware, head_dim: int, tail: float = 1.0) -> float:
    """The cycles per 16x64 tile a measured TFLOP/s implies (tflops' inverse)."""
    return tflops(1.0, hw, head_dim, tail) / measured_tflops


def implied_stall(counts: dict, hw: Hardware, waves_per_simd: int, keys_per_trip: int, head_dim: int,
                  tail: float, measured_tflops: float, trans_cycles: float | None = None) -> float | None:
    """The stall share at which the model gives the measured figure (bisection: the tile's cycles grow with
    the share); negative where the kernel ran faster than its terms without any stall, None where no share up
    to MAX_STALL slows it enough (a bandwidth or wait term binds)."""
    goal = cycles_at(measured_tflops, hw, head_dim, tail)
    if sum(tile_terms(counts, hw, waves_per_simd, keys_per_trip, MAX_STALL, trans_cycles).values()) < goal:
        return None
    lo, hi = -1.0, MAX_STALL
    for _ in range(100):
        mid = (lo + hi) / 2
        total = sum(tile_terms(counts, hw, waves_per_simd, keys_per_trip, mid, trans_cycles).values())
        lo, hi = (mid, hi) if total < goal else (lo, mid)
    return (lo + hi) / 2


def band(stalls: list[float]) -> dict[str, float]:
    """The stall band of a set of fitted shares: low, middle, high."""
    return {"low": min(stalls), "mid": (min(stalls) + max(stalls)) / 2, "high": max(stalls)}


ENDS = ("low", "mid", "high")  # of a stall band


def figure_band(by_stall: dict[str, float]) -> dict[str, float]:
    """A speed (TFLOP/s) at each end of the stall band as the figure's middle, low and high: the high stall
    gives the low figure."""
    return {"mid": round(by_stall["mid"], 1), "low": round(by_stall["high"], 1), "high": round(by_stall["low"], 1)}


def rounded(terms: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in terms.items()}


def priced(counts: dict, hw: Hardware, waves_per_simd: int, keys_per_trip: int, head_dim: int, tail: float,
           stall_band: dict[str, float], trans_cycles: float | None = None) -> dict:
    """A kernel's terms at the band's middle and its TFLOP/s at the middle and both ends (the high stall
    gives the low figure)."""
    terms = {end: tile_terms(counts, hw, waves_per_simd, keys_per_trip, stall_band[end], trans_cycles)
             for end in ENDS}
    return {"terms": rounded(terms["mid"]),
            "cycles": round(sum(terms["mid"].values()), 1), "non_wmma": round(non_wmma(terms["mid"]), 1),
            "tflops": figure_band({end: tflops(sum(terms[end].values()), hw, head_dim, tail) for end in ENDS})}


def launch_tail(hw: Hardware, waves_per_simd: int, waves_per_workgroup: int, workgroups: int) -> float:
    """throughput_estimate.model's launch tail: workgroups run in rounds of the resident ones."""
    resident = hw.cus // 2 * (waves_per_simd * SIMDS_PER_CU * 2 // waves_per_workgroup)
    return tail_efficiency(workgroups, resident)


def non_wmma_budget(target_tflops: float, counts: dict, hw: Hardware, waves_per_simd: int, keys_per_trip: int,
                    head_dim: int, tail: float, stall: float) -> float:
    """The non-WMMA issue cycles per 16x64 tile at which a kernel with these WMMA and wait terms would
    reach `target_tflops` at stall share `stall` (waits taken as today's)."""
    terms = tile_terms(counts, hw, waves_per_simd, keys_per_trip, stall)
    room = cycles_at(target_tflops, hw, head_dim, tail) - terms["wmma"] - terms["waits"]
    return room / (1 + stall)


def wmma_and_trans_floor(counts: dict, hw: Hardware, keys_per_trip: int) -> float:
    """Cycles per 16x64 tile of the WMMAs and transcendentals alone, without stall: no kernel doing this
    work at these rates runs faster."""
    terms = tile_terms(counts, hw, 1 << 20, keys_per_trip, 0.0)
    return terms["wmma"] + terms["trans"]


def kendall_tau(predicted: list[float], measured: list[float]) -> tuple[float, int, int]:
    """Kendall's tau of two orderings, with the concordant and discordant pair counts (ties in either
    count as neither)."""
    concordant = discordant = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            sign = math.copysign(1, predicted[i] - predicted[j]) * math.copysign(1, measured[i] - measured[j])
            if predicted[i] == predicted[j] or measured[i] == measured[j]:
                continue
            concordant += sign > 0
            discordant += sign < 0
    pairs = concordant + discordant
    return ((concordant - discordant) / pairs if pairs else 0.0), concordant, discordant
