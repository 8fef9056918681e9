"""Counts and timings: ``sync_contract`` (host syncs, D2H copies and launches per
iteration, asserted as counts) and ``bench_gpu`` (schedule-side host time, for ``bench/``).
"""
