"""Timing-free instruction counts: how many instructions of each category a dispatch executed.

Categories follow the static estimator (bench/estimate_gfx1100.py): WMMA, VALU, SALU, DS (LDS),
VMEM (global/flat), SMEM, branch, waitcnt (s_waitcnt/s_wait_* and s_delay_alu/s_nop/s_clause:
issue-only), barrier, other.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

CATEGORIES = ("WMMA", "VALU", "SALU", "DS", "VMEM", "SMEM", "branch", "waitcnt", "barrier", "other")
_WAIT_PREFIXES = ("s_waitcnt", "s_wait_", "s_delay_alu", "s_nop", "s_clause", "s_set_inst_prefetch_distance")


def category(name: str, encoding: str) -> str:
    encoding = encoding.split("_LIT")[0]
    if name.startswith("v_wmma"):
        return "WMMA"
    if encoding.startswith(("VOP", "VINTERP")):
        return "VALU"
    if encoding == "DS":
        return "DS"
    if encoding in ("GLOBAL", "FLAT", "SCRATCH", "VGLOBAL", "VFLAT", "VSCRATCH", "MUBUF"):
        return "VMEM"
    if encoding == "SMEM":
        return "SMEM"
    if name.startswith(("s_branch", "s_cbranch")):
        return "branch"
    if name.startswith(_WAIT_PREFIXES):
        return "waitcnt"
    if name.startswith("s_barrier"):
        return "barrier"
    if encoding in ("SOP1", "SOP2", "SOPC", "SOPK"):
        return "SALU"
    return "other"


@dataclass
class KernelTrace:
    """Counts of one kernel over the dispatches it ran: instructions by category, by mnemonic, and
    how many waves and workgroups executed them."""

    kernel: str
    waves: int = 0
    workgroups: int = 0
    by_category: Counter = field(default_factory=Counter)
    by_name: Counter = field(default_factory=Counter)
    by_offset: Counter = field(default_factory=Counter)  # byte offset in the kernel's code -> executions

    def add(self, hits: dict[int, int], instructions: dict) -> None:
        self.by_offset.update(hits)
        for offset, count in hits.items():
            d = instructions[offset]
            self.by_category[category(d.name, d.encoding)] += count
            self.by_name[d.name] += count

    def mnemonics(self) -> Counter:
        """Executed instructions by mnemonic as LLVM's disassembler spells them (a VOPD pair under its
        first half, v_dual_*), the form bench/estimate_gfx1100.py classifies."""
        names = Counter()
        for name, count in self.by_name.items():
            names[name.split("::")[0]] += count
        return names

    def per_wave(self) -> dict[str, float]:
        return {c: self.by_category[c] / max(self.waves, 1) for c in CATEGORIES if self.by_category[c]}

    def summary(self) -> str:
        total = sum(self.by_category.values())
        parts = ", ".join(f"{c} {n:.1f}" for c, n in self.per_wave().items())
        return f"{self.kernel}: {self.workgroups} workgroups, {self.waves} waves, {total} instructions; per wave: {parts}"
