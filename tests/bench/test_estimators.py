"""The static estimators' instruction reading: waits decoded on both ISAs, the interpreter-executed
counts of rdna_fa_lab/masked_throughput_estimate.py against the disassembly-based reconstruction of
rdna_fa_lab/throughput_estimate.py on a shipped code object (they must agree where both apply), the
backward estimate's traces of both targets' shipped code objects, and the pricing of the masked, packed,
8-bit and backward estimates in the speed model's named terms at its stall band."""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter

import pytest

from bench import estimate_8bit, estimate_external, speed_model as bench_speed_model
from rdna_fa_lab import backward_throughput_estimate as backward, masked_throughput_estimate as masked
from rdna_fa_lab import speed_model as sm, throughput_estimate as estimator
from rdna_fa_lab.interpreter import InterpretedLibrary
from rdna_fa_lab.resource_report import find_objdump
from rdna_flash_attn.runtime import artifacts, variants
from rdna_flash_attn.runtime.codeobject import load_code_object

from .conftest import REPO

GFX1100 = REPO / "prebuilt" / "rdna_fa_gfx1100.hsaco"


def wait(op: str, args: str):
    return estimator.Insn(0, op, args)


@pytest.mark.parametrize("op, args, expected", [
    ("s_waitcnt", "vmcnt(0) lgkmcnt(0)", (True, True)),
    ("s_waitcnt", "vmcnt(2)", (False, False)),
    ("s_waitcnt", "lgkmcnt(0)", (False, True)),
    ("s_wait_loadcnt", "0x0", (True, False)),
    ("s_wait_dscnt", "0x0", (False, True)),
    ("s_wait_loadcnt_dscnt", "0x0", (True, True)),  # gfx12's combined wait (flat loads)
    ("s_wait_loadcnt_dscnt", "0x100", (False, True)),  # one load still in flight
    ("s_wait_loadcnt_dscnt", "0x1", (True, False)),
])
def test_waits_to_zero_on_both_isas(op, args, expected):
    assert estimator.waits_to_zero(wait(op, args)) == expected


@pytest.fixture(scope="module")
def gfx1100():
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    functions = estimator.disassemble(objdump, GFX1100, "gfx1100")
    artifact = artifacts.Artifact("gfx1100", GFX1100, hashlib.sha256(GFX1100.read_bytes()).hexdigest(), emulated=False)
    return functions, InterpretedLibrary(artifact), objdump


def test_executed_counts_equal_the_static_reconstruction_of_an_unmasked_tile(gfx1100):
    functions, library, objdump = gfx1100
    variant = variants.fwd_variant("f16", 64)
    executed = masked.tile_counts(library, functions[variant.symbol], variant, "f16", 64, "none")
    body = functions[variant.symbol]
    main = estimator.main_loop(body)
    loops = estimator.inner_loops(body, main, variant, estimator.peeled_score_steps("gfx1100", variant))
    static = estimator.count_tile(body, main, loops)
    for kind in ("wmma", "valu", "trans", "salu", "global_load_insts", "lds_read_insts", "vmem_rounds"):
        assert getattr(executed, kind) == getattr(static, kind), kind


