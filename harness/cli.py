"""``overlap-spec``: the command line (its parser and the small commands).

Exit codes: 0 every check passed; 1 a check failed or was inconclusive (a crash
counts as inconclusive, never as a pass); 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from overlap_spec import __version__
from overlap_spec.harness.conformance.cli import (
    UPSTREAM_EPILOG,
    add_upstream_arguments,
    cmd_upstream,
)
from overlap_spec.harness.drive.cells import (
    DEFAULT_SEED,
    PROFILE_NAMES,
    SIZE_LIMITS,
    ArgumentParser,
    UsageError,
    any_cell_patterns,
    cell_patterns,
    check_cell_patterns,
    device_name,
    input_dir,
    input_file,
    int_in,
    int_list_in,
    name_list,
    output_dir,
    output_file,
    parse_sizes,
    positive_int,
    report_usage_error,
    select_configs,
)
from overlap_spec.harness.exhaust import MAX_DEPTH as EXHAUST_MAX_DEPTH
from overlap_spec.harness.exhaust import MAX_REQUESTS as EXHAUST_MAX_REQUESTS
from overlap_spec.harness.exhaust import MAX_REQUESTS_BY_SCOPE as EXHAUST_REQUESTS_BY_SCOPE
from overlap_spec.harness.exhaust import NON_SPEC_DEPTH, SPEC_DEPTH
from overlap_spec.harness.exhaust import PD_DECODE as EXHAUST_PD
from overlap_spec.harness.exhaust import SCOPES as EXHAUST_SCOPES
from overlap_spec.harness.exhaust import SHARED as EXHAUST_SHARED
from overlap_spec.harness.exhaust import SHARED_DEPTH as EXHAUST_SHARED_DEPTH
from overlap_spec.harness.measure import (
    BENCH_BATCH_SIZES,
    MAX_BATCH_SIZE,
    MAX_ITERATIONS,
    MAX_THREADS,
)
from overlap_spec.harness.mutants.select import CHECKERS
from overlap_spec.harness.pool import get_default_jobs
from overlap_spec.harness.prove.cli import add_prove_arguments, cmd_prove
from overlap_spec.harness.trace.cli import add_trace_arguments, cmd_trace
from overlap_spec.spec.bugs import BUG_IDS
from overlap_spec.spec.config import PRESETS

if TYPE_CHECKING:
    import torch

# review's budget: a reviewer's minute (harness.drive.stateful.PROFILES["quick"]).
REVIEW_PROFILE = "quick"
SIZES_HELP = ("sizes in place of the preset's, e.g. kv_tokens=16,chain_steps=2; settable: "
              + ", ".join(f"{name} {low}..{high}" for name, (low, high, _) in SIZE_LIMITS.items())
              + " (kv_tokens in whole pages)")

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
  mutants      switch each historical bug B1-B25 on alone and print the kill matrix
  exhaust      every operation sequence up to a small depth (1-2 requests; 3 in the
               pd-decode alphabet) in each cell, every invariant checked, states and
               witnesses counted; --radix: the radix cells, over prompts that share
  diff         gpu_impl against the reference only (--device cuda, --cuda-sanitizer)
  syncs        host syncs, D2H copies and launches per steady-state iteration
  bench gpu    schedule-side host time and syncs per iteration, era A vs today
  prove        Z3: induction per transition x invariant, happens-before, BMC
  trace        record / check / render ndjson event traces (docs/trace-format.md)
  vectors      generate / check language-neutral conformance vectors
  replay FILE  re-run a saved counterexample script and report the first finding
  cells        list the configuration cells
  invariants   list the invariants: ID, claim, the cells it applies to, source
  witnesses    check the witness corpus (each cell's deterministic witnesses, replayed
               before every search) still exercises what it claims; --write regenerates it

Invariant IDs follow the digest ('overlap-spec invariants' lists each with its claim).
A check passes only if no invariant fails, every applicable invariant had a
witness in every cell (else "vacuous"; one with no witness at the sizes run is
"n/a" with its reason, never a pass), gpu_impl agrees with the reference with
no race, every proof is proved (a solver timeout or "unknown" fails), and every
mutant is killed by every checker that claims it.
Exit codes: 0 all checks passed; 1 a check failed, crashed, was vacuous or
inconclusive; 2 a usage error, found before any work (one line on stderr, an
unwritable --json or --out included); 3 the upstream tier cannot drive the sglang
it was given (it does not import, or a name the tier relies on is missing or has
another signature: 'overlap-spec upstream compat') and nothing else failed;
130 interrupted.
"""

