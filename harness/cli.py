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
from typing import Any

import torch

from overlap_spec.gpu_impl.scheduler import SUPPORTED_FAULTS as GPU_SUPPORTED_FAULTS
from overlap_spec.harness.bench_gpu import (
    BENCH_BATCH_SIZES,
    render_bench,
    run_bench_gpu,
    write_bench,
)
from overlap_spec.harness.differential import (
    DifferentialResult,
    check_cell_differential,
    get_default_device,
    get_differential_examples,
    run_differential,
)
from overlap_spec.harness.mutants import (
    CHECKERS,
    KILLED,
    NOT_APPLICABLE,
    CellKill,
    MutantResult,
    build_mutants_json,
    render_mutants,
    run_mutants,
)
from overlap_spec.harness.prove import (
    add_prove_arguments,
    cmd_prove,
    get_default_jobs,
    run_proofs_for_check,
)
from overlap_spec.harness.report import build_json, is_clean, render_table, write_json
from overlap_spec.harness.script import ScriptError, load_script, run_script, save_script
from overlap_spec.harness.stateful import (
    PROFILES,
    CellResult,
    Profile,
    check_cell,
    get_failure_dir,
    get_profile,
)
from overlap_spec.harness.sync_contract import (
    get_sync_table,
    render_sync_table,
)
from overlap_spec.harness.trace import add_trace_arguments, cmd_trace
from overlap_spec.harness.upstream_cli import (
    UsageError,
    add_upstream_arguments,
    cmd_upstream,
    get_upstream_python,
    render_report,
    run_upstream_check,
)
from overlap_spec.harness.vectors import add_vectors_arguments, cmd_vectors
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.bugs import BUG_IDS, Bug
from overlap_spec.spec.config import PRESETS, ModelConfig, enumerate_cells
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.transitions import compute_host_sync_budget

DEFAULT_SEED = 20261122

