"""Benchmarks, studies, the static estimators' records and the GPU check scripts, each run from the
repository's root as `python -m bench.NAME` (NAME --help for its options). They use the package
(rdna_flash_attn) and the lab (rdna_fa_lab); neither imports them. Recorded runs: bench/results/."""
