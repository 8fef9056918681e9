"""``overlap-spec``: the command line.

Exit codes: 0 every check passed; 1 a check failed or was inconclusive (a crash
counts as inconclusive, never as a pass); 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path

from harness.mutants import (
    KILLED,
    NOT_APPLICABLE,
    CellKill,
    MutantResult,
    build_mutants_json,
    render_mutants,
    run_mutants,
)
from harness.report import build_json, is_clean, render_table, write_json
from harness.script import ScriptError, load_script, run_script
from harness.stateful import PROFILES, CellResult, check_cell, get_profile
from reference.scheduler import SUPPORTED_FAULTS
from spec.bugs import BUG_IDS, Bug
from spec.config import PRESETS, ModelConfig, enumerate_cells
from spec.invariants import INVARIANTS

DEFAULT_SEED = 20261122

DESCRIPTION = """\
Executable model and checkers for the seq_lens / KV-accounting state of SGLang's
overlap scheduler with speculative decoding v2.

commands:
  check        run every checker tier on every configuration cell (default job):
               the Hypothesis state machine per cell, then the mutant matrix
  mutants      switch each historical bug B1-B16 on alone and print the kill matrix
  replay FILE  re-run a saved counterexample script and report the first violation
  cells        list the configuration cells
  invariants   list the invariant IDs with their claims and sources

