"""``overlap-spec exhaust``: the small-scope exhaustive tier, one task per cell.

Per cell it runs :func:`~overlap_spec.harness.exhaust.search.explore` to the cell's depth
(:func:`get_default_depth`, or ``--depth``) over its alphabet (:func:`get_default_scope`:
``full``, and ``shared`` in the radix cells, which ``--radix`` selects), saves and replays
every counterexample, and reports the depth, the distinct states and the transitions
explored, the observation points checked, each applicable invariant's witness count and the
time. Zero after a complete search is *vacuous*, a failure, within bounds that hold the
default ones (where every applicable invariant has a witness in every cell); within smaller
or other bounds it is n/a with that reason (no sequence within them exercises it), not
counted as passed.

With ``--faults`` the search stops at the first (shortest) violation of an invariant the
catalogue lists for one of those bugs: the bug is *killed* there; violations of other IDs
are reported and the search goes on around them (*other-id* when nothing else is found);
a search that completes with neither is *survived*. A crash stops the search too: it is a
kill when it is exactly the crash the catalogue expects of one of those bugs (B25,
``harness/crash.py``), and inconclusive otherwise.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from overlap_spec.harness.catalogue import get_bug, get_bugs_expecting
from overlap_spec.harness.drive.cells import (
    CONFIG_WIDTH,
    NoCellMatches,
    UsageError,
    check_sizes,
    get_fault_sizes,
    make_preset,
    select_cells,
    split_preset,
)
from overlap_spec.harness.drive.script import save_script
from overlap_spec.harness.exhaust import (
    FULL,
    MAX_REQUESTS,
    MAX_REQUESTS_BY_SCOPE,
    NON_SPEC_DEPTH,
    PD_DECODE,
    SHARED,
    SHARED_DEPTH,
    SPEC_DEPTH,
)
from overlap_spec.harness.exhaust.alphabet import get_alphabet
from overlap_spec.harness.exhaust.search import (
    Exploration,
    Finding,
    check_replays,
    explore,
    get_script,
)
from overlap_spec.harness.pool import catching_interrupts, raise_if_interrupted, run_tasks
from overlap_spec.harness.report import write_json
from overlap_spec.harness.trace.check import record_script_trace
from overlap_spec.harness.trace.format import get_trace_path
from overlap_spec.harness.verdict import Verdict
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.config import Cell, ModelConfig, enumerate_cells, enumerate_radix_cells
from overlap_spec.spec.invariants import INVARIANTS, Invariant, InvariantViolation

KILLED, SURVIVED, OTHER_ID = "killed", "survived", "other-id"


def get_default_scope(cell: Cell) -> str:
    """The alphabet a cell is searched over unless told: ``shared`` in a radix cell (its
    prompts share a page of key, what the tree is for), ``full`` elsewhere."""
    return SHARED if cell.radix else FULL


def get_default_depth(cell: Cell, scope: str | None = None) -> int:
    """The depth of the default bounds for the cell over ``scope`` (its default scope when
    None): the shared alphabet's in a radix cell, else by speculation."""
    if (scope or get_default_scope(cell)) == SHARED:
        return SHARED_DEPTH
    return SPEC_DEPTH if cell.is_spec else NON_SPEC_DEPTH


def get_wanted_ids(faults: Iterable[str]) -> frozenset[str]:
    """The invariants the catalogue lists for these bugs (what a kill must trip)."""
    return frozenset(i for bug_id in faults for i in get_bug(bug_id).invariants)


@dataclass(frozen=True)
class ExhaustTask:
    config: ModelConfig
    depth: int
    faults: frozenset[str]
    out_dir: Path
    max_requests: int = MAX_REQUESTS
    scope: str = FULL  # the alphabet (harness.exhaust.SCOPES)


@dataclass(frozen=True)
class FindingReport:
    """A saved counterexample, in plain values (it crosses process boundaries)."""

    kind: str  # "violation" | "crash"
    invariant: str | None
    ids: tuple[str, ...]
    message: str
    ops: int
    requests: int
    script: str
    expected: bool  # with faults: trips an invariant (or the crash) the catalogue lists
    trace: str | None = None  # the same run as a trace (violations), and its checker's word
    trace_status: str | None = None

    @property
    def replay(self) -> str:
        return f"overlap-spec replay {self.script}"


