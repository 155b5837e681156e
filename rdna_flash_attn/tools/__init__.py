"""The command line, `python -m rdna_flash_attn VERB`: cli (the verbs), doctor, selftest_cli,
benchmark, rebuild (local builds, and the compiles kernels/build.py runs), report (the static
resource report of the code objects)."""
