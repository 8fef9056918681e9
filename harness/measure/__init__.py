"""Counts and timings: ``sync_contract`` (host syncs, D2H copies and launches per
iteration, asserted as counts) and ``bench_gpu`` (schedule-side host time, for ``bench/``).

The limits the command line checks live here, away from torch, so the parser stays light.
"""

from typing import Final

BENCH_BATCH_SIZES: Final = (1, 16, 64, 256, 1024)
# The steady-state preset holds 256 KV tokens per request: past this a batch is a typo
# that would allocate gigabytes before the first iteration.
MAX_BATCH_SIZE: Final = 4096
MAX_ITERATIONS: Final = 100_000
MAX_THREADS: Final = 256