@dataclass
class CellReport:
    cell: str
    depth: int
    faults: tuple[str, ...]
    alphabet: str
    applicable: tuple[str, ...]
    levels: list[dict[str, int]] = field(default_factory=list)
    states: int = 0
    transitions: int = 0
    observations: int = 0
    exercised: dict[str, int] = field(default_factory=dict)
    complete: bool = False
    stopped: FindingReport | None = None
    others: list[FindingReport] = field(default_factory=list)
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    error: str | None = None  # this tier's own failure (a counterexample that did not replay)
    # Whether the bounds hold the default ones (the full alphabet at the preset's sizes, at
    # least the default depth and requests), at which every applicable invariant has a
    # witness in every cell (tests/test_exhaust.py): one unreached there is a regression.
    default_bounds: bool = True

    @property
    def unreached(self) -> tuple[str, ...]:
        """Applicable invariants with no witness; judged only when every sequence ran."""
        if not self.complete:
            return ()
        return tuple(i for i in self.applicable if not self.exercised.get(i))

    @property
    def vacuous(self) -> tuple[str, ...]:
        """Unreached within bounds that hold the default ones, where each used to be
        exercised: a failure."""
        return self.unreached if self.default_bounds else ()

    @property
    def not_applicable(self) -> tuple[str, ...]:
        """Unreached within other bounds (a smaller depth, the narrower alphabet, other
        sizes): no sequence within them exercises it (every one ran). That says what the
        bounds reach: the invariant is n/a there, with that reason, and is not counted as
        passed; the cell passes on what it did reach."""
        return () if self.default_bounds else self.unreached

    @property
    def kill(self) -> str | None:
        """With faults: killed, other-id or survived; None without faults."""
        if not self.faults:
            return None
        if self.stopped is not None and (self.stopped.kind == "violation" or self.stopped.expected):
            return KILLED
        if self.others:
            return OTHER_ID
        return SURVIVED if self.complete else None

    @property
    def verdict(self) -> Verdict:
        if self.error is not None or (self.stopped is not None and self.stopped.kind == "crash"
                                      and not self.stopped.expected):
            return Verdict.INCONCLUSIVE  # a crash the catalogue does not expect
        if self.stopped is not None or self.others:
            return Verdict.FAIL
        if self.vacuous:
            return Verdict.VACUOUS
        return Verdict.PASS


def _save(task: ExhaustTask, result: Exploration, finding: Finding, suffix: str,
          wanted: frozenset[str]) -> FindingReport:
    """Save, replay from scratch (it must fail the same way) and describe one finding."""
    check_replays(result, finding)
    script = get_script(result, finding)
    scope = [] if task.scope == FULL else [task.scope]  # a pd-decode run keeps its own files
    name = "-".join([task.config.name.replace("@", "-"), *scope, *sorted(task.faults)]) + suffix
    path = save_script(script, task.out_dir / f"{name}.json")
    violation: InvariantViolation | None = finding.violation
    trace, trace_status = None, None
    if violation is not None:
        trace = get_trace_path(path)
        trace_status = record_script_trace(script, trace).status
    # The invariant a kill is named by: the first listed one it tripped, else the first;
    # a crash by its label (crash:ValueError@retract_decode).
    invariant = None if violation is None else next(
        (i for i in violation.all_ids if i in wanted), violation.invariant_id)
    expected = bool(set(finding.ids) & wanted)
    if finding.crash is not None:
        invariant = finding.crash.label
        expected = bool(get_bugs_expecting(task.faults, finding.crash))
    return FindingReport(
        kind="violation" if violation is not None else "crash",
        invariant=invariant,
        ids=finding.ids, message=finding.describe(), ops=len(finding.ops),
        requests=script.count_requests(), script=str(path),
        expected=expected,
        trace=None if trace is None else str(trace), trace_status=trace_status)


