"""bench/results_page.py: the page users read, from a recorded run."""

from __future__ import annotations

import json
import re

import pytest

from bench import results_page
from rdna_flash_attn.tools.benchmark import Shape, memory_growth

from .conftest import REPO, kernel_row


def write(tmp_path, data: dict, name: str = "suite-nvidia-h100-80gb-hbm3-float16.json"):
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    path = results / name
    path.write_text(json.dumps(data))
    return path


def test_page_from_a_recorded_emulation_run(recorded_run, tmp_path):
    path = write(tmp_path, recorded_run)
    page_path = tmp_path / "README.md"
    assert results_page.main([str(path), "--out", str(page_path)]) == 0
    page = page_path.read_text()
    # plainly: which GPU, that kernel speed there is emulation, that RDNA numbers are estimates
    assert "Measured on **NVIDIA H100 80GB HBM3** (cuda)" in page
    assert "**No number on this page was measured on an RDNA GPU.**" in page
    assert "**NVIDIA emulation build**" in page and "**not RDNA speed**" in page
    # SD1.5 1024 px: 3.1 GiB with the kernels against 38.6 with SDPA math
    assert f"{3.1 / 38.6:.2f}x" in page
    assert "| sd15 1024x1024 batch 1 | 2 | 2.00 | 1.90 | 9.00 | 3.10 | 38.60 | 3.00 | 0.08 |" in page
    assert "skipped: SDPA math needs ~194 GiB" in page
    # memory: kernels exactly output + LSE, growth exponents 1 (kernels) and 2 (math)
    assert "<= 1.00x outputs + LSE" in page and "rdna_fa forward 1.00" in page and "sdpa-math forward 2.00" in page
    # bench/results/speed_model.json: the forward at the ends of the stall band
    recorded = json.loads((REPO / "bench" / "results" / "speed_model.json").read_text())["forward_grid"]
    ranges = ", ".join(f"{g['tflops']['low']:.0f}-{g['tflops']['high']:.0f} (d{g['d']})" for g in recorded
                       if g["target"] == "gfx1100" and g["dtype"] == "f16")
    assert f"estimate {ranges} TFLOP/s f16" in page
    assert "its stall band fitted on published measurements of other kernels" in page
    targets = len(json.loads((REPO / "prebuilt" / "manifest.json").read_text())["targets"])
    assert re.search(rf"\| kernel static limits \| .* \| met: \d+ kernels, {targets} targets, scratch 0 B, spills 0", page)
    # plots regenerated from the JSON next to it and linked relative to the page
    for part in ("kernels", "memory", "generation", "vae"):
        png = path.parent / f"{path.stem}-{part}.png"
        assert png.stat().st_size > 5000 and f"](results/{png.name})" in page
    assert "python -m bench.suite --out" in page and "attach the JSON" in page


def test_a_run_on_rdna_hardware_is_named_as_such(recorded_run, tmp_path):
    recorded_run["meta"]["device"] = {"backend": "zluda", "name": "AMD Radeon RX 7900 XTX [ZLUDA]", "index": 0,
                                      "gfx_target": "gfx1100", "runtime_version": "6.2.41512"}
    recorded_run["meta"]["kernels"] = {"target": "gfx1100", "path": "/p/prebuilt/rdna_fa_gfx1100.hsaco",
                                       "sha256": "cd" * 32, "emulated": False}
    page = results_page.page([(recorded_run, "results/x.json", [])])
    assert "RDNA runs: AMD Radeon RX 7900 XTX [ZLUDA]." in page and "No number on this page" not in page
    assert "The kernels ran natively (`rdna_fa_gfx1100.hsaco`, sha256 cdcdcdcdcdcd…)" in page
    assert "emulation" not in results_page.evaluate_targets(recorded_run)[3]["basis"]


def test_kernels_off_and_no_runs_are_stated(recorded_run):
    recorded_run["meta"]["kernels"] = "NVIDIA GPU: the kernels run on AMD RDNA3/RDNA4 GPUs (RDNA_FA_FORCE=1 ...)"
    page = results_page.page([(recorded_run, "results/x.json", [])])
    assert "The kernels did not run: NVIDIA GPU" in page
    empty = results_page.page([])
    assert "No suite run is recorded yet." in empty and "| kernel static limits |" in empty


def test_memory_growth_exponent_separates_linear_from_quadratic():
    shapes = [Shape(f"s{n}", 1, 2, n, n, 64) for n in (256, 512, 1024)]
    rows = [kernel_row(s, "linear", "forward", 1.0, s.linear_bytes("forward", 2) / 2**20) for s in shapes]
    rows += [kernel_row(s, "quadratic", "backward", 1.0, s.scores_bytes(2) * 3 / 2**20) for s in shapes]
    rows += [kernel_row(s, "cpu", "forward", 1.0, None) for s in shapes]
    growth = {g["provider"]: g for g in memory_growth(rows)}
    assert growth["linear"]["exponent"] == pytest.approx(1.0) and growth["quadratic"]["exponent"] == pytest.approx(2.0)
    assert growth["cpu"] == {"provider": "cpu", "pass": "forward", "tokens": [], "peak_extra_mib": [], "exponent": None}


def test_the_linear_minimum_is_what_the_kernels_allocated_on_the_h200():
    """Every forward kernel row of the recorded H200 run allocated exactly output + LSE."""
    from bench import suite

    recorded = json.loads((suite.REPO / "bench/results/bench_h200_2026-11-22_forward-only-kernels.json").read_text())
    rows = [r for r in recorded["results"] if r["provider"] == "rdna_fa" and r["pass"] == "forward"]
    assert len(rows) == 19
    for r in rows:
        shape = Shape(r["shape"], r["batch"], r["heads"], r["q_tokens"], r["k_tokens"], r["head_dim"])
        assert r["peak_extra_mib"] == pytest.approx(shape.linear_bytes("forward", 2) / 2**20, rel=0.01, abs=0.07)
