"""The command line, `python -m rdna_flash_attn VERB`: cli (the verbs), doctor, selftest_cli,
benchmark and results_folder (bench), rebuild (local builds, and the compiles kernels/build.py runs)."""