CHECK_EPILOG = """\
exit codes: 0 every tier passed; 1 a violation, crash, vacuous or inconclusive check in
any tier; 2 a usage error, found before any tier runs (one line on stderr; an unwritable
--json PATH or --out DIR included); 3 the upstream tier cannot drive the sglang given
(each cell says 'cannot drive this sglang: <hook>: <what changed>'; 'overlap-spec
upstream compat' lists every name it relies on) and no other tier failed; 130
interrupted (Ctrl-C), the report marked incomplete."""


def cmd_witnesses(args: argparse.Namespace) -> int:
    from overlap_spec.harness.drive.witness import cmd_witnesses as run_witnesses

    return run_witnesses(args)


def cmd_check(args: argparse.Namespace) -> int:
    from overlap_spec.harness.check import cmd_check as run_check

    return run_check(args)


def cmd_review(args: argparse.Namespace) -> int:
    from overlap_spec.harness.review import cmd_review as run_review

    return run_review(args)


def cmd_diff(args: argparse.Namespace) -> int:
    from overlap_spec.harness.differential.tier import cmd_diff as run_diff

    return run_diff(args)


def cmd_exhaust(args: argparse.Namespace) -> int:
    from overlap_spec.harness.exhaust.tier import cmd_exhaust as run_exhaust

    return run_exhaust(args)


def cmd_vectors(args: argparse.Namespace) -> int:
    from overlap_spec.harness.vectors import cmd_vectors as run_vectors

    return run_vectors(args)


def cmd_mutants(args: argparse.Namespace) -> int:
    from overlap_spec.harness.drive.stateful import get_profile
    from overlap_spec.harness.mutants.matrix import (
        build_mutants_json,
        print_mutant_progress,
        render_mutants,
        run_mutants,
    )
    from overlap_spec.harness.mutants.select import KILLED, NOT_APPLICABLE
    from overlap_spec.harness.report import write_json

    profile = get_profile(args.profile)
    # --bugs and --checkers name only known IDs and checkers (checked by the parser).
    bug_ids = {b.strip() for b in args.bugs.split(",") if b.strip()} if args.bugs else None
    checkers = tuple(c.strip() for c in args.checkers.split(",") if c.strip())
    cells = None
    if args.cells:
        cells = tuple(c.cell for c in select_configs(args.cells, "minimal", with_radix=True))
    started = time.perf_counter()
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
    from overlap_spec.harness.catalogue import get_bugs_expecting
    from overlap_spec.harness.drive.script import ScriptError, load_script, run_script

    try:
        script = load_script(Path(args.file))
    except ScriptError as error:
        raise UsageError(str(error)) from None
    if script.implementation.startswith("upstream"):
        # sglang's own scheduler: its own environment (re-executed there when needed).
        return cmd_upstream(argparse.Namespace(action="replay", file=args.file,
                                               sglang_src=None))
    if script.implementation == "gpu_impl":
        from overlap_spec.harness.differential.compare import run_differential

        # A gpu_impl counterexample: the differential run against the clean reference.
        diff = run_differential(script)
        print(f"replayed {diff.ops} ops of gpu_impl against the reference in cell "
              f"{script.get_config().name} faults={list(script.faults)} seed={script.seed}")
        print(diff.describe())
        crashed = None if diff.divergence is None else diff.divergence.gpu_crash
        expected = get_bugs_expecting(script.faults, crashed)
        if expected:
            print(f"gpu_impl's crash is the one the catalogue expects of {', '.join(expected)}: "
                  "a kill")
        return 0 if diff.ok else 1
    outcome = run_script(script, catch_crash=True)
    print(f"replayed {len(script.ops)} ops in cell {script.get_config().name}"
          f" faults={list(script.faults)} seed={script.seed}")
    if outcome.crash is not None:
        expected = get_bugs_expecting(script.faults, outcome.crashed)
        print(f"op {outcome.failed_at}: the model crashed: {outcome.crash} " +
              (f"(the crash the catalogue expects of {', '.join(expected)}: a kill)"
               if expected else "(inconclusive)"))
        return 1
    if outcome.violation is None:
        print("no violation")
        return 0
    print(f"step {outcome.failed_at}: {outcome.violation}")
    return 1


