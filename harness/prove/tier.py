"""The proofs tier: the Z3 matrix (transition x invariant) per cell, the bounded model
check and its witnesses, run across processes, as JSON and as a table.

A verdict is proved, counterexample, unknown (a solver timeout included) or n/a; only
"proved" passes, and a point claim that does not apply at a transition is left out of the
matrix rather than shown as proved. A spec invariant that applies to a cell and has no row
there (nothing in ``proofs/`` encodes it) is n/a in Z3, named with the reason beside the
matrix (``not_encoded``), never counted as proved.
"""

from __future__ import annotations

import fnmatch
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

from overlap_spec.harness.drive.cells import CELL_WIDTH
from overlap_spec.harness.pool import run_tasks
from overlap_spec.harness.verdict import TierReport, Verdict
from overlap_spec.proofs import bmc
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.induction import DEFAULT_BATCH_BOUND, Obligation, prove_cell
from overlap_spec.proofs.model import Context
from overlap_spec.proofs.streams import get_expected_ids, prove_protocol
from overlap_spec.spec.config import (
    PRESETS,
    Cell,
    ModelConfig,
    enumerate_cells,
    enumerate_radix_cells,
    get_cell,
)
from overlap_spec.spec.invariants import INVARIANTS

DEFAULT_TIMEOUT_MS = zs.DEFAULT_TIMEOUT_MS
DEFAULT_DEPTH = bmc.DEFAULT_DEPTH
DEFAULT_REQUESTS = bmc.DEFAULT_REQUESTS
DEFAULT_BMC_TIMEOUT_MS = bmc.DEFAULT_TIMEOUT_MS
# The bound `overlap-spec check` runs in every cell: the same default as `overlap-spec
# prove` (-K / -B), the K=6, B=3.
CHECK_BMC_BOUND: Final = (DEFAULT_DEPTH, DEFAULT_REQUESTS)
# A radix cell runs the BMC only, at its own bound (proofs/bmc.py RADIX_BOUND, whatever
# -K / -B say): the induction's per-request model and the happens-before protocol have no
# tree, so their rows are its release cell's. `check` runs these radix cells (about 20 s
# of CPU together: bench/results/2026-11-29-bmc-radix.md); `prove --radix` runs all 16.
RADIX_BMC_BOUND: Final = bmc.RADIX_BOUND
CHECK_RADIX_CELLS: Final = ("ov-p1-none-radix", "ov-p4-v2chain-cpu-honest-radix")


