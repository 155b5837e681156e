"""bench/flash_attn_suite.py's own logic on a small synthetic test file: how cases are classified (a clear
refusal of the stand-in, directly or behind a pytest.raises that it does not match, is "refused"; any other
error is "failed"), the deterministic sampling, the time budget, the JSON and PNG, and the flash_attn names
the harness serves. flash-attn's real test file is not needed (nor kept in this repository)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from bench import flash_attn_suite as suite

SYNTHETIC_TESTS = '''
import pytest

REFUSAL = "rdna_flash_attn's flash_attn_func does not support softcap (tanh soft-capping)"


@pytest.mark.parametrize("n", range(10))
def test_even(n):
    assert n % 2 == 0, f"{n} is odd"


def test_refused():
    raise NotImplementedError(REFUSAL)


def test_refused_behind_a_pytest_raises_that_does_not_match():
    with pytest.raises(RuntimeError, match="some other message"):
        raise NotImplementedError(REFUSAL)


def test_other_not_implemented_is_a_failure():
    raise NotImplementedError("not ours")


def test_skipped():
    pytest.skip("not on this device")
'''


def run(tmp_path, **options):
    test_file = tmp_path / "test_synthetic.py"
    test_file.write_text(SYNTHETIC_TESTS, encoding="utf-8")
    updates = []
    recorder = suite.OutcomeRecorder(on_update=lambda rec: updates.append(rec.totals()), progress=lambda line: None,
                                     **options)
    suite.run_tests(test_file, recorder)
    return recorder, updates


def test_outcomes_per_function_and_refusals_told_apart_from_failures(tmp_path):
    recorder, updates = run(tmp_path)
    functions = recorder.functions
    assert (functions["test_even"]["passed"], functions["test_even"]["failed"]) == (5, 5)
    assert functions["test_even"]["parametrizations"] == functions["test_even"]["selected"] == 10
    assert functions["test_even"]["failures"] == [f"AssertionError: {n} is odd assert ({n} % 2) == 0"
                                                  for n in (1, 3, 5)]  # the first MESSAGES_KEPT, values shown
    assert functions["test_refused"]["refused"] == 1
    assert functions["test_refused"]["refusals"] == [f"NotImplementedError: {suite.REFUSAL_PREFIX}flash_attn_func "
                                                     "does not support softcap (tanh soft-capping)"]
    assert functions["test_refused_behind_a_pytest_raises_that_does_not_match"]["refused"] == 1
    assert functions["test_other_not_implemented_is_a_failure"]["failed"] == 1
    assert functions["test_skipped"]["skipped"] == 1
    assert functions["test_skipped"]["skip_reasons"] == ["Skipped: not on this device"]
    assert recorder.totals() == {"passed": 5, "refused": 2, "skipped": 1, "failed": 6, "not_run": 0}
    assert len(updates) == 14 and updates[-1] == recorder.totals()  # the JSON is rewritten after every case


def test_sampling_is_deterministic_and_runs_functions_in_turns(tmp_path):
    order = []
    first, _ = run(tmp_path, max_cases_per_function=3, seed=7)
    recorder = suite.OutcomeRecorder(max_cases_per_function=3, seed=7, progress=order.append)
    suite.run_tests(tmp_path / "test_synthetic.py", recorder)
    assert first.functions == {name: dict(record, seconds=first.functions[name]["seconds"])
                               for name, record in recorder.functions.items()}
    assert first.functions["test_even"]["parametrizations"] == 10
    assert first.functions["test_even"]["selected"] == 3
    cases = [line.split()[3] for line in order if line.startswith("[")]  # "[done/total  Ns] outcome case ..."
    assert [case.split("[")[0] for case in cases[:5]] == ["test_even", "test_refused",
                                                          "test_refused_behind_a_pytest_raises_that_does_not_match",
                                                          "test_other_not_implemented_is_a_failure", "test_skipped"]
    picked = [case for case in cases if case.startswith("test_even")]
    assert picked == sorted(picked, key=lambda case: int(case.split("[")[1].rstrip("]")))  # collection order kept


def test_sample_depends_on_the_function_and_seed_only():
    cases = list(range(100))
    assert suite.sample_cases("test_a", cases, 5, 0) == suite.sample_cases("test_a", cases, 5, 0)
    assert suite.sample_cases("test_a", cases, 5, 0) != suite.sample_cases("test_a", cases, 5, 1)
    assert suite.sample_cases("test_a", cases, 0, 0) == cases
    assert suite.sample_cases("test_a", cases[:4], 5, 0) == cases[:4]


def test_a_spent_budget_leaves_the_rest_not_run(tmp_path):
    recorder, _ = run(tmp_path, deadline=0.0)
    assert recorder.totals() == {"passed": 0, "refused": 0, "skipped": 0, "failed": 0, "not_run": 14}


def test_writes_json_and_png(tmp_path):
    recorder, _ = run(tmp_path, max_cases_per_function=2)
    meta = {"label": "cpu", "device": "cpu", "max_cases_per_function": 2}
    doc = suite.document(recorder, meta, {"flash_attn.flash_attn_func": "rdna_flash_attn stand-in"})
    suite.write_json(tmp_path / "out.json", doc)
    suite.write_chart(tmp_path / "out.png", doc)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["functions"]["test_refused"]["refused"] == 1 and saved["totals"]["not_run"] == 0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def no_flash_attn_modules(monkeypatch):
    """The flash_attn modules the harness imports or creates are gone again after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = {name for name in sys.modules if name.split(".")[0] == "flash_attn"}
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "flash_attn" and name not in before]:
        del sys.modules[name]


