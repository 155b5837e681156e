"""The lab's expected_speed.json (what its `bench` shows without an RDNA GPU) is what
bench/expected_speed.py makes of the estimators' records, says where it came from, and is read as an
estimate by the bench."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from bench import expected_speed
from rdna_fa_lab import expected_speed as lab_expected_speed, interpreted

from .conftest import REPO


def shipped() -> dict:
    return json.loads(expected_speed.OUTPUT.read_text(encoding="utf-8"))


def without_commits(data: dict) -> dict:
    """The file but the commits that last wrote each record: git history, which a shallow clone lacks."""
    data = copy.deepcopy(data)
    for record in data["provenance"]["records"].values():
        record.pop("commit")
    return data


def test_the_shipped_file_is_what_the_records_give():
    assert without_commits(expected_speed.build()) == without_commits(shipped()), (
        "the estimators' records changed: python -m bench.expected_speed")


@pytest.mark.parametrize("change", ["stall band", "backward"])
def test_a_changed_record_would_show(monkeypatch, change):
    records = {name: expected_speed._load(name) for name in expected_speed.RECORDS}
    if change == "stall band":
        records[expected_speed.SPEED_MODEL]["stall_band"]["gfx1201"]["high"] += 0.1
    else:
        records[expected_speed.BACKWARD]["results"][0]["estimate"]["now"]["tflops"]["low"] += 1.0
    monkeypatch.setattr(expected_speed, "_load", lambda name: records[name])
    assert without_commits(expected_speed.build()) != without_commits(shipped())


def test_the_forward_and_the_backward_are_the_speed_models():
    data, speed = shipped(), expected_speed._load(expected_speed.SPEED_MODEL)
    backward = expected_speed._load(expected_speed.BACKWARD)
    assert backward["stall_band"] == speed["stall_band"]
    for target, gpu in data["gpus"].items():
        grid = {(g["dtype"], g["d"]): g["tflops"] for g in speed["forward_grid"] if g["target"] == target}
        for row in gpu["forward_by_head_dim"]:
            figures = grid[(row["dtype"], row["head_dim"])]
            assert row["tflops"] == [figures["low"], figures["high"]]
        now = {(r["dtype"], r["d"]): r["estimate"]["now"]["tflops"] for r in backward["results"]
               if r["target"] == target}
        for row in gpu["backward_by_head_dim"]:
            figures = now[(row["dtype"], row["head_dim"])]
            assert row["tflops"] == [figures["low"], figures["high"]]
        assert "calibration" not in gpu


def test_provenance_names_the_estimators_records_and_code_objects():
    provenance = shipped()["provenance"]
    for name, sha256 in provenance["estimators"].items():
        assert hashlib.sha256((REPO / name).read_bytes()).hexdigest() == sha256, name
    for name, record in provenance["records"].items():
        assert hashlib.sha256((REPO / name).read_bytes()).hexdigest() == record["sha256"], name
        assert record["commit"] is None or len(record["commit"]) == 40
    forward = json.loads((REPO / expected_speed.FORWARD).read_text())
    assert {k["target"]: k["code_object"]["sha256"] for k in forward["kernels"]} == {
        target: entry["sha256"] for target, entry in provenance["code_objects"].items()}


def test_every_figure_is_an_estimate_band_below_the_peak():
    data = shipped()
    assert "not a measurement" in data["what"] and "stall band" in data["band"]
    for target, gpu in data["gpus"].items():
        rows = gpu["forward_workloads"] + gpu["forward_by_head_dim"] + gpu["backward_by_head_dim"]
        assert rows and all(0 < r["tflops"][0] <= r["tflops"][1] < gpu["peak_tflops"] for r in rows), target
        assert gpu["published"] and all(p["where"] for p in gpu["published"])
    assert data["gpus"]["gfx1201"]["gpu"] == "RX 9070 XT" and data["gpus"]["gfx1100"]["gpu"] == "RX 7900 XTX"


def test_the_bench_says_when_the_estimates_come_from_other_code_objects():
    data = shipped()
    made = {t: e["sha256"] for t, e in data["provenance"]["code_objects"].items()}
    assert lab_expected_speed.code_objects_note(data, made) is None
    note = lab_expected_speed.code_objects_note(data, dict(made, gfx1201="f" * 64))
    assert note.startswith("estimated on an earlier build of the gfx1201 code objects")
    now = {t: interpreted.shipped_sha256(t) for t in made}
    assert (lab_expected_speed.code_objects_note(data, now) is None) == (now == made)


@pytest.mark.parametrize("values, text", [([40.4, 49.9], "40-50"), ([117.9, 117.9], "118"), ([66.0, 66.4], "66")])
def test_bands_print_as_whole_tflops(values, text):
    assert lab_expected_speed.band(values) == text
