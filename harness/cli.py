"""``overlap-spec``: the command line (its parser and the small commands).

Exit codes: 0 every check passed; 1 a check failed or was inconclusive (a crash
counts as inconclusive, never as a pass); 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from overlap_spec import __version__
from overlap_spec.harness.check import cmd_check
from overlap_spec.harness.conformance.cli import (
    add_upstream_arguments,
    cmd_upstream,
)
from overlap_spec.harness.differential.compare import (
    run_differential,
)
from overlap_spec.harness.differential.tier import cmd_diff, parse_device
from overlap_spec.harness.drive.cells import DEFAULT_SEED, select_configs
from overlap_spec.harness.drive.cells import UsageError as CommandUsageError
from overlap_spec.harness.drive.script import ScriptError, load_script, run_script
from overlap_spec.harness.drive.stateful import (
    PROFILES,
    get_profile,
)
from overlap_spec.harness.measure.bench_gpu import (
    BENCH_BATCH_SIZES,
    render_bench,
    run_bench_gpu,
    write_bench,
)
from overlap_spec.harness.measure.sync_contract import (
    get_sync_table,
    render_sync_table,
)
from overlap_spec.harness.mutants.matrix import (
    build_mutants_json,
    print_mutant_progress,
    render_mutants,
    run_mutants,
)
from overlap_spec.harness.mutants.select import CHECKERS, KILLED, NOT_APPLICABLE
from overlap_spec.harness.prove.cli import add_prove_arguments, cmd_prove
from overlap_spec.harness.prove.tier import get_default_jobs
from overlap_spec.harness.report import write_json
from overlap_spec.harness.review import add_review_arguments, cmd_review
from overlap_spec.harness.trace.cli import add_trace_arguments, cmd_trace
from overlap_spec.harness.vectors import add_vectors_arguments, cmd_vectors
from overlap_spec.spec.bugs import BUG_IDS
from overlap_spec.spec.config import PRESETS, enumerate_cells
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.transitions import compute_host_sync_budget

DESCRIPTION = """\
Executable model and checkers for the seq_lens / KV-accounting state of SGLang's
overlap scheduler with speculative decoding v2.

commands:
  review       a reviewer's minute: the reference (or --sglang-src DIR, an SGLang
               tree) against every invariant in every cell, failures grouped
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


def cmd_mutants(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    bug_ids = {b.strip() for b in args.bugs.split(",")} if args.bugs else None
    if bug_ids is not None and bug_ids - set(BUG_IDS):
        print(f"overlap-spec: unknown bug IDs {sorted(bug_ids - set(BUG_IDS))}; known: "
              f"{', '.join(BUG_IDS)}", file=sys.stderr)
        return 2
    cells = None
    if args.cells:
        cells = tuple(c.cell for c in select_configs(args.cells, "minimal"))
    started = time.perf_counter()
    checkers = tuple(c.strip() for c in args.checkers.split(",") if c.strip())
    if set(checkers) - set(CHECKERS):
        print(f"overlap-spec: unknown checkers {sorted(set(checkers) - set(CHECKERS))}; "
              f"known: {', '.join(CHECKERS)}", file=sys.stderr)
        return 2
    results = run_mutants(profile, args.seed, bug_ids, cells, preset=args.preset,
                          progress=None if args.quiet else print_mutant_progress,
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
        print(f"replayed {diff.ops} ops of gpu_impl against the reference in cell "
              f"{script.cell}@{script.preset} faults={list(script.faults)} seed={script.seed}")
        print(diff.describe())
        return 0 if diff.ok else 1
    outcome = run_script(script, catch_crash=True)
    print(f"replayed {len(script.ops)} ops in cell {script.cell}@{script.preset}"
          f" faults={list(script.faults)} seed={script.seed}")
    if outcome.crash is not None:
        print(f"op {outcome.failed_at}: the model crashed: {outcome.crash} (inconclusive)")
        return 1
    if outcome.violation is None:
        print("no violation")
        return 0
    print(f"step {outcome.failed_at}: {outcome.violation}")
    return 1


def cmd_syncs(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
    rows = get_sync_table(device, args.batch_size)
    print(render_sync_table(rows))
    cells = {c.name: c for c in enumerate_cells()}
    bad = [r for r in rows if len(r.host_syncs) != compute_host_sync_budget(cells[r.cell])
           or (cells[r.cell].overlap and r.schedule_stream_syncs)]
    for row in bad:
        print(f"sync contract broken in {row.cell}: {list(row.host_syncs)}")
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
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
    parser.add_argument("--version", action="version",
                        version=f"overlap-spec {__version__}")
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
    review = sub.add_parser("review", help="a reviewer's minute: does my change to the "
                            "reference (or an SGLang tree) break an invariant?")
    add_review_arguments(review)
    review.set_defaults(func=cmd_review)
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
    try:
        code: int = args.func(args)
    except CommandUsageError as error:  # bad input found after parsing: one line, exit 2
        print(f"overlap-spec: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

