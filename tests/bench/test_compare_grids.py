"""bench/compare_grids.py: a run's grid cases against the record, bit for bit, per layer."""

from __future__ import annotations

import gzip
import json
import math

from bench import compare_grids


def _recorded(layer: str) -> list[dict]:
    cases = json.loads(gzip.decompress((compare_grids.RESULTS / "backward_grid_cases.json.gz").read_bytes()))
    return [case for case in cases if case["layer"] == layer]


def _write_run(folder, cases):
    folder.mkdir()
    (folder / "backward_grid.json").write_text(json.dumps({"summary": {}, "cases": cases}))


def test_a_run_that_reproduces_its_layers_cases_is_identical(tmp_path, capsys):
    cases = [dict(case, seconds=1.0) for case in _recorded("gfx11")]  # timings are not compared
    _write_run(tmp_path / "run", cases)
    assert compare_grids.main([str(tmp_path / "run")]) == 0
    assert "1000 cases, 1000 recorded for layers gfx11: identical" in capsys.readouterr().out


def test_one_error_off_by_a_unit_in_the_last_place_is_a_difference(tmp_path, capsys):
    cases = _recorded("gfx12")
    cases[7] = dict(cases[7], dq_error=math.nextafter(cases[7]["dq_error"], math.inf))
    _write_run(tmp_path / "run", cases)
    assert compare_grids.main([str(tmp_path / "run")]) == 1
    assert "1 only in the run, 1 only in the record" in capsys.readouterr().out


def test_no_report_or_an_empty_one_is_a_failure(tmp_path):
    assert compare_grids.main([str(tmp_path)]) == 1
    _write_run(tmp_path / "run", [])
    assert compare_grids.main([str(tmp_path / "run")]) == 1


def test_a_run_compares_with_a_baseline_run_of_the_same_call(tmp_path, capsys):
    cases = _recorded("gfx11")[:50]
    _write_run(tmp_path / "before", cases)
    _write_run(tmp_path / "after", [dict(case, seconds=2.0) for case in cases])
    assert compare_grids.main(["--baseline", str(tmp_path / "before"), str(tmp_path / "after")]) == 0
    assert "50 cases, 50 recorded for layers gfx11: identical" in capsys.readouterr().out
    changed = [dict(cases[0], dv_error=math.nextafter(cases[0]["dv_error"], 0.0))] + cases[1:]
    _write_run(tmp_path / "changed", changed)
    assert compare_grids.main(["--baseline", str(tmp_path / "before"), str(tmp_path / "changed")]) == 1
