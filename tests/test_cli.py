"""`python -m rdna_flash_attn doctor | selftest | bench | rebuild`, and environment detection with a
faked ZLUDA device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import selftest, state
from rdna_flash_attn.runtime import artifacts, device, driver, loader
from rdna_flash_attn.tools import benchmark, cli, results_folder

REPO = Path(__file__).resolve().parent.parent

ZLUDA_NAME = "AMD Radeon RX 7900 XTX [ZLUDA]"
GPU = torch.device("cuda", 0)


class FakeHip:
    """The HIP runtime ZLUDA loads, as device.describe asks it."""

    def device_arch(self, ordinal):
        return "gfx1100"

    def runtime_version(self):
        return "6.2.41512"


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch sees one CUDA device named `fake_cuda.name` (ZLUDA's by default); describe is real."""

    class Fake:
        name = ZLUDA_NAME

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: Fake.name)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(driver, "hip_driver", lambda zluda: FakeHip())
    device._describe.cache_clear()  # describe caches per device: forget the fake before and after
    yield Fake
    device._describe.cache_clear()


def test_zluda_is_detected_by_its_device_name(fake_cuda):
    info = device.describe(GPU)
    assert info == device.DeviceInfo("zluda", ZLUDA_NAME, 0, "gfx1100", "6.2.41512")
    assert state.policy_refusal(info) is None


def test_the_same_gpu_without_the_suffix_is_an_nvidia_device_to_policy(fake_cuda):
    fake_cuda.name = "NVIDIA GeForce RTX 4090"
    info = device.describe(GPU)
    assert info.backend == "cuda" and info.gfx_target is None
    assert "RDNA_FA_FORCE" in state.policy_refusal(info)


def fake_code_object(monkeypatch, path="/p/gfx1100.hsaco", sha256="ef" * 32, refusal=None, target="gfx1100"):
    """loader.loaded_library gives a library of this code object, or raises `refusal`."""

    def loaded_library(info):
        if refusal:
            raise loader.KernelUnavailable(refusal)
        artifact = artifacts.Artifact(target, Path(path), sha256, emulated=False)
        return SimpleNamespace(artifact=artifact, device_info=info, runtime_version=info.runtime_version)

    monkeypatch.setattr(loader, "loaded_library", loaded_library)


# --- doctor -------------------------------------------------------------------------------------------


