"""Benchmark of the Z3 tier: the default-bound `prove` wall time (the issue's 60 s budget
on 2 cores), the BMC per cell and by method, each mutant's counterexample, and the
largest K, B and N that finish within a budget.

Run: ``PYTHONPATH=. python bench/bench_proofs.py [--jobs 2] [--budget-s 600]
[--bmc-cells GLOB] [--bmc-timeout-s 60] [--max-k 48] [--max-b 6] [--max-n 64]
[--unrolled] [--skip-n]``. Timings are printed, never asserted (GUIDE.md).

- "prove": what ``overlap-spec prove`` runs at its defaults (induction with N=16,
  happens-before, BMC at ``bmc.DEFAULT_DEPTH`` / ``DEFAULT_REQUESTS``) for all 22 cells,
  with 1 worker and with ``--jobs`` workers.
- "bmc": the clean model per cell at the default bound, with the method that proved it
  (inductive step / windows / unrolled); ``--unrolled`` also times the plain unrolling
  (``window=False``), the path the mutant column and a failed step take.
- "largest": the largest K (B=3) and B (K=6) whose clean BMC proves in every selected
  cell within ``--budget-s``; the largest N for the sum claims.
"""

from __future__ import annotations

import argparse
import time

from overlap_spec.harness.drive.cells import select_cells
from overlap_spec.harness.mutants.z3 import run_z3_mutant_column
from overlap_spec.harness.pool import get_default_jobs
from overlap_spec.harness.prove.tier import (
    DEFAULT_BMC_TIMEOUT_MS,
    DEFAULT_TIMEOUT_MS,
    ProveJob,
    run_jobs,
    run_proofs,
)
from overlap_spec.proofs import bmc
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.induction import DEFAULT_BATCH_BOUND
from overlap_spec.proofs.model import Context
from overlap_spec.spec.config import MINIMAL, Cell, ModelConfig, enumerate_cells


def bench_prove(jobs: int) -> float:
    """Wall seconds of the default `prove` over all cells with ``jobs`` workers."""
    cells = list(enumerate_cells())
    job = ProveJob("", "minimal", DEFAULT_BATCH_BOUND, DEFAULT_TIMEOUT_MS,
                   (bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS), DEFAULT_BMC_TIMEOUT_MS)
    started = time.perf_counter()
    results = run_jobs(cells, job, jobs)
    seconds = time.perf_counter() - started
    rows = [row for rows in results.values() for row in rows]
    bad = sum(row.verdict != zs.PROVED for row in rows)
    print(f"prove defaults (N={DEFAULT_BATCH_BOUND}, K={bmc.DEFAULT_DEPTH}, "
          f"B={bmc.DEFAULT_REQUESTS}), 22 cells, {jobs} worker(s): {seconds:.1f} s wall, "
          f"{len(rows)} rows, {bad} not proved", flush=True)
    return seconds


def bench_bmc(cells: list[Cell], depth: int, requests: int, timeout_s: float,
              window: bool = True, quiet: bool = False) -> tuple[float, bool]:
    """Total seconds and whether every cell proved."""
    total = 0.0
    ok = True
    for cell in cells:
        result = bmc.check_bounded(Context(ModelConfig(cell, MINIMAL)), depth, requests,
                                   timeout_ms=int(timeout_s * 1000), window=window)
        total += result.seconds
        ok = ok and result.verdict == zs.PROVED
        how = ("inductive step" if result.inductive else
               f"{result.windows} windows" if window else "unrolled")
        if not quiet:
            print(f"bmc K={depth} B={requests} {cell.name:<32} {result.verdict:<14} "
                  f"{result.seconds:7.2f} s {how} {result.invariant or ''} {result.reason}",
                  flush=True)
    return total, ok


def largest(cells: list[Cell], bounds: list[tuple[int, int]], budget_s: float) -> str:
    """The last (K, B) of ``bounds`` (in order) that proves in every cell within budget."""
    best = "none"
    for depth, requests in bounds:
        started = time.perf_counter()
        seconds, ok = bench_bmc(cells, depth, requests, budget_s, quiet=True)
        wall = time.perf_counter() - started
        print(f"  K={depth} B={requests}: {'proved' if ok else 'not proved'} in all cells, "
              f"{wall:.1f} s", flush=True)
        if not ok or wall > budget_s:
            break
        best = f"K={depth}, B={requests}"
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=get_default_jobs(),
                        help="workers for the parallel prove measurement")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="budget for one K / B / N step")
    parser.add_argument("--bmc-cells", help="cell globs for the BMC measurements (default all)")
    parser.add_argument("--bmc-timeout-s", type=float, default=60.0, help="per BMC query")
    parser.add_argument("--max-k", type=int, default=48, help="largest K to try (B=3)")
    parser.add_argument("--max-b", type=int, default=6, help="largest B to try (K=6)")
    parser.add_argument("--max-n", type=int, default=64, help="largest N to try")
    parser.add_argument("--unrolled", action="store_true",
                        help="also time the plain K x B unrolling per cell")
    parser.add_argument("--skip-n", action="store_true", help="skip the N measurements")
    args = parser.parse_args()
    bmc_cells = select_cells(args.bmc_cells)
    bench_prove(1)
    if args.jobs > 1:
        bench_prove(args.jobs)
    total, _ = bench_bmc(bmc_cells, bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS,
                         args.bmc_timeout_s)
    print(f"bmc default bound, {len(bmc_cells)} cells: {total:.1f} s")
    if args.unrolled:
        total, _ = bench_bmc(bmc_cells, bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS,
                             args.bmc_timeout_s, window=False)
        print(f"bmc default bound unrolled, {len(bmc_cells)} cells: {total:.1f} s")
    started = time.perf_counter()
    for bug_id, kill in run_z3_mutant_column().items():
        print(f"mutant {bug_id:<4} {kill.verdict:<9} {kill.invariant or '-':<5} "
              f"{kill.seconds:6.2f} s  " + ", ".join(
                  f"{c.cell} {c.seconds:.2f} s K,B={c.bound}" for c in kill.cells), flush=True)
    print(f"z3 column: {time.perf_counter() - started:.1f} s")
    depths = [k for k in (6, 12, 24, 48, 96) if k <= args.max_k]
    print(f"largest K (B=3) within {args.budget_s:.0f} s: "
          f"{largest(bmc_cells, [(k, 3) for k in depths], args.budget_s)}")
    print(f"largest B (K=6) within {args.budget_s:.0f} s: "
          f"{largest(bmc_cells, [(6, b) for b in range(3, args.max_b + 1)], args.budget_s)}")
    if args.skip_n:
        return
    cells = list(enumerate_cells())
    n = 16
    best = 16
    while n * 2 <= args.max_n:
        n *= 2
        started = time.perf_counter()
        run_proofs(cells, bound=n)
        seconds = time.perf_counter() - started
        print(f"N={n}: {seconds:.1f} s", flush=True)
        if seconds > args.budget_s:
            break
        best = n
    print(f"largest N within {args.budget_s:.0f} s (tried up to {args.max_n}): {best}")


if __name__ == "__main__":
    main()
