"""Seeds of the random inputs: fresh every run, and a failure's inputs reproducible. conftest draws a run
seed (pytest's summary shows it) unless RDNA_FA_TEST_SEED names one; each case's seed mixes it with the
case's id."""

from __future__ import annotations

import os
import random
import zlib

RUN_SEED_VARIABLE = "RDNA_FA_TEST_SEED"


def draw_run_seed() -> int:
    """The run's seed, drawn once and handed to pytest-xdist's workers through the environment."""
    return int(os.environ.setdefault(RUN_SEED_VARIABLE, str(random.randrange(2**31))))


def case_seed(case) -> int:
    """A case's seed: the same for the same case and run seed, on every process."""
    return zlib.crc32(f"{os.environ.get(RUN_SEED_VARIABLE, '0')}:{case}".encode()) % 2**31
