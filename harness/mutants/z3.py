"""The z3 column of the mutant matrix: each bug's mutated BMC (and stream protocol) in its
representative cells; a counterexample is decoded into an operation script and replayed on
the reference, and counts as a kill only where the reference fails a catalogue invariant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from overlap_spec.harness.catalogue import BUGS, Bug
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Flush,
    Iterate,
    Op,
    Script,
    run_script,
    save_script,
)
from overlap_spec.harness.mutants.select import get_representative_cells
from overlap_spec.harness.prove.tier import DEFAULT_TIMEOUT_MS
from overlap_spec.proofs import bmc
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.model import Context
from overlap_spec.proofs.streams import STREAM_MUTANTS, prove_protocol
from overlap_spec.spec.config import PRESETS, Cell, ModelConfig
from overlap_spec.spec.state import IterationChoices


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
    """The BMC model as a harness script: Admit ops before their iteration (in a radix
    cell all of family 0), one Iterate per iteration up to the violation, accepts and EOS
    placed at batch positions, and after an iteration a flush that ran."""
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
    # A radix cell's BMC keeps one prompt family (proofs/bmc_radix.py): every request's.
    family = 0 if unrolling.ctx.config.cell.radix else None
    ops: list[Op] = []
    for i, it in enumerate(unrolling.iterations[:last + 1]):
        for b, at in enumerate(admissions):
            if at == i:
                ops.append(Admit(value(unrolling.prompt_len[b]),
                                 value(unrolling.max_new_tokens[b]), family))
        members = sorted((value(it.order[b]), b) for b in range(len(it.launched))
                         if flag(it.launched[b]))
        accepts = tuple(value(it.accept[b]) for _, b in members) or (1,)
        eos = frozenset(j for j, (_, b) in enumerate(members) if flag(it.eos[b]))
        ops.append(Iterate(IterationChoices(
            allow_prefill=flag(it.allow_prefill), retract=value(it.retract),
            accept_lens=accepts, eos_positions=eos,
            disable_overlap=flag(it.disable_overlap), spec_steps=value(it.rung),
            eos_offset=value(it.eos_offset))))
        if it.flushed is not None and flag(it.flushed):
            ops.append(Flush())
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
        if not cells or bug.not_in_z3:
            column[bug.id] = Z3Kill(bug.id, "n/a", None, None, 0.0, None,
                                    bug.not_in_z3 or "no cell applies")
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
    PD-prebuilt request (B9), or stashes one into a row it reuses (B9 with the release's
    fence); the first that fails a catalogue invariant is kept."""
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
    # B9 under the release's fence (#35748): a request that stops in the first decode runs
    # once more while one finishing by length sits out; that result frees both rows (the
    # FIFO free list then reads 3, 1, 2), and the second of two prebuilt requests takes
    # the stopped one's row while the in-flight forward still stashes to it.
    scenarios.append([AdmitPrebuilt(1, 8), AdmitPrebuilt(1, 2), Iterate(finish_first),
                      Iterate(plain), AdmitPrebuilt(1, 4), AdmitPrebuilt(1, 4), Iterate(plain)])
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
