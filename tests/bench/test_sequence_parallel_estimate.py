"""bench/sequence_parallel_estimate.py: its exact arithmetic of memory and communication, and a run."""

from __future__ import annotations

import json

import pytest

from bench import sequence_parallel_estimate as estimate

SHAPE = estimate.SHAPE
TENSOR = SHAPE["batch"] * SHAPE["tokens"] * SHAPE["heads"] * SHAPE["head_dim"] * SHAPE["bytes"]  # one of q, k, v


@pytest.mark.parametrize("cards", [2, 4, 8])
def test_communication_is_what_each_scheme_sends(cards):
    shard = TENSOR // cards
    assert estimate.communication_bytes("ulysses", cards)["forward"] == 4 * (shard * (cards - 1) // cards)
    assert estimate.communication_bytes("ring", cards)["forward"] == (cards - 1) * 2 * shard
    assert estimate.communication_bytes("ring", 1) == {"forward": 0, "backward": 0}


def test_memory_per_card_falls_with_the_cards():
    single = sum(estimate.memory_terms("single", 1).values())
    assert single == 4 * TENSOR + SHAPE["batch"] * SHAPE["heads"] * SHAPE["tokens"] * 4
    for scheme in ("ulysses", "ring"):
        totals = [sum(estimate.memory_terms(scheme, cards).values()) for cards in (2, 4, 8)]
        assert totals[0] > totals[1] > totals[2]
        assert totals[2] == pytest.approx(totals[1] / 2, rel=1e-3)


def test_a_run_writes_the_record_and_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    estimate.main(["--json", str(tmp_path / "e.json"), "--png", str(tmp_path / "e.png")])
    record = json.loads((tmp_path / "e.json").read_text())
    assert "no multi-GPU run" in record["what"] and (tmp_path / "e.png").stat().st_size > 0
    single = next(r for r in record["rows"] if r["scheme"] == "single" and r["target"] == "gfx1201")
    eight = next(r for r in record["rows"] if r["scheme"] == "ulysses" and r["cards"] == 8 and r["target"] == "gfx1201")
    assert eight["seconds"]["forward"]["kernel_s"][0] == pytest.approx(single["seconds"]["forward"]["kernel_s"][0] / 8)
