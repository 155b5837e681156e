"""The interpreter's own rules: its decoding agrees with LLVM's disassembler, every instruction of
the shipped kernels is implemented, and the errors it must raise (out-of-bounds access, LDS beyond
the allocation, argument-block mismatch, unknown instruction, gfx11 WMMA half-wave rule) are raised."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from rdna_flash_attn import artifacts, ops, runtime, variants
from rdna_flash_attn.launch_args import FwdArgs

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from rdna_flash_attn.interpreter import InterpretedLibrary, InterpreterError, floats  # noqa: E402
from rdna_flash_attn.interpreter.dispatch import Dispatch, kernarg_segment  # noqa: E402
from rdna_flash_attn.interpreter.executor import CompiledKernel  # noqa: E402
from rdna_flash_attn.interpreter.matrix import compile_matrix  # noqa: E402
from rdna_flash_attn.interpreter.program import CodeObjectImage  # noqa: E402
from rdna_flash_attn.interpreter.trace import KernelTrace  # noqa: E402
from rdna_flash_attn.interpreter.wave import Wave  # noqa: E402

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
    from rdna_flash_attn.interpreter.library import tensor_region
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

    from rdna_flash_attn.interpreter.decode import Decoded

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
    assert ops.forward_refusal(q, q, q) is not None
    with runtime.explicit_library(InterpretedLibrary(artifacts.prebuilt_artifact("gfx1100"))):
        assert ops.forward_refusal(q, q, q) is None
    assert ops.forward_refusal(q, q, q) is not None


def test_selftest_interpret_command_runs_the_code_object(capsys):
    from rdna_flash_attn import cli

    assert cli.main(["selftest", "--interpret", "--target", "gfx1201"]) == 0
    printed = capsys.readouterr().out
    assert "rdna_fa_gfx1201.hsaco, interpreted on the CPU" in printed and "FAIL" not in printed


def test_packed_f16_ops_select_halves_and_round_once():
    from tinygrad.renderer.amd.dsl import v
    from tinygrad.runtime.autogen.amd.rdna3.enum import VOP3POp
    from tinygrad.runtime.autogen.amd.rdna3.ins import VOP3P

    from rdna_flash_attn.interpreter.decode import Decoded
    from rdna_flash_attn.interpreter.vector import compile_vector

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
