"""The speed model in named cycle terms (rdna_fa_lab/speed_model.py): its terms add up to the tile's
cycles, the fitted stall reproduces each fit measurement, the recorded fit and held-out residual table is
what the records give, the hardware's ISA capabilities are the tuning table's, and the forward estimator
reads every shipped kernel (f16 and bf16, both ISAs) with the bf16 huge-score rounding as a cold path."""

from __future__ import annotations

import json

import pytest

from bench import speed_model as bench_speed_model
from rdna_fa_lab import speed_model as sm, throughput_estimate as estimator
from rdna_fa_lab.resource_report import find_objdump
from rdna_flash_attn.runtime import tuning, variants

from .conftest import REPO

RECORD = REPO / "bench" / "results" / "speed_model.json"
COUNTS = {"wmma": 32, "valu": 150, "trans": 17, "salu": 20, "branch": 3, "vmem_rounds": 2, "lds_rounds": 3,
          "lds_read_bytes": 8192, "lds_write_bytes": 2048, "global_load_bytes": 16384}


def inputs() -> tuple[dict, dict, dict]:
    return tuple(json.loads(path.read_text()) for path in (bench_speed_model.CALIBRATION, bench_speed_model.FORWARD,
                                                          bench_speed_model.BACKWARD))


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
@pytest.mark.parametrize("waves", [1, 2, 8])
def test_the_terms_add_up_to_the_tiles_cycles(target, waves):
    hw = estimator.HARDWARE[target]
    terms = sm.tile_terms(COUNTS, hw, waves, keys_per_trip=32, stall=0.9)
    scale = sm.TILE_KEYS / 32
    assert set(terms) == set(sm.TERMS)
    assert terms["wmma"] == COUNTS["wmma"] * hw.wmma_cycles * scale
    assert terms["trans"] == COUNTS["trans"] * sm.TRANS_CYCLES[hw.isa.name] * scale
    assert terms["stall"] == pytest.approx(0.9 * sm.non_wmma(terms))
    priced = sm.priced(COUNTS, hw, waves, 32, 128, 1.0, {"low": 0.5, "mid": 0.9, "high": 1.3})
    assert priced["cycles"] == pytest.approx(sum(terms.values()), abs=0.1)
    assert priced["tflops"]["low"] <= priced["tflops"]["mid"] <= priced["tflops"]["high"]  # equal where a pipe binds
    assert sm.tflops(sm.cycles_at(80.0, hw, 128, 0.9), hw, 128, 0.9) == pytest.approx(80.0)


def test_wmma_alone_reaches_the_peak_and_no_factor_touches_it():
    for hw in estimator.HARDWARE.values():
        wmma_only = {**{k: 0 for k in COUNTS}, "wmma": 64}
        cycles = sum(sm.tile_terms(wmma_only, hw, 4, keys_per_trip=64, stall=5.0).values())
        assert sm.tflops(cycles, hw, 128) == pytest.approx(hw.peak_tflops)


def test_the_fitted_stall_gives_each_fit_measurement_back():
    rows = [r for r in bench_speed_model.external_rows(inputs()[0]) if r["role"] == "fit"]
    assert rows
    for row in rows:
        hw = estimator.HARDWARE[row["target"]]
        stall = bench_speed_model.implied(row)
        cycles = sum(sm.tile_terms(row["counts"], hw, row["waves_per_simd"], row["keys_per_trip"], stall).values())
        assert sm.tflops(cycles, hw, row["head_dim"], row["tail"]) == pytest.approx(row["measured"], rel=2e-3)


def test_the_recorded_residual_table_is_what_the_records_give():
    recorded = json.loads(RECORD.read_text())
    built = json.loads(json.dumps(bench_speed_model.build(*inputs())))
    assert built == recorded, "the speed model's inputs or code changed: python -m bench.speed_model --json ..."
    for row in recorded["kernels"]:
        assert row["residual"] == round(row["measured"] / row["predicted"]["tflops"]["mid"] - 1, 3)
    held_out = [r for r in recorded["kernels"] if r["role"] == "held out"]
    assert held_out and all(r["target"] in estimator.HARDWARE for r in held_out)


def test_the_stall_band_spans_the_fit_rows_of_its_isa():
    recorded = json.loads(RECORD.read_text())
    for target, band in recorded["stall_band"].items():
        fitted = [r["implied_stall"] for r in recorded["kernels"] if r["target"] == target and r["role"] == "fit"]
        assert band["low"] == pytest.approx(min(fitted), abs=1e-3)
        assert band["high"] == pytest.approx(max(fitted), abs=1e-3)


def test_the_estimates_price_at_the_recorded_stall_band():
    """The band the backward, masked and 8-bit estimates take (stall_bands) is the record's fitted one."""
    assert bench_speed_model.stall_bands() == json.loads(RECORD.read_text())["stall_band"]