def _resolve_device(name: str) -> torch.device:
    from overlap_spec.harness.differential.tier import parse_device

    return parse_device(name)


def cmd_syncs(args: argparse.Namespace) -> int:
    from overlap_spec.harness.measure.sync_contract import get_sync_table, render_sync_table
    from overlap_spec.spec.config import enumerate_cells
    from overlap_spec.spec.transitions import compute_host_sync_budget

    rows = get_sync_table(_resolve_device(args.device), args.batch_size)
    print(render_sync_table(rows))
    cells = {c.name: c for c in enumerate_cells()}
    bad = [r for r in rows if len(r.host_syncs) != compute_host_sync_budget(cells[r.cell])
           or (cells[r.cell].overlap and r.schedule_stream_syncs)]
    for row in bad:
        print(f"sync contract broken in {row.cell}: {list(row.host_syncs)}")
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from overlap_spec.harness.measure.bench_gpu import render_bench, run_bench_gpu, write_bench

    device = _resolve_device(args.device)
    # Intra-op threads fight over 2 cores for tensors this small (profiled: 1024 requests,
    # 76 ms per iteration with 2 threads under load, 8.8 ms with 1).
    torch.set_num_threads(args.threads)
    rows = run_bench_gpu(device, args.batch_sizes, args.iterations)
    print(render_bench(rows))
    if args.out:
        sizes = ",".join(map(str, args.batch_sizes))
        command = (f"overlap-spec bench gpu --device {args.device} --batch-sizes "
                   f"{sizes} --iterations {args.iterations} --threads "
                   f"{args.threads} --out {args.out}")
        path = write_bench(rows, Path(args.out), command)
        print(f"written: {path}")
    return 0


