"""The interpreter's own rules: its decoding agrees with LLVM's disassembler, every instruction of
the shipped kernels is implemented, and the errors it must raise (out-of-bounds access, LDS beyond
the allocation, argument-block mismatch, unknown instruction, gfx11 WMMA half-wave rule) are raised."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from rdna_flash_attn.runtime import artifacts, loader as runtime, variants
from rdna_flash_attn.ops import attention as ops, plans
from rdna_flash_attn.ops.launch_args import FwdArgs

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from rdna_fa_lab.interpreter import InterpretedLibrary, InterpreterError, floats  # noqa: E402
from rdna_fa_lab.interpreter.dispatch import Dispatch, kernarg_segment  # noqa: E402
from rdna_fa_lab.interpreter.executor import CompiledKernel  # noqa: E402
from rdna_fa_lab.interpreter.matrix import compile_matrix  # noqa: E402
from rdna_fa_lab.interpreter.program import CodeObjectImage  # noqa: E402
from rdna_fa_lab.interpreter.trace import KernelTrace  # noqa: E402
from rdna_fa_lab.interpreter.wave import Wave  # noqa: E402
from rdna_fa_lab import cli as lab_cli, interpreted_selftest  # noqa: E402

TARGETS = ("gfx1100", "gfx1201")
SAMPLE_KERNELS = ("rdna_fa_fwd_f16_d64", "rdna_fa_bwd_dkdv_bf16_d128", "rdna_fa_bwd_dq_f16_d512")


def _image(target: str) -> CodeObjectImage:
    try:
        return CodeObjectImage(artifacts.prebuilt_artifact(target).read_verified())
    except artifacts.ArtifactError as error:
        pytest.skip(str(error))


def _objdump_mnemonics(path, target, kernel) -> dict[int, str]:
    """offset from the kernel's entry -> mnemonic, as llvm-objdump-19 decodes it."""
    listing = subprocess.run(["llvm-objdump-19", "-d", f"--mcpu={target}", f"--disassemble-symbols={kernel}", str(path)],
                             capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\s+(\S+).*// ([0-9A-F]+):", listing, re.MULTILINE)
    entry = int(rows[0][1], 16)
    return {int(address, 16) - entry: mnemonic for mnemonic, address in rows}


@pytest.mark.skipif(shutil.which("llvm-objdump-19") is None, reason="llvm-objdump-19 not installed")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", SAMPLE_KERNELS)
def test_decoding_matches_llvm_objdump(target, kernel):
    image = _image(target)
    compiled = CompiledKernel(image.program(kernel))
    expected = _objdump_mnemonics(artifacts.prebuilt_artifact(target).path, target, kernel)
    decoded = {offset: d.name for offset, d in compiled.instructions.items()}
    # The interpreter stops at the first s_code_end; LLVM lists the padding after it as well.
    expected = {offset: name for offset, name in expected.items() if offset <= max(decoded)}
    assert decoded.keys() == expected.keys(), "instruction boundaries differ"
    for offset, name in decoded.items():
        llvm = expected[offset]
        if "::" in name:  # VOPD: LLVM prints the X half first, then the Y half after "::"
            assert llvm == name.split("::")[0], (offset, name, llvm)
        else:
            assert llvm == name or llvm.startswith(name + "_e") or name.startswith(llvm), (offset, name, llvm)


@pytest.mark.parametrize("target", TARGETS)
def test_every_shipped_instruction_is_implemented(target):
    image = _image(target)
    missing = {}
    for kernel in image.kernel_names:
        for d in CompiledKernel(image.program(kernel)).unsupported:
            missing.setdefault(d.name, kernel)
    assert not missing, f"instructions the interpreter cannot run: {missing}"


def _forward_launch(target, seq_q=64, seq_k=64, head_dim=64):
    library = InterpretedLibrary(artifacts.prebuilt_artifact(target))
    q, k, v = (torch.randn(1, 1, s, head_dim, dtype=torch.float16) for s in (seq_q, seq_k, seq_k))
    out, lse = torch.empty_like(q), torch.empty(1, 1, seq_q, dtype=torch.float32)
    variant = variants.fwd_variant("f16", head_dim)
    strides = [s for t in (q, k, v, out) for s in t.stride()[:3]]
    args = FwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), *strides,
                   lse.stride(0), lse.stride(1), seq_q, seq_k, head_dim, 0, 0.18, -(-seq_q // variant.block_rows))
    args.kv_group = 1
    return library, variant, args, (q, k, v, out, lse)


def test_access_outside_the_launch_buffers_is_an_error():
    library, variant, args, buffers = _forward_launch("gfx1100")
    args.seqlen_k = 128  # the kernel now reads keys past the end of k
    with pytest.raises(InterpreterError, match=r"rdna_fa_fwd_f16_d64 pc 0x[0-9a-f]+ global_load.*outside every launch buffer"):
        library.launch(variant, (1, 1, 1), args, buffers)


def test_lds_smaller_than_the_kernel_touches_is_an_error():
    library, variant, args, buffers = _forward_launch("gfx1201")
    kernel = library.kernel(variant.symbol)
    segment = kernarg_segment(kernel.program, bytes(args), (1, 1, 1), (variant.threads, 1, 1))
    from rdna_fa_lab.interpreter.library import tensor_region
    regions = [tensor_region(i, t) for i, t in enumerate(buffers)]
    too_small = kernel.program.descriptor.group_segment_fixed_size // 2
    dispatch = Dispatch(kernel, (1, 1, 1), (variant.threads, 1, 1), too_small, segment, regions, KernelTrace("x"))
    with pytest.raises(InterpreterError, match="beyond the .* bytes allocated"):
        dispatch.run()


def test_argument_block_of_the_wrong_size_is_an_error():
    library, variant, args, buffers = _forward_launch("gfx1100")
    program = library.kernel(variant.symbol).program
    with pytest.raises(InterpreterError, match="ABI mismatch"):
        kernarg_segment(program, bytes(args)[:-8], (1, 1, 1), (variant.threads, 1, 1))


def test_unknown_instruction_is_an_error_naming_it():
    from tinygrad.renderer.amd.dsl import v
    from tinygrad.runtime.autogen.amd.rdna3.enum import SOPPOp, VOP1Op
    from tinygrad.runtime.autogen.amd.rdna3.ins import SOPP, VOP1

    image = _image("gfx1100")
    program = image.program("rdna_fa_fwd_f16_d64")
    code = VOP1(VOP1Op.V_SIN_F32_E32, v[1], v[0]).to_bytes() + SOPP(SOPPOp.S_ENDPGM, 0).to_bytes()
    kernel = CompiledKernel(type(program)(program.name, program.target, code, 0, program.descriptor, program.metadata))
    wave = Wave(8, 0)
    with pytest.raises(InterpreterError, match="v_sin_f32_e32.*not implemented"):
        kernel.run_wave(wave, {})


def test_gfx11_wmma_with_different_half_waves_is_an_error():
    from tinygrad.renderer.amd.dsl import v
    from tinygrad.runtime.autogen.amd.rdna3.enum import VOP3POp
    from tinygrad.runtime.autogen.amd.rdna3.ins import VOP3P

    from rdna_fa_lab.interpreter.decode import Decoded

    inst = VOP3P(VOP3POp.V_WMMA_F32_16X16X16_F16, v[16:23], v[0:7], v[8:15], v[16:23])
    context = CompiledKernel(_image("gfx1100").program("rdna_fa_fwd_f16_d64")).context
    run = compile_matrix(Decoded(0, 8, "v_wmma_f32_16x16x16_f16", "VOP3P", inst), context)
    wave = Wave(32, 0)
    wave.sgpr[126] = 0xFFFFFFFF
    wave.vgpr[0:16] = np.uint32(0x3C003C00)  # A = B = 1.0 everywhere: the rule holds
    wave.vgpr[16:24] = 0  # C
    run(wave)
    assert np.all(wave.vgpr[16:24].view(np.float32) == 16.0)
    wave.vgpr[3, 20] ^= 1  # lane 20 disagrees with lane 4
    with pytest.raises(InterpreterError, match="differs between the half-waves: lane 4"):
        run(wave)


def test_conversions_round_to_nearest_even():
    halfway = np.array([1 + 2**-11, 1 + 3 * 2**-11], np.float32)  # ties: down to even, up to even
    assert floats.f16_bits(halfway).tolist() == [0x3C00, 0x3C02]
    bf16_ties = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    assert floats.bf16_bits(bf16_ties).tolist() == [0x3F80, 0x3F82]


def test_fused_multiply_add_rounds_once():
    # a*b + c whose exact value lies just above a tie of f32: a double rounding (f64, then f32)
    # would round to even, the single correct rounding rounds up.
    a = np.array([1 + 2**-12], np.float32)
    c = np.array([2**-25 + 2**-60], np.float64).astype(np.float32)
    exact = (1 + 2**-12) ** 2 + float(c[0])
    correct = np.float32(exact) if abs(np.float64(np.float32(exact)) - exact) <= 2**-24 else None
    assert correct is not None and floats.fma_f32(a, a, c)[0] == correct


def test_ops_accept_cpu_tensors_only_with_an_explicit_library():
    q = torch.randn(1, 1, 16, 64, dtype=torch.float16)
    assert isinstance(plans.plan_forward(q, q, q), plans.Refusal)
    with runtime.explicit_library(InterpretedLibrary(artifacts.prebuilt_artifact("gfx1100"))):
        assert isinstance(plans.plan_forward(q, q, q), plans.ForwardPlan)
    assert isinstance(plans.plan_forward(q, q, q), plans.Refusal)


def test_the_labs_selftest_runs_the_code_object(capsys):
    assert lab_cli.main(["selftest", "--target", "gfx1201"]) == 0
    printed = capsys.readouterr().out
    assert "rdna_fa_gfx1201.hsaco, interpreted on the CPU" in printed and "FAIL" not in printed


def test_packed_f16_ops_select_halves_and_round_once():
    from tinygrad.renderer.amd.dsl import v
    from tinygrad.runtime.autogen.amd.rdna3.enum import VOP3POp
    from tinygrad.runtime.autogen.amd.rdna3.ins import VOP3P

    from rdna_fa_lab.interpreter.decode import Decoded
    from rdna_fa_lab.interpreter.vector import compile_vector

    context = CompiledKernel(_image("gfx1100").program("rdna_fa_fwd_f16_d64")).context
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((2, 32)).astype(np.float16) for _ in range(3))
    pack = lambda x: (x[0].view(np.uint16).astype(np.uint32) | x[1].view(np.uint16).astype(np.uint32) << 16)  # noqa: E731
    for op, expected in ((VOP3POp.V_PK_MUL_F16, a.astype(np.float64) * b), (VOP3POp.V_PK_ADD_F16, a.astype(np.float64) + b),
                         (VOP3POp.V_PK_FMA_F16, a.astype(np.float64) * b + c)):
        sources = (v[0], v[1], v[2]) if op == VOP3POp.V_PK_FMA_F16 else (v[0], v[1])
        inst = VOP3P(op, v[3], *sources, opsel_hi=3, opsel_hi2=1)  # high results from the high halves
        wave = Wave(8, 0)
        wave.sgpr[126] = 0xFFFFFFFF
        wave.vgpr[0], wave.vgpr[1], wave.vgpr[2] = pack(a), pack(b), pack(c)
        compile_vector(Decoded(0, 8, op.name.lower(), "VOP3P", inst), context)(wave)
        got = np.stack([(wave.vgpr[3] & 0xFFFF).astype(np.uint16), (wave.vgpr[3] >> 16).astype(np.uint16)]).view(np.float16)
        assert np.array_equal(got, expected.astype(np.float16)), op