DESCRIPTION = """\
Executable model and checkers for the seq_lens / KV-accounting state of SGLang's
overlap scheduler with speculative decoding v2.

commands:
  check        the main job, on every configuration cell: the Hypothesis state
               machine (reference + every invariant), the differential tier
               (gpu_impl vs reference, CPU race detector), the Z3 proofs, then the
               mutant matrix with its hypothesis, gpu_impl and z3 columns
               and, when the upstream environment exists (./dev upstream), the
               upstream tier: sglang 0.5.23's own scheduler against the spec
  upstream     check sglang's own scheduler (the release, or --sglang-src DIR, a
               PR branch) against the spec: invariants, findings, differential
  mutants      switch each historical bug B1-B16 on alone and print the kill matrix
  diff         gpu_impl against the reference only (--device cuda, --cuda-sanitizer)
  syncs        host syncs, D2H copies and launches per steady-state iteration
  bench gpu    schedule-side host time and syncs per iteration, era A vs today
  prove        Z3: induction per transition x invariant, happens-before, BMC
  trace        record / check / render ndjson event traces (docs/trace-format.md)
  vectors      generate / check language-neutral conformance vectors
  replay FILE  re-run a saved counterexample script and report the first finding
  cells        list the configuration cells
  invariants   list the invariant IDs with their claims and sources

Invariant IDs follow the digest: SL1-SL11, KV1-KV10, FM1-FM5, ST1-ST5, RP1-RP3.
A check passes only if no invariant fails, every applicable invariant had a
witness in every cell (else "vacuous"), gpu_impl agrees with the reference with
no race, every proof is proved (a solver timeout or "unknown" fails), and every
mutant is killed by every checker that claims it.
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
    if args.jobs < 1:
        print("overlap-spec: --jobs must be >= 1", file=sys.stderr)
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
                                     progress=None if args.quiet else _mutant_progress,
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


def _mutant_progress(bug: Bug, kill: CellKill) -> None:
    print(f"  mutant {bug.id:<4} {kill.checker:<10} {kill.cell:<32} {kill.verdict} "
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
    checkers = tuple(c.strip() for c in args.checkers.split(",") if c.strip())
    if set(checkers) - set(CHECKERS):
        print(f"overlap-spec: unknown checkers {sorted(set(checkers) - set(CHECKERS))}; "
              f"known: {', '.join(CHECKERS)}", file=sys.stderr)
        return 2
    results = run_mutants(profile, args.seed, bug_ids, cells, preset=args.preset,
                          progress=None if args.quiet else _mutant_progress,
                          all_cells=args.all_cells, checkers=checkers)
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
    if script.implementation.startswith("upstream"):
        # sglang's own scheduler: its own environment (re-executed there when needed).
        return cmd_upstream(argparse.Namespace(action="replay", file=args.file,
                                               sglang_src=None))
    if script.implementation == "gpu_impl":
        # A gpu_impl counterexample: the differential run against the clean reference.
        diff = run_differential(script)
        print(f"replayed {diff.steps} steps of gpu_impl against the reference in cell "
              f"{script.cell}@{script.preset} faults={list(script.faults)} seed={script.seed}")
        print(diff.describe())
        return 0 if diff.ok else 1
    outcome = run_script(script)
    print(f"replayed {len(script.ops)} steps in cell {script.cell}@{script.preset}"
          f" faults={list(script.faults)} seed={script.seed}")
    if outcome.violation is None:
        print("no violation")
        return 0
    print(f"step {outcome.failed_at}: {outcome.violation}")
    return 1


def _parse_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return get_default_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("overlap-spec: --device cuda asked for, but torch sees no CUDA device")
    return device


def run_differential_tier(configs: list[ModelConfig], profile: Profile, seed: int,
                          device: torch.device, quiet: bool, out: Path | None,
                          faults: frozenset[str] = frozenset()) -> list[DifferentialResult]:
    """gpu_impl against the reference in each cell, races watched (CPU) - the diff tier."""
    results = []
    for k, config in enumerate(configs, 1):
        if not quiet:
            print(f"[{k:2d}/{len(configs)}] differential {device.type:<4} {config.name} ...",
                  end="", file=sys.stderr, flush=True)
        result = check_cell_differential(config, profile, seed, faults,
                                         max_examples=get_differential_examples(profile),
                                         device=device)
        if result.failure is not None:
            directory = out or get_failure_dir()
            name = "-".join([config.name.replace("@", "-"), *sorted(faults), "gpu_impl"])
            path = save_script(result.failure.script, directory / f"{name}.json")
            result.failure.script_path = path
        results.append(result)
        if not quiet:
            status = "ok" if result.ok else "FAIL"
            print(f" {status} ({result.examples} runs, {result.seconds:.2f}s)",
                  file=sys.stderr, flush=True)
    return results


def render_differential(results: list[DifferentialResult]) -> str:
    lines = []
    for result in results:
        if result.failure is not None:
            path = result.failure.script_path
            lines.append(f"  {result.config.name}: {result.failure.outcome.describe()}"
                         f" (seed {result.seed}; replay: overlap-spec replay {path})")
        elif result.error is not None:
            lines.append(f"  {result.config.name}: inconclusive, crash "
                         f"{type(result.error).__name__}: {result.error}")
    clean = sum(r.ok for r in results)
    lines.append(f"differential gpu_impl vs reference: {clean}/{len(results)} cells agree, "
                 "no race")
    return "\n".join(lines)


def build_differential_json(results: list[DifferentialResult]) -> dict[str, Any]:
    if not results:
        return {"status": "skipped"}
    return {
        "status": "pass" if all(r.ok for r in results) else "fail",
        "cells": {
            r.config.name: {
                "verdict": "pass" if r.ok else "fail" if r.failure else "inconclusive",
                "examples": r.examples, "seconds": round(r.seconds, 3), "seed": r.seed,
                **({"finding": r.failure.outcome.describe(),
                    "replay": f"overlap-spec replay {r.failure.script_path}"}
                   if r.failure is not None else {}),
                **({"error": f"{type(r.error).__name__}: {r.error}"}
                   if r.error is not None else {}),
            }
            for r in results
        },
    }


def cmd_diff(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    device = _parse_device(args.device)
    if args.cuda_sanitizer:
        if device.type != "cuda":
            print("overlap-spec: --cuda-sanitizer needs --device cuda", file=sys.stderr)
            return 2
        # torch's own CSAN watches the real streams; a race raises inside gpu_impl and is
        # reported as a divergence (an exception the reference did not raise).
        from torch.cuda._sanitizer import enable_cuda_sanitizer
        enable_cuda_sanitizer()  # type: ignore[no-untyped-call]
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    if faults - GPU_SUPPORTED_FAULTS:
        print(f"overlap-spec: gpu_impl does not know faults {sorted(faults - GPU_SUPPORTED_FAULTS)}"
              f"; supported: {', '.join(sorted(GPU_SUPPORTED_FAULTS))}", file=sys.stderr)
        return 2
    configs = _select_configs(args.cells, args.preset)
    started = time.perf_counter()
    results = run_differential_tier(configs, profile, args.seed, device, args.quiet,
                                    Path(args.out) if args.out else None, faults)
    print(render_differential(results))
    ok = all(r.ok for r in results)
    print(f"{'OK' if ok else 'FAILED'}: seed {args.seed}, profile {profile.name}, "
          f"device {device}, {time.perf_counter() - started:.1f}s")
    return 0 if ok else 1


def cmd_syncs(args: argparse.Namespace) -> int:
    device = _parse_device(args.device)
    rows = get_sync_table(device, args.batch_size)
    print(render_sync_table(rows))
    cells = {c.name: c for c in enumerate_cells()}
    bad = [r for r in rows if len(r.host_syncs) != compute_host_sync_budget(cells[r.cell])
           or (cells[r.cell].overlap and r.schedule_stream_syncs)]
    for row in bad:
        print(f"sync contract broken in {row.cell}: {list(row.host_syncs)}")
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    device = _parse_device(args.device)
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    # Intra-op threads fight over 2 cores for tensors this small (profiled: 1024 requests,
    # 76 ms per iteration with 2 threads under load, 8.8 ms with 1).
    torch.set_num_threads(args.threads)
    rows = run_bench_gpu(device, sizes, args.iterations)
    print(render_bench(rows))
    if args.out:
        command = (f"overlap-spec bench gpu --device {args.device} --batch-sizes "
                   f"{args.batch_sizes} --iterations {args.iterations} --threads "
                   f"{args.threads} --out {args.out}")
        path = write_bench(rows, Path(args.out), command)
        print(f"written: {path}")
    return 0


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
    check.add_argument("--no-differential", action="store_true",
                       help="skip the gpu_impl tier (differential run and mutant column)")
    check.add_argument("--no-proofs", action="store_true",
                       help="skip the Z3 tier (proofs and the z3 mutant column)")
    check.add_argument("--no-upstream", action="store_true",
                       help="skip the upstream tier (it runs only when ./dev upstream built "
                            "its environment)")
    check.add_argument("--no-mutants", action="store_true",
                       help="skip the mutant matrix (it is skipped anyway with --faults)")
    check.add_argument("-j", "--jobs", type=int, default=get_default_jobs(),
                       help="worker processes for the proofs tier, one cell each "
                            "(default: the CPUs available, here %(default)s)")
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
    mutants.add_argument("--checkers", default=",".join(CHECKERS),
                         help=f"comma-separated checkers (default: {','.join(CHECKERS)})")
    mutants.add_argument("--json", metavar="PATH", help="write the kill matrix as JSON")
    mutants.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    mutants.set_defaults(func=cmd_mutants)
    diff = sub.add_parser("diff", help="gpu_impl against the reference, races watched")
    diff.add_argument("--cells", default=None, help="cell names or globs (default: every cell)")
    diff.add_argument("--preset", choices=[*sorted(PRESETS), "all"], default="minimal")
    diff.add_argument("--profile", choices=sorted(PROFILES), default=None)
    diff.add_argument("--seed", type=int, default=DEFAULT_SEED)
    diff.add_argument("--device", default="auto",
                      help="cpu, cuda or auto (default: cuda when available)")
    diff.add_argument("--out", metavar="DIR", help="where failing scripts are saved")
    diff.add_argument("--faults", default=None,
                      help="switch bugs on in gpu_impl (the clean reference is the oracle)")
    diff.add_argument("--cuda-sanitizer", action="store_true",
                      help="on CUDA, run under torch's CUDA sanitizer (CSAN)")
    diff.add_argument("-q", "--quiet", action="store_true")
    diff.set_defaults(func=cmd_diff)
    syncs = sub.add_parser("syncs", help="host syncs, D2H copies, launches per iteration")
    syncs.add_argument("--device", default="auto")
    syncs.add_argument("--batch-size", type=int, default=4)
    syncs.set_defaults(func=cmd_syncs)
    bench = sub.add_parser("bench", help="benchmarks: 'bench gpu'")
    bench.add_argument("target", choices=["gpu"])
    bench.add_argument("--device", default="auto")
    bench.add_argument("--batch-sizes", default=",".join(map(str, BENCH_BATCH_SIZES)))
    bench.add_argument("--iterations", type=int, default=20)
    bench.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads on the host (default 1)")
    bench.add_argument("--out", metavar="DIR", help="write .json and .md results here "
                       "(e.g. bench/results)")
    bench.set_defaults(func=cmd_bench)
    prove = sub.add_parser("prove", help="Z3: induction, happens-before, bounded model checking")
    add_prove_arguments(prove)
    prove.set_defaults(func=cmd_prove)
    trace = sub.add_parser("trace", help="record, check and render ndjson event traces")
    add_trace_arguments(trace)
    trace.set_defaults(func=cmd_trace)
    vectors = sub.add_parser("vectors", help="generate and check conformance vectors")
    add_vectors_arguments(vectors)
    vectors.set_defaults(func=cmd_vectors)
    upstream = sub.add_parser(
        "upstream", help="sglang's own scheduler (release or --sglang-src tree) against the spec")
    add_upstream_arguments(upstream)
    upstream.set_defaults(func=cmd_upstream)
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