def prove_one_cell(cell: Cell, preset: str = "minimal", bound: int = DEFAULT_BATCH_BOUND,
                   timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[Obligation]:
    """Inductive rows plus the happens-before rows (transition "streams") of one cell."""
    ctx = Context(ModelConfig(cell, PRESETS[preset]))
    rows = prove_cell(ctx, bound, timeout_ms)
    found = {r.invariant: r for r in prove_protocol(cell, timeout_ms=timeout_ms)}
    for invariant in get_expected_ids(cell):
        hb = found.get(invariant)
        if hb is None:
            rows.append(Obligation("streams", invariant, zs.UNKNOWN, 0.0, "not produced"))
        else:
            rows.append(Obligation("streams", invariant, hb.verdict, hb.seconds, hb.detail))
    return rows


def bmc_row(cell: Cell, preset: str = "minimal", depth: int = DEFAULT_DEPTH,
            requests: int = DEFAULT_REQUESTS,
            timeout_ms: int = DEFAULT_BMC_TIMEOUT_MS) -> Obligation:
    """The clean model's BMC as a matrix row: transition "bmc", invariant "K=..,B=..";
    proved = no violation of any check within the bound."""
    ctx = Context(ModelConfig(cell, PRESETS[preset]))
    result = bmc.check_bounded(ctx, depth, requests, None, timeout_ms)
    label = f"K={depth},B={requests}"
    how = ("iteration 0 unrolled, iterations 1..K-1 by the inductive step"
           if result.inductive else
           f"unrolled, {result.windows} of {depth} iterations by the one-iteration window")
    detail = {zs.PROVED: f"no violation within K={depth}, B={requests} ({how})",
              zs.COUNTEREXAMPLE: f"{result.invariant} at {result.where}",
              zs.UNKNOWN: f"solver gave up: {result.reason}"}[result.verdict]
    return Obligation("bmc", label, result.verdict, result.seconds, detail)


# The bound of the reachable witnesses: every checked ID has one in every cell here. With
# speculation under overlap the first result that feeds the spec metrics (RP3's subject:
# a decode's, not the prefill's) is processed in the third iteration.
WITNESS_BOUND: Final = (2, 2)
SPEC_OVERLAP_WITNESS_DEPTH: Final = 3


def get_witness_bound(cell: Cell) -> tuple[int, int]:
    depth = SPEC_OVERLAP_WITNESS_DEPTH if cell.is_spec and cell.overlap else WITNESS_BOUND[0]
    return depth, WITNESS_BOUND[1]


def witness_rows(cell: Cell, preset: str = "minimal",
                 timeout_ms: int = DEFAULT_BMC_TIMEOUT_MS) -> list[Obligation]:
    """Transition "reachable": per ID the BMC checks, a run within the cell's witness
    bound (:func:`get_witness_bound`) that gives the check something to check. A vacuous
    check is a failure, like a counterexample; undecided is unknown."""
    ctx = Context(ModelConfig(cell, PRESETS[preset]))
    started = time.perf_counter()
    depth, requests = get_witness_bound(cell)
    found = bmc.find_reachable_witnesses(ctx, depth, requests, timeout_ms=timeout_ms)
    seconds = (time.perf_counter() - started) / max(len(found), 1)
    bound = f"K={depth}, B={requests}"
    verdicts = {zs.SATISFIABLE: (zs.PROVED, f"a run within {bound} exercises it"),
                zs.UNSATISFIABLE: (zs.COUNTEREXAMPLE, f"vacuous: no run within {bound} "
                                                      "exercises it")}
    rows = []
    for invariant, answer in sorted(found.items()):
        verdict, detail = verdicts.get(answer, (zs.UNKNOWN, "solver gave up"))
        rows.append(Obligation("reachable", invariant, verdict, seconds, detail))
    return rows


# Why a spec invariant has no row in a cell: read from the rows, so a new invariant is n/a
# here, with this reason, until proofs/ encodes it.
NOT_ENCODED: Final = ("no Z3 encoding: nothing in proofs/ states it (claims.py, the sum claims "
                      "of induction.py, streams.py, the BMC's checks); the other tiers check it")
NOT_ENCODED_RADIX: Final = ("a radix cell runs the BMC only (its induction and happens-before "
                             "rows are its release cell's); the other tiers check it")
NOT_ENCODED_NO_BMC: Final = ("no row without the BMC (--no-bmc): the induction and happens-"
                             "before proofs do not state it; the other tiers check it")


def get_not_encoded(cell: Cell, rows: list[Obligation]) -> dict[str, str]:
    """The spec invariants that apply to ``cell`` and have no row among ``rows``, with why."""
    covered = {row.invariant for row in rows}
    reason = NOT_ENCODED if any(row.transition == "bmc" for row in rows) else NOT_ENCODED_NO_BMC
    if cell.radix:
        reason = NOT_ENCODED_RADIX
    return {inv.id: reason for inv in INVARIANTS if inv.applies(cell) and inv.id not in covered}


def render_not_encoded(document: dict[str, Any]) -> str:
    """A line per reason: the invariants n/a in Z3, each with the number of its cells."""
    found = Counter((invariant_id, reason) for per_cell in document["not_encoded"].values()
                    for invariant_id, reason in per_cell.items())
    by_reason: dict[str, list[str]] = {}
    for (invariant_id, reason), cells in found.items():
        plural = "s" * (cells != 1)
        by_reason.setdefault(reason, []).append(f"{invariant_id} ({cells} cell{plural})")
    return "\n".join(f"n/a in Z3: {', '.join(ids)}; {reason}" for reason, ids in by_reason.items())


def build_proofs_json(results: dict[str, list[Obligation]], seconds: float,
                      bound: int) -> dict[str, Any]:
    counts = {zs.PROVED: 0, zs.COUNTEREXAMPLE: 0, zs.UNKNOWN: 0, zs.NOT_APPLICABLE: 0}
    cells: dict[str, Any] = {}
    for name, rows in results.items():
        for row in rows:
            counts[row.verdict] = counts.get(row.verdict, 0) + 1
        cells[name] = [{"transition": r.transition, "invariant": r.invariant,
                        "verdict": r.verdict, "seconds": round(r.seconds, 4),
                        **({"detail": r.detail} if r.detail else {})} for r in rows]
    ok = counts[zs.COUNTEREXAMPLE] == 0 and counts[zs.UNKNOWN] == 0 and bool(results)
    not_encoded = {name: get_not_encoded(get_cell(name), rows) for name, rows in results.items()}
    return {"ok": ok, "elapsed_s": round(seconds, 3), "batch_bound": bound,
            "counts": counts, "cells": cells, "not_encoded": not_encoded}


def run_proofs(cells: list[Cell], preset: str = "minimal", bound: int = DEFAULT_BATCH_BOUND,
               timeout_ms: int = DEFAULT_TIMEOUT_MS) -> dict[str, list[Obligation]]:
    return {cell.name: prove_one_cell(cell, preset, bound, timeout_ms) for cell in cells}


@dataclass(frozen=True)
class ProveJob:
    """What one worker proves for one cell (plain values: it crosses a process)."""

    cell: str
    preset: str
    bound: int
    timeout_ms: int
    bmc: tuple[int, int] | None  # (K, B), or None for no BMC
    bmc_timeout_ms: int


def run_job(job: ProveJob) -> list[Obligation]:
    cell = get_cell(job.cell)
    if cell.radix:  # the BMC's bounded tree only (RADIX_BMC_BOUND)
        if job.bmc is None:
            return []
        return [bmc_row(cell, job.preset, *RADIX_BMC_BOUND, job.bmc_timeout_ms),
                *witness_rows(cell, job.preset, job.bmc_timeout_ms)]
    rows = prove_one_cell(cell, job.preset, job.bound, job.timeout_ms)
    if job.bmc is not None:
        rows.append(bmc_row(cell, job.preset, job.bmc[0], job.bmc[1], job.bmc_timeout_ms))
        rows.extend(witness_rows(cell, job.preset, job.bmc_timeout_ms))
    return rows


def _expected_cost(cell: Cell) -> tuple[bool, bool, bool]:
    """Slowest cells first (overlap, page 4, spec: measured in docs/proofs.md), so the
    last cell a worker takes is a short one."""
    return (cell.overlap, cell.page_size > 1, cell.is_spec)


def run_jobs(cells: list[Cell], job: ProveJob, jobs: int,
             progress: Callable[[str, list[Obligation]], None] | None = None,
             ) -> dict[str, list[Obligation]]:
    """``job`` (its cell field replaced) for every cell, on ``jobs`` worker processes
    (1: in this process). Results come back in ``cells`` order whatever the finish order."""
    todo = [replace(job, cell=c.name) for c in sorted(cells, key=_expected_cost, reverse=True)]
    report = None if progress is None else (lambda item, rows: progress(item.cell, rows))
    done = dict(zip((item.cell for item in todo), run_tasks(run_job, todo, jobs, report),
                    strict=True))
    return {c.name: done[c.name] for c in cells}


def run_proofs_for_check(cell_names: list[str] | None, jobs: int = 1,
                         progress: bool = False) -> dict[str, Any]:
    """The "proofs" section of ``overlap-spec check``'s JSON; ``progress``: a stderr line
    per finished cell."""
    started = time.perf_counter()
    # The default run: two radix cells (CHECK_RADIX_CELLS); a selection: every radix cell
    # it names, at the radix bound.
    radix = (tuple(map(get_cell, CHECK_RADIX_CELLS)) if cell_names is None
             else enumerate_radix_cells())
    cells = [c for c in (*enumerate_cells(), *radix)
             if cell_names is None or c.name in cell_names
             or any(fnmatch.fnmatch(c.name, n) for n in cell_names)]
    job = ProveJob("", "minimal", DEFAULT_BATCH_BOUND, DEFAULT_TIMEOUT_MS, CHECK_BMC_BOUND,
                   DEFAULT_BMC_TIMEOUT_MS)
    finished = 0

    def report(cell: str, rows: list[Obligation]) -> None:
        nonlocal finished
        finished += 1
        counts = Counter(row.verdict for row in rows)
        print(f"[{finished:2d}/{len(cells)}] proofs {cell:<{CELL_WIDTH}} "
              + ", ".join(f"{verdict} {n}" for verdict, n in sorted(counts.items()))
              + f" ({sum(row.seconds for row in rows):.1f}s)", file=sys.stderr, flush=True)

    results = run_jobs(cells, job, jobs, report if progress else None)
    document = build_proofs_json(results, time.perf_counter() - started, DEFAULT_BATCH_BOUND)
    bmc_rows = [r for rows in results.values() for r in rows if r.transition == "bmc"]
    document["bmc"] = {"depth": CHECK_BMC_BOUND[0], "requests": CHECK_BMC_BOUND[1],
                       "proved": sum(r.verdict == zs.PROVED for r in bmc_rows),
                       "counterexample": sum(r.verdict == zs.COUNTEREXAMPLE for r in bmc_rows),
                       "unknown": sum(r.verdict == zs.UNKNOWN for r in bmc_rows),
                       "seconds": round(sum(r.seconds for r in bmc_rows), 3),
                       "radix": {"cells": [c.name for c in cells if c.radix],
                                 "depth": RADIX_BMC_BOUND[0],
                                 "requests": RADIX_BMC_BOUND[1]}}
    reach = [r for rows in results.values() for r in rows if r.transition == "reachable"]
    document["witnesses"] = {"depth": WITNESS_BOUND[0],
                             "depth_spec_overlap": SPEC_OVERLAP_WITNESS_DEPTH,
                             "requests": WITNESS_BOUND[1],
                             "exercised": sum(r.verdict == zs.PROVED for r in reach),
                             "vacuous": sum(r.verdict == zs.COUNTEREXAMPLE for r in reach),
                             "unknown": sum(r.verdict == zs.UNKNOWN for r in reach)}
    return document


def render_matrix(results: dict[str, list[Obligation]]) -> str:
    """One line per (transition, invariant): verdict over the cells, and the time."""
    merged: dict[tuple[str, str], list[tuple[str, Obligation]]] = {}
    for cell, rows in results.items():
        for row in rows:
            merged.setdefault((row.transition, row.invariant), []).append((cell, row))
    lines = [f"{'transition':<22} {'invariant':<9} {'verdict':<15} {'cells':>6} {'seconds':>8}"]
    for (transition, invariant), entries in merged.items():
        bad = [(c, r) for c, r in entries if r.verdict != zs.PROVED]
        verdict = bad[0][1].verdict if bad else zs.PROVED
        seconds = sum(r.seconds for _, r in entries)
        lines.append(f"{transition:<22} {invariant:<9} {verdict:<15} "
                     f"{len(entries) - len(bad):>3}/{len(entries):<2} {seconds:8.3f}")
        for cell, row in bad[:3]:
            lines.append(f"      {row.verdict} in {cell}: {row.detail[:200]}")
    return "\n".join(lines)


def proofs_tier_report(document: dict[str, Any]) -> TierReport:
    """PASS only when every obligation is proved: a counterexample fails, a solver
    timeout or "unknown" is inconclusive, and no obligation at all is a failure."""
    counts = document.get("counts", {})
    if document.get("ok"):
        verdict = Verdict.PASS
    elif counts.get(zs.COUNTEREXAMPLE):
        verdict = Verdict.FAIL
    elif counts.get(zs.UNKNOWN):
        verdict = Verdict.INCONCLUSIVE
    else:
        verdict = Verdict.FAIL
    return TierReport("proofs", verdict,
                      "proofs ok" if verdict is Verdict.PASS else "PROOFS FAILED",
                      {"proofs": document})