def test_round_toward_zero_to_f16():
    values = np.array([1 + 2**-11 + 2**-13, -(1 + 3 * 2**-11), 70000.0, -1e-9, 65504.0], np.float32)
    got = floats.f16_from_bits(floats.f16_bits_toward_zero(values))
    assert got.tolist() == [1.0, -(1 + 2**-10), 65504.0, -0.0, 65504.0]


def _isa(target, module):
    """tinygrad's instruction classes ("ins") or opcode enums ("enum") of a target's ISA."""
    arch = "rdna3" if target.startswith("gfx11") else "rdna4"
    return importlib.import_module(f"tinygrad.runtime.autogen.amd.{arch}.{module}")


def _run_instructions(target, instructions, wave, exec_mask=0xFFFFFFFF):
    """Runs hand-assembled instructions (then s_endpgm) on `wave` with the interpreter's rules for `target`."""
    sopp, end = _isa(target, "ins").SOPP, _isa(target, "enum").SOPPOp.S_ENDPGM
    program = _image(target).program("rdna_fa_fwd_f16_d64")
    code = b"".join(inst.to_bytes() for inst in instructions) + sopp(end, 0).to_bytes()
    kernel = CompiledKernel(type(program)(program.name, program.target, code, 0, program.descriptor, program.metadata))
    assert not kernel.unsupported, [d.name for d in kernel.unsupported]
    wave.sgpr[126] = exec_mask
    kernel.run_wave(wave, {})


