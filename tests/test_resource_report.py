"""The static resource report (rdna_fa_lab/resource_report.py): occupancy arithmetic, loop/WMMA
attribution on hand-written disassembly, and (when clang-19 and llvm-objdump are installed) the whole
command on kernels compiled here."""

import json
import re
import shutil
import subprocess

import pytest

from rdna_fa_lab import resource_report
from rdna_flash_attn.runtime import variants
from rdna_flash_attn.runtime.codeobject import KernelResources, load_code_object

CLANG = shutil.which("clang-19")
OBJDUMP = resource_report.find_objdump()
needs_clang = pytest.mark.skipif(CLANG is None, reason="clang-19 is not installed")
needs_objdump = pytest.mark.skipif(CLANG is None or OBJDUMP is None, reason="clang-19 or llvm-objdump absent")
ALL_TARGETS = ["gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1200", "gfx1201"]


def kernel(vgprs=32, lds=0, wave=32, wgp_mode=True) -> KernelResources:
    return KernelResources(
        name="k", vgpr_count=vgprs, sgpr_count=10, agpr_count=None, lds_bytes=lds, scratch_bytes=0,
        vgpr_spill_count=0, sgpr_spill_count=0, uses_dynamic_stack=False,
        max_flat_workgroup_size=1024, wavefront_size=wave, workgroup_processor_mode=wgp_mode,
    )


# --- Occupancy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, vgprs, waves",
    [
        ("gfx1100", 141, 10),  # 1536 // roundup(141, 24) = 1536 // 144
        ("gfx1101", 64, 16),  # 1536 // 72 = 21, but only 16 wave slots
        ("gfx1151", 256, 5),  # 1536 // 264
        ("gfx1102", 141, 7),  # 1024 // roundup(141, 16) = 1024 // 144
        ("gfx1103", 128, 8),  # 1024 // 128
        ("gfx1150", 96, 10),  # 1024 // 96
        ("gfx1152", 256, 4),  # 1024 // 256, as clang-19 estimates it for gfx1152
        ("gfx1200", 130, 10),  # 1536 // 144
        ("gfx1201", 192, 8),  # 1536 // 192
    ],
)
def test_waves_limited_by_vgprs(target, vgprs, waves):
    assert resource_report.occupancy(target, kernel(vgprs=vgprs), 64).waves_per_simd == waves


def test_wave64_uses_half_the_registers_per_simd():
    assert resource_report.occupancy("gfx1100", kernel(vgprs=141, wave=64), 64).waves_per_simd == 768 // 144


def test_lds_is_allocated_in_1k_blocks():
    # 26214 bytes would fit 5 times into 128 KiB; rounded up to 26624 only 4 do: 4 groups x 4 waves / 4 SIMDs.
    occ = resource_report.occupancy("gfx1100", kernel(lds=26214), 128)
    assert (occ.waves_per_simd, occ.limited_by) == (4, "LDS")


def test_cu_mode_has_half_the_lds_and_simds():
    # WGP: 3 groups of 2 waves over 4 SIMDs; CU: 1 group of 2 waves over 2 SIMDs.
    assert resource_report.occupancy("gfx1100", kernel(lds=40960), 64).waves_per_simd == 2
    assert resource_report.occupancy("gfx1100", kernel(lds=40960, wgp_mode=False), 64).waves_per_simd == 1


def test_lds_larger_than_a_wgp_means_no_wave_fits():
    assert resource_report.occupancy("gfx1100", kernel(lds=200_000), 64).waves_per_simd == 0


def test_unknown_target_has_no_occupancy():
    assert resource_report.occupancy("gfx90a", kernel(), 64) is None


# --- WMMA in loops, from hand-written llvm-objdump output -----------------------------------------

