"""The compiled kernel variants: their symbols, launch geometry and LDS, from the tuning table
(tuning.py), which the build writes into each instance's traits (instantiation_lines). The build, the
launcher and the static report read them here, so the shapes the kernels are compiled with are the ones
the host launches.

A variant is fixed by its kernel, dtype, padded head dim and whether it reads a mask; its choices may differ
per matrix ISA (`traits(target)`), its launch geometry may not. The real head dim (any multiple of 8) is a
runtime argument; the kernel zero-fills the columns between it and the padded one. Each LDS size below
mirrors the kernel's *Shape struct; the static report checks the two agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import tuning

ABI_VERSION = 5
DTYPES = ("f16", "bf16")
WAVE_SIZE = 32
FRAG = tuning.FRAG
LDS_LIMIT = 64 * 1024
LDS_ROW_PAD = 8  # elements added to every LDS row so rows start on different banks
MAX_O_CHUNK = 256  # output columns one forward workgroup accumulates in registers
MAX_GRAD_CHUNK = 128  # gradient columns one backward workgroup accumulates in registers
BWD_WAVES = 4
ISA_NAMES = tuple(tuning.ISAS)


SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8)) + (320, 384, 512)


def padded_head_dim(head_dim: int) -> int:
    """The head dim a kernel variant is compiled for: the next multiple of the WMMA tile edge."""
    return (head_dim + FRAG - 1) // FRAG * FRAG


PADDED_HEAD_DIMS = tuple(sorted({padded_head_dim(d) for d in SUPPORTED_HEAD_DIMS}))
# Head dims with masked variants: at the others (odd multiples of 16 from 80, and 256 and up) the
# masked kernels spill registers on gfx11 (python -m rdna_fa_lab report --check). A masked call
# runs in the next larger masked variant instead (PixArt's 72 and SD1.5's 80 in 96, Sana's 112 in 128),
# which does the padding's matrix work: no column past the call's head dim reaches a result (the
# forward's Q columns there are zero and its K/V ones repeat real columns; the backward zero-fills
# every operand there), and only the call's columns are stored. Past 224, masked calls fall back.
MASKED_PADDED_HEAD_DIMS = (16, 32, 48, 64, 96, 128, 160, 192, 224)
# padded head dim -> the masked variant its masked calls run in (looked up on every launch)
_MASKED_VARIANT_HEAD_DIM = {d: min(m for m in MASKED_PADDED_HEAD_DIMS if m >= d)
                            for d in PADDED_HEAD_DIMS if d <= MASKED_PADDED_HEAD_DIMS[-1]}
MASKED_HEAD_DIMS = tuple(d for d in SUPPORTED_HEAD_DIMS if padded_head_dim(d) in _MASKED_VARIANT_HEAD_DIM)
_MASKED_SUFFIX = "_masked"


def kernel_head_dim(head_dim: int, masked: bool = False) -> int:
    """The head dim of the variant that runs a call at `head_dim` (masked: one of MASKED_PADDED_HEAD_DIMS)."""
    padded = padded_head_dim(head_dim)
    if not masked:
        return padded
    if padded not in _MASKED_VARIANT_HEAD_DIM:
        raise ValueError(f"no masked kernel for head dim {head_dim} (masked kernels take up to {MASKED_HEAD_DIMS[-1]})")
    return _MASKED_VARIANT_HEAD_DIM[padded]

# Preferred (waves per workgroup, keys per LDS tile), best first; the first that fits LDS wins.
_TILE_PREFERENCE = ((4, 64), (4, 32), (2, 32), (2, 16), (1, 16))


def _same_on_every_isa(kernel: str, dtype: str, d_pad: int, masked: bool, knob: str, out_frags: int = 0):
    """A tuning choice that shapes the launch, which must not differ between matrix ISAs."""
    values = {getattr(tuning.traits(isa, kernel, dtype, d_pad, masked, out_frags), knob) for isa in ISA_NAMES}
    if len(values) != 1:
        raise ValueError(f"{kernel} {dtype} d{d_pad}: {knob} differs between ISAs, but it shapes the launch")
    return values.pop()


def lds_elems_fwd(waves: int, block_n: int, d_pad: int, d_chunk: int, masked: bool = False) -> int:
    """16-bit elements of LDS the forward kernel declares; mirrors FwdShape in kernels/fa_fwd.h (a
    masked kernel stages one float per key of its tile)."""
    row = d_pad + LDS_ROW_PAD
    mask_elems = 2 * block_n if masked else 0
    return waves * FRAG * row + block_n * row + d_chunk * (block_n + LDS_ROW_PAD) + mask_elems


class _WaveTiled:
    """Workgroups of `waves` waves, each wave one 16-row fragment, over `d_chunk`-column chunks."""

    @property
    def block_rows(self) -> int:
        return self.waves * FRAG

    @property
    def threads(self) -> int:
        return self.waves * WAVE_SIZE

    @property
    def d_chunks(self) -> int:
        return -(-self.d_pad // self.d_chunk)


@dataclass(frozen=True)
class FwdVariant(_WaveTiled):
    dtype: str
    d_pad: int
    waves: int
    block_n: int
    d_chunk: int
    copy_loads: int  # global loads in flight per thread and K/V copy batch
    masked: bool = False  # reads the attention mask (kernels/sequence.h); the others ignore it

    @property
    def symbol(self) -> str:
        return f"rdna_fa_fwd_{self.dtype}_d{self.d_pad}" + _MASKED_SUFFIX * self.masked

    def traits(self, target: str) -> tuning.Traits:
        return tuning.traits(target, "fwd", self.dtype, self.d_pad, self.masked, self.d_chunk // FRAG)

    def lds_bytes(self, target: str) -> int:
        """The LDS its kernel declares in code objects for `target`: the same on every target."""
        return 2 * lds_elems_fwd(self.waves, self.block_n, self.d_pad, self.d_chunk, self.masked)


def _fwd_variant(dtype: str, d_pad: int, masked: bool = False) -> FwdVariant:
    chunks = -(-d_pad // MAX_O_CHUNK)
    d_chunk = d_pad // chunks
    for waves, block_n in _TILE_PREFERENCE:
        if 2 * lds_elems_fwd(waves, block_n, d_pad, d_chunk, masked) <= LDS_LIMIT:
            copy_loads = _same_on_every_isa("fwd", dtype, d_pad, masked, "copy_loads", d_chunk // FRAG)
            return FwdVariant(dtype, d_pad, waves, block_n, d_chunk, copy_loads, masked)
    raise ValueError(f"no tile shape fits LDS for head dim {d_pad}")


FWD_VARIANTS = tuple(_fwd_variant(dt, d, masked) for masked in (False, True) for dt in DTYPES
                     for d in (PADDED_HEAD_DIMS if not masked else MASKED_PADDED_HEAD_DIMS))
FWD_BY_SYMBOL = {v.symbol: v for v in FWD_VARIANTS}


def fwd_variant(dtype: str, head_dim: int, masked: bool = False) -> FwdVariant:
    return FWD_BY_SYMBOL[f"rdna_fa_fwd_{dtype}_d{kernel_head_dim(head_dim, masked)}" + _MASKED_SUFFIX * masked]


def _grad_chunk(d_pad: int) -> int:
    """Gradient columns per workgroup: the fewest chunks of at most MAX_GRAD_CHUNK, evenly sized."""
    chunks = -(-d_pad // MAX_GRAD_CHUNK)
    return -(-d_pad // chunks // FRAG) * FRAG


def lds_elems_dkdv(block_m: int, d_pad: int, d_chunk: int, choices: tuning.Traits, waves: int = BWD_WAVES) -> int:
    """Mirrors DkdvShape in kernels/fa_bwd.h: Q, dO rows; Q^T, dO^T chunks; row offset and delta floats,
    and the log2 sum's where it is not folded into the offset; where K and V are staged, each wave's 16 K
    and 16 V rows."""
    row_stats = 2 if choices.folded_log2_sum else 3
    staged_kv = waves * 2 * FRAG * (d_pad + LDS_ROW_PAD) if choices.staged_kv else 0
    return (2 * block_m * (d_pad + LDS_ROW_PAD) + 2 * d_chunk * (block_m + LDS_ROW_PAD) + 2 * row_stats * block_m
            + staged_kv)


def lds_elems_dq(block_n: int, d_pad: int, d_chunk: int, staged_qdo: bool = False, waves: int = BWD_WAVES) -> int:
    """Mirrors DqShape in kernels/fa_bwd.h: K, V rows; K^T chunk; where Q and dO are staged, the workgroup's
    Q and dO rows."""
    staged = 2 * waves * FRAG * (d_pad + LDS_ROW_PAD) if staged_qdo else 0
    return 2 * block_n * (d_pad + LDS_ROW_PAD) + d_chunk * (block_n + LDS_ROW_PAD) + staged


@dataclass(frozen=True)
class BwdVariant(_WaveTiled):
    """dK/dV (rows = keys, tile = queries) or dQ (rows = queries, tile = keys) kernel."""

    kind: str  # "dkdv" | "dq"
    dtype: str
    d_pad: int
    waves: int
    block_tile: int  # rows of the streamed operand per LDS tile
    d_chunk: int
    masked: bool = False

    @property
    def symbol(self) -> str:
        return f"rdna_fa_bwd_{self.kind}_{self.dtype}_d{self.d_pad}" + _MASKED_SUFFIX * self.masked

    def traits(self, target: str) -> tuning.Traits:
        return tuning.traits(target, self.kind, self.dtype, self.d_pad, self.masked)

    @functools.cached_property  # read per launch: the table is walked once per variant
    def fused(self) -> bool:
        """A dK/dV workgroup makes both gradients (else half the workgroups make dV, half dK): the same on
        every ISA."""
        return self.kind == "dkdv" and _same_on_every_isa("dkdv", self.dtype, self.d_pad, self.masked, "fused")

    @property
    def jobs_per_block(self) -> int:
        """Workgroups per row block along grid x: one per column chunk, and dK/dV apart unless fused."""
        return self.d_chunks * (2 if self.kind == "dkdv" and not self.fused else 1)

    def lds_bytes(self, target: str) -> int:
        """The LDS its kernel declares in code objects for `target` (which stages what differs per ISA)."""
        choices = self.traits(target)
        if self.kind == "dkdv":
            return 2 * lds_elems_dkdv(self.block_tile, self.d_pad, self.d_chunk, choices, self.waves)
        return 2 * lds_elems_dq(self.block_tile, self.d_pad, self.d_chunk, choices.staged_qdo, self.waves)


def _bwd_variant(kind: str, dtype: str, d_pad: int, masked: bool = False) -> BwdVariant:
    d_chunk = _grad_chunk(d_pad)
    staging = 2 * BWD_WAVES * FRAG * (d_chunk + LDS_ROW_PAD)  # bytes of the gradient, reusing the tiles' LDS
    knob = "query_tiles" if kind == "dkdv" else "key_tiles"
    for tile in _same_on_every_isa(kind, dtype, d_pad, masked, knob):
        variant = BwdVariant(kind, dtype, d_pad, BWD_WAVES, tile, d_chunk, masked)
        lds = [variant.lds_bytes(isa) for isa in ISA_NAMES]
        if max(lds) <= LDS_LIMIT and staging <= min(lds):
            return variant
    raise ValueError(f"no backward tile shape fits LDS for head dim {d_pad}")


BWD_VARIANTS = tuple(_bwd_variant(kind, dt, d, masked) for masked in (False, True) for kind in ("dkdv", "dq")
                     for dt in DTYPES for d in (PADDED_HEAD_DIMS if not masked else MASKED_PADDED_HEAD_DIMS))
BWD_BY_SYMBOL = {v.symbol: v for v in BWD_VARIANTS}


# The opt-in 8-bit forward (kernels/fa_fwd8.h, "8-bit QK+PV"): gfx12 only, whose WMMA runs 8-bit
# operands at twice the 16-bit rate (gfx11's at the same rate). K and V come quantized into buffers of
# the kernel's layout (rdna_flash_attn/ops/quantized.py): keys padded to whole tiles, head dim to d_pad;
# the kernel quantizes Q itself.
FWD8_PADDED_HEAD_DIMS = tuple(range(48, 161, 16))
FWD8_WAVES = 4
FWD8_BLOCK_N = 64
FWD8_SCALE_KEYS = FRAG  # keys per K scale: one WMMA fragment
_FWD8_PAD_BYTES = 16  # added to every LDS row, as LDS_ROW_PAD is for 16-bit rows


def has_fwd8(target: str) -> bool:
    """Whether code objects for `target` ("gfx1201", or "emulated-gfx12") hold the 8-bit forward: only where
    8-bit WMMA outruns 16-bit."""
    return tuning.isa_of(target).eight_bit_rate > 1


@dataclass(frozen=True)
class Fwd8Variant(_WaveTiled):
    dtype: str  # the output's
    d_pad: int
    waves: int = FWD8_WAVES
    block_n: int = FWD8_BLOCK_N

    @property
    def d_chunk(self) -> int:
        return self.d_pad  # one workgroup makes every output column

    @property
    def symbol(self) -> str:
        return f"rdna_fa_fwd8_{self.dtype}_d{self.d_pad}"

    def traits(self, target: str) -> tuning.Traits:
        return tuning.traits(target, "fwd8", self.dtype, self.d_pad)

    def lds_bytes(self, target: str) -> int:
        """Mirrors Fwd8Shape (gfx12 only): Q and K rows of d_pad bytes, V^T rows of block_n bytes, each row
        padded."""
        return ((self.block_rows + self.block_n) * (self.d_pad + _FWD8_PAD_BYTES)
                + self.d_pad * (self.block_n + _FWD8_PAD_BYTES))


FWD8_VARIANTS = tuple(Fwd8Variant(dt, d) for dt in DTYPES for d in FWD8_PADDED_HEAD_DIMS)
FWD8_BY_SYMBOL = {v.symbol: v for v in FWD8_VARIANTS}
FWD8_HEAD_DIMS = tuple(d for d in SUPPORTED_HEAD_DIMS if padded_head_dim(d) in FWD8_PADDED_HEAD_DIMS)


def fwd8_variant(dtype: str, head_dim: int) -> Fwd8Variant:
    return FWD8_BY_SYMBOL[f"rdna_fa_fwd8_{dtype}_d{padded_head_dim(head_dim)}"]


# K and V's quantizing pass (kernels/quant8.h): "stats" (one workgroup per key/value head: channel means
# and V's scales), then "codes" (one per 64 keys of a key/value head: the 8-bit codes in the kernel's
# layout; a whole number of them per key tile).
QUANT8_STATS_THREADS = 256
QUANT8_ROWS = 64


@dataclass(frozen=True)
class Quant8Variant:
    kind: str  # "stats" | "codes"
    dtype: str  # the inputs'
    d_pad: int

    @property
    def threads(self) -> int:
        return QUANT8_STATS_THREADS if self.kind == "stats" else QUANT8_ROWS

    @property
    def symbol(self) -> str:
        return f"rdna_fa_quant8_{self.kind}_{self.dtype}_d{self.d_pad}"

    def lds_bytes(self, target: str) -> int:
        """The same on every target. Mirrors Quant8StatsShape (four partials of 8 channels per thread) and
        Quant8CodesShape (a padded V^T row of the block per channel, then one float per row)."""
        if self.kind == "stats":
            return 4 * 4 * 8 * QUANT8_STATS_THREADS
        return 4 * (self.d_pad * (QUANT8_ROWS // 4 + _FWD8_PAD_BYTES // 4) + QUANT8_ROWS)


QUANT8_VARIANTS = tuple(Quant8Variant(kind, dt, d) for kind in ("stats", "codes") for dt in DTYPES
                        for d in FWD8_PADDED_HEAD_DIMS)
QUANT8_BY_SYMBOL = {v.symbol: v for v in QUANT8_VARIANTS}


def quant8_variant(kind: str, dtype: str, head_dim: int) -> Quant8Variant:
    return QUANT8_BY_SYMBOL[f"rdna_fa_quant8_{kind}_{dtype}_d{padded_head_dim(head_dim)}"]


ALL_SYMBOLS = tuple(FWD_BY_SYMBOL) + tuple(BWD_BY_SYMBOL)


def target_symbols(target: str) -> tuple[str, ...]:
    """The kernels a code object for `target` holds."""
    return ALL_SYMBOLS + (tuple(FWD8_BY_SYMBOL) + tuple(QUANT8_BY_SYMBOL) if has_fwd8(target) else ())


def bwd_variant(kind: str, dtype: str, head_dim: int, masked: bool = False) -> BwdVariant:
    return BWD_BY_SYMBOL[f"rdna_fa_bwd_{kind}_{dtype}_d{kernel_head_dim(head_dim, masked)}" + _MASKED_SUFFIX * masked]


def _cpp_name(knob: str) -> str:
    return "k" + "".join(part.capitalize() for part in knob.split("_"))


def _cpp_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _traits_struct(variant, isa: str, geometry: dict) -> str:
    """One instance's traits: its geometry and every scalar tuning choice, as the kernel templates read them."""
    fields = dict(geometry)
    fields.update((name, value) for name, value in variant.traits(isa).values.items() if not isinstance(value, tuple))
    members = " ".join(f"static constexpr {'bool' if isinstance(value, bool) else 'int'} {_cpp_name(name)} = "
                       f"{_cpp_value(value)};" for name, value in fields.items())
    return f"struct {variant.symbol}_traits {{ {members} }};"