def _pairs(low, high, dtype):
    """Two columns of per-lane values packed as (high << 16 | low) 16-bit patterns."""
    bits = lambda x: (np.asarray(x, np.float32).view(np.uint32) >> 16 if dtype == "bf16"  # noqa: E731
                      else np.asarray(x, np.float16).view(np.uint16)).astype(np.uint32)
    return bits(low) | bits(high) << 16


# Per lane (a.lo, a.hi, b.lo, b.hi, accumulator) and the f32 result by hand. Row 1: each product
# is 2^-24, half an ulp of 1.0: adding them one at a time (AMD's pseudocode) rounds to even twice
# and leaves 1.0, where one rounding of the exact sum would give 1 + 2^-23.
DOT2_CASES = ((1.5, -0.5, 2.0, 4.0, 0.25, 1.25),
              (2.0**-12, 2.0**-12, 2.0**-12, 2.0**-12, 1.0, 1.0),
              (3.0, 0.5, -1.0, 0.5, -8.0, -10.75))


def _dot2_wave(dtype):
    cases = np.array([DOT2_CASES[lane % len(DOT2_CASES)] for lane in range(32)], np.float64)
    wave = Wave(8, 0)
    wave.vgpr[0] = _pairs(cases[:, 0], cases[:, 1], dtype)
    wave.vgpr[1] = _pairs(cases[:, 2], cases[:, 3], dtype)
    wave.vgpr[2] = cases[:, 4].astype(np.float32).view(np.uint32)
    return wave, cases[:, 5].astype(np.float32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ("f16", "bf16"))
