"""``overlap-spec check``: the main job. Runs every tier on the selected cells (the
Hypothesis state machine, the differential, the proofs, the mutant matrix and, when its
environment exists, the upstream tier), prints one table and writes one JSON report.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from overlap_spec.harness.conformance.cli import (
    CellServer,
    UpstreamPlan,
    UsageError,
    get_upstream_python,
    plan_upstream_check,
    run_upstream_check,
    start_upstream_check,
)
from overlap_spec.harness.conformance.report import (
    render_report,
    upstream_tier_error,
    upstream_tier_report,
)
from overlap_spec.harness.differential.tier import (
    differential_tier_report,
    render_differential,
    run_differential_tier,
)
from overlap_spec.harness.drive.cells import (
    CONFIG_WIDTH,
    describe_variants,
    format_sizes,
    get_budget_shares,
    get_fault_sizes,
    select_configs,
)
from overlap_spec.harness.drive.stateful import (
    CellResult,
    CellTask,
    Profile,
    get_profile,
    run_cell_task,
)
from overlap_spec.harness.drive.witness import describe_witnesses
from overlap_spec.harness.mutants.matrix import (
    mutants_tier_report,
    print_mutant_progress,
    render_mutants,
    run_mutants,
)
from overlap_spec.harness.mutants.select import CHECKERS
from overlap_spec.harness.pool import (
    catching_interrupts,
    raise_if_interrupted,
    run_tasks,
    sharing_workers,
)
from overlap_spec.harness.prove.tier import proofs_tier_report, run_proofs_for_check
from overlap_spec.harness.report import hypothesis_tier_report, render_table, write_json
from overlap_spec.harness.verdict import CheckReport, TierReport, Verdict
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.config import ModelConfig


def cmd_check(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    faults = get_faults_and_check_jobs(args)
    sizes = get_fault_sizes(getattr(args, "sizes", None), faults)
    configs = select_configs(args.cells, args.preset, sizes, variants=not (sizes or faults),
                             with_radix=True)
    if getattr(args, "sizes", None):
        print(f"sizes {format_sizes(args.sizes)}: the Hypothesis, differential and upstream "
              "tiers run at them; the proofs and the mutant matrix at their own")
    variants = describe_variants(configs)
    if variants:
        print(variants)
    run = _Run(args, profile, faults, configs, CheckReport(args.seed, profile.name))
    started = time.perf_counter()
    tiers = (("hypothesis", _hypothesis_tier), ("differential", _differential_tier),
             ("proofs", _proofs_tier), ("upstream", _upstream_tier), ("mutants", _mutant_tier))
    _start_upstream(run)
    with catching_interrupts(), run, sharing_workers(args.jobs):
        for name, tier in tiers:
            tier_started = time.perf_counter()
            try:
                tier(run)
                raise_if_interrupted()
                last = run.report.tiers[-1]
                if last.name == name and last.verdict is not Verdict.SKIPPED:
                    run.report.tiers[-1] = replace(
                        last, seconds=time.perf_counter() - tier_started)
            except KeyboardInterrupt:
                # Ctrl-C: what ran is reported, the tier it stopped is inconclusive, and
                # the run is marked incomplete (exit 130, the shell's code for SIGINT).
                run.report.interrupt(name)
                break
    run.report.elapsed_s = time.perf_counter() - started
    print(f"\n{run.report.closing_line()}")
    if args.json:
        write_json(run.report.to_json(), Path(args.json))
    return run.report.exit_code


@dataclass
class _Run:
    """What the tiers of one ``check`` share."""

    args: argparse.Namespace
    profile: Profile
    faults: frozenset[str]
    configs: list[ModelConfig]
    report: CheckReport

    # The upstream tier's plan and its cell server, started before the first tier so
    # that sglang imports while the other tiers run (or why the plan failed).
    upstream_plan: UpstreamPlan | None = None
    upstream_server: CellServer | None = None
    upstream_error: str | None = None

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.upstream_server is not None:  # unused (an interrupt, a skipped tier)
            self.upstream_server.stop()
            self.upstream_server = None

    @property
    def out(self) -> Path | None:
        return Path(self.args.out) / "failures" if self.args.out else None

    def skips(self, tier: str, option: str, by_option: bool) -> bool:
        """Record ``tier`` as skipped (by its option, or because --faults runs the
        Hypothesis tier only) and say so."""
        if not (by_option or self.faults):
            return False
        reason = option if by_option else "--faults (a faulted run checks the Hypothesis tier only)"
        self.report.add(TierReport.skipped(tier, reason))
        return True


def get_faults_and_check_jobs(args: argparse.Namespace) -> frozenset[str]:
    """``--faults`` as a set; the parser checks it and ``--jobs``, this guards a
    programmatic call (a ``UsageError``: one line, exit 2 in ``main``)."""
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    if faults - SUPPORTED_FAULTS:
        raise UsageError(f"unknown fault IDs {sorted(faults - SUPPORTED_FAULTS)}; supported: "
                         f"{', '.join(sorted(SUPPORTED_FAULTS))}")
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    return faults


def run_hypothesis_cells(configs: list[ModelConfig], profile: Profile, seed: int,
                         faults: frozenset[str], out: Path | None, jobs: int, quiet: bool,
                         shrink: bool = True) -> list[CellResult]:
    """The Hypothesis tier's cells on ``jobs`` processes, a progress line per cell;
    ``shrink=False``: the project's minimiser instead of Hypothesis's shrinker."""
    tasks = [CellTask(config, profile, seed, faults, out, shrink, share)
             for config, share in zip(configs, get_budget_shares(configs), strict=True)]
    progress = None if quiet else CellProgress(len(tasks), "hypothesis", profile.name)
    return run_tasks(run_cell_task, tasks, jobs, None if progress is None else progress.cell_done)


def _hypothesis_tier(run: _Run) -> None:
    args = run.args
    print(describe_witnesses(run.configs))
    results = run_hypothesis_cells(run.configs, run.profile, args.seed, run.faults, run.out,
                                   args.jobs, args.quiet)
    print(render_table(results))
    run.report.add(hypothesis_tier_report(results))


def _differential_tier(run: _Run) -> None:
    if run.skips("differential", "--no-differential", run.args.no_differential):
        return
    print("\ndifferential tier (gpu_impl vs reference, CPU race detector):")
    results = run_differential_tier(run.configs, run.profile, run.args.seed,
                                    torch.device("cpu"), run.args.quiet, run.out,
                                    jobs=run.args.jobs)
    print(render_differential(results))
    run.report.add(differential_tier_report(results))


def _proofs_tier(run: _Run) -> None:
    if run.skips("proofs", "--no-proofs", run.args.no_proofs):
        return
    # The default run: every cell without the cache and two radix cells (the BMC's bounded
    # tree, harness/prove/tier.py); a selection: its cells.
    names = [c.cell.name for c in run.configs] if run.args.cells else None
    print("\nproofs (Z3: induction, happens-before, bounded model checking):")
    proofs = run_proofs_for_check(names, run.args.jobs, progress=not run.args.quiet)
    counts = proofs.get("counts", {})
    print("  " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f" ({proofs.get('elapsed_s', 0):.1f}s)")
    run.report.add(proofs_tier_report(proofs))


def _will_run_upstream(run: _Run) -> bool:
    return not (run.args.no_upstream or run.faults) and get_upstream_python() is not None


def _start_upstream(run: _Run) -> None:
    """Plan the upstream tier and start its cell server, waiting: sglang's import (about
    10 s on one core) then overlaps the tiers before it instead of idling a core."""
    if not _will_run_upstream(run):
        return
    args = run.args
    up_args = argparse.Namespace(
        cells=",".join(dict.fromkeys(c.cell.name for c in run.configs)) if args.cells else None,
        with_radix=True,
        sglang_src=None, out=args.out, seed=args.seed, profile=run.profile.name,
        preset="minimal" if args.preset == "all" else args.preset,
        sizes=getattr(args, "sizes", None), jobs=args.jobs, quiet=args.quiet)
    try:
        run.upstream_plan = plan_upstream_check(up_args)
        if run.upstream_plan.runnable:
            run.upstream_server = start_upstream_check(run.upstream_plan)
    except UsageError as error:
        run.upstream_error = str(error)


def _upstream_tier(run: _Run) -> None:
    args = run.args
    if run.skips("upstream", "--no-upstream", args.no_upstream):
        upstream = run.report.tiers[-1]
    elif not _will_run_upstream(run):
        upstream = run.report.add(TierReport.skipped(
            "upstream", "no upstream environment (build it with './dev upstream')"))
    else:
        print("\nupstream tier (sglang's own scheduler against the spec):")
        try:
            if run.upstream_error is not None or run.upstream_plan is None:
                raise UsageError(run.upstream_error or "the upstream tier was not planned")
            server, run.upstream_server = run.upstream_server, None
            document = run_upstream_check(run.upstream_plan.args, progress=not args.quiet,
                                          plan=run.upstream_plan, server=server)
            print(render_report(document))
            upstream = run.report.add(upstream_tier_report(document))
        except UsageError as error:
            upstream = run.report.add(upstream_tier_error(str(error)))
            print(f"  upstream tier could not run: {error}")
    if upstream.verdict is Verdict.SKIPPED:
        print(f"\nupstream tier skipped: {upstream.reason}")


def _mutant_tier(run: _Run) -> None:
    args = run.args
    if run.skips("mutants", "--no-mutants", args.no_mutants):
        return
    where = "the selected cells" if args.cells else "representative cells"
    print(f"\nmutant matrix (each bug alone, {where}):")
    subset = tuple(c.cell for c in run.configs) if args.cells else None
    # The matrix runs at minimal sizes when several presets were asked for.
    preset = "minimal" if args.preset == "all" else args.preset
    mutant_dir = Path(args.out) / "mutants" if args.out else None
    checkers = tuple(c for c in CHECKERS
                     if not (c == "gpu_impl" and args.no_differential)
                     and not (c == "z3" and args.no_proofs))
    results = run_mutants(run.profile, args.seed, cells=subset, preset=preset,
                          save_dir=mutant_dir,
                          progress=None if args.quiet else print_mutant_progress,
                          checkers=checkers, jobs=args.jobs)
    print(render_mutants(results))
    run.report.add(mutants_tier_report(results))


class CellProgress:
    """One stderr line per finished cell: ``[k/N] hypothesis ci  CELL ok (4.51s)``."""

    def __init__(self, total: int, tier: str, profile: str) -> None:
        self.total, self.tier, self.profile, self.done = total, tier, profile, 0

    def cell_done(self, task: CellTask, result: CellResult) -> None:
        self.done += 1
        status = "ok" if result.ok else "FAIL " + ",".join(result.failed_ids or ("crash",))
        print(f"[{self.done:2d}/{self.total}] {self.tier} {self.profile:<8} "
              f"{task.config.name:<{CONFIG_WIDTH}} {status} ({result.seconds:.2f}s)",
              file=sys.stderr, flush=True)