def run_exhaust_task(task: ExhaustTask) -> CellReport:
    """One cell (module level: the pool pickles it by name)."""
    config, faults = task.config, task.faults
    alphabet = get_alphabet(config, task.max_requests, task.scope)
    wanted = get_wanted_ids(faults)
    report = CellReport(config.name, task.depth, tuple(sorted(faults)), alphabet.describe(),
                        tuple(i.id for i in _applicable(config)))
    report.default_bounds = (task.scope == get_default_scope(config.cell)
                             and task.depth >= get_default_depth(config.cell, task.scope)
                             and task.max_requests >= MAX_REQUESTS
                             and not split_preset(config.preset)[1])
    if faults:
        def stop(violation: InvariantViolation) -> bool:
            return bool(set(violation.all_ids) & wanted)
        result = explore(config, task.depth, faults, stop, alphabet)
    else:
        result = explore(config, task.depth, faults, alphabet=alphabet)
    report.levels = [{"depth": level.depth, "transitions": level.transitions,
                      "new_states": level.new_states, "merged": level.merged}
                     for level in result.levels]
    report.states, report.transitions = result.states, result.transitions
    report.observations = result.observations
    report.exercised = dict(sorted(result.exercised.items()))
    report.complete = result.complete
    report.wall_seconds, report.cpu_seconds = result.wall_seconds, result.cpu_seconds
    try:
        for finding in result.findings:
            report.others.append(_save(task, result, finding, f"-{finding.ids[0]}", wanted))
        if result.stopped is not None:
            suffix = "-crash" if result.stopped.crash is not None else ""
            report.stopped = _save(task, result, result.stopped, suffix, wanted)
    except Exception as error:  # noqa: BLE001 - reported as this tier's failure
        report.error = f"{type(error).__name__}: {error}"
    return report


def _applicable(config: ModelConfig) -> list[Invariant]:
    return [inv for inv in INVARIANTS if inv.applies(config.cell)]


def run_exhaust(configs: list[ModelConfig], depth: int | None, faults: frozenset[str],
                out_dir: Path, jobs: int, quiet: bool = True,
                max_requests: int = MAX_REQUESTS, scope: str | None = None) -> list[CellReport]:
    """Each cell over ``scope`` (None: the cell's default scope) to ``depth`` (None: the
    default depth of the cell and scope)."""
    tasks = []
    for config in configs:
        alphabet = scope or get_default_scope(config.cell)
        tasks.append(ExhaustTask(config, depth or get_default_depth(config.cell, alphabet),
                                 faults, out_dir, max_requests, alphabet))

    def progress(task: ExhaustTask, report: CellReport) -> None:
        if not quiet:
            print(render_cell_line(report), flush=True)

    return run_tasks(run_exhaust_task, tasks, jobs, progress)


# -- reports ---------------------------------------------------------------------------------
HEADER: Final = (f"{'cell':<{CONFIG_WIDTH}} {'depth':>5} {'states':>8} {'transitions':>11} "
                 f"{'observations':>12} {'witnessed':>9} {'time':>8}  verdict")


def _word(report: CellReport) -> str:
    if report.kill is not None and report.verdict is not Verdict.INCONCLUSIVE:
        return report.kill
    if report.verdict is Verdict.PASS and report.not_applicable:
        return f"pass (n/a {len(report.not_applicable)})"
    return report.verdict.value


def render_cell_line(report: CellReport) -> str:
    witnessed = sum(1 for i in report.applicable if report.exercised.get(i))
    states = f"{report.states}" + ("" if report.complete else "+")
    return (f"{report.cell:<{CONFIG_WIDTH}} {report.depth:>5} {states:>8} {report.transitions:>11} "
            f"{report.observations:>12} {f'{witnessed}/{len(report.applicable)}':>9} "
            f"{f'{report.wall_seconds:.1f}s':>8}  {_word(report)}")


def render_witnesses(report: CellReport) -> str:
    """Each applicable invariant's witness count in one cell (0: vacuous when complete)."""
    counts = ", ".join(f"{i} {report.exercised.get(i, 0)}" for i in report.applicable)
    return f"{report.cell} witnesses: {counts}"


