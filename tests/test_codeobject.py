"""codeobject.py: the MessagePack decoder on hand-built bytes, the ELF reader on a synthetic code
object, and (when clang-19 is installed) the metadata of kernels compiled here for gfx1100/gfx1201."""

import shutil
import struct
import subprocess

import pytest

from rdna_flash_attn.runtime.codeobject import (
    CodeObjectError,
    load_code_object,
    parse_code_object,
    processor_of,
    unpack_msgpack,
)

CLANG = shutil.which("clang-19")
needs_clang = pytest.mark.skipif(CLANG is None, reason="clang-19 is not installed")


# --- MessagePack ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"\x00", 0),
        (b"\x7f", 127),
        (b"\xff", -1),
        (b"\xe0", -32),
        (b"\xc0", None),
        (b"\xc2", False),
        (b"\xc3", True),
        (b"\xcc\xff", 255),
        (b"\xcd\x01\x00", 256),
        (b"\xce\x00\x01\x00\x00", 65536),
        (b"\xcf\x00\x00\x00\x01\x00\x00\x00\x00", 1 << 32),
        (b"\xd0\x80", -128),
        (b"\xd1\x80\x00", -32768),
        (b"\xd2\xff\xff\xff\xfe", -2),
        (b"\xd3\xff\xff\xff\xff\xff\xff\xff\xfd", -3),
        (b"\xca\x3f\xc0\x00\x00", 1.5),
        (b"\xcb\x40\x09\x21\xfb\x54\x44\x2d\x18", 3.141592653589793),
        (b"\xa5hello", "hello"),
        (b"\xa0", ""),
        (b"\xd9\x03abc", "abc"),
        (b"\xda\x00\x02\xc3\xa9", "\u00e9"),
        (b"\xdb\x00\x00\x00\x01z", "z"),
        (b"\xc4\x03\x00\x01\x02", b"\x00\x01\x02"),
        (b"\xc5\x00\x01\xff", b"\xff"),
        (b"\xc6\x00\x00\x00\x00", b""),
        (b"\x93\x01\xa1x\xc0", [1, "x", None]),
        (b"\xdc\x00\x02\x01\x02", [1, 2]),
        (b"\xdd\x00\x00\x00\x01\x90", [[]]),
        (b"\x82\xa1a\x01\xa1b\x91\x02", {"a": 1, "b": [2]}),
        (b"\xde\x00\x01\xa1k\x80", {"k": {}}),
        (b"\xdf\x00\x00\x00\x01\x01\xc3", {1: True}),
    ],
)
def test_msgpack_decodes_every_type_the_metadata_uses(data, expected):
    value = unpack_msgpack(data)
    assert value == expected and type(value) is type(expected)


def test_msgpack_nested_metadata_shape():
    # {"amdhsa.kernels": [{".name": "k", ".vgpr_count": 200}], "amdhsa.version": [1, 2]}
    data = (
        b"\x82\xaeamdhsa.kernels\x91\x82\xa5.name\xa1k\xab.vgpr_count\xcc\xc8"
        b"\xaeamdhsa.version\x92\x01\x02"
    )
    expected = {"amdhsa.kernels": [{".name": "k", ".vgpr_count": 200}], "amdhsa.version": [1, 2]}
    assert unpack_msgpack(data) == expected


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x92\x01", "truncated"),
        (b"\xa5abc", "truncated"),
        (b"\xcd\x01", "truncated"),
        (b"", "truncated"),
        (b"\x01\x02", "after the MessagePack value"),
        (b"\xd4\x01\x00", "unsupported"),  # fixext1: no extension types in AMDGPU metadata
        (b"\xc1", "unsupported"),  # never used by the format
    ],
)
def test_msgpack_rejects_malformed_data(data, message):
    with pytest.raises(CodeObjectError, match=message):
        unpack_msgpack(data)


# --- ELF -----------------------------------------------------------------------------------------


def _pack(value) -> bytes:
    """Minimal MessagePack encoder for building synthetic metadata in tests."""
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return struct.pack(">BI", 0xCE, value)
    if isinstance(value, str):
        raw = value.encode()
        return struct.pack(">BB", 0xD9, len(raw)) + raw
    if isinstance(value, list):
        return struct.pack(">BH", 0xDC, len(value)) + b"".join(map(_pack, value))
    return struct.pack(">BH", 0xDE, len(value)) + b"".join(_pack(k) + _pack(v) for k, v in value.items())


def _note(name: bytes, note_type: int, desc: bytes) -> bytes:
    def pad4(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("<III", len(name), len(desc), note_type) + pad4(name) + pad4(desc)


def _synthetic_code_object(metadata: dict, e_flags: int = 0x41) -> bytes:
    """ELF64 header + one PT_NOTE program header + an unrelated note + the AMDGPU metadata note."""
    notes = _note(b"GNU\0", 3, b"abcd") + _note(b"AMDGPU\0", 32, _pack(metadata))
    note_offset = 64 + 56
    ident = b"\x7fELF" + bytes([2, 1, 1, 64, 3]) + b"\0" * 7
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 224, 1, 0, 64, 0, e_flags, 64, 56, 1, 64, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_offset, 0, 0, len(notes), len(notes), 4)
    return header + phdr + notes


