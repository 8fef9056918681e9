"""The mutant matrix: each catalogue bug switched on alone, run through the Hypothesis
(reference), gpu_impl and z3 checkers; a kill names the invariant that fired and saves a
replayable script.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlap_spec.harness.catalogue import BUGS, Bug
from overlap_spec.harness.crash import Crash
from overlap_spec.harness.drive.cells import CONFIG_WIDTH, make_preset
from overlap_spec.harness.drive.minimize import minimize_script
from overlap_spec.harness.drive.script import (
    Script,
    load_script,
    run_script,
    save_script,
)
from overlap_spec.harness.drive.stateful import CellResult, Profile, check_cell, get_failure_dir
from overlap_spec.harness.mutants.select import (
    KILLED,
    NO_GPU_PATH,
    NOT_APPLICABLE,
    OTHER_ID,
    SURVIVED,
    get_applicable_cells,
    get_gpu_unobservable_reason,
    get_representative_cells,
)
from overlap_spec.harness.mutants.z3 import run_z3_mutant_column
from overlap_spec.harness.pool import run_tasks
from overlap_spec.harness.trace.check import record_script_trace
from overlap_spec.harness.trace.format import get_trace_path
from overlap_spec.harness.verdict import TierReport, Verdict, as_verdict, combine
from overlap_spec.spec.config import PRESETS, Cell, ModelConfig


@dataclass
class CellKill:
    cell: str
    verdict: str
    checker: str = "hypothesis"
    invariant: str | None = None
    all_invariants: tuple[str, ...] = ()
    ops: int | None = None
    requests: int | None = None
    seconds: float = 0.0
    replay: str | None = None
    detail: str | None = None


@dataclass
class MutantResult:
    bug: Bug
    checker: str
    cells: list[CellKill] = field(default_factory=list)
    not_applicable: str | None = None  # why this checker has nothing to say about the bug

    @property
    def verdict(self) -> str:
        ran = [c for c in self.cells if c.verdict != NOT_APPLICABLE]
        if not ran or self.not_applicable:
            return NOT_APPLICABLE
        if all(c.verdict == KILLED for c in ran):
            return KILLED
        if any(c.verdict == SURVIVED for c in ran):
            return SURVIVED
        return OTHER_ID

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.cells)

    def get_representative(self) -> CellKill | None:
        """The smallest counterexample over the cells (what a reader should open first)."""
        kills = [c for c in self.cells if c.verdict == KILLED and c.ops is not None]
        return min(kills, key=lambda c: (c.requests or 0, c.ops or 0), default=None)

    @property
    def invariant(self) -> str | None:
        counts = Counter(c.invariant for c in self.cells if c.invariant)
        return counts.most_common(1)[0][0] if counts else None


def run_mutant_in_cell(bug: Bug, config: ModelConfig, profile: Profile, seed: int,
                       save_dir: Path) -> CellKill:
    started = time.perf_counter()
    result = _replay_known_trigger(bug, config) or check_cell(
        config, profile, seed, frozenset({bug.id}), save_dir=save_dir, shrink=False,
        max_examples=profile.mutant_examples)
    kill = CellKill(config.name, SURVIVED)
    if result.error is not None:
        found = Crash.of(result.error)
        if bug.crash is not None and bug.crash.matches(found) and result.script is not None:
            kill = _save_crash_kill(bug, config, result.script, found, save_dir)
        else:  # a crash is never a pass, nor a kill unless the catalogue expects it
            kill.detail = f"crash: {found.describe()}" + (
                f"; the catalogue expects {bug.crash.describe()}" if bug.crash else "")
    elif result.violation is not None and result.script is not None:
        # Report the invariant the catalogue expects when it tripped; else the first one.
        tripped = result.violation.all_ids
        invariant = next((i for i in tripped if i in bug.invariants), tripped[0])
        small = minimize_script(result.script, invariant)
        replayed = run_script(small)
        assert replayed.violation is not None
        tripped = replayed.violation.all_ids
        invariant = next((i for i in tripped if i in bug.invariants), invariant)
        name = "-".join([config.name.replace("@", "-"), bug.id])
        path = save_script(small, save_dir / f"{name}.json")
        record_script_trace(small, get_trace_path(path))  # the kill as a checkable trace
        listed = set(tripped) & set(bug.invariants)
        kill = CellKill(config.name, KILLED if listed else OTHER_ID, "hypothesis", invariant,
                        tripped, len(small.ops), small.count_requests(), 0.0,
                        f"overlap-spec replay {path}",
                        None if listed else f"tripped {', '.join(tripped)}; the catalogue "
                        f"lists {_get_expected(bug)}")
    kill.seconds = time.perf_counter() - started
    return kill


def _get_expected(bug: Bug) -> str:
    """What a kill of ``bug`` must show, in words: its invariants, or its crash."""
    shown = [", ".join(bug.invariants)] if bug.invariants else []
    shown += [f"the crash {bug.crash.describe()}"] if bug.crash is not None else []
    return " or ".join(shown)


def _save_crash_kill(bug: Bug, config: ModelConfig, script: Script, found: Crash,
                     save_dir: Path) -> CellKill:
    """The Hypothesis column's kill of a crash bug: the crashing script, minimised so that
    it still raises the expected crash, saved; its replay reports that crash."""
    assert bug.crash is not None
    expected = bug.crash

    def still_crashes(trial: Script) -> bool:
        return expected.matches(run_script(trial, catch_crash=True).crashed)

    small = minimize_script(script, found.label, still_fails=still_crashes)
    replayed = run_script(small, catch_crash=True)
    name = "-".join([config.name.replace("@", "-"), bug.id])
    path = save_script(small, save_dir / f"{name}.json")
    if not expected.matches(replayed.crashed):  # the saved script must crash the same way
        return CellKill(config.name, SURVIVED, "hypothesis", detail=(
            f"crash: {found.describe()}, but the saved script (overlap-spec replay {path}) "
            f"gives {replayed.crash or replayed.violation or 'no crash'}"))
    return CellKill(config.name, KILLED, "hypothesis", found.label, (found.label,),
                    len(small.ops), small.count_requests(), 0.0,
                    f"overlap-spec replay {path}", f"op {replayed.failed_at}: {found.describe()}")


def get_gpu_supported_faults() -> frozenset[str]:
    """The fault IDs gpu_impl implements. Imported on use, like the gpu_impl checker
    below: gpu_impl imports torch, which a worker process given only Hypothesis or z3
    tasks never needs (about 2 s of CPU per spawned worker)."""
    from overlap_spec.gpu_impl.scheduler import SUPPORTED_FAULTS

    return SUPPORTED_FAULTS


# The invariants a race (spec.invariants.classify_race) or a read hidden from the streams
# (ST3) is reported under: the kills only gpu_impl's CPU race detector can see.
RACE_INVARIANTS = frozenset({"FM1", "FM3", "ST1", "ST2", "ST3", "ST4", "ST5"})


# Committed triggers (``<cell>@<preset>[sizes]-<bug>.json`` of the gpu_impl column,
# ``...-<bug>.reference.json`` of the Hypothesis column): bugs whose kill the column's seeded
# search finds at some seeds only (B19's mixed step needs a prompt capped to 0 new tokens
# beside a running decode: missed at 2 of 4 seeds; B29's dedup needs two requests of one
# family prefilled together: missed in the tree cell once the radix cells drew flushes;
# B38 three requests, one finishing early beside two arrivals, missed in ov-p1-none once
# the pause operations were drawn; B39 a pause right after a prefill's launch).
KILL_CORPUS = Path(__file__).parent / "kills"


def load_known_trigger(bug: Bug, config: ModelConfig,
                       implementation: str = "gpu_impl") -> Script | None:
    """The committed trigger of ``bug`` in ``config``, as a faulted script of
    ``implementation`` (the gpu_impl column's ``<name>-<bug>.json``, the Hypothesis
    column's ``<name>-<bug>.reference.json``)."""
    suffix = "" if implementation == "gpu_impl" else f".{implementation}"
    path = KILL_CORPUS / f"{config.name.replace('@', '-')}-{bug.id}{suffix}.json"
    if not path.exists():
        return None
    script = load_script(path)
    assert script.faults == (bug.id,) and script.implementation == implementation, path
    return script


def _replay_known_trigger(bug: Bug, config: ModelConfig) -> CellResult | None:
    """The Hypothesis column's committed trigger of ``bug`` in ``config``, replayed on the
    faulted reference: its result when it trips an invariant the catalogue lists for the
    bug (the kill is then judged, minimised and saved as a search's would be), else None
    and the seeded search runs. For bugs whose trigger that search reaches at some seeds
    only (B38's three requests, one finishing early beside two arrivals)."""
    known = load_known_trigger(bug, config, "reference")
    if known is None:
        return None
    outcome = run_script(known, catch_crash=True)
    if outcome.violation is None or not set(outcome.violation.all_ids) & set(bug.invariants):
        return None
    result = CellResult(config, frozenset({bug.id}), 0, "known trigger", 0.0)
    result.violation, result.script = outcome.violation, known
    return result


def needs_race_detector(bug: Bug) -> bool:
    """Whether the gpu_impl column's search for ``bug`` must watch races: the catalogue
    lists a race invariant for it, or lists none (a crash bug: watched, to be safe)."""
    return not bug.invariants or bool(RACE_INVARIANTS & set(bug.invariants))


def run_gpu_mutant_in_cell(bug: Bug, config: ModelConfig, profile: Profile, seed: int,
                           save_dir: Path) -> CellKill:
    """The gpu_impl checker: differential run against the clean reference + race detector."""
    import torch

    from overlap_spec.harness.differential.compare import (
        DifferentialOutcome,
        check_cell_differential,
        get_finding_kind,
        get_gpu_mutant_examples,
        run_differential,
    )

    started = time.perf_counter()
    kill = CellKill(config.name, SURVIVED, "gpu_impl")
    if bug.id not in get_gpu_supported_faults():
        kill.verdict = NOT_APPLICABLE
        kill.detail = NO_GPU_PATH
        return kill
    unobservable = get_gpu_unobservable_reason(bug.id, config.cell)
    if unobservable is not None:
        kill.verdict = NOT_APPLICABLE
        kill.detail = unobservable
        return kill
    # The committed trigger first, where the search alone finds the bug at some seeds only
    # (KILL_CORPUS): replayed, it is the search's first example; the kill is judged below
    # on the saved script's run, as a found one is.
    known = load_known_trigger(bug, config)
    found = None if known is None else run_differential(known, device=torch.device("cpu"))
    # Virtual streams on CPU: the race detector that judges the stream bugs runs there. A
    # bug the catalogue expects as a divergence is searched for without it (a trial costs
    # about a quarter); the saved script's run below, which judges the kill, has it on.
    result = None
    failing: tuple[Script, DifferentialOutcome] | None = None
    if known is not None and found is not None and not found.ok:
        failing = (known, found)
    else:
        result = check_cell_differential(
            config, profile, seed, frozenset({bug.id}),
            max_examples=get_gpu_mutant_examples(profile), device=torch.device("cpu"),
            shrink=False, detect_races=needs_race_detector(bug))
        if result.failure is not None:
            failing = (result.failure.script, result.failure.outcome)
    if result is not None and result.error is not None:
        kill.detail = f"crash: {type(result.error).__name__}: {result.error}"
    elif failing is not None:
        failing_script, failing_outcome = failing
        kind = get_finding_kind(failing_outcome)

        def is_same_finding(outcome: DifferentialOutcome) -> bool:
            """The finding again: the same kind, and for the crash the catalogue expects,
            that crash (its label leaves the message out)."""
            if outcome.ok or get_finding_kind(outcome) != kind:
                return False
            if bug.crash is not None and kind == bug.crash.label:
                assert outcome.divergence is not None
                return bug.crash.matches(outcome.divergence.gpu_crash)
            return True

        def get_still_fails(detect_races: bool) -> Callable[[Script], bool]:
            def still_fails(trial: Script) -> bool:
                return is_same_finding(run_differential(trial, device=torch.device("cpu"),
                                                        detect_races=detect_races))
            return still_fails

        # A divergence is minimised without the race detector (a trial costs about a
        # quarter), then confirmed with it; should a race come first on the small script,
        # the minimisation is redone with the detector on. A race is minimised with it.
        is_race = kind.startswith("race:")
        small = minimize_script(failing_script, kind, budget=100,
                                still_fails=get_still_fails(is_race))
        outcome = run_differential(small, device=torch.device("cpu"))
        if not is_race and not is_same_finding(outcome):
            small = minimize_script(failing_script, kind, budget=100,
                                    still_fails=get_still_fails(True))
            outcome = run_differential(small, device=torch.device("cpu"))
        name = "-".join([config.name.replace("@", "-"), bug.id, "gpu_impl"])
        path = save_script(small, save_dir / f"{name}.json")
        record_script_trace(small, get_trace_path(path))  # gpu_impl's own trace of the kill
        if not is_same_finding(outcome):  # judged on the saved script's run alone
            kill.detail = (f"{kind} did not replay on the saved script "
                           f"(overlap-spec replay {path}): {outcome.describe()}")
            kill.seconds = time.perf_counter() - started
            return kill
        race_id = kind.removeprefix("race:") if kind.startswith("race:") else None
        crashed = None if outcome.divergence is None else outcome.divergence.gpu_crash
        if crashed is not None or kind == "diff:exception":  # only the expected crash kills
            listed = bug.crash is not None and bug.crash.matches(crashed)
        elif not bug.invariants:
            listed = False  # a bug that was only a crash (B25) is killed by it alone
        else:
            listed = race_id is None or race_id in bug.invariants
        kill = CellKill(config.name, KILLED if listed else OTHER_ID, "gpu_impl", kind, (kind,),
                        len(small.ops), small.count_requests(), 0.0,
                        f"overlap-spec replay {path}",
                        outcome.describe() if listed else f"{kind}; the catalogue "
                        f"expects {_get_expected(bug)}: {outcome.describe()}")
    kill.seconds = time.perf_counter() - started
    return kill


def run_z3_for_bug(bug: Bug, save_dir: Path) -> MutantResult:
    """The z3 column: BMC / happens-before counterexample, replayed on the reference."""
    started = time.perf_counter()
    kill = run_z3_mutant_column([bug.id])[bug.id]
    result = MutantResult(bug, "z3")
    if kill.verdict == NOT_APPLICABLE:
        result.not_applicable = kill.reason or "the z3 encoding has no path for this bug"
        return result
    cell = CellKill(kill.cell or "-", kill.verdict if kill.verdict == KILLED else SURVIVED,
                    "z3", kill.invariant, (kill.invariant,) if kill.invariant else (),
                    detail=kill.reason or None)
    if kill.script is not None:
        name = "-".join([(kill.cell or "cell").replace("@", "-"), bug.id, "z3"])
        path = save_script(kill.script, save_dir / f"{name}.json")
        record_script_trace(kill.script, get_trace_path(path))
        cell.ops, cell.requests = len(kill.script.ops), kill.script.count_requests()
        cell.replay = f"overlap-spec replay {path}"
    cell.seconds = time.perf_counter() - started
    result.cells.append(cell)
    return result


@dataclass(frozen=True)
class MutantTask:
    """One (bug, checker, cell) of the matrix, as sent to a worker process; the z3
    checker's task has no cell (its BMC picks one)."""

    bug_id: str
    checker: str
    config: ModelConfig | None
    profile: Profile
    seed: int
    save_dir: Path


def run_mutant_task(task: MutantTask) -> MutantResult | CellKill:
    bug = next(b for b in BUGS if b.id == task.bug_id)
    if task.checker == "z3":
        return run_z3_for_bug(bug, task.save_dir)
    assert task.config is not None
    run_in_cell = run_gpu_mutant_in_cell if task.checker == "gpu_impl" else run_mutant_in_cell
    return run_in_cell(bug, task.config, task.profile, task.seed, task.save_dir)


def get_unselected_representatives(bug: Bug, cells: tuple[Cell, ...] | None,
                                   all_cells: bool) -> str | None:
    """Why a cell selection leaves ``bug`` out, or None. The catalogue names the cells
    where the search kills a bug at every seed (B9's row race, for one, shows in the
    release's cells in about 2 seeds of 5); another applicable cell would make a survival
    there a matter of luck, a false alarm on a clean tree."""
    if cells is None or all_cells or not bug.representative_cells:
        return None
    if any(cell.name in bug.representative_cells for cell in cells):
        return None
    return (f"its representative cells ({', '.join(bug.representative_cells)}) are not "
            f"among the selected cells; overlap-spec mutants --bugs {bug.id} runs it there")


# Worst first, so that no long task starts last on a worker (measured in bench/results:
# a gpu_impl cell takes 1-20 s, a hypothesis cell about 1 s, a z3 bug 0.5-3 s).
_CHECKER_COST = {"gpu_impl": 0, "z3": 1, "hypothesis": 2}


def run_mutants(profile: Profile, seed: int, bug_ids: set[str] | None = None,
                cells: tuple[Cell, ...] | None = None, preset: str = "minimal",
                save_dir: Path | None = None, progress: Any = None,
                all_cells: bool = False,
                checkers: tuple[str, ...] = ("hypothesis",),
                max_cells: int | None = None, jobs: int = 1) -> list[MutantResult]:
    """The kill matrix. Default: the representative cells of each bug (among ``cells``
    when given); ``all_cells``: every applicable cell (among ``cells``). Each (bug,
    checker, cell) is one task, run on ``jobs`` worker processes."""
    directory = save_dir or get_failure_dir().parent / "mutants"
    results: list[MutantResult] = []
    tasks: list[tuple[MutantResult, MutantTask]] = []
    gpu_faults = get_gpu_supported_faults() if "gpu_impl" in checkers else frozenset()
    for bug in BUGS:
        if bug_ids is not None and bug.id not in bug_ids:
            continue
        if all_cells:
            targets = get_applicable_cells(bug, cells)
        else:
            targets = get_representative_cells(bug, cells)
        targets = targets[:max_cells] if max_cells is not None else targets
        for checker in checkers:
            result = MutantResult(bug, checker)
            results.append(result)
            if checker == "z3":
                tasks.append((result, MutantTask(bug.id, checker, None, profile, seed,
                                                 directory)))
            elif checker == "gpu_impl" and bug.id not in gpu_faults:
                result.not_applicable = NO_GPU_PATH
            elif (unchosen := get_unselected_representatives(bug, cells, all_cells)):
                result.not_applicable = unchosen
            else:
                sized = make_preset(preset, dict(bug.sizes)) if bug.sizes else PRESETS[preset]
                tasks.extend((result, MutantTask(bug.id, checker, ModelConfig(cell, sized),
                                                 profile, seed, directory))
                             for cell in targets)
    order = sorted(range(len(tasks)), key=lambda i: (_CHECKER_COST[tasks[i][1].checker], i))
    owner = {id(tasks[i][1]): tasks[i][0] for i in order}

    def report(task: MutantTask, outcome: MutantResult | CellKill) -> None:
        if progress is None:
            return
        for kill in (outcome.cells if isinstance(outcome, MutantResult) else [outcome]):
            progress(owner[id(task)].bug, kill)

    outcomes = run_tasks(run_mutant_task, [tasks[i][1] for i in order], jobs, report)
    by_index = dict(zip(order, outcomes, strict=True))
    for index, (result, _) in enumerate(tasks):
        outcome = by_index[index]
        if isinstance(outcome, MutantResult):  # the z3 column: one result per bug
            result.cells, result.not_applicable = outcome.cells, outcome.not_applicable
        else:
            result.cells.append(outcome)
    return results


def build_mutants_json(results: list[MutantResult]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for result in results:
        rep = result.get_representative()
        document.setdefault(result.bug.id, {})[result.checker] = {
                "verdict": result.verdict,
                "invariant": result.invariant,
                "ops": rep.ops if rep else None,
                "requests": rep.requests if rep else None,
                "seconds": round(result.seconds, 3),
                "expected": list(result.bug.invariants),
                "replay": rep.replay if rep else None,
                "cells": {
                    c.cell: {"verdict": c.verdict, "invariant": c.invariant,
                             "all": list(c.all_invariants), "ops": c.ops,
                             "requests": c.requests, "seconds": round(c.seconds, 3),
                             **({"detail": c.detail} if c.detail else {})}
                    for c in result.cells
                },
                **({"not_applicable": result.not_applicable} if result.not_applicable else {}),
            }
    return document


def render_mutants(results: list[MutantResult]) -> str:
    # The invariant column is as wide as its widest entry ("diff:running.seq_lens_sum").
    width = max([9, *(len(r.invariant or "-") for r in results)])
    lines = [f"{'bug':<5} {'checker':<11} {'verdict':<9} {'invariant':<{width}} {'ops':>5} "
             f"{'reqs':>4} {'cells':>6} {'seconds':>8}  title"]
    for result in results:
        rep = result.get_representative()
        killed = sum(c.verdict == KILLED for c in result.cells)
        ran = sum(c.verdict != NOT_APPLICABLE for c in result.cells)
        lines.append(
            f"{result.bug.id:<5} {result.checker:<11} {result.verdict:<9} "
            f"{result.invariant or '-':<{width}} {rep.ops if rep else '-':>5} "
            f"{rep.requests if rep else '-':>4} {f'{killed}/{ran}':>6} "
            f"{result.seconds:8.2f}  {result.bug.title}"
            + (" (current upstream)" if result.bug.current_upstream else ""))
        if result.not_applicable:
            lines.append(f"      n/a: {result.not_applicable}")
        for cell in result.cells:
            if cell.verdict == NOT_APPLICABLE:
                lines.append(f"      n/a in {cell.cell}: {cell.detail}")
            elif cell.verdict == OTHER_ID:
                lines.append(f"      killed by another ID in {cell.cell} ({cell.detail})")
            elif cell.verdict != KILLED:
                lines.append(f"      survived in {cell.cell}" +
                             (f" ({cell.detail})" if cell.detail else ""))
    small = [r for r in results if (rep := r.get_representative()) is not None
             and (rep.requests or 0) <= 2 and (rep.ops or 0) <= 8]
    if results:
        lines.append(f"counterexamples with <= 2 requests and <= 8 ops: {len(small)}/"
                     f"{len(results)}")
    return "\n".join(lines)


def print_mutant_progress(bug: Bug, kill: CellKill) -> None:
    """One progress line per (bug, checker, cell) on stderr."""
    print(f"  mutant {bug.id:<4} {kill.checker:<10} {kill.cell:<{CONFIG_WIDTH}} {kill.verdict:<9} "
          f"{kill.invariant or '-':<26} ({kill.seconds:.2f}s)", file=sys.stderr, flush=True)


def mutants_tier_report(results: list[MutantResult]) -> TierReport:
    """PASS when every mutant is killed (or n/a) in every checker that claims it."""
    ok = not combine([as_verdict(m.verdict) for m in results]).fails_run
    killed = sum(m.verdict == KILLED for m in results)
    unrun = sum(m.verdict == NOT_APPLICABLE for m in results)
    summary = (f"{killed}/{len(results) - unrun} mutants killed"
               + (f" ({unrun} n/a in these cells)" if unrun else ""))
    return TierReport("mutants", Verdict.PASS if ok else Verdict.FAIL, summary,
                      {"mutants": build_mutants_json(results)})