def test_a_higher_stall_gives_the_lower_figure():
    assert sm.figure_band({"low": 120.04, "mid": 110.0, "high": 99.96}) == {"mid": 110.0, "low": 100.0, "high": 120.0}
    hw = estimator.HARDWARE["gfx1201"]
    figures = sm.priced(COUNTS, hw, 4, 32, 128, 1.0, {"low": 0.2, "mid": 1.0, "high": 3.0})["tflops"]
    assert figures["low"] < figures["mid"] < figures["high"]


def test_kendall_tau_counts_pairs_out_of_order():
    assert sm.kendall_tau([1, 2, 3], [10, 20, 30]) == (1.0, 3, 0)
    assert sm.kendall_tau([1, 2, 3], [30, 20, 10]) == (-1.0, 0, 3)
    assert sm.kendall_tau([1, 3, 2], [10, 20, 30]) == (pytest.approx(1 / 3), 2, 1)


@pytest.mark.parametrize("target, isa", [("gfx1100", "gfx11"), ("gfx1201", "gfx12")])
def test_the_hardware_takes_its_isa_capabilities_from_the_tuning_table(target, isa):
    hw = estimator.HARDWARE[target]
    assert hw.isa is tuning.ISAS[isa]
    assert hw.operand_copies == tuning.ISAS[isa].operand_vgprs // 4
    assert hw.eight_bit_rate == tuning.ISAS[isa].eight_bit_rate


@pytest.fixture(scope="module")
def forward_rows():
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    return {target: estimator.analyse(REPO / "prebuilt" / f"rdna_fa_{target}.hsaco", objdump)
            for target in ("gfx1100", "gfx1201")}


@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_the_estimator_reads_every_shipped_forward_kernel(forward_rows, target):
    rows = {(r["dtype"], r["d"]): r for r in forward_rows[target]}
    assert set(rows) == {(dtype, d) for dtype in estimator.DTYPES for d in estimator.HEAD_DIMS}
    for (dtype, d), row in rows.items():
        rounds = variants.fwd_variant(dtype, d).traits(target).rounds_huge_scores
        # bf16 kernels carry the huge-score rounding, priced apart as a cold path; f16 ones have none
        assert (row["cold_path"]["valu"] > 0) == rounds, (dtype, d)


SHIPPED = json.loads((REPO / "prebuilt" / "manifest.json").read_text())["targets"]


@pytest.mark.parametrize("target", [t for t in SHIPPED if t not in estimator.HARDWARE])
def test_the_key_tile_is_read_in_every_other_shipped_code_object(target):
    """The targets the model does not price: their forward tiles are read the same way, every WMMA found."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    functions = estimator.disassemble(objdump, REPO / "prebuilt" / f"rdna_fa_{target}.hsaco", target)
    for dtype in estimator.DTYPES:
        for d in estimator.HEAD_DIMS:
            variant = variants.fwd_variant(dtype, d)
            body = functions[variant.symbol]
            main = estimator.main_loop(body)
            loops = estimator.inner_loops(body, main, variant, estimator.peeled_score_steps(target, variant))
            share = estimator.rescaled_tile_share(variant.block_n) if estimator.rescale_blocks(body, main, loops) else None
            counts = estimator.count_tile(body, main, loops, share)
            assert counts.wmma == (variant.d_pad + variant.d_chunk) // 16 * (variant.block_n // 16), (dtype, d)
            cold = estimator.cold_path_counts(body, main, loops)
            assert (cold.valu > 0) == variant.traits(target).rounds_huge_scores, (dtype, d)


def test_the_huge_score_rounding_runs_on_no_tile_and_its_test_on_every_tile():
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    path = REPO / "prebuilt" / "rdna_fa_gfx1100.hsaco"
    body = estimator.disassemble(objdump, path, "gfx1100")[variants.fwd_variant("bf16", 128).symbol]
    variant = variants.fwd_variant("bf16", 128)
    main = estimator.main_loop(body)
    loops = estimator.inner_loops(body, main, variant, estimator.peeled_score_steps("gfx1100", variant))
    runs = estimator.tile_runs(body, main, loops, estimator.rescaled_tile_share(variant.block_n))
    cold = [b for b in estimator.skipped_blocks(body, main, loops) if estimator.is_huge_score_rounding(body, b)]
    assert len(cold) == 1
    assert all(runs[i.addr] == 0 for i in estimator.up_to_jump(body, cold[0]))
    test = [i for i in body if i.op.startswith("v_cmp") and estimator.HUGE_SCORE_LITERAL in i.args
            and main[0] <= i.addr <= main[1]]
    assert len(test) == 1 and runs[test[0].addr] == 1.0