def render_findings(reports: list[CellReport]) -> str:
    lines: list[str] = []
    for report in reports:
        shown = ([report.stopped] if report.stopped is not None else []) + report.others
        for finding in shown:
            what = ("kill" if report.faults and finding.expected else
                    "crash" if finding.kind == "crash" else
                    "violation" if not report.faults else "other-id")
            lines.append(f"[{what}] {report.cell}" + (
                f", faults {','.join(report.faults)}" if report.faults else ""))
            lines.append(f"    {finding.message}")
            lines.append(f"    counterexample: {finding.ops} op{'s' * (finding.ops != 1)}, "
                         f"{finding.requests} request{'s' * (finding.requests != 1)} "
                         "(no shorter sequence over the alphabet fails)")
            lines.append(f"    replay: {finding.replay}")
            if finding.trace is not None:
                lines.append(f"    trace: {finding.trace} (trace checker: "
                             f"{finding.trace_status})")
        if report.error is not None:
            lines.append(f"[error] {report.cell}: {report.error}")
        if report.vacuous:
            lines.append(f"[vacuous] {report.cell}: no witness for "
                         f"{', '.join(report.vacuous)} (every sequence up to depth "
                         f"{report.depth} ran; the default bounds used to witness it)")
        if report.not_applicable:
            lines.append(f"[n/a] {report.cell}: {', '.join(report.not_applicable)}: no "
                         f"sequence of up to {report.depth} operations over this alphabet "
                         "exercises it (every one ran): n/a within these bounds, not "
                         "passed; the default bounds, at the preset's sizes, witness it")
    return "\n".join(lines)


def is_ok(reports: list[CellReport]) -> bool:
    return not any(r.verdict.fails_run for r in reports)


def build_exhaust_json(reports: list[CellReport], elapsed: float) -> dict[str, Any]:
    def finding(f: FindingReport | None) -> dict[str, Any] | None:
        if f is None:
            return None
        return {"kind": f.kind, "invariant": f.invariant, "ids": list(f.ids),
                "message": f.message, "ops": f.ops, "requests": f.requests,
                "expected": f.expected, "script": f.script, "replay": f.replay,
                "trace": f.trace, "trace_status": f.trace_status}

    return {
        "version": 1,
        "ok": is_ok(reports),
        "elapsed_s": round(elapsed, 3),
        "cells": {
            r.cell: {
                "verdict": r.verdict.value, "kill": r.kill, "depth": r.depth,
                "faults": list(r.faults), "alphabet": r.alphabet, "complete": r.complete,
                "states": r.states, "transitions": r.transitions,
                "observations": r.observations, "levels": r.levels,
                "witnesses": {i: r.exercised.get(i, 0) for i in r.applicable},
                "vacuous": list(r.vacuous), "not_applicable": list(r.not_applicable),
                "default_bounds": r.default_bounds, "stopped": finding(r.stopped),
                "others": [finding(f) for f in r.others], "error": r.error,
                "wall_s": round(r.wall_seconds, 3), "cpu_s": round(r.cpu_seconds, 3),
            }
            for r in reports
        },
    }


def select_exhaust_configs(patterns: str | None, radix: bool,
                           sizes: dict[str, int] | None) -> list[ModelConfig]:
    """The selected cells at the minimal preset with ``sizes``: among the release's cells,
    or with ``radix`` among the radix cells (``overlap-spec cells --radix``), as the
    upstream tier's ``--radix`` selects; a name from the other list says which flag it
    needs."""
    try:
        cells = select_cells(patterns, radix=radix)
    except NoCellMatches as error:
        hint = ("--radix selects among the radix cells only" if radix else
                "radix cells need --radix")
        raise NoCellMatches(f"{error}; {hint}") from None
    configs = [ModelConfig(cell, make_preset("minimal", sizes or {})) for cell in cells]
    for config in configs:
        problem = check_sizes(config)
        if problem is not None:
            raise UsageError(problem)
    return configs