def cmd_cells(args: argparse.Namespace) -> int:
    from overlap_spec.spec.config import enumerate_cells

    if getattr(args, "radix", False):
        from dataclasses import replace

        from overlap_spec.harness.drive.cells import is_serving_default
        from overlap_spec.spec.config import enumerate_radix_cells

        # The release serves with the radix cache on: a serving default's radix twin is
        # what it serves (the upstream tier chunks there as in the twin).
        width = max(len(cell.name) for cell in enumerate_radix_cells())
        for cell in enumerate_radix_cells():
            mark = "serving default" if is_serving_default(replace(cell, radix=False)) else ""
            print(f"{cell.name:<{width}}  {mark}".rstrip())
        return 0

    if args.switches:
        from overlap_spec.harness.drive.cells import is_serving_default
        from overlap_spec.spec.config import get_departures

        rows: list[tuple[str, ...]] = [("cell", "overlap", "page", "spec", "host mirror",
                                        "claim", "reserve", "length finish", "finish run",
                                        "host bound", "read-done", "serving", "design")]
        for cell in enumerate_cells():
            departures = get_departures(cell)
            rows.append((cell.name, "yes" if cell.overlap else "no", str(cell.page_size),
                         cell.spec_mode.value,
                         ("yes" if cell.needs_cpu_seq_lens else "no") if cell.is_spec else "-",
                         ("pre-claim" if cell.preclaim else "honest") if cell.is_spec else "-",
                         ("rung" if cell.rung_reserve else "2A(max)") if cell.is_spec else "-",
                         ("overshoot" if cell.overshoot else "skip") if cell.overlap else "-",
                         ("trimmed" if cell.trimmed_finish else "whole") if cell.is_spec else "-",
                         ("seq_len_cpu_ub" if cell.cpu_ub else "none")
                         if cell.is_spec and not cell.needs_cpu_seq_lens else "-",
                         ("pre-publish" if cell.early_fence else "post-draft-extend")
                         if cell.is_spec and cell.overlap else "-",
                         "default" if is_serving_default(cell) else "-",
                         "; ".join(departures) or "release"))
        _print_table(rows)
        print("release: sglang 0.5.23's design; the differences the model keeps from it are "
              "in docs/coverage.md and docs/upstream-tier.md")
        return 0
    if not args.limits:
        from overlap_spec.harness.drive.cells import is_serving_default

        # A second column marks what sglang 0.5.23 serves by default (the overlap scheduler
        # on, no era or proposal switch; chunked prefill on, the upstream tier chunks there),
        # here with the radix cache off: its radix twin (--radix) is what it serves.
        width = max(len(cell.name) for cell in enumerate_cells())
        for cell in enumerate_cells():
            mark = ("serving default, radix cache off (the -radix twin serves)"
                    if is_serving_default(cell) else "")
            print(f"{cell.name:<{width}}  {mark}".rstrip())
        return 0
    from overlap_spec.harness.drive.script import get_op_limits
    from overlap_spec.spec.config import ModelConfig

    def span(bounds: tuple[int, int]) -> str:
        return f"{bounds[0]}..{bounds[1]}"

    rows = [("cell", "prompt_len", "max_new_tokens", "retract", "accept_lens", "rows",
             "spec_steps", "eos_offset")]
    for cell in enumerate_cells():
        limits = get_op_limits(ModelConfig(cell, PRESETS[args.preset]))
        rows.append((cell.name, span(limits.prompt_len), span(limits.max_new_tokens),
                     span(limits.retract), span(limits.accept_len),
                     str(limits.batch_positions), span(limits.spec_steps),
                     span(limits.eos_offset)))
    print(f"op field limits, preset {args.preset} (scripts and traces outside them are "
          "refused)")
    _print_table(rows)
    return 0


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    for row in rows:
        cells_text = (value.ljust(width) for value, width in zip(row, widths, strict=True))
        print("  ".join(cells_text).rstrip())


