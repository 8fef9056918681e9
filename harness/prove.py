"""``overlap-spec prove``: the Z3 matrix (transition x invariant) per cell, and the z3
column of the mutant matrix.

A verdict is proved, counterexample, unknown (a solver timeout included) or n/a;
only "proved" passes, and a point claim that does not apply at a transition is
left out of the matrix rather than shown as proved.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from overlap_spec.harness.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    run_script,
    save_script,
)
from overlap_spec.proofs import bmc
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.induction import DEFAULT_BATCH_BOUND, prove_cell
from overlap_spec.proofs.induction import Cell as MatrixCell
from overlap_spec.proofs.model import Context
from overlap_spec.proofs.streams import STREAM_MUTANTS, get_expected_ids, prove_protocol
from overlap_spec.spec.bugs import BUGS, Bug
from overlap_spec.spec.config import PRESETS, Cell, ModelConfig, enumerate_cells, get_cell
from overlap_spec.spec.state import IterationChoices


def get_representative_cells(bug: Bug) -> list[Cell]:
    """harness.mutants.get_representative_cells (imported late: mutants imports this)."""
    from overlap_spec.harness.mutants import get_representative_cells as representative

    return representative(bug)

DEFAULT_TIMEOUT_MS = zs.DEFAULT_TIMEOUT_MS
DEFAULT_DEPTH = bmc.DEFAULT_DEPTH
DEFAULT_REQUESTS = bmc.DEFAULT_REQUESTS
DEFAULT_BMC_TIMEOUT_MS = bmc.DEFAULT_TIMEOUT_MS
# The bound `overlap-spec check` runs in every cell: the same default as `overlap-spec
# prove` (-K / -B), the K=6, B=3.
CHECK_BMC_BOUND: Final = (DEFAULT_DEPTH, DEFAULT_REQUESTS)


@dataclass
class Z3Kill:
    bug_id: str
    verdict: str  # "killed" | "survived" | "n/a" | "unknown"
    invariant: str | None
    cell: str | None
    seconds: float
    script: Script | None
    reason: str = ""
    script_path: Path | None = None  # where the replayable script was saved, if asked
    cells: list[Z3CellKill] = field(default_factory=list)  # one per representative cell


def add_prove_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cells", help="comma-separated cell names or globs (default: all)")
    parser.add_argument("-N", "--batch-bound", type=int, default=DEFAULT_BATCH_BOUND,
                        help="largest batch size for the sum claims (default 16)")
    parser.add_argument("-K", "--depth", type=int, default=DEFAULT_DEPTH,
                        help=f"BMC depth in event-loop iterations (default {DEFAULT_DEPTH})")
    parser.add_argument("-B", "--requests", type=int, default=DEFAULT_REQUESTS,
                        help=f"BMC symbolic requests (default {DEFAULT_REQUESTS})")
    parser.add_argument("--bmc-timeout-ms", type=int, default=DEFAULT_BMC_TIMEOUT_MS,
                        help="per BMC query; a timeout is a failure (default 60000)")
    parser.add_argument("--no-bmc", action="store_true",
                        help="skip the bounded model check and its reachable witnesses")
    parser.add_argument("--timeout-ms", type=int, default=DEFAULT_TIMEOUT_MS,
                        help="per solver call; a timeout is a failure (default 20000)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="minimal")
    parser.add_argument("-j", "--jobs", type=int, default=get_default_jobs(),
                        help="cells proved in parallel worker processes (default: the CPUs "
                             "available, here %(default)s)")
    parser.add_argument("--json", help="write the proofs section as JSON to this path")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")


def select_cells(patterns: str | None) -> list[Cell]:
    cells = list(enumerate_cells())
    if not patterns:
        return cells
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cells if any(fnmatch.fnmatch(c.name, p) for p in wanted)]


def prove_one_cell(cell: Cell, preset: str = "minimal", bound: int = DEFAULT_BATCH_BOUND,
                   timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[MatrixCell]:
    """Inductive rows plus the happens-before rows (transition "streams") of one cell."""
    ctx = Context(ModelConfig(cell, PRESETS[preset]))
    rows = prove_cell(ctx, bound, timeout_ms)
    found = {r.invariant: r for r in prove_protocol(cell, timeout_ms=timeout_ms)}
    for invariant in get_expected_ids(cell):
        hb = found.get(invariant)
        if hb is None:
            rows.append(MatrixCell("streams", invariant, zs.UNKNOWN, 0.0, "not produced"))
        else:
            rows.append(MatrixCell("streams", invariant, hb.verdict, hb.seconds, hb.detail))
    return rows


def bmc_row(cell: Cell, preset: str = "minimal", depth: int = DEFAULT_DEPTH,
            requests: int = DEFAULT_REQUESTS,
            timeout_ms: int = DEFAULT_BMC_TIMEOUT_MS) -> MatrixCell:
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
    return MatrixCell("bmc", label, result.verdict, result.seconds, detail)


# The bound of the reachable witnesses: every checked ID has one in every cell here.
WITNESS_BOUND: Final = (2, 2)


def witness_rows(cell: Cell, preset: str = "minimal",
                 timeout_ms: int = DEFAULT_BMC_TIMEOUT_MS) -> list[MatrixCell]:
    """Transition "reachable": per ID the BMC checks, a run within WITNESS_BOUND that
    gives the check something to check. A vacuous check is a failure, like a
    counterexample; undecided is unknown."""
    ctx = Context(ModelConfig(cell, PRESETS[preset]))
    started = time.perf_counter()
    found = bmc.find_reachable_witnesses(ctx, *WITNESS_BOUND, timeout_ms=timeout_ms)
    seconds = (time.perf_counter() - started) / max(len(found), 1)
    bound = f"K={WITNESS_BOUND[0]}, B={WITNESS_BOUND[1]}"
    verdicts = {zs.SATISFIABLE: (zs.PROVED, f"a run within {bound} exercises it"),
                zs.UNSATISFIABLE: (zs.COUNTEREXAMPLE, f"vacuous: no run within {bound} "
                                                      "exercises it")}
    rows = []
    for invariant, answer in sorted(found.items()):
        verdict, detail = verdicts.get(answer, (zs.UNKNOWN, "solver gave up"))
        rows.append(MatrixCell("reachable", invariant, verdict, seconds, detail))
    return rows


def build_proofs_json(results: dict[str, list[MatrixCell]], seconds: float,
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
    return {"ok": ok, "elapsed_s": round(seconds, 3), "batch_bound": bound,
            "counts": counts, "cells": cells}


def run_proofs(cells: list[Cell], preset: str = "minimal", bound: int = DEFAULT_BATCH_BOUND,
               timeout_ms: int = DEFAULT_TIMEOUT_MS) -> dict[str, list[MatrixCell]]:
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


def run_job(job: ProveJob) -> list[MatrixCell]:
    cell = get_cell(job.cell)
    rows = prove_one_cell(cell, job.preset, job.bound, job.timeout_ms)
    if job.bmc is not None:
        rows.append(bmc_row(cell, job.preset, job.bmc[0], job.bmc[1], job.bmc_timeout_ms))
        rows.extend(witness_rows(cell, job.preset, job.bmc_timeout_ms))
    return rows


def get_default_jobs() -> int:
    """The CPUs this process may run on (the default of ``--jobs``)."""
    return max(len(os.sched_getaffinity(0)), 1) if hasattr(os, "sched_getaffinity") else 1


def _expected_cost(cell: Cell) -> tuple[bool, bool, bool]:
    """Slowest cells first (overlap, page 4, spec: measured in docs/proofs.md), so the
    last cell a worker takes is a short one."""
    return (cell.overlap, cell.page_size > 1, cell.is_spec)


def run_jobs(cells: list[Cell], job: ProveJob, jobs: int,
             progress: Callable[[str, list[MatrixCell]], None] | None = None,
             ) -> dict[str, list[MatrixCell]]:
    """``job`` (its cell field replaced) for every cell, on ``jobs`` worker processes
    (1: in this process). Results come back in ``cells`` order whatever the finish order."""
    todo = [replace(job, cell=c.name) for c in sorted(cells, key=_expected_cost, reverse=True)]
    done: dict[str, list[MatrixCell]] = {}
    if jobs <= 1 or len(todo) <= 1:
        for item in todo:
            done[item.cell] = run_job(item)
            if progress:
                progress(item.cell, done[item.cell])
    else:
        spawn = multiprocessing.get_context("spawn")  # no state shared with this process
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=spawn) as pool:
            futures = {pool.submit(run_job, item): item.cell for item in todo}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                if progress:
                    progress(futures[future], done[futures[future]])
    return {c.name: done[c.name] for c in cells}


def run_proofs_for_check(cell_names: list[str] | None, jobs: int = 1) -> dict[str, Any]:
    """The "proofs" section of ``overlap-spec check``'s JSON."""
    started = time.perf_counter()
    cells = [c for c in enumerate_cells() if cell_names is None or c.name in cell_names
             or any(fnmatch.fnmatch(c.name, n) for n in cell_names)]
    job = ProveJob("", "minimal", DEFAULT_BATCH_BOUND, DEFAULT_TIMEOUT_MS, CHECK_BMC_BOUND,
                   DEFAULT_BMC_TIMEOUT_MS)
    results = run_jobs(cells, job, jobs)
    document = build_proofs_json(results, time.perf_counter() - started, DEFAULT_BATCH_BOUND)
    bmc_rows = [r for rows in results.values() for r in rows if r.transition == "bmc"]
    document["bmc"] = {"depth": CHECK_BMC_BOUND[0], "requests": CHECK_BMC_BOUND[1],
                       "proved": sum(r.verdict == zs.PROVED for r in bmc_rows),
                       "counterexample": sum(r.verdict == zs.COUNTEREXAMPLE for r in bmc_rows),
                       "unknown": sum(r.verdict == zs.UNKNOWN for r in bmc_rows),
                       "seconds": round(sum(r.seconds for r in bmc_rows), 3)}
    reach = [r for rows in results.values() for r in rows if r.transition == "reachable"]
    document["witnesses"] = {"depth": WITNESS_BOUND[0], "requests": WITNESS_BOUND[1],
                             "exercised": sum(r.verdict == zs.PROVED for r in reach),
                             "vacuous": sum(r.verdict == zs.COUNTEREXAMPLE for r in reach),
                             "unknown": sum(r.verdict == zs.UNKNOWN for r in reach)}
    return document


