"""``overlap-spec check``: the main job. Runs every tier on the selected cells (the
Hypothesis state machine, the differential, the proofs, the mutant matrix and, when its
environment exists, the upstream tier), prints one table and writes one JSON report.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from overlap_spec.harness.conformance.cli import (
    UsageError,
    get_upstream_python,
    render_report,
    run_upstream_check,
)
from overlap_spec.harness.differential.compare import (
    DifferentialResult,
)
from overlap_spec.harness.differential.tier import (
    build_differential_json,
    render_differential,
    run_differential_tier,
)
from overlap_spec.harness.drive.cells import select_configs_or_exit
from overlap_spec.harness.drive.stateful import (
    CellResult,
    check_cell,
    get_profile,
)
from overlap_spec.harness.mutants.matrix import (
    MutantResult,
    build_mutants_json,
    print_mutant_progress,
    render_mutants,
    run_mutants,
)
from overlap_spec.harness.mutants.select import CHECKERS, KILLED, NOT_APPLICABLE
from overlap_spec.harness.prove.tier import run_proofs_for_check
from overlap_spec.harness.report import build_json, is_clean, render_table, write_json
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS


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
    configs = select_configs_or_exit(args.cells, args.preset)
    out = Path(args.out) / "failures" if args.out else None
    started = time.perf_counter()
    results: list[CellResult] = []
    for k, config in enumerate(configs, 1):
        if not args.quiet:
            print(f"[{k:2d}/{len(configs)}] hypothesis {profile.name:<8} {config.name} ...",
                  end="", file=sys.stderr, flush=True)
        result = check_cell(config, profile, args.seed, faults, save_dir=out)
        results.append(result)
        if not args.quiet:
            status = "ok" if result.ok else "FAIL " + ",".join(result.failed_ids or ("crash",))
            print(f" {status} ({result.seconds:.2f}s)", file=sys.stderr, flush=True)
    print(render_table(results))
    diff_results: list[DifferentialResult] = []
    if not args.no_differential and not faults:
        print("\ndifferential tier (gpu_impl vs reference, CPU race detector):")
        diff_results = run_differential_tier(configs, profile, args.seed, torch.device("cpu"),
                                             args.quiet, out)
        print(render_differential(diff_results))
    proofs: dict[str, Any] = {"status": "skipped"}
    if not args.no_proofs and not faults:
        print("\nproofs (Z3: induction, happens-before, bounded model checking):")
        proofs = run_proofs_for_check([c.cell.name for c in configs] if args.cells else None,
                                      args.jobs)
        counts = proofs.get("counts", {})
        print("  " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f" ({proofs.get('elapsed_s', 0):.1f}s)")
    upstream: dict[str, Any] = {"status": "skipped"}
    if args.no_upstream or faults:
        upstream["reason"] = "--no-upstream" if args.no_upstream else "--faults"
    elif get_upstream_python() is None:
        upstream["reason"] = "no upstream environment (build it with './dev upstream')"
    else:
        print("\nupstream tier (sglang's own scheduler against the spec):")
        up_args = argparse.Namespace(
            cells=",".join(c.cell.name for c in configs) if args.cells else None,
            sglang_src=None, out=args.out, seed=args.seed, profile=profile.name,
            preset="minimal" if args.preset == "all" else args.preset,
            jobs=args.jobs, quiet=args.quiet)
        try:
            upstream = run_upstream_check(up_args, progress=not args.quiet)
            print(render_report(upstream))
        except UsageError as error:
            upstream = {"status": "error", "ok": False, "reason": str(error)}
            print(f"  upstream tier could not run: {error}")
    if upstream.get("status") == "skipped":
        print(f"\nupstream tier skipped: {upstream['reason']}")
    mutant_results: list[MutantResult] = []
    if not args.no_mutants and not faults:
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
                                     checkers=checkers)
        print(render_mutants(mutant_results))
    elapsed = time.perf_counter() - started
    cells_ok = is_clean(results)
    diff_ok = all(r.ok for r in diff_results)
    proofs_ok = proofs.get("status") == "skipped" or bool(proofs.get("ok"))
    mutants_ok = all(m.verdict in (KILLED, NOT_APPLICABLE) for m in mutant_results)
    upstream_ok = upstream.get("status") == "skipped" or bool(upstream.get("ok"))
    ok = cells_ok and mutants_ok and diff_ok and proofs_ok and upstream_ok
    killed = sum(m.verdict == KILLED for m in mutant_results)
    unrun = sum(m.verdict == NOT_APPLICABLE for m in mutant_results)
    mutant_note = (f", {killed}/{len(mutant_results) - unrun} mutants killed"
                   + (f" ({unrun} n/a in these cells)" if unrun else "")
                   if mutant_results else ", mutants skipped")
    proofs_note = (", proofs skipped" if proofs.get("status") == "skipped"
                   else ", proofs ok" if proofs_ok else ", PROOFS FAILED")
    diff_note = (f", differential {sum(r.ok for r in diff_results)}/{len(diff_results)} cells"
                 if diff_results else ", differential skipped")
    diff_note += (", upstream skipped" if upstream.get("status") == "skipped"
                  else ", upstream ok" if upstream_ok else ", UPSTREAM FAILED")
    print(f"\n{'OK' if ok else 'FAILED'}: {sum(r.ok for r in results)}/{len(results)} cells "
          f"clean{'' if cells_ok else ' (or an invariant was vacuous)'}{diff_note}{proofs_note}"
          f"{mutant_note}, "
          f"seed {args.seed}, profile {profile.name}, {elapsed:.1f}s")
    if args.json:
        document = build_json(results, elapsed, build_mutants_json(mutant_results), mutants_ok)
        document["ok"] = ok
        document["differential"] = build_differential_json(diff_results)
        document["proofs"] = proofs
        document["upstream"] = upstream
        write_json(document, Path(args.json))
    return 0 if ok else 1