def test_a_d128_tile_skips_only_its_o_rescale_as_the_interpreter_executes_it(gfx1100):
    """The traits' skips_rescale: the one skipped block of the tile holds the rescale's exp2 and O's
    multiplications, and the interpreter-executed tile, its rescale weighted by the same share, is the
    static tile."""
    functions, library, _ = gfx1100
    variant = variants.fwd_variant("f16", 128)
    body = functions[variant.symbol]
    main = estimator.main_loop(body)
    loops = estimator.inner_loops(body, main, variant, estimator.peeled_score_steps("gfx1100", variant))
    assert [loop.trips for loop in loops if loop.role.startswith("head-dim")] == [(8 - 2) // 2]  # two steps peeled
    assert len(estimator.rescale_blocks(body, main, loops)) == 1
    every, never = (estimator.count_tile(body, main, loops, share) for share in (1.0, 0.0))
    assert every.wmma == never.wmma and every.trans - never.trans == 1
    assert every.valu - never.valu >= variant.d_chunk // 16 * 8 // 2  # O's values, two to a VOPD pair at most
    share = estimator.rescaled_tile_share(variant.block_n)
    static = estimator.count_tile(body, main, loops, share)
    executed = masked.tile_counts(library, body, variant, "f16", 128, "none")
    for kind in ("wmma", "valu", "trans", "salu", "vopd", "lds_read_insts", "global_load_insts"):
        assert getattr(executed, kind) == pytest.approx(getattr(static, kind)), kind


@pytest.mark.parametrize("d", [64, 128])
def test_a_bf16_tile_runs_its_huge_score_test_as_the_interpreter_executes_it(gfx1100, d):
    """The bf16 forwards' huge-score test runs on every tile and its rounding on none, in the static count
    as in the interpreter's run of model-like inputs; at d128 the rescale's else, which the interpreter's
    fourth tile runs or not, leaves at most one issue between them."""
    functions, library, _ = gfx1100
    variant = variants.fwd_variant("bf16", d)
    body = functions[variant.symbol]
    main = estimator.main_loop(body)
    loops = estimator.inner_loops(body, main, variant, estimator.peeled_score_steps("gfx1100", variant))
    share = estimator.rescaled_tile_share(variant.block_n) if estimator.rescale_blocks(body, main, loops) else None
    static = estimator.count_tile(body, main, loops, share)
    executed = masked.tile_counts(library, body, variant, "bf16", d, "none")
    for kind in ("wmma", "trans", "salu", "branch", "lds_read_insts", "global_load_insts"):
        assert getattr(executed, kind) == pytest.approx(getattr(static, kind)), kind
    assert abs(executed.valu - static.valu) <= (0 if share is None else 1)


def test_the_rescaled_share_counts_the_tiles_that_meet_new_row_maxima():
    assert estimator.rescaled_tile_share(64, keys=64) == 1.0  # a row's first tile always rescales
    share_64, share_16 = estimator.rescaled_tile_share(64), estimator.rescaled_tile_share(16)
    assert 1 / 64 < share_64 < 1 and share_16 < share_64  # more, smaller tiles: more of them without a new maximum


def test_a_key_padding_tile_waits_for_its_mask_once_per_fragment(gfx1100):
    """The grouped bias loads (kernels/sequence.h): a contiguous mask row costs one wait per 16-key
    fragment, not one per element."""
    functions, library, _ = gfx1100
    variant = variants.fwd_variant("f16", 64, masked=True)
    counts = masked.tile_counts(library, functions[variant.symbol], variant, "f16", 64,
                                         masked.SCATTERED)
    assert counts.wmma == (variant.d_pad + variant.d_chunk) // 16 * (variant.block_n // 16)
    assert counts.vmem_rounds <= 1 + variant.block_n // 16


def test_the_calibration_factors_are_the_recorded_fit():
    import json

    recorded = json.loads((REPO / "bench" / "results" / "estimator_calibration.json").read_text())
    for target, fit in recorded["fit"].items():
        assert estimator.CALIBRATION[target] == fit["factor"], target
    # every published figure in the fit is reproduced within 12 % by the calibrated model
    assert all(abs(r["residual_under_fit"]) <= 0.12 for r in recorded["kernels"] if r["in_fit"])


def test_the_fit_is_the_geometric_mean_of_measured_over_estimated():
    rows = [{"name": name, "shape": [1, 1, 1, 1], "target": "gfx1201", "in_fit": in_fit, "published_tflops": measured,
             "model": {"tflops_pess_nominal": 100.0}} for name, measured, in_fit in
            (("a", 50.0, True), ("b", 200.0, True), ("c", 10.0, False))]
    fit = estimate_external.fitted_ratios(rows)["gfx1201"]
    assert fit["factor"] == 1.0 and fit["cases_in_fit"] == 2  # sqrt(0.5 * 2); the stand-in is left out
    assert [r["residual_under_fit"] for r in rows] == [-0.5, 1.0, -0.9]


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_the_backward_estimate_traces_every_path_of_a_shipped_code_object(target):
    """Each path's traced WMMA and global-load counts must equal the source's (analyse raises otherwise):
    on gfx1201 an operand read from global memory is one load per lane, on gfx1100 two."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    stall_band = bench_speed_model.stall_bands()[target]
    results = backward.analyse(REPO / "prebuilt" / f"rdna_fa_{target}.hsaco", objdump, stall_band)
    assert {(r["dtype"], r["d"]) for r in results} == {
        (dtype, d) for dtype in ("f16", "bf16") for d in backward.HEAD_DIMS}
    for r in results:
        _check_backward_scenarios(r, estimator.HARDWARE[target])


def _check_backward_scenarios(result: dict, hw) -> None:
    """Every scenario's figures are a band under the peak, its terms add up to its cycles, and the cycles
    per tile over the SIMDs give its time."""
    tiles = estimator.SEQ ** 2 * estimator.BATCH_HEADS / (sm.TILE_ROWS * sm.TILE_KEYS)
    for label, s in result["estimate"].items():
        assert 0 < s["tflops"]["low"] <= s["tflops"]["mid"] <= s["tflops"]["high"] < hw.peak_tflops, label
        assert s["ms"]["low"] <= s["ms"]["mid"] <= s["ms"]["high"], label
        assert set(s["terms"]) == set(sm.TERMS)
        assert sum(s["terms"].values()) == pytest.approx(s["cycles"], abs=0.5)
        seconds = s["cycles"] * tiles / (hw.cus * estimator.SIMDS_PER_CU * hw.clock_hz)
        assert seconds * 1e3 == pytest.approx(s["ms"]["mid"], rel=1e-3)
        assert result["flops"] / seconds / 1e12 == pytest.approx(s["tflops"]["mid"], abs=0.1)
    # training skips dQ's first sweep for one prologue read: never slower than the two sweeps
    assert result["estimate"]["now"]["ms"]["mid"] < result["estimate"][backward.TWO_SWEEPS]["ms"]["mid"]


def test_the_recorded_backward_is_priced_at_the_speed_models_band():
    import json

    recorded = json.loads((REPO / "bench" / "results" / "backward_estimate_gfx1100.json").read_text())
    assert recorded["stall_band"] == bench_speed_model.stall_bands()
    for r in recorded["results"]:
        _check_backward_scenarios(r, estimator.HARDWARE[r["target"]])


@functools.lru_cache(maxsize=None)
def _shipped_listing(target: str) -> dict:
    """A shipped code object's disassembly, once per target for the tests that read it (tens of seconds each)."""
    return estimator.disassemble(find_objdump(), REPO / "prebuilt" / f"rdna_fa_{target}.hsaco", target)


def _backward_cfg(target: str, kind: str, d: int, dtype: str = "f16"):
    """A shipped backward kernel's control-flow graph and variant."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    variant = variants.bwd_variant(kind, dtype, d)
    return backward.Cfg(_shipped_listing(target)[variant.symbol]), variant


@pytest.mark.parametrize("target, d, split", [("gfx1100", 64, True), ("gfx1201", 128, True), ("gfx1201", 64, False)])
def test_the_backward_estimate_counts_dq_over_the_tiles_every_query_sees_whole(target, d, split):
    """Where dQ runs the key tiles every query of its workgroup sees whole in a loop of their own
    (the traits' open_key_tiles; not gfx12's d64), the estimate counts that loop: the other one
    tests each score of its tiles, one compare more per score (8 per lane and key fragment)."""
    cfg, variant = _backward_cfg(target, "dq", d)
    counted = backward.main_loop(cfg)
    others = [h for h, blocks in backward.tile_loops(cfg).items()
              if h != counted and not blocks & cfg.loops[counted]]
    assert len(others) == (1 if split else 0)

    def compares(header):
        return sum(op.startswith("v_cmp") for op in cfg.ops(cfg.loops[header]))
    for masked in others:
        assert compares(masked) - compares(counted) == 8 * variant.block_tile // 16


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
@pytest.mark.parametrize("d", [64, 128])
def test_the_backward_estimate_counts_dkdv_fragments_without_the_per_score_test(target, d):
    """dK/dV tests each score only in query fragments some of whose queries miss a key of the wave (one
    wave-uniform branch on any_lane, kernels/fa_bwd.h); every fragment of the estimate's non-causal calls
    takes the other side. There, on every path (dK+dV fused; dV, dK), the 8 probabilities run straight
    (at most two blocks); the side the trace skips holds the tested copy of them (all 8, or 7 where clang
    merges one into a block both sides run)."""
    cfg, variant = _backward_cfg(target, "dkdv", d)
    main = backward.main_loop(cfg)
    votes = backward.score_test_votes(cfg, main)
    assert len(votes) == 1
    voting_loop = cfg.innermost(votes[0])  # the query-fragment loop; at 16-query tiles the tile loop itself
    exps = {b: n for b in cfg.loops[voting_loop] if (n := cfg.ops({b}).count("v_exp_f32_e32"))}
    trips = backward.loop_trips(cfg, main, variant, target)
    for expect in backward.paths(variant, estimator.HARDWARE[target]).values():
        _, _, insns = backward.count_path(cfg, main, trips, variant, expect)
        counted = {i.addr for i, _, _ in insns}
        run = [n for b, n in exps.items() if cfg.blocks[b][0].addr in counted]
        skipped = [n for b, n in exps.items() if cfg.blocks[b][0].addr not in counted]
        assert sum(run) == 8 and len(run) <= 2
        assert sum(skipped) >= 7


def _vgprs(operand: str) -> set[int]:
    """The VGPRs an operand names: v7 or v[8:15]; none for anything else."""
    if match := re.fullmatch(r"v\[(\d+):(\d+)\]", operand):
        return set(range(int(match[1]), int(match[2]) + 1))
    return {int(operand[1:])} if re.fullmatch(r"v\d+", operand) else set()


_LOADS = ("ds_load", "global_load", "scratch_load", "buffer_load")


def _halves(insn) -> list[str]:
    """An instruction's text per issued operation, opcode first: one, or the two halves of a dual issue."""
    first, *second = insn.args.split("::")
    return [f"{insn.op} {first}", *second]


def _written_vgprs(insn) -> set[int]:
    """The VGPRs an instruction writes: each half's first operand, for VALU instructions and loads."""
    if not (insn.op.startswith("v_") or insn.op.startswith(_LOADS)):
        return set()
    return set().union(*(_vgprs(half.split(",")[0].split()[-1]) for half in _halves(insn)))


def _sets_zero(insn, register: int) -> bool:
    """Whether the instruction moves 0 into the register (v_mov_b32, or either half of a dual move)."""
    return any(re.fullmatch(rf"v_(dual_)?mov_b32(_e32)? v{register}, 0", " ".join(half.split()))
               for half in _halves(insn))


@pytest.mark.parametrize("d", [64, 96])
def test_gfx11_dkdv_fragments_start_their_products_from_held_zeros(d):
    """gfx11's WMMA takes no inline zero C operand. A dK/dV query fragment's first products of S and dP
    read 8 VGPRs set to zero before the query-tile loop and written nowhere in it (the traits' held_zero_c,
    where K is held in registers: d64 fused, d96 split), not zeros that 8 moves re-create
    per fragment; every other product accumulates in place."""
    cfg, _ = _backward_cfg("gfx1100", "dkdv", d)
    main = backward.main_loop(cfg)
    loop = [i for b in sorted(cfg.loops[main]) for i in cfg.blocks[b]]
    firsts = [args for i in loop if i.op.startswith("v_wmma")
              and (args := [a.strip() for a in i.args.split(",")])[0] != args[3]]
    assert len(firsts) == 2
    zeros = set().union(*(_vgprs(args[3]) for args in firsts))
    assert len(zeros) == 8
    assert not [i for i in loop if _written_vgprs(i) & zeros]
    before = [i for i in cfg.body if i.addr < min(i.addr for i in loop)]
    for register in zeros:
        last = [i for i in before if register in _written_vgprs(i)][-1]
        assert _sets_zero(last, register), (register, last)


def _probability_roundings(loop) -> tuple[int, int]:
    """A loop's f16 roundings of probabilities, v_fma_mix{lo,hi}_f16 p, one, 0 with the 1.0 in an SGPR (dS's
    mixes multiply by a VGPR), and its f32 -> f16 conversions."""
    mixes = sum(i.op in ("v_fma_mixlo_f16", "v_fma_mixhi_f16")
                and re.fullmatch(r"s\d+", (args := [a.strip() for a in i.args.split(",")])[2]) is not None
                and args[3] == "0" for i in loop)
    return mixes, sum(i.op.startswith("v_cvt_f16_f32") for i in loop)


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_f16_probabilities_are_rounded_by_one_mix_each(target):
    """pack_probabilities (kernels/platform/amdgcn.h) has clang round each f16 probability with one
    v_fma_mix{lo,hi}_f16, not two conversions and a pack per pair: the forward's 32 per lane and 64-key tile,
    d64 dK/dV's 8 (P for dV) per query fragment, and no f32 -> f16 conversion left in either loop."""
    assert _probability_roundings(_forward_key_loop(target, variants.fwd_variant("f16", 64).symbol)) == (32, 0)
    cfg, _ = _backward_cfg(target, "dkdv", 64)
    main = backward.main_loop(cfg)
    fragments = [blocks for h, blocks in cfg.loops.items() if h != main and blocks < cfg.loops[main]
                 and any(op.startswith("v_wmma") for op in cfg.ops(blocks))]
    assert len(fragments) == 1
    assert _probability_roundings([i for b in sorted(fragments[0]) for i in cfg.blocks[b]]) == (8, 0)


def _forward_key_loop(target: str, symbol: str) -> list:
    """The key-tile loop of a shipped forward kernel, as the estimator finds it."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    body = _shipped_listing(target)[symbol]
    start, end = estimator.main_loop(body)
    return [i for i in body if start <= i.addr <= end]


@pytest.mark.parametrize("target, symbol", [
    ("gfx1100", variants.fwd_variant("f16", 64).symbol), ("gfx1100", variants.fwd_variant("bf16", 128).symbol),
    ("gfx1100", variants.fwd_variant("f16", 80).symbol), ("gfx1201", variants.fwd_variant("f16", 128).symbol),
    ("gfx1201", variants.fwd_variant("bf16", 40).symbol), ("gfx1201", variants.fwd8_variant("f16", 128).symbol)])
def test_forward_key_tile_loads_take_their_scalar_base_form(target, symbol):
    """Every K and V load of the forward's key-tile loop is the tile's uniform base plus a 32-bit lane offset
    (load16_at), and no 64-bit address add is left in the loop: loop_variant (kernels/platform/amdgcn.h) keeps
    the offsets that are the same on every tile next to their loads (a 64-bit address would take two VALU per
    load)."""
    loop = _forward_key_loop(target, symbol)
    loads = [i for i in loop if i.op.startswith("global_load")]
    assert loads and not [i for i in loads if re.search(r", off\b", i.args)]
    assert not [i for i in loop if i.op.startswith("v_add_co")]


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
@pytest.mark.parametrize("dtype, d, masked", [("f16", 40, False), ("f16", 64, False), ("bf16", 80, False),
                                              ("f16", 128, False), ("bf16", 160, False), ("bf16", 64, True),
                                              ("f16", 128, True)])
def test_forward_v_tiles_go_to_lds_transposed_by_16_bit_stores(target, dtype, d, masked):
    """The forward stores V^T one element per 16-bit store (store_transposed_pair, kernels/tiles.h: half of
    them in the d16_hi form), every element of the thread's key pairs, not as pairs packed by a v_perm_b32
    each into 32-bit stores. An f16 kernel's loop then holds no v_perm_b32 at all (bf16
    still packs its probabilities with one). The unmasked kernels' key-tile loop is read; a masked kernel, whose
    several tile loops the estimator does not tell apart, is read whole: its key biases are staged by
    ds_store_b32 and O by ds_store_b16, so there only the d16_hi stores are V^T's alone."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    variant = variants.fwd_variant(dtype, d, masked)
    code = _shipped_listing(target)[variant.symbol] if masked else _forward_key_loop(target, variant.symbol)
    ops = Counter(i.op for i in code)
    assert ops["ds_store_b16_d16_hi"] > 0 and (masked or ops["ds_store_b16"] == ops["ds_store_b16_d16_hi"])
    packed = ("ds_store_2addr_b32",) if masked else ("ds_store_b32", "ds_store_2addr_b32")
    assert not [op for op in ops if op.startswith(packed)]
    if not masked and estimator.copy_batches(variant) <= 2:  # unrolled copy: each key pair's 16 stores once
        assert ops["ds_store_b16"] + ops["ds_store_b16_d16_hi"] == 16 * estimator.vt_pairs_per_thread(variant)
    if dtype == "f16" and not masked:  # gfx11 kernels hold v_perm_b32 after the key loop (O staged to LDS)
        assert ops["v_perm_b32"] == 0