def check_faults_apply(faults: frozenset[str], configs: list[ModelConfig], radix: bool) -> None:
    """A bug that applies only among the radix cells, or in none of them, run on the other
    list applies in none of the selected cells: a usage error naming the flag, never a
    matrix of survivals."""
    other = enumerate_cells() if radix else enumerate_radix_cells()
    for bug_id in sorted(faults):
        bug = get_bug(bug_id)
        if any(bug.applies(c.cell) for c in configs) or not any(map(bug.applies, other)):
            continue
        raise UsageError(f"{bug_id} applies in none of the selected cells: "
                         + ("it applies only outside the radix cells (drop --radix)" if radix
                            else "it applies only in radix cells (add --radix)"))


def cmd_exhaust(args: argparse.Namespace) -> int:
    """``overlap-spec exhaust`` (its arguments: ``harness.cli``)."""
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    if faults - SUPPORTED_FAULTS:
        raise UsageError(f"unknown fault IDs {sorted(faults - SUPPORTED_FAULTS)}; supported: "
                         f"{', '.join(sorted(SUPPORTED_FAULTS))}")
    scope = args.alphabet or (SHARED if args.radix else FULL)
    if scope == SHARED and not args.radix:
        raise UsageError(f"--alphabet {SHARED} is the radix cells' alphabet (add --radix): "
                         "without a prefix tree no prompt is shared")
    most = MAX_REQUESTS_BY_SCOPE[scope]
    if args.requests > most:
        raise UsageError(f"--requests {args.requests}: the {scope} alphabet admits at "
                         f"most {most}" + (f" ({PD_DECODE}: {MAX_REQUESTS_BY_SCOPE[PD_DECODE]})"
                                           if scope != PD_DECODE else ""))
    configs = select_exhaust_configs(args.cells, args.radix,
                                     get_fault_sizes(getattr(args, "sizes", None), faults))
    check_faults_apply(faults, configs, args.radix)
    out_dir = Path(args.out or os.environ.get("OVERLAP_SPEC_OUT", ".overlap-spec")) / "exhaust"
    depth = args.depth
    depths = {depth or get_default_depth(c.cell, scope) for c in configs}
    bound = (f"depth {depths.pop()}" if len(depths) == 1 else
             f"depth {NON_SPEC_DEPTH} in non-speculative cells, {SPEC_DEPTH} in speculative ones")
    alphabet = "" if scope == FULL else f" ({scope})"
    print(f"exhaust: every sequence of operations over each cell's alphabet{alphabet}, up to "
          f"{bound}, "
          f"at most {args.requests} request{'s' * (args.requests != 1)}, in {len(configs)} "
          f"{'radix ' * args.radix}cell{'s' * (len(configs) != 1)}"
          + (f", faults {','.join(sorted(faults))}" if faults else ""))
    if not args.quiet:
        print(HEADER)
    started = time.perf_counter()
    try:
        with catching_interrupts():
            reports = run_exhaust(configs, depth, faults, out_dir, args.jobs, args.quiet,
                                  args.requests, scope)
            raise_if_interrupted()
    except KeyboardInterrupt:
        print("INTERRUPTED (report incomplete)")
        return 130
    elapsed = time.perf_counter() - started
    if args.quiet:
        print(HEADER)
        for report in reports:
            print(render_cell_line(report))
    if args.witnesses:
        for report in reports:
            print(render_witnesses(report))
    findings = render_findings(reports)
    if findings:
        print(findings)
    ok = is_ok(reports)
    clean = sum(not r.verdict.fails_run for r in reports)
    total_states = sum(r.states for r in reports)
    total_transitions = sum(r.transitions for r in reports)
    kills = ""
    if faults:
        killed = sum(r.kill == KILLED for r in reports)
        kills = f", {','.join(sorted(faults))} killed in {killed}/{len(reports)} cells"
    na = sum(len(r.not_applicable) for r in reports)
    kills += (f", {na} invariant x cell n/a (unreached within these bounds)" if na else "")
    print(f"{'OK' if ok else 'FAILED'}: {clean}/{len(reports)} cells clean{kills}, "
          f"{total_states} states, {total_transitions} transitions, {elapsed:.1f}s")
    if args.json:
        write_json(build_exhaust_json(reports, elapsed), Path(args.json))
    return 0 if ok else 1