Invariant IDs follow the digest: SL1-SL11, KV1-KV10, FM1-FM5, ST1-ST5, RP1-RP3.
A check passes only if no invariant fails, every applicable invariant had a
witness in every cell (else "vacuous"), and every mutant is killed.
Exit codes: 0 all checks passed, 1 a check failed or was inconclusive, 2 usage error.
"""


def _select_configs(cell_patterns: str | None, preset: str) -> list[ModelConfig]:
    presets = list(PRESETS.values()) if preset == "all" else [PRESETS[preset]]
    cells = enumerate_cells()
    if cell_patterns:
        patterns = [p.strip() for p in cell_patterns.split(",") if p.strip()]
        cells = tuple(c for c in cells if any(fnmatch.fnmatch(c.name, p) for p in patterns))
        if not cells:
            raise SystemExit(f"overlap-spec: no cell matches {cell_patterns!r} "
                             "(see 'overlap-spec cells')")
    return [ModelConfig(cell, p) for p in presets for cell in cells]


def cmd_check(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    unknown = faults - SUPPORTED_FAULTS
    if unknown:
        print(f"overlap-spec: unknown fault IDs {sorted(unknown)}; supported: "
              f"{', '.join(sorted(SUPPORTED_FAULTS))}", file=sys.stderr)
        return 2
    configs = _select_configs(args.cells, args.preset)
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
    mutant_results: list[MutantResult] = []
    if not args.no_mutants and not faults:
        where = "the selected cells" if args.cells else "representative cells"
        print(f"\nmutant matrix (each bug alone, {where}):")
        subset = tuple(c.cell for c in configs) if args.cells else None
        # The matrix runs at minimal sizes when several presets were asked for.
        preset = "minimal" if args.preset == "all" else args.preset
        mutant_dir = Path(args.out) / "mutants" if args.out else None
        mutant_results = run_mutants(profile, args.seed, cells=subset, preset=preset,
                                     save_dir=mutant_dir,
                                     progress=None if args.quiet else _mutant_progress)
        print(render_mutants(mutant_results))
    elapsed = time.perf_counter() - started
    cells_ok = is_clean(results)
    mutants_ok = all(m.verdict in (KILLED, NOT_APPLICABLE) for m in mutant_results)
    ok = cells_ok and mutants_ok
    killed = sum(m.verdict == KILLED for m in mutant_results)
    unrun = sum(m.verdict == NOT_APPLICABLE for m in mutant_results)
    mutant_note = (f", {killed}/{len(mutant_results) - unrun} mutants killed"
                   + (f" ({unrun} n/a in these cells)" if unrun else "")
                   if mutant_results else ", mutants skipped")
    print(f"\n{'OK' if ok else 'FAILED'}: {sum(r.ok for r in results)}/{len(results)} cells "
          f"clean{'' if cells_ok else ' (or an invariant was vacuous)'}{mutant_note}, "
          f"seed {args.seed}, profile {profile.name}, {elapsed:.1f}s")
    if args.json:
        document = build_json(results, elapsed, build_mutants_json(mutant_results), mutants_ok)
        write_json(document, Path(args.json))
    return 0 if ok else 1


def _mutant_progress(bug: Bug, kill: CellKill) -> None:
    print(f"  mutant {bug.id:<4} {kill.cell:<40} {kill.verdict} "
          f"{kill.invariant or ''} ({kill.seconds:.2f}s)", file=sys.stderr, flush=True)


def cmd_mutants(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    bug_ids = {b.strip() for b in args.bugs.split(",")} if args.bugs else None
    if bug_ids is not None and bug_ids - set(BUG_IDS):
        print(f"overlap-spec: unknown bug IDs {sorted(bug_ids - set(BUG_IDS))}; known: "
              f"{', '.join(BUG_IDS)}", file=sys.stderr)
        return 2
    cells = None
    if args.cells:
        cells = tuple(c.cell for c in _select_configs(args.cells, "minimal"))
    started = time.perf_counter()
    results = run_mutants(profile, args.seed, bug_ids, cells, preset=args.preset,
                          progress=None if args.quiet else _mutant_progress,
                          all_cells=args.all_cells)
    print(render_mutants(results))
    ok = all(m.verdict in (KILLED, NOT_APPLICABLE) for m in results)
    elapsed = time.perf_counter() - started
    print(f"\n{'OK' if ok else 'FAILED'}: {sum(m.verdict == KILLED for m in results)}/"
          f"{len(results)} mutants killed, seed {args.seed}, profile {profile.name}, "
          f"{elapsed:.1f}s")
    if args.json:
        write_json({"version": 1, "ok": ok, "elapsed_s": round(elapsed, 3),
                    "mutants": build_mutants_json(results)}, Path(args.json))
    return 0 if ok else 1


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        script = load_script(Path(args.file))
    except FileNotFoundError:
        print(f"overlap-spec: no such file {args.file}", file=sys.stderr)
        return 2
    except ScriptError as error:
        print(f"overlap-spec: {error}", file=sys.stderr)
        return 2
    outcome = run_script(script)
    print(f"replayed {len(script.ops)} steps in cell {script.cell}@{script.preset}"
          f" faults={list(script.faults)} seed={script.seed}")
    if outcome.violation is None:
        print("no violation")
        return 0
    print(f"step {outcome.failed_at}: {outcome.violation}")
    return 1


def cmd_cells(args: argparse.Namespace) -> int:
    for cell in enumerate_cells():
        print(cell.name)
    return 0


def cmd_invariants(args: argparse.Namespace) -> int:
    for inv in INVARIANTS:
        doc = " ".join((inv.check.__doc__ or "").split())
        print(f"{inv.id:<5} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap-spec", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every checker tier on every cell")
    check.add_argument("--profile", choices=sorted(PROFILES), default=None,
                       help="hypothesis budget (default: $HYPOTHESIS_PROFILE or ci)")
    check.add_argument("--seed", type=int, default=DEFAULT_SEED,
                       help=f"hypothesis seed, printed with every failure (default {DEFAULT_SEED})")
    check.add_argument("--cells", default=None,
                       help="comma-separated cell names or globs (default: every cell)")
    check.add_argument("--preset", choices=[*sorted(PRESETS), "all"], default="minimal",
                       help="sizes to run with (default: minimal)")
    check.add_argument("--faults", default=None,
                       help="switch on historical bugs by ID, e.g. B3 (the check should fail)")
    check.add_argument("--json", metavar="PATH", help="write the JSON report here")
    check.add_argument("--out", metavar="DIR",
                       help="where failing scripts are saved (default: .overlap-spec)")
    check.add_argument("--no-mutants", action="store_true",
                       help="skip the mutant matrix (it is skipped anyway with --faults)")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    check.set_defaults(func=cmd_check)
    mutants = sub.add_parser("mutants", help="the B1-B16 kill matrix")
    mutants.add_argument("--bugs", help="comma-separated bug IDs (default: all)")
    mutants.add_argument("--all-cells", action="store_true",
                         help="every applicable cell instead of the representative ones")
    mutants.add_argument("--cells", default=None, help="restrict to these cells (names or globs)")
    mutants.add_argument("--profile", choices=sorted(PROFILES), default=None)
    mutants.add_argument("--seed", type=int, default=DEFAULT_SEED)
    mutants.add_argument("--preset", choices=sorted(PRESETS), default="minimal")
    mutants.add_argument("--json", metavar="PATH", help="write the kill matrix as JSON")
    mutants.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    mutants.set_defaults(func=cmd_mutants)
    replay = sub.add_parser("replay", help="re-run a saved counterexample script")
    replay.add_argument("file")
    replay.set_defaults(func=cmd_replay)
    sub.add_parser("cells", help="list the configuration cells").set_defaults(func=cmd_cells)
    sub.add_parser("invariants", help="list invariant IDs").set_defaults(func=cmd_invariants)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