_DISASSEMBLY = """
t.hsaco:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000001000 <outer_inner>:
\ts_mov_b32 s0, 0                                            // 000000001000: BE800080
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]   // 000000001004: CC404000 1C021108
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]   // 000000001008: CC404000 1C021108
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]   // 00000000100C: CC404000 1C021108
\ts_cbranch_execz 65534                                      // 000000001010: BFA5FFFE <outer_inner+0xc>
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]// 000000001014: CC404000 1C021108
\ts_cbranch_scc1 -4                                          // 000000001018: BFA2FFFC <outer_inner+0xc>
\ts_cbranch_vccnz 65530                                      // 00000000101C: BFA4FFFA <outer_inner+0x8>
\ts_branch 1                                                 // 000000001020: BFA00001 <outer_inner+0x28>
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]   // 000000001024: CC404000 1C021108
\ts_endpgm                                                   // 000000001028: BFB00000

0000000000001100 <no_loops>:
\tv_wmma_f32_16x16x16_f16 v[0:7], v[8:15], v[8:15], v[0:7]   // 000000001100: CC404000 1C021108
\ts_endpgm                                                   // 000000001104: BFB00000
"""


def test_wmma_are_attributed_to_their_innermost_loop():
    counts = resource_report.count_wmma(_DISASSEMBLY)
    nested = counts["outer_inner"]
    # Inner loop 0x100c..0x1018 (two back edges: a `continue` and the latch) holds 0x100c, 0x1014;
    # the outer loop 0x1008..0x101c holds 0x1008; 0x1004 and 0x1024 are outside any loop.
    assert [(l.start, l.end, l.wmma) for l in nested.loops] == [(0x1008, 0x101C, 1), (0x100C, 0x1018, 2)]
    assert (nested.main_loop, nested.in_loops, nested.total) == (2, 3, 5)
    flat = counts["no_loops"]
    assert (flat.main_loop, flat.in_loops, flat.total, flat.loops) == (0, 0, 1, ())


# --- The command on compiled kernels -------------------------------------------------------------

_PRELUDE = r"""
#define KERNEL extern "C" __attribute__((global))
#define SHARED __attribute__((shared))
#define THREADS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
typedef float f32x8 __attribute__((ext_vector_type(8)));
#if defined(__gfx1200__) || defined(__gfx1201__)
typedef _Float16 frag __attribute__((ext_vector_type(8)));  // gfx12: K split across half-waves
#define WMMA __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12
#else
typedef _Float16 frag __attribute__((ext_vector_type(16)));  // gfx11: A/B duplicated
#define WMMA __builtin_amdgcn_wmma_f32_16x16x16_f16_w32
#endif
"""

_WMMA_AND_SCRATCH = _PRELUDE + r"""
// One WMMA before the loop, one per iteration of a loop that must stay rolled.
KERNEL THREADS(64) void wmma_loop(const frag* a, f32x8* c, int n) {
  unsigned t = __builtin_amdgcn_workitem_id_x();
  f32x8 acc = WMMA(a[t], a[t], c[t]);
#pragma clang loop unroll(disable)
  for (int i = 1; i <= n; ++i) acc = WMMA(a[t + 32 * i], a[t], acc);
  c[t] = acc;
}

KERNEL void scratch_kernel(float* out, int i) {
  float a[512];  // indexed at run time: cannot live in registers
  for (int j = 0; j < 512; ++j) a[j] = out[j * 7];
  out[0] = a[i & 511];
}
"""

# Kernels whose LDS and workgroup size are known multiples of the allocation granules, so the
# The report's occupancy must equal the compiler's own estimate. `many_vgprs` keeps 12 accumulators live.
_OCCUPANCY = _PRELUDE + r"""
#define LDS_KERNEL(name, threads, floats)                                  \
  KERNEL THREADS(threads) void name(float* out) {                          \
    SHARED float tile[floats];                                             \
    unsigned t = __builtin_amdgcn_workitem_id_x();                         \
    for (unsigned i = t; i < floats; i += threads) tile[i] = out[i];       \
    __builtin_amdgcn_s_barrier();                                          \
    out[t] = tile[floats - 1 - t];                                         \
  }
LDS_KERNEL(lds40k_wg256, 256, 10240)
LDS_KERNEL(lds20k_wg64, 64, 5120)
LDS_KERNEL(lds60k_wg128, 128, 15360)
LDS_KERNEL(lds8k_wg32, 32, 2048)

KERNEL THREADS(256) void many_vgprs(const frag* a, f32x8* out, int n) {
  unsigned t = __builtin_amdgcn_workitem_id_x();
  f32x8 acc[12] = {};
  for (int i = 0; i < n; ++i) {
#pragma unroll
    for (int j = 0; j < 12; ++j) acc[j] = WMMA(a[t + i * j], a[t + i], acc[j]);
  }
#pragma unroll
  for (int j = 0; j < 12; ++j) out[t * 12 + j] = acc[j];
}
"""