def _instances(isa: str) -> list[str]:
    lines = []
    for v in FWD_VARIANTS:
        lines.append(_traits_struct(v, isa, {"head_dim": v.d_pad, "waves": v.waves, "block_n": v.block_n,
                                             "chunk": v.d_chunk, "masked": v.masked}))
        lines.append(f"RDNA_FA_FWD_INSTANCE({v.symbol}, {v.dtype}, {v.symbol}_traits)")
    for v in BWD_VARIANTS:
        block = "block_m" if v.kind == "dkdv" else "block_n"
        lines.append(_traits_struct(v, isa, {"head_dim": v.d_pad, "waves": v.waves, block: v.block_tile,
                                             "chunk": v.d_chunk, "masked": v.masked}))
        lines.append(f"RDNA_FA_BWD_{v.kind.upper()}_INSTANCE({v.symbol}, {v.dtype}, {v.symbol}_traits)")
    if has_fwd8(isa):
        for v in FWD8_VARIANTS:
            lines.append(_traits_struct(v, isa, {"head_dim": v.d_pad, "waves": v.waves, "block_n": v.block_n}))
            lines.append(f"RDNA_FA_FWD8_INSTANCE({v.symbol}, {v.dtype}, {v.symbol}_traits)")
        lines += [f"RDNA_FA_QUANT8_{v.kind.upper()}_INSTANCE({v.symbol}, {v.dtype}, {v.d_pad})" for v in QUANT8_VARIANTS]
    return lines


def instantiation_lines() -> str:
    """C++ that instantiates every variant with its traits, per matrix ISA; the build writes it to a header."""
    lines = ["#if defined(__GFX12__)", *_instances("gfx12"), "#else", *_instances("gfx11"), "#endif"]
    return "\n".join(lines) + "\n"
