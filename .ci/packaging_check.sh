#!/usr/bin/env bash
# Packaging, on the CPU:
#  - install.py --strict: every committed code object matches the manifest's sha256, and fast;
#  - the universal wheel: its file list, `pip install .` and `pip install <wheel>` into a fresh virtual
#    environment with the CPU torch, and doctor run from outside the repository (it must find the
#    code objects inside the installed package);
#  - the manifest's source hash equals the kernel sources' (prebuilt/ was built from them; the rebuild
#    that proves it byte for byte is dev/verify_builds.sh).
source "$(dirname "$0")/../dev/_venv.sh"
repo=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
step() { echo; echo "=== packaging [$((SECONDS - started)) s]: $* ==="; }

step "install.py --strict: sha256 of every committed code object (timed, python startup included)"
TIMEFORMAT="install.py: %R s wall"
time python3 install.py --strict

step "kernels/build.py --check: the manifest's source hash is the kernel sources' and every file its sha256"
python3 kernels/build.py --check

step "build the wheel (hatchling, build isolation)"
python3 -m pip wheel --no-deps -q -w "$work/dist" .
wheel=$(ls "$work"/dist/rdna_flash_attn-*-py3-none-any.whl)
echo "$wheel"
python3 - "$wheel" <<'EOF'
import json, pathlib, sys, zipfile
from rdna_flash_attn.runtime import build_facts as facts
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
manifest = json.loads(zipfile.ZipFile(sys.argv[1]).read(f"rdna_flash_attn/prebuilt/{facts.MANIFEST_FILE}"))
sources = {path.as_posix() for path in pathlib.Path("rdna_flash_attn").rglob("*.py")}
required = {"rdna_flash_attn_autoload.pth", f"rdna_flash_attn/prebuilt/{facts.MANIFEST_FILE}",
            f"rdna_flash_attn/kernels/{facts.MAIN_SOURCE}", "rdna_flash_attn/kernels/isa/gfx11.h",
            "rdna_flash_attn/kernels/isa/gfx12.h", "rdna_flash_attn/kernels/platform/amdgcn.h"}
required |= sources
required |= {f"rdna_flash_attn/prebuilt/{entry['file']}" for _, _, entry in facts.listed_code_objects(manifest)}
missing = sorted(required - names)
stray = sorted(n for n in names if n.startswith(("prebuilt/", "kernels/", "tests/", "build/", "rdna_fa_lab/", "bench/"))
               or "__pycache__" in n or n.endswith("/kernels/build.py"))
listed = facts.listed_code_objects(manifest)
assert sorted(t for t, v, _ in listed if v == facts.CODE_OBJECT_VERSION) == sorted(facts.PREBUILT_TARGETS), listed
assert sorted(t for t, v, _ in listed if v == facts.LEGACY_CODE_OBJECT_VERSION) == sorted(facts.LEGACY_TARGETS), listed
assert not missing, f"missing from the wheel: {missing}"
assert not stray, f"should not be in the wheel: {stray}"
print(f"wheel: {len(names)} files; every package module, {len(listed)} code objects (v5 and v4), manifest, "
      "kernel sources, .pth at the root")
EOF

step "fresh virtual environment: CPU torch, then pip install . (the source tree)"
targets=$(python3 -c "from rdna_flash_attn.runtime import build_facts; print(len(build_facts.PREBUILT_TARGETS))")
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
cpu_torch "$py"
"$py" -m pip install -q "$repo"
cd "$work"  # from here on, nothing can come from the checkout
"$py" -m rdna_flash_attn doctor > doctor_source.txt
grep -E "^prebuilt +$work/venv/lib/python[0-9.]+/site-packages/rdna_flash_attn/prebuilt: $targets targets sha256-verified" \
  doctor_source.txt

step "pip install <wheel> over it, doctor from outside the repository"
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
"$py" -m rdna_flash_attn doctor | tee doctor.txt
grep -qE "^prebuilt +$work/venv/lib/python[0-9.]+/site-packages/rdna_flash_attn/prebuilt: $targets targets sha256-verified" \
  doctor.txt
test -f "$work"/venv/lib/python*/site-packages/rdna_flash_attn_autoload.pth
"$py" -c "import rdna_flash_attn, sys; assert rdna_flash_attn.__file__.startswith(sys.prefix), rdna_flash_attn.__file__"

echo
echo "packaging check passed in $((SECONDS - started)) s"