def cmd_invariants(args: argparse.Namespace) -> int:
    """Every invariant as the registry holds it (spec/invariants/): ID, one-line claim, the
    cells it applies to, the claim in full and its upstream source; ``--json`` writes the
    same with the cells by name."""
    import json
    import textwrap

    from overlap_spec.harness.drive.checker import describe_id_ranges
    from overlap_spec.spec.config import enumerate_cells
    from overlap_spec.spec.invariants import INVARIANT_IDS, INVARIANTS

    ranges = describe_id_ranges(INVARIANT_IDS)
    if args.json:
        cells = enumerate_cells()
        Path(args.json).write_text(json.dumps({"ranges": ranges, "invariants": [
            {"id": inv.id, "claim": inv.claim, "statement": inv.statement, "source": inv.source,
             "applies": inv.cells, "cells": [c.name for c in cells if inv.applies(c)]}
            for inv in INVARIANTS]}, indent=1) + "\n")
    print(f"{len(INVARIANTS)} invariants: {ranges}")
    for inv in INVARIANTS:
        print(f"{inv.id:<5} {inv.claim} (in {inv.cells})")
        print(textwrap.fill(f"{inv.statement} Source: {inv.source}.", 96,
                            initial_indent=" " * 6, subsequent_indent=" " * 6,
                            break_on_hyphens=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Building it imports no torch, Z3 or Hypothesis (each command
    imports what it runs), so ``--help`` is quick; every argument type checks its range or
    path here, before a run starts."""
    parser = ArgumentParser(prog="overlap-spec", description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"overlap-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    jobs = get_default_jobs()
    bug_ids = name_list(BUG_IDS, "bug IDs")
    profiles = ", ".join(PROFILE_NAMES)
    check = sub.add_parser("check", help="run every checker tier on every cell",
                           epilog=CHECK_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--profile", choices=PROFILE_NAMES, default=None,
                       help=f"hypothesis budget: {profiles} (default: $HYPOTHESIS_PROFILE "
                            "or ci)")
    check.add_argument("--seed", type=int, default=DEFAULT_SEED,
                       help=f"hypothesis seed, printed with every failure (default {DEFAULT_SEED})")
    check.add_argument("--cells", type=check_cell_patterns, default=None,
                       help="comma-separated cell names or globs, the radix cells' among them "
                            "(default: every cell and every radix cell)")
    check.add_argument("--preset", choices=[*sorted(PRESETS), "all"], default="minimal",
                       help="sizes to run with (default: minimal)")
    check.add_argument("--faults", type=bug_ids, default=None,
                       help="switch on historical bugs by ID, e.g. B3 (the check should fail)")
    check.add_argument("--sizes", type=parse_sizes, metavar="NAME=N,...", default=None,
                       help=SIZES_HELP + ". The Hypothesis, differential and upstream tiers "
                            "run at them; the proofs are symbolic and the mutant matrix runs "
                            "each bug at the preset's sizes and its own")
    check.add_argument("--json", type=output_file, metavar="PATH",
                       help="write the JSON report here")
    check.add_argument("--out", type=output_dir, metavar="DIR",
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
    check.add_argument("-j", "--jobs", type=positive_int, default=jobs,
                       help="worker processes for every tier: one cell (or mutant and cell) "
                            "each "
                            "(default: the CPUs available, here %(default)s)")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    check.set_defaults(func=cmd_check)
    review = sub.add_parser("review", help="a reviewer's minute: does my change to the "
                            "reference (or an SGLang tree) break an invariant?",
                            epilog=CHECK_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    review.add_argument("--sglang-src", type=input_dir, metavar="DIR", default=None,
                        help="review an SGLang checkout (its python/sglang) with the upstream "
                             "tier instead of the reference (needs ./dev upstream)")
    review.add_argument("--sizes", type=parse_sizes, metavar="NAME=N,...", default=None,
                        help=SIZES_HELP)
    review.add_argument("--cells", type=check_cell_patterns, default=None,
                        help="comma-separated cell names or globs, the radix cells' among "
                             "them (default: every cell and every radix cell)")
    review.add_argument("--profile", choices=PROFILE_NAMES, default=REVIEW_PROFILE,
                        help=f"hypothesis budget (default: {REVIEW_PROFILE})")
    review.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"hypothesis seed (default {DEFAULT_SEED})")
    review.add_argument("--faults", type=bug_ids, default=None,
                        help="switch historical bugs on in the reference, e.g. B3: what a "
                             "broken change looks like")
    review.add_argument("-j", "--jobs", type=positive_int, default=jobs,
                        help="worker processes, one cell each (default: the CPUs available, "
                             "here %(default)s)")
    review.add_argument("--json", type=output_file, metavar="PATH",
                        help="write the JSON report here")
    review.add_argument("--out", type=output_dir, metavar="DIR",
                        help="where failing scripts are saved (default: .overlap-spec)")
    review.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    review.set_defaults(func=cmd_review)
    mutants = sub.add_parser("mutants", help="the B1-B39 kill matrix")
    mutants.add_argument("--bugs", type=bug_ids, help="comma-separated bug IDs (default: all)")
    mutants.add_argument("--all-cells", action="store_true",
                         help="every applicable cell instead of the representative ones")
    mutants.add_argument("--cells", type=check_cell_patterns, default=None,
                         help="restrict to these cells (names or globs; the radix cells "
                              "too, where B26-B35 run)")
    mutants.add_argument("--profile", choices=PROFILE_NAMES, default=None)
    mutants.add_argument("--seed", type=int, default=DEFAULT_SEED)
    mutants.add_argument("--preset", choices=sorted(PRESETS), default="minimal")
    mutants.add_argument("--checkers", type=name_list(CHECKERS, "checkers"),
                         default=",".join(CHECKERS),
                         help=f"comma-separated checkers (default: {','.join(CHECKERS)})")
    mutants.add_argument("--json", type=output_file, metavar="PATH",
                         help="write the kill matrix as JSON")
    mutants.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    mutants.set_defaults(func=cmd_mutants)
    pd_max_requests = EXHAUST_REQUESTS_BY_SCOPE[EXHAUST_PD]
    exhaust = sub.add_parser(
        "exhaust", help="every operation sequence up to a small depth, 1-2 requests per cell "
                        "(1-3 in the pd-decode alphabet)")
    exhaust.add_argument("--sizes", type=parse_sizes, metavar="NAME=N,...", default=None,
                         help=SIZES_HELP)
    exhaust.add_argument("--cells", type=any_cell_patterns, default=None,
                         help="comma-separated cell names or globs (default: every cell, or "
                              "every radix cell with --radix)")
    exhaust.add_argument("--radix", action="store_true",
                         help="search the radix cells instead (overlap-spec cells --radix), "
                              f"over the {EXHAUST_SHARED} alphabet unless --alphabet says "
                              "otherwise; the RX invariants judge the prefix tree")
    exhaust.add_argument("--depth", type=int_in(1, EXHAUST_MAX_DEPTH), default=None,
                         help=f"operations per sequence, 1..{EXHAUST_MAX_DEPTH} (default: "
                              f"{NON_SPEC_DEPTH} in non-speculative cells, {SPEC_DEPTH} in "
                              f"speculative ones, {EXHAUST_SHARED_DEPTH} over the "
                              f"{EXHAUST_SHARED} alphabet)")
    exhaust.add_argument("--requests", type=int_in(1, pd_max_requests),
                         default=EXHAUST_MAX_REQUESTS,
                         help=f"admissions per sequence, 1..{EXHAUST_MAX_REQUESTS} "
                              f"(1..{pd_max_requests} with --alphabet {EXHAUST_PD}; "
                              f"default: {EXHAUST_MAX_REQUESTS}); 1 reaches a depth further "
                              "in the same time")
    exhaust.add_argument("--alphabet", choices=EXHAUST_SCOPES, default=None,
                         help=f"{EXHAUST_SCOPES[0]}: every kind of operation (the default "
                              f"without --radix); "
                              f"{EXHAUST_PD}: PD decode at the stream level, prebuilt "
                              "admissions and EOS positions only, for a deeper search "
                              "(B9 with the release's fence: --depth 6 --requests 3 "
                              f"--sizes max_running_requests=2); {EXHAUST_SHARED} (radix "
                              "cells only, their default): two requests of one prompt "
                              "family sharing a page of key, iterations varying the "
                              "retraction, the two extreme accept lengths and the EOS "
                              "position")
    exhaust.add_argument("--faults", type=bug_ids, default=None,
                         help="switch historical bugs on in the reference, e.g. B16: the "
                              "search stops at the shortest sequence that trips an "
                              "invariant the catalogue lists for them, or raises the "
                              "crash it lists (B25)")
    exhaust.add_argument("--json", type=output_file, metavar="PATH",
                         help="write the JSON report here")
    exhaust.add_argument("--out", type=output_dir, metavar="DIR",
                         help="counterexample scripts go to DIR/exhaust (default: "
                              ".overlap-spec)")
    exhaust.add_argument("-j", "--jobs", type=positive_int, default=jobs,
                         help="worker processes, one cell each (default: the CPUs "
                              "available, here %(default)s)")
    exhaust.add_argument("--witnesses", action="store_true",
                         help="print each applicable invariant's witness count per cell")
    exhaust.add_argument("-q", "--quiet", action="store_true",
                         help="no progress lines (the table is printed at the end)")
    exhaust.set_defaults(func=cmd_exhaust)
    diff = sub.add_parser("diff", help="gpu_impl against the reference, races watched")
    diff.add_argument("--sizes", type=parse_sizes, metavar="NAME=N,...", default=None,
                      help=SIZES_HELP)
    diff.add_argument("--cells", type=cell_patterns, default=None,
                      help="cell names or globs (default: every cell)")
    diff.add_argument("--preset", choices=[*sorted(PRESETS), "all"], default="minimal")
    diff.add_argument("--profile", choices=PROFILE_NAMES, default=None)
    diff.add_argument("--seed", type=int, default=DEFAULT_SEED)
    diff.add_argument("--device", type=device_name, default="auto",
                      help="cpu, cuda or auto (default: cuda when available)")
    diff.add_argument("--out", type=output_dir, metavar="DIR",
                      help="where failing scripts are saved")
    diff.add_argument("--faults", type=bug_ids, default=None,
                      help="switch bugs on in gpu_impl (the clean reference is the oracle)")
    diff.add_argument("--cuda-sanitizer", action="store_true",
                      help="on CUDA, run under torch's CUDA sanitizer (CSAN)")
    diff.add_argument("-q", "--quiet", action="store_true")
    diff.set_defaults(func=cmd_diff)
    batch_size = int_in(1, MAX_BATCH_SIZE)
    syncs = sub.add_parser("syncs", help="host syncs, D2H copies, launches per iteration")
    syncs.add_argument("--device", type=device_name, default="auto",
                       help="cpu, cuda or auto (default: cuda when available)")
    syncs.add_argument("--batch-size", type=batch_size, default=4,
                       help=f"requests in the steady-state batch (default 4, at most "
                            f"{MAX_BATCH_SIZE})")
    syncs.set_defaults(func=cmd_syncs)
    bench = sub.add_parser("bench", help="benchmarks: 'bench gpu'")
    bench.add_argument("target", choices=["gpu"])
    bench.add_argument("--device", type=device_name, default="auto",
                       help="cpu, cuda or auto (default: cuda when available)")
    bench.add_argument("--batch-sizes", type=int_list_in(1, MAX_BATCH_SIZE),
                       default=BENCH_BATCH_SIZES, metavar="N,N,...",
                       help=f"comma-separated batch sizes, each 1..{MAX_BATCH_SIZE} (default "
                            f"{','.join(map(str, BENCH_BATCH_SIZES))})")
    bench.add_argument("--iterations", type=int_in(1, MAX_ITERATIONS), default=20,
                       help=f"timed iterations per batch size (default 20, at most "
                            f"{MAX_ITERATIONS})")
    bench.add_argument("--threads", type=int_in(1, MAX_THREADS), default=1,
                       help=f"torch intra-op threads on the host (default 1, at most "
                            f"{MAX_THREADS})")
    bench.add_argument("--out", type=output_dir, metavar="DIR",
                       help="write .json and .md results here (e.g. bench/results)")
    bench.set_defaults(func=cmd_bench)
    prove = sub.add_parser("prove", help="Z3: induction, happens-before, bounded model checking")
    add_prove_arguments(prove)
    prove.set_defaults(func=cmd_prove)
    trace = sub.add_parser("trace", help="record, check and render ndjson event traces")
    add_trace_arguments(trace)
    trace.set_defaults(func=cmd_trace)
    vectors = sub.add_parser("vectors", help="generate and check conformance vectors")
    vectors_sub = vectors.add_subparsers(dest="vectors_command", required=True)
    generate = vectors_sub.add_parser("generate", help="write conformance vectors for every cell")
    generate.add_argument("dir", type=output_dir)
    generate.add_argument("--seed", type=int, default=DEFAULT_SEED)
    generate.add_argument("--scripts-per-cell", type=int_in(1, 1000), default=4,
                          help="clean random scripts per cell (default 4, at most 1000)")
    generate.add_argument("--ops-per-script", type=int_in(1, 1000), default=6,
                          help="operations per script (default 6, at most 1000)")
    generate.add_argument("--fault-tries", type=int_in(1, 1000), default=60,
                          help="random faulted scripts tried per bug and cell before the pair "
                               "is reported as having no invalid vector (default 60)")
    vectors_sub.add_parser("check", help="replay every vector under DIR").add_argument(
        "dir", type=input_dir)
    vectors.set_defaults(func=cmd_vectors)
    upstream = sub.add_parser(
        "upstream", help="sglang's own scheduler (release or --sglang-src tree) against the spec",
        epilog=UPSTREAM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_upstream_arguments(upstream)
    upstream.set_defaults(func=cmd_upstream)
    replay = sub.add_parser("replay", help="re-run a saved counterexample script")
    replay.add_argument("file", type=input_file)
    replay.set_defaults(func=cmd_replay)
    cells = sub.add_parser(
        "cells", help="list the configuration cells",
        description="The configuration cells, one a line; a second column marks the "
                    "release's serving defaults (the overlap scheduler on, no era or "
                    "proposal switch): there the upstream tier runs chunked prefill, which "
                    "sglang 0.5.23 has on by default, at the preset's "
                    "serving chunk size (minimal 4, realistic 32). The release serves "
                    "with its radix prefix cache on: without --radix the marked cells are "
                    "those defaults with the cache off, and their radix twins (--radix) "
                    "the defaults themselves.")
    cells.add_argument("--limits", action="store_true",
                       help="the range of every script and trace op field, per cell")
    cells.add_argument("--preset", choices=sorted(PRESETS), default="minimal",
                       help="the sizes the limits are for (default minimal)")
    cells.add_argument("--radix", action="store_true",
                       help="the radix cells instead: each release cell with the radix prefix "
                            "cache on, in the default run of check and review, "
                            "'overlap-spec upstream check --radix', 'overlap-spec exhaust "
                            "--radix' and 'overlap-spec prove --radix' ('overlap-spec diff' "
                            "does not take them yet)")
    cells.add_argument("--switches", action="store_true",
                       help="each cell's design switches, and which of them are an earlier "
                            "era or a proposal rather than sglang 0.5.23")
    cells.set_defaults(func=cmd_cells)
    invariants = sub.add_parser(
        "invariants", help="list the invariants: ID, claim, cells, source",
        description="Every invariant as spec/invariants/ registers it: its ID, one-line claim, "
                    "the cells it applies to (elsewhere n/a), the claim in full and its "
                    "upstream source.")
    invariants.add_argument("--json", type=output_file, metavar="PATH",
                            help="also write them as JSON, with the cells each applies to")
    invariants.set_defaults(func=cmd_invariants)
    witnesses = sub.add_parser(
        "witnesses", help="check (or --write) the committed witness corpus",
        description="Each cell's deterministic witnesses, replayed before every random "
                    "search at the sizes the commands offer (harness/drive/witnesses/). "
                    "Without flags: every witness is replayed on the clean reference and "
                    "must still exercise every invariant it claims, and every applicable "
                    "invariant must be claimed or n/a with a reason (exit 1 otherwise). "
                    "--write regenerates the corpus from a seeded search, minimised, "
                    "keeping a committed witness of what the search no longer reaches "
                    "where it still exercises it (after a change of behaviour; about "
                    "ten minutes on 2 cores).")
    witnesses.add_argument("--write", action="store_true",
                           help="regenerate the corpus in place; refused (exit 1, nothing "
                                "written) where an invariant the corpus witnessed would "
                                "become n/a (no committed witness of it still exercising "
                                "it)")
    witnesses.add_argument("--accept-lost", action="store_true",
                           help="with --write: write even so (the loss is intended)")
    witnesses.add_argument("-j", "--jobs", type=positive_int, default=jobs,
                           help=f"worker processes (default {jobs})")
    witnesses.set_defaults(func=cmd_witnesses)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every usage error, whether the parser or a command finds it, is one line on stderr
    (``overlap-spec: error: ...``) and exit 2, never a traceback; so is a file the run
    could not read or write after all."""
    try:
        args = build_parser().parse_args(argv)
        code: int = args.func(args)
    except UsageError as error:
        return report_usage_error(error)
    except BrokenPipeError:
        # The reader went away (`overlap-spec invariants | head`): stop quietly, as a
        # process killed by SIGPIPE would, with no error at exit from flushing stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as error:
        if error.filename is None:  # not a file the user named: a crash, with its traceback
            raise
        print(f"overlap-spec: error: {error.filename}: {error.strerror or error}",
              file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