def test_dot2_adds_exact_products_one_at_a_time(target, dtype):
    from tinygrad.renderer.amd.dsl import v
    ins = _isa(target, "ins")
    op = getattr(_isa(target, "enum").VOP3POp, f"V_DOT2_F32_{dtype.upper()}")
    wave, expected = _dot2_wave(dtype)
    _run_instructions(target, [ins.VOP3P(op, v[3], v[0], v[1], v[2], opsel_hi=3, opsel_hi2=1)], wave)
    assert np.array_equal(wave.vgpr[3].view(np.float32), expected)
    # The kernels' form: the row sum of a packed pair, the literal (1.0, 1.0) as the second source.
    one_one = 0x3C003C00 if dtype == "f16" else 0x3F803F80
    _run_instructions(target, [ins.VOP3P(op, v[4], v[0], one_one, v[2], opsel_hi=3, opsel_hi2=1)], wave)
    cases = np.array([DOT2_CASES[lane % len(DOT2_CASES)] for lane in range(32)], np.float64)
    sums = [np.float32(np.float32(c[4] + c[0]) + c[1]) for c in cases]  # exact here: small sums
    assert np.array_equal(wave.vgpr[4].view(np.float32), np.array(sums, np.float32))


def test_dot2acc_accumulates_into_its_destination_in_both_encodings():
    from tinygrad.renderer.amd.dsl import v
    from tinygrad.runtime.autogen.amd.rdna3.enum import VOP2Op, VOPDOp
    from tinygrad.runtime.autogen.amd.rdna3.ins import VOP2, VOPD

    wave, expected = _dot2_wave("f16")
    wave.vgpr[3] = wave.vgpr[2]
    wave.vgpr[4] = wave.vgpr[2]
    accumulator = wave.vgpr[2].copy()
    _run_instructions("gfx1100", [
        VOP2(VOP2Op.V_DOT2ACC_F32_F16_E32, v[3], v[0], v[1]),
        # The dual form reads its sources before either half writes: v[7] gets v[4]'s old value.
        VOPD(VOPDOp.V_DUAL_DOT2ACC_F32_F16, VOPDOp.V_DUAL_MOV_B32, vdstx=v[4], vdsty=v[7], srcx0=v[0], vsrcx1=v[1],
             srcy0=v[4], vsrcy1=v[5]),
    ], wave)
    assert np.array_equal(wave.vgpr[3].view(np.float32), expected)
    assert np.array_equal(wave.vgpr[4].view(np.float32), expected)
    assert np.array_equal(wave.vgpr[7], accumulator)