def test_gfx11_masked_f16_d64_forward_keeps_packed_v_stores():
    """The one exception (the traits' sixteen_bit_vt): gfx11's masked f16 d64 kernel, at 256 VGPRs, spilled
    with 16-bit V^T stores and keeps the pairs packed by v_perm_b32 into 32-bit stores."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    ops = Counter(i.op for i in _shipped_listing("gfx1100")[variants.fwd_variant("f16", 64, True).symbol])
    assert ops["ds_store_2addr_b32"] > 0 and ops["v_perm_b32"] > 0 and ops["ds_store_b16_d16_hi"] == 0


@pytest.mark.parametrize("target, symbol", [
    ("gfx1201", variants.fwd_variant("f16", 128).symbol), ("gfx1201", variants.fwd_variant("bf16", 128).symbol),
    ("gfx1201", variants.fwd8_variant("f16", 128).symbol), ("gfx1100", variants.fwd_variant("f16", 128).symbol),
    ("gfx1100", variants.fwd_variant("bf16", 128).symbol)])
def test_o_rescale_multiplications_pair_as_dual_issues(target, symbol):
    """O's rescale takes its odd accumulators' factor from a second register (unmerged_copy, or where the
    traits' adjacent_rescale_factors say the register beside the factor's: kernels/platform/amdgcn.h): at
    d128 at least half of its 64 multiplications (acc *= factor, each factor register multiplying at least
    16 accumulators) pair with each other as dual issues, where with one register, or two in one bank, none
    do (gfx1100 f16 with unmerged_copy)."""
    loop = _forward_key_loop(target, symbol)

    def in_place_factor(half: str) -> str | None:  # the factor of "vA = vF * vA", else None
        m = re.fullmatch(r"v_(?:dual_)?mul_f32(?:_e32)? (v\d+), (v\d+), (v\d+)", " ".join(half.split()))
        if not m or m[1] not in (m[2], m[3]):
            return None
        return m[3] if m[1] == m[2] else m[2]

    issues = [_halves(i) for i in loop if i.op.startswith("v_")]
    factors = Counter(f for halves in issues for half in halves if (f := in_place_factor(half)))
    rescale = {f for f, n in factors.items() if n >= 16}
    pairs = [halves for halves in issues
             if len(halves) == 2 and len({in_place_factor(h) for h in halves} & rescale) == 2]
    assert len(pairs) >= 16


@pytest.mark.parametrize("target, kind, dtype, d", [
    ("gfx1100", "dkdv", "f16", 64), ("gfx1100", "dkdv", "f16", 128), ("gfx1100", "dkdv", "bf16", 160),
    ("gfx1201", "dkdv", "bf16", 64), ("gfx1201", "dkdv", "f16", 128), ("gfx1100", "dq", "f16", 64),
    ("gfx1100", "dq", "bf16", 128), ("gfx1201", "dq", "f16", 80)])
def test_the_backward_transposed_tiles_go_to_lds_by_16_bit_stores(target, kind, dtype, d):
    """dQ's K^T, and dK/dV's Q^T and dO^T where the traits' sixteen_bit_transpose takes them, go to
    LDS one element per 16-bit store, half of them in the d16_hi form (load_transposed's SIXTEEN_BIT), and an
    f16 main loop holds no v_perm_b32 (the packed form spends one per pair of rows, into a 32-bit word)."""
    cfg, _ = _backward_cfg(target, kind, d, dtype)
    ops = Counter(cfg.ops(cfg.loops[backward.main_loop(cfg)]))
    assert ops["ds_store_b16_d16_hi"] > 0 and ops["ds_store_b16"] == ops["ds_store_b16_d16_hi"]
    assert ops["ds_store_2addr_b32"] <= 1  # the row statistics' floats, not transposed words
    if dtype == "f16":
        assert ops["v_perm_b32"] == 0


@pytest.mark.parametrize("target, dtype, d", [("gfx1100", "f16", 80), ("gfx1100", "bf16", 64), ("gfx1100", "f16", 112),
                                              ("gfx1201", "f16", 48), ("gfx1201", "bf16", 96)])
def test_the_dkdv_kernels_kept_packed_store_each_pair_as_one_permuted_word(target, dtype, d):
    """The dK/dV kernels sixteen_bit_transpose leaves packed (slower with 16-bit stores, or spilling)
    store two rows' elements as one 32-bit word each, packed by one v_perm_b32 (at least 8 words per
    main-loop pass: a row pair of 8 columns), and no element by a 16-bit store."""
    cfg, _ = _backward_cfg(target, "dkdv", d, dtype)
    ops = Counter(cfg.ops(cfg.loops[backward.main_loop(cfg)]))
    assert ops["v_perm_b32"] >= 8 and ops["ds_store_b32"] + 2 * ops["ds_store_2addr_b32"] >= 8
    assert ops["ds_store_b16"] == ops["ds_store_b16_d16_hi"] == 0


@pytest.mark.parametrize("target, dtype, d", [("gfx1100", "f16", 64), ("gfx1100", "bf16", 112),
                                              ("gfx1201", "f16", 128), ("gfx1201", "bf16", 112)])
def test_dq_reads_q_and_do_per_key_tile_without_zero_fill(target, dtype, d):
    """dQ's head-dim loop loads Q and dO by RepeatingRows (kernels/tiles.h) where the traits'
    repeating_qdo takes it: no exec mask saved for a row or column test and no register zeroed for
    it. Guarded loads do both around every one of these loads."""
    cfg, variant = _backward_cfg(target, "dq", d, dtype)
    main = backward.main_loop(cfg)
    trips = backward.loop_trips(cfg, main, variant, target)
    insns = [i for b in cfg.loops[main] for i in cfg.blocks[b]
             if backward.region(cfg, trips, i) == "head-dim loop"]
    assert any(i.op == "global_load_b128" for i in insns)
    assert not any(i.op == "s_and_saveexec_b32" for i in insns)
    assert not any(i.op.startswith(("v_mov_b32", "v_dual_mov_b32")) and re.search(r", 0(\s|$)", i.args) for i in insns)


@pytest.mark.parametrize("target, dtype, d", [("gfx1100", "f16", 128), ("gfx1100", "bf16", 128),
                                              ("gfx1201", "f16", 80), ("gfx1201", "bf16", 64),
                                              ("gfx1201", "f16", 48), ("gfx1201", "bf16", 96)])
def test_dq_reads_q_and_do_once(target, dtype, d):
    """Where the traits' held_qdo or staged_qdo take it, a dQ key tile reads Q and dO from
    registers (gfx12) or from the workgroup's LDS rows (gfx11), not from global memory: each traced path's
    global loads are the K, V (and K^T) copies alone, the paths together run every global load of the
    key-tile loop (none is left behind a guard the traces skipped), and no head-dim step loads from global
    memory. Without them a dQ key tile re-reads both."""
    cfg, variant = _backward_cfg(target, "dq", d, dtype)
    choices = variant.traits(target)
    assert choices.held_qdo != choices.staged_qdo
    main = backward.main_loop(cfg)
    trips = backward.loop_trips(cfg, main, variant, target)
    hw = backward.HARDWARE[target]
    traced = set()
    for name, expect in backward.paths(variant, hw).items():
        _, _, insns = backward.count_path(cfg, main, trips, variant, expect)
        traced |= {i.addr for i, _, _ in insns}
        assert not any(i.op.startswith("global_load") for i, _, where in insns if where == "head-dim loop"), name
        if choices.held_qdo:  # the operands' constant indices leave no loop
            assert not any(where == "head-dim loop" for _, _, where in insns), name
    assert {i.addr for b in cfg.loops[main] for i in cfg.blocks[b] if i.op.startswith("global_load")} <= traced


@pytest.mark.parametrize("target, dtype, d", [("gfx1100", "f16", 64), ("gfx1100", "bf16", 32),
                                              ("gfx1201", "bf16", 64), ("gfx1201", "f16", 32)])
def test_fused_dkdv_copies_read_their_tiles_without_guards(target, dtype, d):
    """The fused dK/dV kernels copy Q, dO, Q^T and dO^T with repeated edges (the traits' repeating_copies):
    where the threads cover the tiles whole, every 16-byte load of a query tile sits in one block that no
    exec-mask branch leads into. Guarded copies test each load's row and column."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    for masked in (False, True):
        variant = variants.bwd_variant("dkdv", dtype, d, masked)
        symbol = variant.symbol
        cfg = backward.Cfg(_shipped_listing(target)[symbol])
        main = backward.main_loop(cfg)
        trips = backward.loop_trips(cfg, main, variant, target)
        copies = [b for b in cfg.loops[main] if any(i.op == "global_load_b128" for i in cfg.blocks[b])
                  and backward.region(cfg, trips, cfg.blocks[b][0]) == "rest"]
        assert len(copies) == 1, symbol
        assert not [p for p in cfg.loops[main] if copies[0] in cfg.succ[p]
                    and cfg.blocks[p][-1].op.startswith("s_cbranch_exec")], symbol


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_d128_dkdv_makes_both_gradients_from_staged_k_and_v(target, dtype):
    """The unmasked d128 dK/dV workgroup makes dK and dV from one S (the traits' fused and
    staged_kv): its traced query tile is the fused path, whose K and V operands come from the wave's
    LDS rows (no global load in the head-dim loop), and the tile's copies and row statistics share one
    memory round trip (stats_with_copies). Split into dV and dK, the workgroup re-reads V from global memory
    per query fragment on gfx11 and waits three times per tile."""
    cfg, variant = _backward_cfg(target, "dkdv", 128, dtype)
    assert variant.fused
    main = backward.main_loop(cfg)
    trips = backward.loop_trips(cfg, main, variant, target)
    hw = backward.HARDWARE[target]
    (name, expect), = backward.paths(variant, hw).items()
    counts, _, insns = backward.count_path(cfg, main, trips, variant, expect)
    assert name == "dK+dV" and counts.vmem_rounds == 1
    head_dim_loop = [i for i, _, where in insns if where == "head-dim loop"]
    assert any(i.op.startswith("v_wmma") for i in head_dim_loop)
    assert not any(i.op.startswith("global_load") for i in head_dim_loop)


@pytest.mark.parametrize("target, dtype, d", [("gfx1100", "f16", 64), ("gfx1100", "bf16", 128),
                                              ("gfx1201", "f16", 128), ("gfx1201", "bf16", 40)])
def test_backward_scores_take_one_subtraction_each(target, dtype, d):
    """A backward score's exponent takes an fma and a min: dividing by the row's probability sum is
    folded into its offset (RowExponent in kernels/fa_bwd.h), so the only f32 subtraction per
    score (per exponential) is dS's dP - delta. Without the fold it takes two on every path that makes dS."""
    if find_objdump() is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    hw = backward.HARDWARE[target]
    for kind in ("dq", "dkdv"):
        cfg, variant = _backward_cfg(target, kind, d, dtype)
        main = backward.main_loop(cfg)
        trips = backward.loop_trips(cfg, main, variant, target)
        for name, expect in backward.paths(variant, hw).items():
            _, _, insns = backward.count_path(cfg, main, trips, variant, expect)
            ops = Counter()
            for i, runs, _ in insns:  # both halves of a dual issue
                for op in [i.op, *re.findall(r"::\s*(v_\w+)", i.args)]:
                    ops[re.sub(r"_e(32|64)$", "", op.replace("v_dual_", "v_"))] += runs
            assert ops["v_exp_f32"] > 0
            assert ops["v_sub_f32"] + ops["v_subrev_f32"] <= ops["v_exp_f32"], (variant.symbol, name)


BAND = {"low": 0.5, "mid": 1.0, "high": 1.5}


def _tile_row(target: str, mask: str, valu: int) -> dict:
    """A masked-estimate row of bf16 d128 counts, priced as analyse prices it at the model's own launch."""
    variant = variants.fwd_variant("bf16", 128, masked=masked.runs_masked(mask))
    counts = {"wmma": 64, "wmma_8bit": 0, "valu": valu, "trans": 16, "salu": 20, "branch": 2, "vmem_rounds": 1,
              "lds_rounds": 2, "global_load_bytes": 16 * 512, "lds_read_bytes": 64 * 512, "lds_write_bytes": 8192}
    hw = estimator.HARDWARE[target]
    groups = estimator.SEQ // variant.block_rows * variant.d_chunks * estimator.BATCH_HEADS
    tail = sm.launch_tail(hw, 2, variant.waves, groups)
    return {"target": target, "dtype": "bf16", "d": 128, "mask": mask, "waves_per_simd": 2,
            "counts_per_wave_tile": counts,
            **sm.priced(counts, hw, 2, variant.block_n, masked.head_dim_share(variant, 128), tail, BAND)}


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_shape_pricing_reproduces_the_tile_at_its_own_launch(target):
    """masked.shape_rows priced at the model's launch (SEQ tokens, BATCH_HEADS entries x heads, whole tiles)
    gives the tile's own figures and terms; a ragged length costs the padding of its last tiles."""
    rows = [_tile_row(target, "none", 300)]
    seq, bands = estimator.SEQ, {target: BAND}
    whole, ragged = masked.shape_rows(rows, bands, shapes=(
        ("whole", "bf16", 128, "none", 1, estimator.BATCH_HEADS, (seq,), (seq,), None, None),
        ("ragged", "bf16", 128, "none", 1, estimator.BATCH_HEADS, (seq - 100,), (seq - 100,), None, None)))
    assert whole["tflops"] == rows[0]["tflops"] and whole["terms"] == rows[0]["terms"]
    assert whole["useful_share_of_tiles"] == 1.0
    assert ragged["useful_share_of_tiles"] < 1.0 and ragged["tflops"]["mid"] < whole["tflops"]["mid"]
    for r in (whole, ragged):
        assert r["tflops"]["low"] <= r["tflops"]["mid"] <= r["tflops"]["high"]
        assert sum(r["terms"].values()) == pytest.approx(r["cycles"], abs=0.5)


def test_a_padding_mask_prices_its_masked_key_tiles_as_the_scattered_masks():
    """Under a key-padding mask the tiles holding masked keys take the scattered mask's cycles: the launch's
    terms lie between the kept tiles' and those, weighted by the share of such tiles."""
    kept, scattered = _tile_row("gfx1201", masked.KEY_PADDING, 300), _tile_row("gfx1201", masked.SCATTERED, 400)
    seq = estimator.SEQ
    shape, = masked.shape_rows([kept, scattered], {"gfx1201": BAND}, shapes=(
        ("padded", "bf16", 128, masked.KEY_PADDING, 1, 16, (seq,), (seq,), None, (0, seq // 2)),))
    share = shape["tiles_with_masked_keys"]
    assert share == 0.5
    assert shape["terms"]["valu"] == pytest.approx((1 - share) * kept["terms"]["valu"] + share * scattered["terms"]["valu"],
                                                   abs=0.1)
    assert scattered["tflops"]["mid"] < shape["tflops"]["mid"] < kept["tflops"]["mid"]


def test_the_recorded_masked_estimate_is_priced_at_the_speed_models_band():
    import json

    recorded = json.loads((REPO / "bench" / "results" / "masked_estimate.json").read_text())
    assert recorded["stall_band"] == bench_speed_model.stall_bands()
    for r in recorded["rows"] + recorded["shapes"]:
        assert r["tflops"]["low"] <= r["tflops"]["mid"] <= r["tflops"]["high"]
        assert set(r["terms"]) == set(sm.TERMS)
        assert sum(r["terms"].values()) == pytest.approx(r["cycles"], abs=0.5)
    for r in recorded["rows"]:  # a packed batch runs the unmasked kernel
        if r["mask"] == masked.VARLEN:
            assert r["vs_unmasked"] == 1.0


@pytest.fixture(scope="module")
def eight_bit_rows():
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    path = REPO / "prebuilt" / "rdna_fa_gfx1201.hsaco"
    co = load_code_object(path)
    functions = estimator.disassemble(objdump, path, "gfx1201")
    row = estimator.eight_bit_row(functions, co, {k.name: k for k in co.kernels}, "f16", 128)
    exact = next(r for r in estimator.analyse(path, objdump) if (r["dtype"], r["d"]) == ("f16", 128))
    return row, exact


def test_the_8bit_forward_costs_half_a_wmma_per_8bit_product_and_its_pass_its_bytes(eight_bit_rows):
    row, exact = eight_bit_rows
    hw = estimator.HARDWARE["gfx1201"]
    stall_band = bench_speed_model.stall_bands()["gfx1201"]
    priced = estimate_8bit.priced(row, exact, stall_band)
    counts, kernel = row["counts_per_wave_tile"], priced["kernel_alone"]
    assert counts["wmma"] == counts["wmma_8bit"] == 2 * (128 // 16) * (64 // 16)  # S^T and O^T, 64-key tiles
    assert kernel["terms"]["wmma"] == counts["wmma"] * hw.wmma_cycles / hw.eight_bit_rate
    assert sum(kernel["terms"].values()) == pytest.approx(kernel["cycles"], abs=0.5)
    assert row["skips_rescale"]  # O's rescale counted on the forward's share of the tiles
    # 16-bit K and V read twice, their 8-bit codes written once; a float per 16 keys, three per channel (Q: in
    # the kernel)
    assert estimator.pass_bytes(128) == {"read": 4096 * 128 * 8, "written": 4096 * 128 * 2 + 4 * (256 + 3 * 128)}
    pass_ms = priced["quantizing_pass"]["ms"]
    assert pass_ms == round(sum(estimator.pass_bytes(128).values()) * estimator.BATCH_HEADS / (hw.dram_gbs * 1e9) * 1e3, 3)
    for end in sm.ENDS:  # per call: the kernel, then its pass
        assert priced["per_call"]["ms"][end] == pytest.approx(kernel["ms"][end] + pass_ms, abs=2e-3)
    for figures in (kernel["tflops"], priced["per_call"]["tflops"], priced["exact_tflops"]):
        assert figures["low"] <= figures["mid"] <= figures["high"]
    assert priced["per_call"]["tflops"]["mid"] < kernel["tflops"]["mid"]


def test_the_quantizing_pass_scales_with_its_bytes():
    hw = estimator.HARDWARE["gfx1201"]
    one = estimator.pass_seconds({"read": 1_000_000, "written": 0}, hw)
    assert estimator.pass_seconds({"read": 1_000_000, "written": 1_000_000}, hw) == pytest.approx(2 * one)
    assert one == pytest.approx(1e6 * estimator.BATCH_HEADS / (hw.dram_gbs * 1e9))
    assert estimator.pass_bytes(128)["read"] == 2 * estimator.pass_bytes(64)["read"]  # K and V grow with d
    assert estimator.pass_seconds(estimator.pass_bytes(128), hw) > estimator.pass_seconds(estimator.pass_bytes(64), hw)
