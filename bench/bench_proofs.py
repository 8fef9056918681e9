"""Benchmark of the Z3 tier: default-bound proof time, per-mutant time, largest N in budget.

Run: ``PYTHONPATH=. python bench/bench_proofs.py [--max-n 64] [--budget-s 600]
[--bmc-cells GLOB] [--bmc-timeout-s 60] [--max-k 6] [--skip-n]``.
Timings are printed, never asserted (GUIDE.md). BMC: the clean model per cell at the
default bound (``bmc.DEFAULT_DEPTH`` / ``DEFAULT_REQUESTS``) under a per-query timeout,
each mutant's replayed counterexample, and the largest K (B=3) whose clean BMC
finishes within the budget in the selected cells.
"""

from __future__ import annotations

import argparse
import time

from harness.prove import run_proofs, run_z3_mutant_column, select_cells
from proofs import bmc
from proofs import solver as zs
from proofs.model import Context
from spec.config import MINIMAL, Cell, ModelConfig, enumerate_cells


def bench_bmc(cells: list[Cell], depth: int, requests: int, timeout_s: float) -> float:
    total = 0.0
    for cell in cells:
        result = bmc.check_bounded(Context(ModelConfig(cell, MINIMAL)), depth, requests,
                                   timeout_ms=int(timeout_s * 1000))
        total += result.seconds
        print(f"bmc K={depth} B={requests} {cell.name:<32} {result.verdict:<14} "
              f"{result.seconds:7.2f} s {result.invariant or ''} {result.reason}", flush=True)
    return total


def largest_k(cells: list[Cell], requests: int, max_k: int, budget_s: float) -> int:
    """The largest K whose clean BMC proves in every selected cell within ``budget_s``."""
    best = 0
    for depth in range(1, max_k + 1):
        started = time.perf_counter()
        ok = True
        for cell in cells:
            left = budget_s - (time.perf_counter() - started)
            if left <= 0:
                ok = False
                break
            result = bmc.check_bounded(Context(ModelConfig(cell, MINIMAL)), depth, requests,
                                       timeout_ms=int(left * 1000))
            ok = ok and result.verdict == zs.PROVED
        seconds = time.perf_counter() - started
        print(f"largest-K search: K={depth} B={requests} {'ok' if ok else 'not within'} "
              f"{seconds:.1f} s", flush=True)
        if not ok:
            break
        best = depth
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-n", type=int, default=64, help="largest N to try")
    parser.add_argument("--budget-s", type=float, default=600.0, help="budget for one N / K")
    parser.add_argument("--bmc-cells", help="cell globs for the BMC measurements (default all)")
    parser.add_argument("--bmc-timeout-s", type=float, default=60.0,
                        help="per-query timeout of the default-bound BMC")
    parser.add_argument("--max-k", type=int, default=6, help="largest K to try (B=3)")
    parser.add_argument("--skip-n", action="store_true", help="skip the N measurements")
    args = parser.parse_args()
    cells = list(enumerate_cells())
    bmc_cells = select_cells(args.bmc_cells)
    started = time.perf_counter()
    for bug_id, kill in run_z3_mutant_column().items():
        print(f"mutant {bug_id:<4} {kill.verdict:<9} {kill.invariant or '-':<5} "
              f"{kill.seconds:6.2f} s  " + ", ".join(
                  f"{c.cell} {c.seconds:.2f} s K,B={c.bound}" for c in kill.cells), flush=True)
    print(f"z3 column: {time.perf_counter() - started:.1f} s")
    total = bench_bmc(bmc_cells, bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS, args.bmc_timeout_s)
    print(f"bmc default bound, {len(bmc_cells)} cells: {total:.1f} s")
    print(f"largest K (B=3) within {args.budget_s:.0f} s: "
          f"{largest_k(bmc_cells, bmc.TARGET_REQUESTS, args.max_k, args.budget_s)}")
    if args.skip_n:
        return
    started = time.perf_counter()
    results = run_proofs(cells)
    rows = sum(len(r) for r in results.values())
    bad = sum(row.verdict != zs.PROVED for r in results.values() for row in r)
    print(f"default proofs (N=16, 22 cells): {rows} rows, {bad} not proved, "
          f"{time.perf_counter() - started:.1f} s")
    n = 16
    largest = 16
    while n * 2 <= args.max_n:
        n *= 2
        started = time.perf_counter()
        run_proofs(cells, bound=n)
        seconds = time.perf_counter() - started
        print(f"N={n}: {seconds:.1f} s")
        if seconds > args.budget_s:
            break
        largest = n
    print(f"largest N within {args.budget_s:.0f} s (tried up to {args.max_n}): {largest}")


if __name__ == "__main__":
    main()