@pytest.mark.parametrize("target", TARGETS)
def test_permlanex16_reads_an_inactive_lane_only_with_fetch_inactive(target):
    """Lane i of each half-wave reads lane i of the other (the kernels' selects). With fetch-inactive
    (op_sel[0], as the kernels issue it) an inactive source lane is read; without it that lane's "old"
    fallback is not modelled, and reading it is an error rather than a silent guess."""
    from tinygrad.renderer.amd.dsl import s, v

    isa = _isa(target, "ins")
    swap = lambda fetch_inactive: isa.VOP3(_isa(target, "enum").VOP3Op.V_PERMLANEX16_B32, v[2], v[0], s[0], s[1],  # noqa: E731
                                           opsel=int(fetch_inactive))
    wave = Wave(32, 0)
    wave.sgpr[0], wave.sgpr[1] = 0x76543210, 0xFEDCBA98
    wave.vgpr[0] = np.arange(32, dtype=np.uint32) + 100
    _run_instructions(target, [swap(True)], wave, exec_mask=0x0000FFFF)
    assert np.array_equal(wave.vgpr[2][:16], np.arange(16, 32) + 100)  # read from the inactive upper half
    _run_instructions(target, [swap(False)], wave, exec_mask=0xFFFFFFFF)
    assert np.array_equal(wave.vgpr[2], np.roll(np.arange(32) + 100, 16))
    with pytest.raises(InterpreterError, match="reads an inactive lane"):
        _run_instructions(target, [swap(False)], wave, exec_mask=0x0000FFFF)


@pytest.mark.parametrize("target", TARGETS)
def test_bit_reverse(target):
    from tinygrad.renderer.amd.dsl import v
    values = np.array([0xFFFFFFFE, 1, 0x12345678, 0x80000000] * 8, np.uint32)
    wave = Wave(8, 0)
    wave.vgpr[0] = values
    _run_instructions(target, [_isa(target, "ins").VOP1(_isa(target, "enum").VOP1Op.V_BFREV_B32_E32, v[1], v[0])],
                      wave)
    assert [int(x) for x in wave.vgpr[1][:4]] == [0x7FFFFFFF, 0x80000000, 0x1E6A2C48, 1]


