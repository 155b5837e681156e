"""The lab's command line, `python -m rdna_fa_lab bench | selftest | coverage | report`: the main job
without an RDNA GPU (the shipped code objects on the CPU interpreter, the expected speed per GPU), the
interpreted self-test, and help that imports no torch."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rdna_fa_lab import cli, coverage, interpreted, resource_report
from rdna_flash_attn.runtime import artifacts

from . import test_cli

REPO = Path(__file__).resolve().parent.parent
run_cli = functools.partial(test_cli.run_cli, main=cli.main)


def bench_json(folder: Path) -> dict:
    (path,) = folder.glob("*.json")
    return json.loads(path.read_text())


# --- bench --------------------------------------------------------------------------------------------


def test_bench_without_a_gpu_shows_the_code_objects_on_the_interpreter_and_the_expected_speed(tmp_path, capsys):
    # The main job as most readers meet it: no RDNA GPU. Runs the real interpreter (about 15 s here).
    pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")
    code, out, err = run_cli(capsys, "bench", "--out", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"results: {tmp_path}"
    assert "the kernels do not run on cpu: CPU tensors" in lines[1]
    data = bench_json(tmp_path)
    assert (tmp_path / "bench-no-rdna-gpu.png").stat().st_size > 20_000
    results = data["interpreted"]["results"]
    assert [r["target"] for r in results] == ["gfx1100", "gfx1201"] and data["interpreted"]["problem"] is None
    for result in results:
        assert result["sha256"] == artifacts.prebuilt_artifact(result["target"]).sha256
        assert [(c["pass"], c["tensor"]) for c in result["checks"]] == [
            ("forward", "out"), ("backward", "dq"), ("backward", "dk"), ("backward", "dv")]
        assert all(c["passed"] and 0 < c["ours"] <= c["bound"] and c["sdpa_math"] > 0 for c in result["checks"])
        assert result["seconds"]["forward"] > 0 and result["seconds"]["backward"] > 0
    expected = data["expected_speed"]
    assert set(expected["gpus"]) == {"gfx1100", "gfx1201"} and "not a measurement" in expected["what"]
    sdxl = expected["gpus"]["gfx1201"]["forward_workloads"][1]
    assert sdxl["shape"] == [2, 10, 4096, 64] and 0 < sdxl["tflops"][0] <= sdxl["tflops"][1] < 194.6
    # What a reader sees: the errors beside SDPA's, the interpreter named as no speed, estimates as estimates.
    assert "[1/2]" in out and "gfx1201 backward dv" in out and "not how fast a GPU runs them" in out
    assert "[2/2] expected speed" in out and "not a measurement" in out and "RX 9070 XT (gfx1201)" in out
    assert "gcnasm v201 (hand-written assembly)" in out and "FAILED" not in out
    assert "rdna_fa_bwd_dkdv_f16_d64: done in" in err  # progress while the interpreter works


def test_bench_without_the_interpreter_still_shows_the_expected_speed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rdna_fa_lab.interpreter", None)  # numpy / tinygrad not installed
    code, out, _ = run_cli(capsys, "bench", "--out", str(tmp_path))
    assert code == 0
    assert "the interpreter cannot run here" in out and "pip install numpy tinygrad==0.14.0" in out
    data = bench_json(tmp_path)
    assert data["interpreted"]["results"] == [] and set(data["expected_speed"]["gpus"]) == {"gfx1100", "gfx1201"}
    assert (tmp_path / "bench-no-rdna-gpu.png").is_file()


def test_bench_fails_when_an_interpreted_check_fails(tmp_path, monkeypatch, capsys):
    def wrong(target, say):
        check = {"pass": "forward", "tensor": "out", "ours": 0.5, "sdpa_math": 1e-4, "bound": 2e-4,
                 "rule": "2x math SDPA's", "passed": False}
        return {"target": target, "gpu": None, "code_object": "x.hsaco", "sha256": "0" * 64,
                "seconds": {"forward": 1.0, "backward": 2.0}, "checks": [check]}
    monkeypatch.setattr(interpreted, "run_call", wrong)
    code, out, _ = run_cli(capsys, "bench", "--targets", "gfx1100", "--out", str(tmp_path))
    assert code == 1 and "gfx1100 forward out" in out and "FAILED" in out


def test_bench_fails_when_the_interpreter_stops_on_a_code_object(tmp_path, monkeypatch, capsys):
    def stop(target, say):
        raise RuntimeError("rdna_fa_fwd_f16_d64 pc 0x40: v_sin_f32_e32 is not implemented")
    monkeypatch.setattr(interpreted, "run_call", stop)
    code, out, _ = run_cli(capsys, "bench", "--out", str(tmp_path))
    assert code == 1 and "gfx1100: the interpreter stopped: rdna_fa_fwd_f16_d64 pc 0x40" in out
    assert "[2/2] expected speed" in out  # the rest still shown


def test_bench_names_its_results_folder_first_and_defaults_to_a_dated_folder_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "bench", "--no-interpret")
    assert code == 0
    first = out.splitlines()[0]
    assert re.fullmatch(rf"results: {re.escape(str(tmp_path))}/rdna_fa_results/\d{{8}}-\d{{6}}", first), first
    folder = Path(first.removeprefix("results: "))
    assert sorted(p.name for p in folder.iterdir()) == ["bench-no-rdna-gpu.json", "bench-no-rdna-gpu.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["rdna_fa_results"]  # nothing else in the folder it ran in


def test_bench_refuses_an_unwritable_results_folder_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # A subprocess, as a user runs it from the repository: one line, exit 2, no traceback, nothing written.
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "bench", "--out", str(blocker / "results")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip() == f"bench: cannot write results to {blocker / 'results'}: Not a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_bench_runs_the_packages_benchmark_where_the_kernels_run(fake_gpu, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "bench", "--shapes", "sd15-mid-64", "--no-backward", "--budget", "0.01",
                           "--out", str(tmp_path))
    assert code == 0 and out.splitlines()[0] == f"results: {tmp_path}"
    rows = bench_json(tmp_path)["results"]
    assert [(r["shape"], r["pass"]) for r in rows if r["provider"] == "rdna_fa"] == [("sd15-mid-64", "forward")]


# --- selftest -----------------------------------------------------------------------------------------


def test_selftest_without_numpy_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rdna_fa_lab.interpreter", None)
    code, out, _ = run_cli(capsys, "selftest", "--target", "gfx1201")
    assert code == 2 and "cannot interpret the gfx1201 code object" in out and "numpy" in out


def test_selftest_shows_progress_while_it_runs(capsys):
    pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")
    code, out, _ = run_cli(capsys, "selftest", "--target", "gfx1201")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("gfx1201: the self-test's case") and "10 s to a minute" in lines[0]
    assert lines[1] == " float16: forward and backward ..."
    assert " rdna_fa_fwd_f16_d64: 2 workgroups of 128 threads ..." in lines
    assert any(re.fullmatch(r" rdna_fa_bwd_dkdv_bf16_d64: done in \d+\.\d s", line) for line in lines)


def test_selftest_help_states_a_true_duration(capsys):
    with pytest.raises(SystemExit):
        cli.main(["selftest", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a few seconds" not in out and "10 s to a minute" in out


# --- coverage and report ------------------------------------------------------------------------------


def test_coverage_help_names_the_hosts_it_has(capsys):
    with pytest.raises(SystemExit):
        cli.main(["coverage", "--help"])
    out = capsys.readouterr().out
    assert set(coverage.HOST_CHOICES) == {"comfyui", "a1111", "diffusers", "webui", "sd-scripts", "sdnext"}
    assert all(host in out for host in coverage.HOST_CHOICES)


def test_coverage_a1111_without_omegaconf_names_the_package(monkeypatch, capsys):
    from rdna_fa_lab.hosts import a1111_harness

    if not a1111_harness.ldm_available():
        pytest.skip("A1111's ldm (stable-diffusion-sdkit) is not installed")
    monkeypatch.setitem(sys.modules, "omegaconf", None)
    code, out, err = run_cli(capsys, "coverage", "--host", "a1111", "--families", "sd15")
    assert code == 2 and out == ""
    assert err.strip() == "coverage: A1111's ldm model code needs omegaconf, not installed: pip install omegaconf"


def test_report_gets_the_rest_of_the_command_line(monkeypatch):
    seen = []
    monkeypatch.setattr(resource_report, "main", lambda argv: seen.append(argv) or 5)
    assert cli.main(["report", "--check", "x.hsaco"]) == 5
    assert seen == [["--check", "x.hsaco"]]


def test_report_help_shows_no_path_of_this_machine(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    out = capsys.readouterr().out
    assert str(REPO) not in out and "manifest.json" in out


# --- the module entry point and help ------------------------------------------------------------------


def test_python_dash_m_from_the_repository():
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and all(verb in result.stderr for verb in cli.VERBS)


@pytest.mark.parametrize("argv", [["--help"], [], ["no-such-verb"]])
def test_help_and_usage_errors_do_not_import_torch(argv):
    assert test_cli.help_without_torch("rdna_fa_lab", argv) == f"{0 if argv == ['--help'] else 2} []"


def test_top_level_help_lists_every_verb_truly(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert set(cli.VERBS) == {"bench", "selftest", "coverage", "report"} and all(verb in out for verb in cli.VERBS)
    assert "ComfyUI-only" not in out
    for host in ("ComfyUI", "A1111", "diffusers", "Forge", "reForge", "SD.Next", "sd-scripts"):
        assert host in out, host


@pytest.mark.parametrize("verb", ["bench", "selftest", "coverage"])
def test_every_verb_help_has_a_description(verb, capsys):
    test_cli.assert_describes(test_cli.verb_description(cli.main, verb, capsys))
