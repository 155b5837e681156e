"""The lab's command line, `python -m rdna_fa_lab VERB` from the repository's root; `VERB --help` gives
a verb's options. Like the package's, it imports a verb's module only when that verb runs."""

from __future__ import annotations

from rdna_flash_attn.tools.cli import CommandLine, Verb

VERBS = {
    "bench": Verb("the main job: kernels vs PyTorch SDPA on an RDNA GPU; without one, a Stable Diffusion "
                  "attention call through the shipped code objects on the CPU interpreter, and the "
                  "expected speed per RDNA GPU", f"{__package__}.interpreted_bench"),
    "selftest": Verb("the kernels' self-test on a shipped code object, on the CPU interpreter (no GPU needed)",
                     f"{__package__}.interpreted_selftest"),
    "coverage": Verb("the share of each model family's attention that reaches the kernels in a host: "
                     "ComfyUI, A1111, diffusers, Forge, reForge, Forge Classic, SD.Next or kohya sd-scripts",
                     f"{__package__}.coverage"),
    "report": Verb("static resource report of the prebuilt code objects (see report --help)",
                   f"{__package__}.resource_report", own_parser=True),
}
COMMAND_LINE = CommandLine("python -m rdna_fa_lab", __doc__.split("\n\n")[0], VERBS)


def main(argv: list[str] | None = None) -> int:
    return COMMAND_LINE.main(argv)