def run_cli(capsys, *argv, main=cli.main):
    """(exit code, stdout, stderr) of a command line (the package's by default), runs of spaces in
    stdout squeezed to one for matching."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, re.sub(r" +", " ", out), err


def test_doctor_on_a_cpu_machine(capsys):
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    for text in ("rdna_flash_attn 0.1.0", f"torch {torch.__version__}", "RDNA_FA_DISABLE",
                 "RDNA_FA_FP32_CAST", "backward", "none: torch sees no GPU"):
        assert text in out


def test_doctor_with_a_zluda_gpu(fake_cuda, monkeypatch, capsys):
    fake_code_object(monkeypatch)
    monkeypatch.setattr(selftest, "run_checks", lambda d, gradients=None: [selftest.Check("forward out", 1e-4, 2e-3)])
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    for text in ("cuda:0:", ZLUDA_NAME, "zluda", "gfx1100", "6.2.41512", "/p/gfx1100.hsaco", "ef" * 32,
                 "code object v5 loaded by HIP runtime 6.2.41512 (order tried: v5, v4)", "loadable yes (sha256 verified)", "self-test passed (run now)", "kernels ON"):
        assert text in out, text
    assert "ComfyUI on cuda:0:" in out and "ComfyUI takes ZLUDA's CUDA build of PyTorch for NVIDIA" in out
    _, again, _ = run_cli(capsys, "doctor")
    assert "passed (cached)" in again
    assert "8-bit attention not available: 8-bit attention needs RDNA4 (gfx12); gfx1100 has no" in again


def test_doctor_on_rdna4_says_whether_8bit_attention_runs(fake_cuda, monkeypatch, capsys):
    fake_code_object(monkeypatch, path="/p/gfx1201.hsaco", target="gfx1201")
    monkeypatch.setattr(selftest, "run_checks", lambda d, gradients=None: [])
    _, out, _ = run_cli(capsys, "doctor")
    assert "precision exact" in out and "8-bit attention available, not used (RDNA_FA_PRECISION=exact)" in out
    monkeypatch.setattr(settings, "precision", "8bit-qkpv")
    monkeypatch.setattr(selftest, "eight_bit_checks", lambda d: [selftest.Check("8-bit x relative L1", 0.2, 0.03)])
    _, out, _ = run_cli(capsys, "doctor")
    assert "precision 8-bit attention (int8 Q K^T, fp8 P V) for inference calls on RDNA4, exact elsewhere" in out
    assert "8-bit attention OFF: 8-bit attention's self-test failed: 8-bit x relative L1: error 0.2 > 0.03" in out


def test_doctor_says_why_the_kernels_are_off(fake_cuda, monkeypatch, capsys):
    fake_code_object(monkeypatch, refusal="no code object for gfx1100 in prebuilt/")
    _, out, _ = run_cli(capsys, "doctor")
    assert "artifact none: no code object" in out
    assert "kernels OFF: no code object for gfx1100 in prebuilt/" in out


def test_doctor_reports_a_failed_self_test_and_the_disable_switch(fake_cuda, monkeypatch, capsys):
    fake_code_object(monkeypatch, path="p", sha256="0" * 64)
    monkeypatch.setattr(selftest, "run_checks", lambda d, gradients=None: [selftest.Check("forward out x", 0.5, 2e-3)])
    _, out, _ = run_cli(capsys, "doctor")
    assert "kernels OFF: self-test failed: forward out x" in out
    monkeypatch.setattr(settings, "disable", True)
    _, out, _ = run_cli(capsys, "doctor")
    assert "OFF: disabled (RDNA_FA_DISABLE" in out


# --- selftest -----------------------------------------------------------------------------------------


def test_selftest_without_a_gpu_names_the_labs_selftest(capsys):
    code, out, _ = run_cli(capsys, "selftest")
    assert code == 2 and out.count("\n") == 1
    assert "no GPU visible to torch" in out and "python -m rdna_fa_lab selftest, from a clone of the repository" in out


def test_selftest_reruns_and_prints_every_check(untested_fake_gpu, capsys):
    code, out, _ = run_cli(capsys, "selftest", "--device", "cpu")
    assert code == 0 and out.count(" ok forward") == len(selftest.CASES) * len(selftest.DTYPES) * 2
    assert f"cpu ({ZLUDA_NAME}): passed" in out
    untested_fake_gpu.error = 0.3  # a rerun ignores the cached pass
    code, out, _ = run_cli(capsys, "selftest", "--device", "cpu")
    assert code == 1 and "FAIL" in out and "self-test failed" in out


def test_selftest_without_kernels(untested_fake_gpu, monkeypatch, capsys):
    fake_code_object(monkeypatch, refusal="no artifact")
    code, out, _ = run_cli(capsys, "selftest", "--device", "cpu")
    assert code == 2 and "no kernels to test: no artifact" in out



# --- bench --------------------------------------------------------------------------------------------


def test_bench_without_the_kernels_names_the_labs_bench_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "bench")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("bench: the kernels do not run on cpu: CPU tensors")
    assert "python -m rdna_fa_lab bench, from a clone of the repository" in err
    assert list(tmp_path.iterdir()) == []


def test_bench_names_its_results_folder_first_and_defaults_to_a_dated_folder_here(fake_gpu, tmp_path, monkeypatch,
                                                                                   capsys):
    here = tmp_path / "here"  # tmp_path holds the self-test cache
    here.mkdir()
    monkeypatch.chdir(here)
    code, out, _ = run_cli(capsys, "bench", "--shapes", "sd15-mid-64", "--no-backward", "--budget", "0.01")
    assert code == 0
    first = out.splitlines()[0]
    assert re.fullmatch(rf"results: {re.escape(str(here))}/rdna_fa_results/\d{{8}}-\d{{6}}", first), first
    folder = Path(first.removeprefix("results: "))
    assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".png"]
    assert [p.name for p in here.iterdir()] == ["rdna_fa_results"]  # nothing else in the folder it ran in


def test_the_default_results_folder_is_ignored_by_git():
    assert "/rdna_fa_results/" in (REPO / ".gitignore").read_text().splitlines()


def test_bench_refuses_an_unwritable_results_folder_before_any_work(fake_gpu, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run_cli(capsys, "bench", "--out", str(blocker / "results"))
    assert code == 2 and out == "" and not fake_gpu.launches
    assert err.strip() == f"bench: cannot write results to {blocker / 'results'}: Not a directory"
    assert blocker.is_file()


def test_results_folder_reports_why_it_cannot_write(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as patch:
        patch.setattr(results_folder.tempfile, "NamedTemporaryFile", refuse)  # a read-only folder, even as root
        with pytest.raises(results_folder.FolderError, match=r"cannot write results to .*/out: Permission denied$"):
            results_folder.prepare(tmp_path / "out")
    assert results_folder.prepare(tmp_path / "ok") == tmp_path / "ok" and not list((tmp_path / "ok").iterdir())


def test_bench_includes_the_kernels_where_they_run(fake_gpu, tmp_path, capsys):
    code, _, err = run_cli(capsys, "bench", "--shapes", "sd15-mid-64,sd15-cross-1024", "--dtype", "fp16",
                           "--budget", "0.01", "--out", str(tmp_path))
    assert code == 0
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    kernel_rows = [r for r in rows if r["provider"] == "rdna_fa"]
    assert [(r["shape"], r["pass"], r["error"]) for r in kernel_rows] == [
        ("sd15-mid-64", "forward", None), ("sd15-mid-64", "backward", None),
        ("sd15-cross-1024", "forward", None), ("sd15-cross-1024", "backward", None),
    ]
    assert fake_gpu.launches and fake_gpu.differentiable_launches
    # SDPA's backends this CPU lacks are named in a few words, not with torch's error text
    assert "sdpa-efficient: not offered for cpu float16" in err and "No viable backend" not in err


def test_bench_shape_table_follows_design_section_4():
    names = {s.name for s in benchmark.SHAPES}
    assert {"sd15-self-4096", "sdxl-self-4096", "flux-joint-4608", "wan-self-32760", "vae-mid-16384"} <= names
    assert set(benchmark.QUICK_SHAPES) <= set(benchmark.SHAPES)
    flux = next(s for s in benchmark.SHAPES if s.name == "flux-joint-4608")
    assert (flux.heads, flux.head_dim) == (24, 128)
    assert flux.flops("backward") == 2.5 * flux.flops("forward") == 2.5 * 4 * 24 * 4608 * 4608 * 128


def test_bench_rejects_unknown_shapes(capsys):
    code, _, err = run_cli(capsys, "bench", "--shapes", "sd9-self-1")
    assert code == 2 and "sd9-self-1" in err


# --- the module entry point ---------------------------------------------------------------------------


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "rdna_flash_attn", "doctor"], capture_output=True, text=True)
    assert result.returncode == 0 and "rdna_flash_attn" in result.stdout
    result = subprocess.run([sys.executable, "-m", "rdna_flash_attn"], capture_output=True, text=True)
    assert result.returncode == 2 and "doctor" in result.stderr


def test_the_cli_imports_without_numpy():
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from rdna_flash_attn.tools import cli\n"
            "assert cli.main(['doctor']) == 0\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- help: no torch, true descriptions ----------------------------------------------------------------

HELP_WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["{package}", *{argv!r}]
try:
    runpy.run_module("{package}", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
heavy = sorted(name for name in ("torch", "numpy", "rdna_flash_attn.dispatch.router", "rdna_flash_attn.tools.benchmark")
               if name in sys.modules)
print(code, heavy)
"""


