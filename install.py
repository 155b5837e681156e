"""Install hook: ComfyUI-Manager runs it after installing requirements.txt, the SD-WebUIs at every
start, each in a subprocess of the host's Python.

It checks every prebuilt code object against the sha256 in prebuilt/manifest.json, target by target
with the runtime's own check (build_facts.verify_code_objects), and prints one status line naming the
targets verified and what is wrong with the others. It imports nothing but the standard library and
the facts the build and the loader share (rdna_flash_attn/runtime/build_facts.py, loaded by its path,
so neither the package nor torch is imported: under ZLUDA the GPU is not even reachable from here),
installs nothing, and takes a few tens of milliseconds, so it runs in full every time rather than
caching a verdict.

It exits 0 whatever it finds, so the host always starts: a damaged code object is refused anyway when
the runtime loads it (the kernels stay off for that GPU target and attention runs on PyTorch SDPA),
and this line tells the user why and how to repair it. `--strict` exits 1 on any problem, for CI.

`--doctor` runs `python -m rdna_flash_attn doctor` on this folder's package, from wherever the user
stands (from ComfyUI's root, `-m rdna_flash_attn` finds no package): the status line names that
command with the host's own Python, so it can be copied as it is.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PREBUILT = ROOT / "prebuilt"
BUILD_FACTS = ROOT / "rdna_flash_attn" / "runtime" / "build_facts.py"
PREFIX = "[RDNA Flash Attention]"
REPAIR = "reinstall the extension (or git checkout prebuilt/) to repair"


def load_build_facts():
    """The package's runtime/build_facts.py as a module of its own (standard library only)."""
    spec = importlib.util.spec_from_file_location("rdna_flash_attn_build_facts", BUILD_FACTS)
    facts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(facts)
    return facts


def check(prebuilt: Path) -> tuple[list[str], list[str]]:
    """(targets whose code objects all match their sha256, problems in a few words each): a manifest
    that cannot be read costs every target, a bad entry or file only its own."""
    facts = load_build_facts()
    try:
        manifest = json.loads((prebuilt / facts.MANIFEST_FILE).read_text(encoding="utf-8"))
        if not isinstance(manifest.get("targets"), dict):
            raise KeyError("targets")
        return facts.verify_code_objects(prebuilt, manifest)
    except FileNotFoundError:
        return [], ["prebuilt/manifest.json is missing"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [], ["prebuilt/manifest.json is damaged"]


def _quoted(path: str) -> str:
    return f'"{path}"' if " " in path else path


def doctor_command() -> str:
    """The command that shows the details, with this Python (the host's) and this file's path."""
    return f"{_quoted(sys.executable)} {_quoted(str(Path(__file__).resolve()))} --doctor"


def status_line(verified: list[str], problems: list[str], seconds: float) -> str:
    if not problems:
        return (f"{PREFIX} {len(verified)} GPU code objects verified ({verified[0]}-{verified[-1]}) "
                f"in {seconds:.2f} s; details: {doctor_command()}")
    if verified:
        scope = (f"{len(verified)} GPU targets verified ({', '.join(verified)}); kernels stay off for the others "
                 "(attention runs on PyTorch SDPA there)")
    else:
        scope = "No GPU target verified: kernels stay off (attention runs on PyTorch SDPA)"
    return f"{PREFIX} WARNING: {'; '.join(problems)}. {scope}; {REPAIR}."


def run_doctor() -> int:
    """`python -m rdna_flash_attn doctor` on the package beside this file (imports torch)."""
    sys.path.insert(0, str(ROOT))
    from rdna_flash_attn.tools import cli

    return cli.main(["doctor"])


def main(argv: list[str]) -> int:
    if "--doctor" in argv:
        return run_doctor()
    started = time.perf_counter()
    try:
        verified, problems = check(PREBUILT)
        if not verified and not problems:
            problems = ["prebuilt/manifest.json lists no GPU code objects"]
    except Exception as error:  # noqa: BLE001  (an install hook must never break the host's start)
        verified, problems = [], [f"the check itself failed ({type(error).__name__}: {error})"]
    line = status_line(verified, problems, time.perf_counter() - started)
    # ASCII only: a Windows console in a legacy code page must not turn the status into a traceback.
    print(line.encode("ascii", "replace").decode("ascii"), flush=True)
    return 1 if problems and "--strict" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