def _variant_kernel(symbol: str, lds_bytes: int, max_threads: int) -> str:
    """A kernel with a variants.py symbol that declares `lds_bytes` of LDS."""
    halves = lds_bytes // 2
    return _PRELUDE + f"""
KERNEL THREADS({max_threads}) void {symbol}(_Float16* out) {{
  SHARED _Float16 tile[{halves}];
  unsigned t = __builtin_amdgcn_workitem_id_x();
  for (unsigned i = t; i < {halves}; i += {max_threads}) tile[i] = out[i];
  __builtin_amdgcn_s_barrier();
  out[t] = tile[{halves} - 1 - t];
}}
"""


def compile_hip(tmp_path, source: str, target: str, *extra: str) -> tuple:
    """Compile for one target; return the code object's path and clang's stderr."""
    src = tmp_path / "kernels.hip"
    out = tmp_path / f"kernels_{target}.hsaco"
    src.write_text(source)
    done = subprocess.run(
        [CLANG, "-x", "hip", f"--offload-arch={target}", "--cuda-device-only", "--no-gpu-bundle-output",
         "-nogpulib", "-nogpuinc", "-O3", *extra, "-o", str(out), str(src)],
        check=True, capture_output=True, text=True,
    )
    return out, done.stderr


def run_report(capsys, *argv) -> tuple:
    rc = resource_report.main([str(a) for a in argv])
    return rc, capsys.readouterr().out


@needs_objdump
@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_wmma_counts_and_resources_in_json(tmp_path, capsys, target):
    hsaco, _ = compile_hip(tmp_path, _WMMA_AND_SCRATCH, target)
    rc, out = run_report(capsys, hsaco, "--json", tmp_path / "r.json")
    assert rc == 0  # without --check the report only reports
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "r.json").read_text())["kernels"]}
    wmma = rows["wmma_loop"]
    assert (wmma["target"], wmma["workgroup_size"], wmma["scratch_bytes"]) == (target, 64, 0)
    assert wmma["vgpr"] > 0 and wmma["waves_per_simd"] == 16
    assert (wmma["wmma"]["main_loop"], wmma["wmma"]["total"]) == (1, 2)
    assert rows["scratch_kernel"]["wmma"]["total"] == 0
    assert re.search(rf"{target}\s+wmma_loop\s+64\s.*\s1/2$", out, re.M)


@needs_clang
def test_check_fails_on_scratch_and_names_the_kernel(tmp_path, capsys):
    hsaco, _ = compile_hip(tmp_path, _WMMA_AND_SCRATCH, "gfx1100")
    rc, out = run_report(capsys, hsaco, "--check", "--no-disasm")
    assert rc == 1
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failures) == 1
    expected = r"FAIL gfx1100 scratch_kernel uses \d+ bytes of scratch per work-item \(limit 0\)"
    assert re.fullmatch(expected, failures[0])
    assert "n/a" in out  # --no-disasm: no WMMA column


@needs_clang
@pytest.mark.parametrize(
    "lds_delta, max_threads, problem",
    [
        (0, 128, None),
        (16, 128, "declares 27664 bytes of LDS but variants.py expects 27648"),
        (0, 64, "is launched with 128 threads but compiled for at most 64"),
    ],
)
def test_check_compares_with_the_variants_table(tmp_path, capsys, lds_delta, max_threads, problem):
    symbol = "rdna_fa_fwd_f16_d64"
    variant = variants.FWD_BY_SYMBOL[symbol]
    assert (variant.lds_bytes("gfx1201"), variant.threads) == (27648, 128)  # the numbers this test was written for
    source = _variant_kernel(symbol, variant.lds_bytes("gfx1201") + lds_delta, max_threads)
    hsaco, _ = compile_hip(tmp_path, source, "gfx1201")
    rc, out = run_report(capsys, hsaco, "--check", "--no-disasm")
    if problem is None:
        assert rc == 0 and "check passed: 1 kernels" in out
    else:
        assert rc == 1 and f"FAIL gfx1201 {symbol} {problem}" in out