def render_matrix(results: dict[str, list[MatrixCell]]) -> str:
    """One line per (transition, invariant): verdict over the cells, and the time."""
    merged: dict[tuple[str, str], list[tuple[str, MatrixCell]]] = {}
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


def cmd_prove(args: argparse.Namespace) -> int:
    cells = select_cells(args.cells)
    if not cells:
        print(f"overlap-spec: no cell matches {args.cells!r} (see 'overlap-spec cells')",
              file=sys.stderr)
        return 2
    if (args.batch_bound < 0 or args.timeout_ms <= 0 or args.depth < 1 or args.requests < 1
            or args.jobs < 1 or args.bmc_timeout_ms <= 0):
        print("overlap-spec: --batch-bound must be >= 0, --timeout-ms and --bmc-timeout-ms "
              "> 0, -K, -B and --jobs >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def progress(name: str, rows: list[MatrixCell]) -> None:
        if not args.quiet:
            bad = sum(r.verdict != zs.PROVED for r in rows)
            print(f"{name:<32} {len(rows) - bad}/{len(rows)} proved", file=sys.stderr)

    job = ProveJob("", args.preset, args.batch_bound, args.timeout_ms,
                   None if args.no_bmc else (args.depth, args.requests), args.bmc_timeout_ms)
    results = run_jobs(cells, job, args.jobs, progress)
    document = build_proofs_json(results, time.perf_counter() - started, args.batch_bound)
    if not args.quiet:
        print(render_matrix(results))
    counts = document["counts"]
    print(f"proofs: {counts[zs.PROVED]} proved, {counts[zs.COUNTEREXAMPLE]} counterexample, "
          f"{counts[zs.UNKNOWN]} unknown in {len(results)} cells, "
          f"{document['elapsed_s']:.1f} s (N={args.batch_bound}, BMC K={args.depth}, "
          f"B={args.requests})")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if document["ok"] else 1


# ----------------------------------------------------------------------------- z3 column
# Bounds tried in order for a mutant's counterexample: the first that finds one gives the
# shortest script. The last is the default bound.
MUTANT_BOUNDS: Final = ((2, 2), (3, 2), (4, 2), (4, 3),
                        (bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS))


@dataclass
class Z3CellKill:
    """One representative cell of a bug: the counterexample and its replay."""

    cell: str
    verdict: str  # "killed" | "survived" | "unknown"
    invariant: str | None  # what the replay failed (killed) or the BMC found
    seconds: float
    script: Script | None
    script_path: Path | None = None
    bound: tuple[int, int] | None = None  # (K, B) of the BMC that found it
    reason: str = ""


def decode_counterexample(result: bmc.BmcResult, faults: tuple[str, ...] = (),
                          preset: str = "minimal") -> Script:
    """The BMC model as a harness script: Admit ops before their iteration, one Iterate
    per iteration up to the violation, accepts and EOS placed at batch positions."""
    unrolling = result.unrolling
    model = result.raw_model
    assert unrolling is not None and model is not None, "no counterexample to decode"

    def value(term: zs.Term) -> int:
        found = zs.evaluate(model, term)
        return int(found) if found is not None else 0

    def flag(term: zs.Term) -> bool:
        return zs.evaluate(model, term) is True

    last = unrolling.depth - 1
    if result.where.startswith("iteration "):
        last = int(result.where.split()[1].rstrip(":"))
    admissions = [value(t) for t in unrolling.admit_at]
    ops: list[Op] = []
    for i, it in enumerate(unrolling.iterations[:last + 1]):
        for b, at in enumerate(admissions):
            if at == i:
                ops.append(Admit(value(unrolling.prompt_len[b]),
                                 value(unrolling.max_new_tokens[b])))
        members = sorted((value(it.order[b]), b) for b in range(len(it.launched))
                         if flag(it.launched[b]))
        accepts = tuple(value(it.accept[b]) for _, b in members) or (1,)
        eos = frozenset(j for j, (_, b) in enumerate(members) if flag(it.eos[b]))
        ops.append(Iterate(IterationChoices(
            allow_prefill=flag(it.allow_prefill), retract=value(it.retract),
            accept_lens=accepts, eos_positions=eos,
            disable_overlap=flag(it.disable_overlap), spec_steps=value(it.rung),
            eos_offset=value(it.eos_offset))))
    return Script(result.cell, preset, ops, tuple(faults))


def replay_counterexample(script: Script, expected: tuple[str, ...]) -> tuple[bool, str, str]:
    """(replays, invariant failed, message): replays when the reference fails one of
    ``expected`` (the bug's catalogue invariants and the one the BMC found)."""
    outcome = run_script(script)
    if outcome.violation is None:
        return False, "", "the reference finishes the script without a violation"
    failed = outcome.violation.all_ids  # every ID violated at that observation point
    hits = [i for i in failed if i in expected]
    if not hits:
        return False, failed[0], (f"the reference fails {', '.join(failed)}, not one of "
                                  f"{', '.join(expected)}")
    return True, hits[0], (f"{hits[0]} among {', '.join(failed)} at step {outcome.failed_at}: "
                           f"{str(outcome.violation).splitlines()[0]}")


def _save(script: Script, bug_id: str, save_dir: Path | None) -> Path | None:
    if save_dir is None:
        return None
    return save_script(script, save_dir / f"{script.cell}-{script.preset}-{bug_id}-z3.json")


def _kill_in_cell(bug: Bug, cell: Cell, timeout_ms: int, save_dir: Path | None,
                  bounds: tuple[tuple[int, int], ...]) -> Z3CellKill:
    started = time.perf_counter()
    ctx = Context(ModelConfig(cell, PRESETS["minimal"]), frozenset({bug.id}))
    notes: list[str] = []
    for depth, requests in bounds:
        result = bmc.check_bounded(ctx, depth, requests, bug.invariants, timeout_ms)
        if result.verdict == zs.UNKNOWN:
            return Z3CellKill(cell.name, "unknown", None, time.perf_counter() - started, None,
                              bound=(depth, requests), reason=f"solver: {result.reason}")
        if result.verdict != zs.COUNTEREXAMPLE:
            continue
        script = decode_counterexample(result, (bug.id,))
        expected = tuple(dict.fromkeys(bug.invariants + ((result.invariant,)
                                                         if result.invariant else ())))
        replays, found, message = replay_counterexample(script, expected)
        if replays:
            return Z3CellKill(cell.name, "killed", found, time.perf_counter() - started,
                              script, _save(script, bug.id, save_dir), (depth, requests),
                              f"BMC K={depth} B={requests}: {result.invariant} at "
                              f"{result.where}; replay: {message}")
        notes.append(f"K={depth} B={requests}: {result.invariant} at {result.where} does not "
                     f"replay on the reference: {message}")
    reason = ("counterexample does not replay on the reference: " + "; ".join(notes) if notes
              else f"no counterexample within K={bounds[-1][0]}, B={bounds[-1][1]}")
    return Z3CellKill(cell.name, "survived", None, time.perf_counter() - started, None,
                      reason=reason)


def run_z3_mutant_column(bug_ids: list[str] | None = None, save_dir: Path | None = None,
                         timeout_ms: int = DEFAULT_TIMEOUT_MS,
                         bounds: tuple[tuple[int, int], ...] = MUTANT_BOUNDS
                         ) -> dict[str, Z3Kill]:
    """The z3 checker's verdict per bug, in each representative cell: a BMC counterexample
    of the mutated model (stream bugs: a happens-before schedule) turned into a script
    that must fail a catalogue invariant on the reference. Killed only if every
    representative cell is."""
    column: dict[str, Z3Kill] = {}
    for bug in BUGS:
        if bug_ids is not None and bug.id not in bug_ids:
            continue
        started = time.perf_counter()
        cells = get_representative_cells(bug)
        if not cells:
            column[bug.id] = Z3Kill(bug.id, "n/a", None, None, 0.0, None, "no cell applies")
            continue
        if bug.id in STREAM_MUTANTS:
            kills = [_kill_stream_in_cell(bug, cell, timeout_ms, save_dir) for cell in cells]
        else:
            kills = [_kill_in_cell(bug, cell, timeout_ms, save_dir, bounds) for cell in cells]
        worst = next((k for k in kills if k.verdict == "unknown"),
                     next((k for k in kills if k.verdict != "killed"), kills[0]))
        column[bug.id] = Z3Kill(
            bug.id, worst.verdict, worst.invariant, worst.cell,
            time.perf_counter() - started, worst.script, worst.reason, worst.script_path,
            kills)
    return column


# ----------------------------------------------------------------------------- stream bugs
def get_stream_scenarios(cell: Cell) -> list[list[Op]]:
    """Hand-sized scenarios, smallest first, that drive the overlap loop through the
    schedules the happens-before model names: a forward in flight while S writes rows
    (B8), resolves (B5), filters spec state (B13), frees tensors (B15) or publishes a
    PD-prebuilt request (B9); the first that fails a catalogue invariant is kept."""
    plain = IterationChoices()
    finish_first = IterationChoices(eos_positions=frozenset({0}))
    scenarios: list[list[Op]] = []
    for iterations in (2, 3, 4):
        for prebuilt in (False, True):
            def admit(prompt_len: int, budget: int, prebuilt: bool = prebuilt) -> Op:
                return AdmitPrebuilt(prompt_len, budget) if prebuilt else Admit(prompt_len,
                                                                                 budget)
            rest: list[Op] = [Iterate(plain)] * iterations
            scenarios.append([admit(1, 4), *rest])
            scenarios.append([admit(1, 4), admit(1, 4), *rest])
            scenarios.append([admit(1, 6), Iterate(plain), admit(1, 4), *rest[1:]])
            scenarios.append([admit(1, 4), admit(1, 4), Iterate(plain),
                              Iterate(finish_first), *rest[1:]])
    del cell  # every scenario applies to every overlap cell
    return scenarios


def _kill_stream_in_cell(bug: Bug, cell: Cell, timeout_ms: int,
                         save_dir: Path | None) -> Z3CellKill:
    """The happens-before counterexample schedule, then the smallest scenario that makes
    the reference fail a catalogue invariant with that fault."""
    started = time.perf_counter()
    expected = bug.invariants
    schedule: list[str] = []
    found: str | None = None
    for result in prove_protocol(cell, frozenset({bug.id}), timeout_ms):
        if result.verdict == zs.UNKNOWN:
            return Z3CellKill(cell.name, "unknown", result.invariant,
                              time.perf_counter() - started, None, reason=result.detail)
        if result.verdict == zs.COUNTEREXAMPLE and result.invariant in expected:
            found, schedule = result.invariant, list(result.schedule)
            break
    if found is None:
        return Z3CellKill(cell.name, "survived", None, time.perf_counter() - started, None,
                          reason="no happens-before counterexample for a catalogue invariant")
    order = " -> ".join(schedule[:8]) + (" ..." if len(schedule) > 8 else "")
    for ops in get_stream_scenarios(cell):
        script = Script(cell.name, "minimal", list(ops), (bug.id,))
        replays, hit, message = replay_counterexample(script, expected)
        if replays:
            return Z3CellKill(cell.name, "killed", hit, time.perf_counter() - started, script,
                              _save(script, bug.id, save_dir), None,
                              f"happens-before {found}: {order}; replay: {message}")
    return Z3CellKill(cell.name, "survived", found, time.perf_counter() - started, None,
                      reason=f"happens-before {found} ({order}), but no scenario replays it "
                      "on the reference")