_KERNEL_META = {
    ".name": "k0",
    ".symbol": "k0.kd",
    ".vgpr_count": 96,
    ".sgpr_count": 20,
    ".agpr_count": 0,
    ".group_segment_fixed_size": 33792,
    ".private_segment_fixed_size": 0,
    ".vgpr_spill_count": 0,
    ".sgpr_spill_count": 0,
    ".uses_dynamic_stack": False,
    ".max_flat_workgroup_size": 128,
    ".wavefront_size": 32,
    ".workgroup_processor_mode": 1,
}


def test_reads_kernels_and_target_from_synthetic_code_object():
    metadata = {"amdhsa.kernels": [_KERNEL_META], "amdhsa.target": "amdgcn-amd-amdhsa--gfx1201"}
    co = parse_code_object(_synthetic_code_object(metadata))
    assert co.target == "gfx1201"
    k = co.kernel("k0")
    assert (k.vgpr_count, k.sgpr_count, k.agpr_count, k.lds_bytes) == (96, 20, 0, 33792)
    assert (k.scratch_bytes, k.vgpr_spill_count, k.sgpr_spill_count) == (0, 0, 0)
    assert (k.max_flat_workgroup_size, k.wavefront_size, k.workgroup_processor_mode) == (128, 32, True)


@pytest.mark.parametrize("e_flags, target", [(0x4A, "gfx1151"), (0x55, "gfx1152")])
def test_target_falls_back_to_e_flags(e_flags, target):
    co = parse_code_object(_synthetic_code_object({"amdhsa.kernels": [_KERNEL_META]}, e_flags=e_flags))
    assert co.target == target


def test_processor_of_strips_triple_and_features():
    assert processor_of("amdgcn-amd-amdhsa--gfx1100") == "gfx1100"
    assert processor_of("amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-") == "gfx90a"


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not an elf" * 10, "not an ELF"),
        (b"\x7fELF" + bytes([1, 1]) + b"\0" * 58, "ELF64"),
        (_synthetic_code_object({"amdhsa.kernels": []})[:18] + b"\x3e\x00" + b"\0" * 44, "not AMDGPU"),
        (_synthetic_code_object({"amdhsa.version": [1, 2]}), "amdhsa.kernels"),
        (_synthetic_code_object({"amdhsa.kernels": [{".name": "k"}]}), "lacks"),
    ],
)
def test_rejects_what_is_not_an_amdgpu_code_object(data, message):
    with pytest.raises(CodeObjectError, match=message):
        parse_code_object(data)


# --- Kernels compiled with clang-19 --------------------------------------------------------------

_HIP_SOURCE = r"""
#define KERNEL extern "C" __attribute__((global))
typedef float f32x8 __attribute__((ext_vector_type(8)));

KERNEL __attribute__((amdgpu_flat_work_group_size(1, 256))) void lds_kernel(float* out) {
  __attribute__((shared)) float tile[1000];  // 4000 bytes of LDS
  unsigned t = __builtin_amdgcn_workitem_id_x();
  tile[t] = out[t];
  __builtin_amdgcn_s_barrier();
  out[t] = tile[999 - t];
}

KERNEL void scratch_kernel(float* out, int i) {
  float a[512];  // indexed at run time: cannot live in registers
  for (int j = 0; j < 512; ++j) a[j] = out[j * 7];
  out[0] = a[i & 511];
}
"""


def compile_hip(tmp_path, source: str, target: str):
    src = tmp_path / f"kernels_{target}.hip"
    out = tmp_path / f"kernels_{target}.hsaco"
    src.write_text(source)
    subprocess.run(
        [CLANG, "-x", "hip", f"--offload-arch={target}", "--cuda-device-only", "--no-gpu-bundle-output",
         "-nogpulib", "-nogpuinc", "-O3", "-o", str(out), str(src)],
        check=True, capture_output=True,
    )
    return out


@needs_clang
@pytest.mark.parametrize("target", ["gfx1100", "gfx1201"])
def test_compiled_kernel_metadata(tmp_path, target):
    co = load_code_object(compile_hip(tmp_path, _HIP_SOURCE, target))
    assert co.target == target
    assert co.target_id == f"amdgcn-amd-amdhsa--{target}"
    assert sorted(k.name for k in co.kernels) == ["lds_kernel", "scratch_kernel"]

    lds = co.kernel("lds_kernel")
    assert lds.lds_bytes == 4000
    assert lds.vgpr_count > 0 and lds.sgpr_count > 0
    assert lds.scratch_bytes == 0 and not lds.uses_dynamic_stack
    assert lds.vgpr_spill_count == 0 and lds.sgpr_spill_count == 0
    assert lds.max_flat_workgroup_size == 256
    assert lds.wavefront_size == 32 and lds.workgroup_processor_mode

    assert co.kernel("scratch_kernel").scratch_bytes >= 512 * 4