@needs_clang
def test_manifest_input_and_missing_kernels(tmp_path, capsys):
    targets = {}
    for target in ("gfx1102", "gfx1200"):
        hsaco, _ = compile_hip(tmp_path, _OCCUPANCY, target)
        targets[target] = {"file": hsaco.name, "sha256": "", "kernels": ["lds8k_wg32", "many_vgprs"]}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"abi_version": 1, "targets": targets}))

    rc, out = run_report(capsys, "--manifest", manifest, "--check", "--no-disasm")
    assert rc == 0
    for target in targets:
        assert re.search(rf"^{target}\s+many_vgprs\s", out, re.M)

    targets["gfx1200"]["kernels"].append("rdna_fa_fwd_f16_d64")
    manifest.write_text(json.dumps({"abi_version": 1, "targets": targets}))
    rc, out = run_report(capsys, "--manifest", manifest, "--check", "--no-disasm")
    assert rc == 1 and "FAIL gfx1200 rdna_fa_fwd_f16_d64: listed in the manifest but missing" in out


def test_unreadable_input_exits_2(tmp_path, capsys):
    (tmp_path / "bad.hsaco").write_bytes(b"not an elf")
    assert resource_report.main([str(tmp_path / "bad.hsaco")]) == 2
    assert resource_report.main(["--manifest", str(tmp_path / "absent.json")]) == 2


@needs_clang
@pytest.mark.parametrize("target", ALL_TARGETS)
def test_occupancy_matches_clang(tmp_path, target):
    hsaco, remarks = compile_hip(tmp_path, _OCCUPANCY, target, "-Rpass-analysis=kernel-resource-usage")
    names = re.findall(r"remark: Function Name: (\w+)", remarks)
    clang_waves = dict(zip(names, map(int, re.findall(r"Occupancy \[waves/SIMD\]: (\d+)", remarks))))
    co = load_code_object(hsaco)
    ours = {k.name: resource_report.occupancy(target, k, k.max_flat_workgroup_size).waves_per_simd for k in co.kernels}
    assert len(ours) == 5 and ours == clang_waves


_READS_BLOCK_SIZE = """
extern "C" __attribute__((global)) void explicit_only(float* out) { out[__builtin_amdgcn_workitem_id_x()] = 1.0f; }
extern "C" __attribute__((global)) void reads_block_size(float* out) {
  out[__builtin_amdgcn_workitem_id_x()] = (float)__builtin_amdgcn_workgroup_size_x();
}
"""


@needs_clang
def test_check_fails_on_hidden_arguments_and_on_a_code_object_version_the_manifest_does_not_name(tmp_path, capsys):
    hsaco, _ = compile_hip(tmp_path, _READS_BLOCK_SIZE, "gfx1100", "-mcode-object-version=5")
    code_object = load_code_object(hsaco)
    assert code_object.code_object_version == 5
    assert code_object.kernel("explicit_only").hidden_args == ()
    assert "hidden_group_size_x" in code_object.kernel("reads_block_size").hidden_args
    rc, out = run_report(capsys, hsaco, "--check", "--no-disasm")
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert rc == 1 and len(failures) == 1
    assert failures[0].startswith("FAIL gfx1100 reads_block_size reads hidden kernel arguments (")

    manifest = tmp_path / "manifest.json"
    entry = {"file": hsaco.name, "sha256": "", "kernels": ["explicit_only"], "code_object_version": 4}
    manifest.write_text(json.dumps({"abi_version": 1, "targets": {}, "targets_cov4": {"gfx1100": entry}}))
    rc, out = run_report(capsys, "--manifest", manifest, "--check", "--no-disasm")
    assert rc == 1 and f"FAIL {hsaco.name}: manifest says code object v4, the ELF header says v5" in out


@needs_clang
def test_a_v4_code_object_is_labelled_with_its_version(tmp_path, capsys):
    hsaco, _ = compile_hip(tmp_path, _READS_BLOCK_SIZE, "gfx1100", "-mcode-object-version=4")
    assert load_code_object(hsaco).code_object_version == 4
    rc, out = run_report(capsys, hsaco, "--no-disasm")
    assert rc == 0 and re.search(r"^gfx1100 v4\s+explicit_only\s", out, re.M)
