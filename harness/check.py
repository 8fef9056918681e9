"""``overlap-spec check``: the main job. Runs every tier on the selected cells (the
Hypothesis state machine, the differential, the proofs, the mutant matrix and, when its
environment exists, the upstream tier), prints one table and writes one JSON report.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from overlap_spec.harness.conformance.cli import (
    UsageError,
    get_upstream_python,
    render_report,
    run_upstream_check,
    upstream_tier_error,
    upstream_tier_report,
)
from overlap_spec.harness.differential.tier import (
    differential_tier_report,
    render_differential,
    run_differential_tier,
)
from overlap_spec.harness.drive.cells import select_configs
from overlap_spec.harness.drive.stateful import (
    CellResult,
    Profile,
    check_cell,
    get_profile,
)
from overlap_spec.harness.mutants.matrix import (
    mutants_tier_report,
    print_mutant_progress,
    render_mutants,
    run_mutants,
)
from overlap_spec.harness.mutants.select import CHECKERS
from overlap_spec.harness.pool import run_tasks
from overlap_spec.harness.prove.tier import proofs_tier_report, run_proofs_for_check
from overlap_spec.harness.report import hypothesis_tier_report, render_table, write_json
from overlap_spec.harness.verdict import CheckReport, TierReport, Verdict
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.config import ModelConfig


def cmd_check(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    unknown = faults - SUPPORTED_FAULTS
    if unknown:
        print(f"overlap-spec: unknown fault IDs {sorted(unknown)}; supported: "
              f"{', '.join(sorted(SUPPORTED_FAULTS))}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("overlap-spec: --jobs must be >= 1", file=sys.stderr)
        return 2
    configs = select_configs(args.cells, args.preset)
    out = Path(args.out) / "failures" if args.out else None
    started = time.perf_counter()
    tasks = [CellTask(config, profile, args.seed, faults, out) for config in configs]
    progress = None if args.quiet else _Progress(len(tasks), "hypothesis", profile.name)
    results = run_tasks(run_cell_task, tasks, args.jobs,
                        None if progress is None else progress.cell_done)
    print(render_table(results))
    report = CheckReport(args.seed, profile.name)
    report.add(hypothesis_tier_report(results))
    if args.no_differential or faults:
        report.add(TierReport.skipped("differential", _why_skipped(args.no_differential,
                                                                   "--no-differential")))
    else:
        print("\ndifferential tier (gpu_impl vs reference, CPU race detector):")
        diff_results = run_differential_tier(configs, profile, args.seed, torch.device("cpu"),
                                             args.quiet, out, jobs=args.jobs)
        print(render_differential(diff_results))
        report.add(differential_tier_report(diff_results))
    if args.no_proofs or faults:
        report.add(TierReport.skipped("proofs", _why_skipped(args.no_proofs, "--no-proofs")))
    else:
        print("\nproofs (Z3: induction, happens-before, bounded model checking):")
        proofs = run_proofs_for_check([c.cell.name for c in configs] if args.cells else None,
                                      args.jobs)
        counts = proofs.get("counts", {})
        print("  " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f" ({proofs.get('elapsed_s', 0):.1f}s)")
        report.add(proofs_tier_report(proofs))
    if args.no_upstream or faults:
        upstream = report.add(TierReport.skipped("upstream", _why_skipped(args.no_upstream,
                                                                          "--no-upstream")))
    elif get_upstream_python() is None:
        upstream = report.add(TierReport.skipped(
            "upstream", "no upstream environment (build it with './dev upstream')"))
    else:
        print("\nupstream tier (sglang's own scheduler against the spec):")
        up_args = argparse.Namespace(
            cells=",".join(c.cell.name for c in configs) if args.cells else None,
            sglang_src=None, out=args.out, seed=args.seed, profile=profile.name,
            preset="minimal" if args.preset == "all" else args.preset,
            jobs=args.jobs, quiet=args.quiet)
        try:
            document = run_upstream_check(up_args, progress=not args.quiet)
            print(render_report(document))
            upstream = report.add(upstream_tier_report(document))
        except UsageError as error:
            upstream = report.add(upstream_tier_error(str(error)))
            print(f"  upstream tier could not run: {error}")
    if upstream.verdict is Verdict.SKIPPED:
        print(f"\nupstream tier skipped: {upstream.reason}")
    if args.no_mutants or faults:
        report.add(TierReport.skipped("mutants", _why_skipped(args.no_mutants, "--no-mutants")))
    else:
        where = "the selected cells" if args.cells else "representative cells"
        print(f"\nmutant matrix (each bug alone, {where}):")
        subset = tuple(c.cell for c in configs) if args.cells else None
        # The matrix runs at minimal sizes when several presets were asked for.
        preset = "minimal" if args.preset == "all" else args.preset
        mutant_dir = Path(args.out) / "mutants" if args.out else None
        checkers = tuple(c for c in CHECKERS
                         if not (c == "gpu_impl" and args.no_differential)
                         and not (c == "z3" and args.no_proofs))
        mutant_results = run_mutants(profile, args.seed, cells=subset, preset=preset,
                                     save_dir=mutant_dir,
                                     progress=None if args.quiet else print_mutant_progress,
                                     checkers=checkers, jobs=args.jobs)
        print(render_mutants(mutant_results))
        report.add(mutants_tier_report(mutant_results))
    report.elapsed_s = time.perf_counter() - started
    print(f"\n{report.closing_line()}")
    if args.json:
        write_json(report.to_json(), Path(args.json))
    return 0 if report.ok else 1


@dataclass(frozen=True)
class CellTask:
    """One cell of the Hypothesis tier, as sent to a worker process."""

    config: ModelConfig
    profile: Profile
    seed: int
    faults: frozenset[str]
    save_dir: Path | None


def run_cell_task(task: CellTask) -> CellResult:
    return check_cell(task.config, task.profile, task.seed, task.faults, save_dir=task.save_dir)


class _Progress:
    """One stderr line per finished cell: ``[k/N] hypothesis ci  CELL ok (4.51s)``."""

    def __init__(self, total: int, tier: str, profile: str) -> None:
        self.total, self.tier, self.profile, self.done = total, tier, profile, 0

    def cell_done(self, task: CellTask, result: CellResult) -> None:
        self.done += 1
        status = "ok" if result.ok else "FAIL " + ",".join(result.failed_ids or ("crash",))
        print(f"[{self.done:2d}/{self.total}] {self.tier} {self.profile:<8} "
              f"{task.config.name:<40} {status} ({result.seconds:.2f}s)",
              file=sys.stderr, flush=True)


def _why_skipped(by_option: bool, option: str) -> str:
    """A tier is skipped by its option, or because --faults runs the Hypothesis tier only."""
    return option if by_option else "--faults (a faulted run checks the Hypothesis tier only)"