def test_every_import_of_the_test_file_is_served(tmp_path, no_flash_attn_modules):
    test_file = tmp_path / "test_imports.py"
    test_file.write_text(textwrap.dedent('''
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
        from flash_attn.bert_padding import pad_input
        from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM
        from flash_attn.layers.rotary import apply_rotary_emb

        def test_inside():
            from flash_attn.flash_attn_interface import flash_attn_gpu, not_a_flash_attn_name
    '''), encoding="utf-8")
    served = suite.provide_flash_attn(test_file)
    assert served["flash_attn.flash_attn_func"] == served["flash_attn.bert_padding.pad_input"] \
        == "rdna_flash_attn stand-in"
    assert served["flash_attn.flash_attn_interface.not_a_flash_attn_name"] == "MISSING: the import fails"
    assert all(served[name].startswith("test harness: ") for name in (
        "flash_attn.flash_attn_with_kvcache", "flash_attn.flash_attn_interface._get_block_size_n",
        "flash_attn.flash_attn_interface.USE_TRITON_ROCM", "flash_attn.layers.rotary.apply_rotary_emb",
        "flash_attn.flash_attn_interface.flash_attn_gpu"))
    from flash_attn import flash_attn_with_kvcache
    from flash_attn.flash_attn_interface import flash_attn_gpu

    for refusing in (flash_attn_with_kvcache, flash_attn_gpu.fwd):
        with pytest.raises(NotImplementedError) as refusal:
            refusing()
        assert suite.is_refusal(refusal.value)


def test_rotary_reference_rotates_pairs_by_position():
    x = torch.randn(2, 5, 3, 8)
    angle = torch.rand(6, 2)  # rotary_dim 4 of 8 channels; 6 positions
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    for interleaved in (False, True):
        out = suite.apply_rotary_emb(x, angle.cos(), angle.sin(), interleaved=interleaved, seqlen_offsets=offsets)
        pairs = (slice(0, 4, 2), slice(1, 4, 2)) if interleaved else (slice(0, 2), slice(2, 4))
        rotated = torch.view_as_complex(torch.stack((x[..., pairs[0]], x[..., pairs[1]]), -1).contiguous())
        position = (offsets[:, None] + torch.arange(5)).clamp(max=5)
        turn = torch.polar(torch.ones(()), angle[position])[:, :, None]
        past_the_table = (offsets[:, None] + torch.arange(5) >= 6)[..., None, None]
        expected = torch.view_as_real(torch.where(past_the_table, rotated, rotated * turn))
        torch.testing.assert_close(out[..., pairs[0]], expected[..., 0])
        torch.testing.assert_close(out[..., pairs[1]], expected[..., 1])
        assert torch.equal(out[..., 4:], x[..., 4:])
