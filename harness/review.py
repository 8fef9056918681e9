"""``overlap-spec review``: a reviewer's minute. Does my change break an invariant?

A change to ``reference/`` (a design stated in the model before it is code): the
Hypothesis state machine on every cell with the ``quick`` budget, every applicable
invariant at every observation point, cells spread over ``--jobs`` processes. A change
to an SGLang tree (``--sglang-src DIR``): the upstream tier on that tree instead, with
the same budget. Failures print once per distinct failure with the cells it occurred
in; nothing else is run (``overlap-spec check`` is the whole job).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from overlap_spec.harness.check import get_faults_and_check_jobs, run_hypothesis_cells
from overlap_spec.harness.conformance.cli import UsageError, run_upstream_check
from overlap_spec.harness.conformance.report import render_report, upstream_tier_report
from overlap_spec.harness.drive.cells import (
    describe_variants,
    format_sizes,
    get_fault_sizes,
    select_configs,
)
from overlap_spec.harness.drive.mechanisms import render_mechanisms
from overlap_spec.harness.drive.stateful import get_profile
from overlap_spec.harness.drive.witness import describe_witnesses
from overlap_spec.harness.pool import catching_interrupts, raise_if_interrupted
from overlap_spec.harness.report import (
    get_mechanism_counts,
    get_verdicts,
    hypothesis_tier_report,
    render_failures,
    render_na_reasons,
    write_json,
)
from overlap_spec.harness.verdict import CheckReport, Verdict
from overlap_spec.spec.config import ModelConfig


def cmd_review(args: argparse.Namespace) -> int:
    """``overlap-spec review`` (its arguments: ``harness.cli``)."""
    profile = get_profile(args.profile)
    faults = get_faults_and_check_jobs(args)
    if args.sglang_src is not None and faults:
        raise UsageError("--faults switches bugs on in the reference; it does not apply to "
                         "--sglang-src")
    sizes = get_fault_sizes(args.sizes, faults)
    # The reference's default run adds the size variants; the upstream tier (--sglang-src)
    # chunks the serving-default cells itself (harness.conformance.tier).
    configs = select_configs(args.cells, "minimal", sizes,
                             variants=not (sizes or faults or args.sglang_src), with_radix=True)
    report = CheckReport(args.seed, profile.name)
    started = time.perf_counter()
    try:
        with catching_interrupts():
            if args.sglang_src is None:
                _review_reference(args, profile.name, faults, configs, report)
            else:
                _review_sglang(args, profile.name, configs, report)
            raise_if_interrupted()
    except KeyboardInterrupt:
        report.interrupt("upstream" if args.sglang_src else "hypothesis")
    report.elapsed_s = time.perf_counter() - started
    print(report.closing_line())
    if args.json:
        write_json(report.to_json(), Path(args.json))
    return report.exit_code


def _review_reference(args: argparse.Namespace, profile_name: str, faults: frozenset[str],
                      configs: list[ModelConfig], report: CheckReport) -> None:
    profile = get_profile(profile_name)
    count = len({c.cell for c in configs})
    cells = f"{count} cell{'s' * (count != 1)}"
    if len(configs) != count:
        cells += f" ({len(configs)} size sets and cells)"
    print(f"review: the reference against the spec in {cells}, profile {profile.name} "
          f"({profile.max_examples} sequences of up to {profile.step_count} "
          f"ops per cell), seed {args.seed}"
          + (f", faults {','.join(sorted(faults))}" if faults else "")
          + (f", sizes {format_sizes(args.sizes)}"
             if getattr(args, "sizes", None) else ""))
    variants = describe_variants(configs)
    if variants:
        print(variants)
    print(describe_witnesses(configs))
    out = Path(args.out) / "failures" if args.out else None
    # Our minimiser instead of Hypothesis's shrinker: a failing cell costs seconds, not
    # tens of seconds, and the counterexample is as small (tests/test_review.py).
    results = run_hypothesis_cells(configs, profile, args.seed, faults, out, args.jobs,
                                   args.quiet, shrink=False)
    print(render_mechanisms(get_mechanism_counts(results)))
    na = render_na_reasons(results)
    if na:
        print(na)
    failures = render_failures(results)
    if failures:
        print(failures)
    vacuous = {inv: [cell for cell, verdict in per_cell.items() if verdict is Verdict.VACUOUS]
               for inv, per_cell in get_verdicts(results).items()}
    lines = [f"  {inv} in {_count_cells(cells)}" for inv, cells in sorted(vacuous.items())
             if cells]
    if lines:
        # One line per invariant: a small pool can leave many invariants without witness.
        print("no witness (vacuous, a failure):\n" + "\n".join(lines))
    report.add(hypothesis_tier_report(results))


def _count_cells(cells: list[str]) -> str:
    return ", ".join(cells) if len(cells) == 1 else f"{len(cells)} cells: {', '.join(cells)}"


def _review_sglang(args: argparse.Namespace, profile_name: str, configs: list[ModelConfig],
                   report: CheckReport) -> None:
    print(f"review: the SGLang tree {args.sglang_src} against the spec (upstream tier), "
          f"profile {profile_name}, seed {args.seed}")
    up_args = argparse.Namespace(
        cells=",".join(dict.fromkeys(c.cell.name for c in configs)) if args.cells else None,
        with_radix=True,
        sglang_src=args.sglang_src, out=args.out, seed=args.seed, profile=profile_name,
        preset="minimal", sizes=args.sizes, jobs=args.jobs, quiet=args.quiet)
    # No upstream environment, or not a checkout: a usage error (exit 2), not a verdict.
    document = run_upstream_check(up_args, progress=not args.quiet)
    print(render_report(document))
    report.add(upstream_tier_report(document))