@pytest.mark.parametrize("target", TARGETS)
def test_64_bit_signed_compares(target):
    from tinygrad.renderer.amd.dsl import s, v
    ins, ops_enum = _isa(target, "ins"), _isa(target, "enum").VOP3Op
    a = np.array([-(2**40), 5, -1, 2**40] * 8, np.int64)
    b = np.array([3, 2**33, -2, 2**40] * 8, np.int64)
    wave = Wave(8, 0)
    for register, values in ((0, a), (2, b)):
        raw = values.view(np.uint64)
        wave.vgpr[register], wave.vgpr[register + 1] = (raw & 0xFFFFFFFF).astype(np.uint32), (raw >> 32).astype(np.uint32)
    _run_instructions(target, [ins.VOP3_SDST(ops_enum.V_CMP_GT_I64_E64, s[4], v[0:1], v[2:3]),
                               ins.VOP3_SDST(ops_enum.V_CMP_LT_I64_E64, s[5], v[0:1], v[2:3])], wave)
    lanes = np.arange(32)
    assert wave.sgpr[4] == int(sum(1 << int(i) for i in lanes[a > b]))  # unsigned order would differ
    assert wave.sgpr[5] == int(sum(1 << int(i) for i in lanes[a < b]))


def test_scalar_float_compare_and_unsigned_conversion():
    from tinygrad.renderer.amd.dsl import s
    from tinygrad.runtime.autogen.amd.rdna4.enum import SOP1Op, SOPCOp
    from tinygrad.runtime.autogen.amd.rdna4.ins import SOP1, SOPC

    f32_bits = lambda x: int(np.float32(x).view(np.uint32))  # noqa: E731
    for a, b, nlt in ((1.0, 2.0, 0), (2.0, 1.0, 1), (1.0, 1.0, 1), (float("nan"), 1.0, 1), (-0.0, 0.0, 1)):
        wave = Wave(8, 0)
        wave.sgpr[0], wave.sgpr[1] = f32_bits(a), f32_bits(b)
        _run_instructions("gfx1201", [SOPC(SOPCOp.S_CMP_NLT_F32, s[0], s[1])], wave)
        assert wave.scc == nlt, (a, b)
    # 2^24 + 1 is a tie between 2^24 and 2^24 + 2: nearest even is 2^24; 2^32 - 1 rounds up to 2^32.
    for value, expected in ((7, 7.0), (2**24 + 1, 2.0**24), (2**24 + 3, 2.0**24 + 4), (2**32 - 1, 2.0**32)):
        wave = Wave(8, 0)
        wave.sgpr[0] = value
        _run_instructions("gfx1201", [SOP1(SOP1Op.S_CVT_F32_U32, s[2], s[0])], wave)
        assert wave.sgpr[2] == f32_bits(expected), value


def test_code_object_v4_runs_like_v5():
    """gfx1100 ships code object v4 beside v5 (HIP before 6.0 loads v4): same kernels, another ELF
    ABI version; the interpreter reads both and they compute the same bits."""
    try:
        legacy = InterpretedLibrary(artifacts.prebuilt_artifact("gfx1100", 4))
    except artifacts.ArtifactError as error:
        pytest.skip(str(error))
    library, variant, args, buffers = _forward_launch("gfx1100")
    library.launch(variant, (1, 1, 1), args, buffers)
    first = [t.clone() for t in buffers[3:]]
    for t in buffers[3:]:
        t.fill_(float("nan"))
    legacy.launch(variant, (1, 1, 1), args, buffers)
    assert all(torch.equal(a, b) for a, b in zip(first, buffers[3:]))
    assert torch.isfinite(buffers[3]).all()


