"""The tuning table: for every kernel instance (matrix ISA, kernel, dtype, padded head dim, masked) what
its workgroup holds in registers, stages in LDS, fuses, unrolls or peels, and how its tiles are shaped.

It is the single source of these choices. kernels/build.py writes it into one traits struct per instance
(variants.instantiation_lines), which the kernel templates read; the launcher, the static report, the
estimator and the tests read it here. A choice is a rule (`KNOBS`: the default, from the instance's shape
and its ISA's capabilities) unless an override row below says otherwise, with its reason. Most reasons are
"a trial build spilled" (`python -m rdna_fa_lab report --check` on clang 19) or a measured/estimated
loss; the trials are in bench/results/backward_estimate_gfx1100.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

FRAG = 16  # WMMA tile edge on both ISAs


@dataclass(frozen=True)
class MatrixIsa:
    """What the tuning rules need to know of a WMMA instruction set."""

    name: str
    operand_vgprs: int  # VGPRs of a lane's 16x16 16-bit operand: gfx11's hold every value twice
    inline_zero_accumulator: bool  # a zero C operand is an inline constant (else zeros live in VGPRs)
    eight_bit_rate: int  # 8-bit WMMA throughput per cycle relative to 16-bit


ISAS = {
    "gfx11": MatrixIsa("gfx11", operand_vgprs=8, inline_zero_accumulator=False, eight_bit_rate=1),
    "gfx12": MatrixIsa("gfx12", operand_vgprs=4, inline_zero_accumulator=True, eight_bit_rate=2),
}


def isa_of(target: str) -> MatrixIsa:
    """The matrix ISA of `target` ("gfx1100", "gfx1201", "emulated-gfx12", "gfx11", ...)."""
    name = target.removeprefix("emulated-")
    return ISAS["gfx12" if name.startswith("gfx12") else "gfx11"]


@dataclass(frozen=True)
class Instance:
    """One compiled kernel: `kernel` is "fwd", "dkdv", "dq" or "fwd8"."""

    isa: MatrixIsa
    kernel: str
    dtype: str
    d_pad: int
    masked: bool = False

    @property
    def dim_frags(self) -> int:
        return self.d_pad // FRAG


@dataclass(frozen=True)
class Knob:
    """A choice and its rule: `default(instance, settled)` may read the knobs listed before it."""

    name: str
    default: Callable[[Instance, dict], object]
    why: str


# --- the rules -----------------------------------------------------------------------------------------

FWD_KNOBS = (
    Knob("copy_loads", lambda i, k: 16 if k["out_frags"] <= 4 else 8,
         "global loads a thread keeps in flight per K/V copy batch (4 VGPRs each): as many as fit beside "
         "the O accumulators"),
    Knob("sixteen_bit_vt", lambda i, k: True,
         "V^T goes to LDS by 16-bit stores, no v_perm_b32 per key pair"),
    Knob("skips_rescale", lambda i, k: 8 <= k["out_frags"] <= 10,
         "a tile with no new row maximum skips rescaling O: below 8 output fragments the branch costs the "
         "scheduler more than it saves (static estimate); past 10 the registers spill"),
    Knob("adjacent_rescale_factors", lambda i, k: False,
         "O's rescale takes its odd accumulators' factor from the register beside the even ones' (an empty asm's "
         "64-bit operand), not from a copy the allocator places: where it placed the copy in the factor's bank, "
         "so that the products did not pair as dual issues"),
    Knob("rounds_huge_scores", lambda i, k: i.dtype == "bf16",
         "bf16 tiles whose scaled maximum reaches 2^24 round their scores first, as SDPA does (a fused "
         "exponent overflows near 2^31); f16 scores cannot get there"),
    Knob("rounds_every_score", lambda i, k: False,
         "every score is scaled and rounded before its exponent, one multiply more per score: only where "
         "the branch that rounds huge tiles alone costs registers"),
    Knob("peeled_score_steps", lambda i, k: 2 if i.dim_frags > 1 else 1,
         "S's first head-dim steps run ahead of its loop from a zero C operand; two keep the loop's parity"),
    Knob("peeled_score_steps_score_bias", lambda i, k: k["peeled_score_steps"],
         "the same, in the loop that biases every score (masked kernels)"),
)

DKDV_KNOBS = (
    Knob("fused", lambda i, k: i.d_pad <= 64,
         "one workgroup makes dK and dV from one S where both accumulator sets fit beside K and V"),
    Knob("staged_kv", lambda i, k: k["fused"] and i.d_pad > 64,
         "a fused workgroup past d64 has no registers for K and V: each wave stages its rows in LDS"),
    Knob("query_tiles", lambda i, k: (64, 32, 16) if i.d_pad <= 64 else (32, 16) if i.masked else (16,),
         "queries per LDS tile to try, the first whose LDS fits taken: split workgroups stream 16 (a dK wave's "
         "per-fragment reads stall less with more waves per SIMD, the summation order is the same); the masked "
         "ones' mask reads hold registers, 16 spilled"),
    Knob("resident_k", lambda i, k: i.d_pad <= 128 and not k["staged_kv"],
         "a wave's K operands stay in registers for the whole kernel; past d128 they are re-read (cache hits)"),
    Knob("resident_v", lambda i, k: i.d_pad <= 128 and not k["staged_kv"],
         "as K, for the dK workgroups' V"),
    Knob("key_bias_once", lambda i, k: i.masked,
         "a key-padding mask's bias is read once per lane (its key's)"),
    Knob("uniform_base", lambda i, k: True,
         "tile copies address from a uniform base with 32-bit offsets"),
    Knob("folded_log2_sum", lambda i, k: not i.masked,
         "each row's log2 probability sum is folded into its offset; a masked row at a huge bias would "
         "lose it there"),
    Knob("stats_with_copies", lambda i, k: k["folded_log2_sum"] and i.d_pad > 64,
         "row statistics are read ahead of a query tile's copies, in their memory round trip; up to d64 "
         "(fused) that lost up to 1 % in trial builds"),
    Knob("repeating_copies", lambda i, k: k["fused"],
         "tile copies repeat their edges instead of lane tests; the split workgroups lost by it in trial builds"),
    Knob("spare_vgprs", lambda i, k: True,
         "registers are left for the choices below that cost some"),
    Knob("sixteen_bit_transpose", lambda i, k: k["spare_vgprs"],
         "Q^T and dO^T go to LDS by 16-bit stores"),
    Knob("fetch_inactive", lambda i, k: k["spare_vgprs"],
         "half-wave exchanges read the inactive lanes' values: a move less each"),
    Knob("held_zero_c", lambda i, k: not i.isa.inline_zero_accumulator and k["resident_k"] and k["spare_vgprs"],
         "without an inline zero C operand, 8 VGPRs of zeros are held across query tiles where the head-dim "
         "loop unrolls (K resident)"),
    Knob("dim_unroll", lambda i, k: 2 if i.dim_frags % 2 == 0 and i.d_pad <= 128 else 1,
         "head-dim steps per loop trip: more, or a remainder trip, costs registers"),
)

DQ_KNOBS = (
    Knob("key_tiles", lambda i, k: (32, 16) if i.d_pad > 64 else (64, 32, 16),
         "keys per LDS tile to try, the first whose LDS fits taken: S^T and dP^T of the whole tile stay live "
         "beside the accumulators, and past d64 (64 gradient columns) a 64-key tile spills on gfx11"),
    Knob("held_qdo", lambda i, k: False,
         "a wave holds its Q and dO operands in registers for the whole kernel"),
    Knob("staged_qdo", lambda i, k: False,
         "the workgroup stages its Q and dO rows in LDS once"),
    Knob("repeating_qdo", lambda i, k: True,
         "Q and dO operands read from global memory repeat their edges (RepeatingRows), no zero fill"),
    Knob("open_key_tiles", lambda i, k: not i.masked,
         "key tiles every query sees whole run in a loop without the per-score test; the masked kernels "
         "test and bias each score anyway"),
    Knob("uniform_base", lambda i, k: True,
         "tile copies address from a uniform base with 32-bit offsets"),
    Knob("dim_unroll", lambda i, k: 2 if i.dim_frags % 2 == 0 else 1,
         "head-dim steps per loop trip: a remainder trip costs registers"),
    Knob("peeled_steps", lambda i, k: k["dim_unroll"],
         "S's and dP's first steps run ahead of their loop from a zero C operand: one trip of it"),
    Knob("loop_unroll", lambda i, k: i.dim_frags if k["held_qdo"] else k["dim_unroll"],
         "held operands need constant indices: no loop"),
)

FWD8_KNOBS = (
    Knob("skips_rescale", lambda i, k: i.dim_frags >= 8,
         "a tile with no new row maximum skips rescaling O; below 8 output fragments it saves nothing"),
)

KNOBS = {"fwd": FWD_KNOBS, "dkdv": DKDV_KNOBS, "dq": DQ_KNOBS, "fwd8": FWD8_KNOBS}


@dataclass(frozen=True)
class Override:
    """Instances where a rule does not hold: None matches every value of that field."""

    kernel: str
    values: dict
    why: str
    isa: str | None = None
    dtype: str | None = None
    d_pad: tuple[int, ...] | None = None
    masked: bool | None = None

    def matches(self, instance: Instance) -> bool:
        return (self.kernel == instance.kernel
                and self.isa in (None, instance.isa.name)
                and self.dtype in (None, instance.dtype)
                and (self.d_pad is None or instance.d_pad in self.d_pad)
                and self.masked in (None, instance.masked))


SPILLED = "a trial build spilled"

OVERRIDES = (
    # forward
    Override("fwd", {"copy_loads": 4}, f"{SPILLED} at 8 on gfx1100", d_pad=(224,)),
    Override("fwd", {"copy_loads": 1}, f"{SPILLED} at 2 on gfx1100 (the packed-batch arguments' registers)",
             d_pad=(320,)),
    Override("fwd", {"sixteen_bit_vt": False}, f"{SPILLED} (256 VGPRs); not peeling S instead cost its key-padding "
             "loop 1.7 % (static estimate)", isa="gfx11", dtype="f16", d_pad=(64,), masked=True),
    Override("fwd", {"rounds_huge_scores": False, "rounds_every_score": True},
             f"{SPILLED} with the branch (11 and 13 output fragments): these round every score",
             dtype="bf16", d_pad=(176, 208)),
    Override("fwd", {"peeled_score_steps": 0, "peeled_score_steps_score_bias": 0},
             "the zero block's 8 VGPRs cannot be spared past d256", isa="gfx11", d_pad=(320, 384, 512)),
    Override("fwd", {"peeled_score_steps": 0, "peeled_score_steps_score_bias": 0},
             f"four steps after two peeled unroll completely: {SPILLED} or ran slower (static estimate)",
             isa="gfx11", dtype="bf16", d_pad=(64,)),
    Override("fwd", {"peeled_score_steps_score_bias": 0},
             f"four steps after two peeled unroll completely: {SPILLED} in the per-score mask loop",
             isa="gfx11", dtype="f16", d_pad=(64,)),
    Override("fwd", {"adjacent_rescale_factors": True}, "the factor and its copy shared a bank (v161 and v117; in three "
             "of the masked kernel's nine rescale blocks too): those products did not pair; adjacent, 304 -> 286 "
             "non-WMMA cycles per 16x64 tile unmasked, 232 -> 229 on a key-padding tile (static estimate)",
             isa="gfx11", dtype="f16", d_pad=(128,)),
    # dK/dV
    Override("dkdv", {"fused": True}, "K and V rows staged in LDS make room for both accumulator sets: trial build "
             "3.38 -> 2.40 ms (gfx12); masked, it spilled on gfx11", d_pad=(128,), masked=False),
    Override("dkdv", {"query_tiles": (32, 16)}, f"{SPILLED} on gfx11 at 16 queries", d_pad=(96,), masked=False),
    Override("dkdv", {"resident_v": False}, f"{SPILLED}: gfx11's V operands, each value held twice, do not fit "
             "beside K", isa="gfx11", d_pad=(112, 128)),
    Override("dkdv", {"resident_v": False}, f"{SPILLED} on gfx1100: the mask's reads hold registers beside both "
             "accumulator sets", d_pad=(64,), masked=True),
    Override("dkdv", {"key_bias_once": False}, SPILLED, isa="gfx11", d_pad=(64, 128), masked=True),
    Override("dkdv", {"uniform_base": False}, f"{SPILLED} (SGPRs)", isa="gfx11", d_pad=(128,), masked=True),
    Override("dkdv", {"folded_log2_sum": False}, f"{SPILLED} (SGPRs) on every gfx11 target but gfx1100",
             d_pad=(112,), masked=False),
    Override("dkdv", {"spare_vgprs": False}, f"bf16 rounding takes the kernel to 255 VGPRs: {SPILLED} with any "
             "register-costing choice", isa="gfx11", dtype="bf16", d_pad=(64,)),
    Override("dkdv", {"sixteen_bit_transpose": False}, "the loops waited longer for the copy's loads held together "
             "(trial builds; gfx11's d96 spilled)", d_pad=(80, 96, 112)),
    Override("dkdv", {"sixteen_bit_transpose": False}, "the loops waited longer for the copy's loads held together "
             "(trial builds)", isa="gfx12", d_pad=(48,)),
    # dQ
    Override("dq", {"held_qdo": True}, "gfx12's operands hold each value once: they fit, and trial builds gained "
             "(d112 and d128 spill)", isa="gfx12", d_pad=(48, 64, 80, 96), masked=False),
    Override("dq", {"staged_qdo": True}, "re-reading them bound the key tile by the global cache", isa="gfx11",
             d_pad=(128,), masked=False),
    Override("dq", {"repeating_qdo": False}, f"{SPILLED} (VGPRs)", isa="gfx11", d_pad=(32,)),
    Override("dq", {"repeating_qdo": False}, f"{SPILLED} (VGPRs)", isa="gfx11", d_pad=(128,), masked=True),
    Override("dq", {"repeating_qdo": False}, f"{SPILLED} (VGPRs)", isa="gfx12", d_pad=(64,)),
    Override("dq", {"open_key_tiles": False}, f"{SPILLED} with the loop's second copy", isa="gfx12", d_pad=(64,),
             masked=False),
    Override("dq", {"uniform_base": False}, f"{SPILLED} (VGPRs)", isa="gfx11", d_pad=(32,), masked=True),
    Override("dq", {"peeled_steps": 1, "loop_unroll": 1}, "after two peeled steps the last two unroll completely: "
             + SPILLED, isa="gfx11", d_pad=(64,)),
)


@dataclass(frozen=True)
class Traits:
    """The settled choices of one instance, and the reason for each that is not its rule's."""

    instance: Instance
    values: dict = field(hash=False)
    reasons: dict = field(hash=False)  # knob -> why, for the overridden ones
    overrides: tuple = field(hash=False)  # the rows that set a choice apart from its rule

    def __getattr__(self, name: str):
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)


def traits(target: str, kernel: str, dtype: str, d_pad: int, masked: bool = False, out_frags: int = 0) -> Traits:
    """The choices of one instance. `out_frags`: the forward's output fragments per workgroup (its column chunk)."""
    instance = Instance(isa_of(target), kernel, dtype, d_pad, masked)
    overrides = [o for o in OVERRIDES if o.matches(instance)]
    values: dict = {"out_frags": out_frags} if kernel == "fwd" else {}
    reasons, changed_by = {}, []
    for knob in KNOBS[kernel]:
        rule = values[knob.name] = knob.default(instance, values)
        for override in overrides:
            if knob.name in override.values:
                values[knob.name] = override.values[knob.name]
                reasons[knob.name] = override.why
                if values[knob.name] != rule:
                    changed_by.append(override)
    values.pop("out_frags", None)
    return Traits(instance, values, reasons, tuple(changed_by))
