"""The tuning table (rdna_flash_attn/runtime/tuning.py) is the one source of the kernels' choices: every
override changes something and says why, every choice reaches the kernels through the generated traits and
nothing else decides there, and the ISA capabilities it reasons from are the headers' own."""

import re
from pathlib import Path

import pytest

from rdna_flash_attn.runtime import tuning, variants

from .. import tuning_page

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
KERNEL_SOURCES = sorted(KERNELS.rglob("*.h")) + sorted(KERNELS.glob("*.hip"))


def compiled_instances():
    """(ISA name, variant) of every kernel the code objects hold."""
    for isa in variants.ISA_NAMES:
        for variant in variants.FWD_VARIANTS + variants.BWD_VARIANTS:
            yield isa, variant
        if variants.has_fwd8(isa):
            for variant in variants.FWD8_VARIANTS:
                yield isa, variant


def dead_overrides(overrides) -> list:
    """Overrides that change no compiled instance's choice from its rule."""
    changing = [override for isa, variant in compiled_instances() for override in variant.traits(isa).overrides]
    return [o for o in overrides if not any(o is c for c in changing)]


def test_every_override_changes_a_compiled_instance():
    assert dead_overrides(tuning.OVERRIDES) == []


def test_a_dead_override_is_found(monkeypatch):
    # The check must fail on what it exists to catch: d112 is never fused by its rule, nor by this row.
    dead = tuning.Override("dkdv", {"fused": False}, "changes nothing", d_pad=(112,))
    monkeypatch.setattr(tuning, "OVERRIDES", tuning.OVERRIDES + (dead,))
    assert dead_overrides(tuning.OVERRIDES) == [dead]


@pytest.mark.parametrize("override", tuning.OVERRIDES, ids=lambda o: f"{o.kernel}-{'-'.join(o.values)}")
def test_every_override_names_known_choices_and_says_why(override):
    knobs = {knob.name for knob in tuning.KNOBS[override.kernel]}
    assert set(override.values) <= knobs
    assert len(override.why) > 10
    assert override.isa in (None, *tuning.ISAS)
    assert override.d_pad is None or set(override.d_pad) <= set(variants.PADDED_HEAD_DIMS)


def test_overridden_choices_carry_their_reason():
    fused = variants.bwd_variant("dkdv", "f16", 128).traits("gfx1201")
    assert fused.fused and "staged" in fused.reasons["fused"]
    split = variants.bwd_variant("dkdv", "f16", 96).traits("gfx1100")
    assert not split.fused and "fused" not in split.reasons


def cpp_name(knob: str) -> str:
    return "k" + "".join(part.capitalize() for part in knob.split("_"))


# Tile candidates (variants.py takes the first whose LDS fits) and spare_vgprs (the other rules read it).
NOT_READ_BY_KERNELS = {"query_tiles", "key_tiles", "spare_vgprs"}


def test_every_other_choice_is_read_by_a_kernel():
    text = "\n".join(path.read_text() for path in KERNEL_SOURCES)
    unread = [f"{kernel}.{knob.name}" for kernel, knobs in tuning.KNOBS.items() for knob in knobs
              if knob.name not in NOT_READ_BY_KERNELS and f"T::{cpp_name(knob.name)}" not in text]
    assert unread == []


def test_generated_traits_hold_the_table():
    lines = variants.instantiation_lines().splitlines()
    gfx11 = lines[lines.index("#else") + 1:]
    structs = {m.group(1): dict(re.findall(r"static constexpr \w+ (\w+) = (\w+);", m.group(2)))
               for m in re.finditer(r"struct (\w+)_traits \{(.*?)\};", "\n".join(gfx11))}
    variant = variants.bwd_variant("dq", "bf16", 128)
    expected = {cpp_name(k): str(v).lower() for k, v in variant.traits("gfx1100").values.items()
                if not isinstance(v, tuple)}
    assert {k: v for k, v in structs[variant.symbol].items() if k in expected} == expected
    assert structs[variant.symbol]["kBlockN"] == str(variant.block_tile)


# What only the table may decide, searched for in the kernel sources.
LITERAL_HEAD_DIM_TEST = re.compile(r"(?<!% )\b(D_PAD|kDimFrags|kOutFrags|D_CHUNK|kHeadDim)\s*(==|!=|<=|>=|<|>)\s*\d+")
ISA_TEST = re.compile(r"kOperandElems\s*[=!]=")
RULE = re.compile(r"constexpr bool (\w+)\s*=(?!\s*(T::|decltype|B;|false;|true;))")
# Facts of a type or of a copy's arithmetic, not tuning choices.
MECHANISM_FLAGS = {"kSplitSlots", "kWaveColumns"}


def decisions_outside_the_table(text: str) -> list[str]:
    found = [m.group(0) for m in LITERAL_HEAD_DIM_TEST.finditer(text)]
    found += [m.group(0) for m in ISA_TEST.finditer(text)]
    found += [m.group(0) for m in RULE.finditer(text) if m.group(1) not in MECHANISM_FLAGS]
    return found


def test_kernels_take_no_decision_of_the_table():
    assert {path.name: decisions_outside_the_table(path.read_text()) for path in KERNEL_SOURCES
            if decisions_outside_the_table(path.read_text())} == {}


@pytest.mark.parametrize("source", [
    "constexpr bool kFused = D_PAD <= 64;",
    "constexpr bool kResidentV = Isa::kOperandElems == 16;",
    "if constexpr (kDimFrags == 4) peel();",
])
def test_a_decision_in_a_kernel_is_found(source):
    assert decisions_outside_the_table(source) != []


@pytest.mark.parametrize("isa", sorted(tuning.ISAS))
def test_isa_capabilities_are_the_headers(isa):
    header = (KERNELS / "isa" / f"{isa}.h").read_text()
    elems = int(re.search(r"kOperandElems = (\d+);", header).group(1))
    assert tuning.ISAS[isa].operand_vgprs == elems // 2  # two 16-bit values per VGPR
    # The 8-bit kernels are compiled where the table says 8-bit WMMA outruns 16-bit.
    main = (KERNELS / "attention.hip").read_text()
    eight_bit_isas = re.findall(r"#if defined\(__(GFX\d+)__\)\n#include \"fa_fwd8.h\"", main)
    assert variants.has_fwd8(isa) == (isa.upper() in eight_bit_isas)


def test_launch_geometry_is_the_same_on_every_isa(monkeypatch):
    # variants.py refuses a table whose tile candidates differ between ISAs (both share one launcher).
    split = tuning.Override("dkdv", {"query_tiles": (32,)}, "differs per ISA", isa="gfx12", d_pad=(96,),
                            masked=False)
    monkeypatch.setattr(tuning, "OVERRIDES", tuning.OVERRIDES + (split,))
    with pytest.raises(ValueError, match="differs between ISAs"):
        variants._bwd_variant("dkdv", "f16", 96)


def test_tuning_page_shows_the_table():
    page = tuning_page.PAGE.read_text(encoding="utf-8")
    assert tuning_page.page_tables(page) == tuning_page.tables(), (
        "the tuning table changed: python -m tests.tuning_page --write")