def test_the_labs_selftest_reports_an_interpreter_error_in_one_line(capsys, monkeypatch):
    def refuse(target):
        raise InterpreterError("v_sin_f32_e32 is not implemented", "rdna_fa_fwd_f16_d64", 0x40)
    monkeypatch.setattr(interpreted_selftest, "run_interpreted", refuse)
    assert lab_cli.main(["selftest", "--target", "gfx1100"]) == 1
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and "rdna_fa_fwd_f16_d64 pc 0x40" in printed and "Traceback" not in printed


def test_artifact_info_describes_the_interpreted_code_object():
    with runtime.explicit_library(InterpretedLibrary.for_target("gfx1100")):
        info = ops.artifact_info(torch.device("cpu"))
    assert info["runtime_version"] is None and info["code_object_version"] == 5 and not info["emulated"]
    assert info["path"].endswith("rdna_fa_gfx1100.hsaco")


@pytest.mark.parametrize("target", TARGETS)
def test_maxmin_and_minmax_clamp_and_pass_nan_over(target):
    """v_maxmin_f32 is min(max(a, b), c) and v_minmax_f32 max(min(a, b), c) (gfx12: the _num forms), with
    IEEE maxNum/minNum's rule that a NaN operand gives the other one (the kernels' bias clamp, sequence.h)."""
    from tinygrad.renderer.amd.dsl import v
    ins, ops_enum = _isa(target, "ins"), _isa(target, "enum").VOP3Op
    suffix = "_F32" if target.startswith("gfx11") else "_NUM_F32"
    values = np.array([5.0, -7.0, np.nan, 0.5] * 8, np.float32)
    wave = Wave(8, 0)
    wave.vgpr[0] = values.view(np.uint32)
    wave.vgpr[1] = np.full(32, -2.0, np.float32).view(np.uint32)
    wave.vgpr[2] = np.full(32, 2.0, np.float32).view(np.uint32)
    _run_instructions(target, [ins.VOP3(getattr(ops_enum, "V_MAXMIN" + suffix), v[3], v[0], v[1], v[2]),
                               ins.VOP3(getattr(ops_enum, "V_MINMAX" + suffix), v[4], v[0], v[2], v[1])], wave)
    assert wave.vgpr[3][:4].view(np.float32).tolist() == [2.0, -2.0, -2.0, 0.5]
    assert wave.vgpr[4][:4].view(np.float32).tolist() == [2.0, -2.0, 2.0, 0.5]


@pytest.mark.parametrize("target", TARGETS)
def test_64_bit_scalar_bitfield_extract(target):
    """s_bfe_i64 / s_bfe_u64 (a mask view's 64-bit row base sign-extends an int with it): the field at
    S1[5:0], S1[22:16] bits wide, from a 64-bit source; signed sign-extends from the field's top bit."""
    from tinygrad.renderer.amd.dsl import s
    ins, ops_enum = _isa(target, "ins"), _isa(target, "enum").SOP2Op
    wave = Wave(8, 0)
    source = 0x8000_0001_F000_0000
    wave.sgpr[0], wave.sgpr[1] = source & 0xFFFFFFFF, source >> 32
    wave.sgpr[2] = 32 << 16  # the low 32 bits, offset 0
    wave.sgpr[3] = (8 << 16) | 28  # 8 bits from bit 28: 0x1F
    _run_instructions(target, [ins.SOP2(ops_enum.S_BFE_I64, s[4:5], s[0:1], s[2]),
                               ins.SOP2(ops_enum.S_BFE_U64, s[6:7], s[0:1], s[2]),
                               ins.SOP2(ops_enum.S_BFE_I64, s[8:9], s[0:1], s[3])], wave)
    assert (wave.sgpr[4], wave.sgpr[5]) == (0xF000_0000, 0xFFFF_FFFF)  # sign-extended
    assert (wave.sgpr[6], wave.sgpr[7]) == (0xF000_0000, 0)
    assert (wave.sgpr[8], wave.sgpr[9]) == (0x1F, 0)