def help_without_torch(package: str, argv: list[str]) -> str:
    """`python -m PACKAGE ARGV` in a child from the repository's root: "EXIT_CODE [heavy modules it imported]"."""
    result = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH.format(package=package, argv=argv)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1]


def verb_description(main, verb: str, capsys) -> str:
    """The description paragraph of `VERB --help`."""
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return capsys.readouterr().out.split("\n\n")[1]  # usage, description, options


def assert_describes(description: str) -> None:
    assert not description.startswith(("options:", "positional")) and len(description) > 40, description
    assert not description.startswith("`python -m")


@pytest.mark.parametrize("argv", [["--help"], [], ["no-such-verb"]])
def test_help_and_usage_errors_do_not_import_torch(argv):
    assert help_without_torch("rdna_flash_attn", argv) == f"{0 if argv == ['--help'] else 2} []"


def test_top_level_help_lists_every_verb(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(verb in out for verb in cli.VERBS) and set(cli.VERBS) == {"doctor", "selftest", "bench", "rebuild"}


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_every_verb_help_has_a_description(verb, capsys):
    assert_describes(verb_description(cli.main, verb, capsys))


def test_doctor_names_the_lab_for_the_interpreter_and_torch_does_not_print_the_numpy_warning():
    # torch warns at import without numpy; the CLI imports it (through a verb's module) with that one silenced
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from rdna_flash_attn.tools import cli\n"
            "assert 'torch' not in sys.modules\n"
            "assert cli.main(['doctor']) == 0\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Failed to initialize NumPy" not in result.stderr
    assert re.search(r"CPU interpreter +of the code objects, without a GPU: python -m rdna_fa_lab selftest, from a "
                     r"clone of the repository", result.stdout), result.stdout
