"""``overlap-spec prove``: its arguments and its command.

The parser needs no Z3: the defaults it shows are restated here (the proofs tier and
``proofs/`` own them; ``tests/test_cli_errors.py`` checks that the two agree), and the
tier is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Final

from overlap_spec.harness.drive.cells import (
    CELL_WIDTH,
    cell_patterns,
    int_in,
    output_file,
    positive_int,
    select_cells,
)
from overlap_spec.harness.pool import get_default_jobs
from overlap_spec.spec.config import PRESETS

DEFAULT_BATCH_BOUND: Final = 16  # proofs.induction.DEFAULT_BATCH_BOUND
DEFAULT_TIMEOUT_MS: Final = 20_000  # proofs.solver.DEFAULT_TIMEOUT_MS
DEFAULT_DEPTH: Final = 6  # proofs.bmc.DEFAULT_DEPTH
DEFAULT_REQUESTS: Final = 3  # proofs.bmc.DEFAULT_REQUESTS
DEFAULT_BMC_TIMEOUT_MS: Final = 60_000  # proofs.bmc.DEFAULT_TIMEOUT_MS
# Upper ends that only keep a typo from building a formula for days; Z3 takes its
# timeout as an unsigned 32-bit count of milliseconds.
MAX_BATCH_BOUND: Final = 1024
MAX_DEPTH: Final = 100
MAX_REQUESTS: Final = 32
MAX_TIMEOUT_MS: Final = 2**32 - 1


def add_prove_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cells", type=cell_patterns,
                        help="comma-separated cell names or globs (default: all)")
    parser.add_argument("-N", "--batch-bound", type=int_in(0, MAX_BATCH_BOUND),
                        default=DEFAULT_BATCH_BOUND,
                        help=f"largest batch size for the sum claims (default "
                             f"{DEFAULT_BATCH_BOUND}, at most {MAX_BATCH_BOUND})")
    parser.add_argument("-K", "--depth", type=int_in(1, MAX_DEPTH), default=DEFAULT_DEPTH,
                        help=f"BMC depth in event-loop iterations (default {DEFAULT_DEPTH}, "
                             f"at most {MAX_DEPTH})")
    parser.add_argument("-B", "--requests", type=int_in(1, MAX_REQUESTS),
                        default=DEFAULT_REQUESTS,
                        help=f"BMC symbolic requests (default {DEFAULT_REQUESTS}, at most "
                             f"{MAX_REQUESTS})")
    parser.add_argument("--bmc-timeout-ms", type=int_in(1, MAX_TIMEOUT_MS),
                        default=DEFAULT_BMC_TIMEOUT_MS,
                        help=f"per BMC query; a timeout is a failure (default "
                             f"{DEFAULT_BMC_TIMEOUT_MS})")
    parser.add_argument("--radix", action="store_true",
                        help="the radix cells instead (the BMC's bounded tree only, at its "
                             "own bound K=3, B=2; see docs/proofs.md)")
    parser.add_argument("--no-bmc", action="store_true",
                        help="skip the bounded model check and its reachable witnesses")
    parser.add_argument("--timeout-ms", type=int_in(1, MAX_TIMEOUT_MS),
                        default=DEFAULT_TIMEOUT_MS,
                        help=f"per solver call; a timeout is a failure (default "
                             f"{DEFAULT_TIMEOUT_MS})")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="minimal")
    parser.add_argument("-j", "--jobs", type=positive_int, default=get_default_jobs(),
                        help="cells proved in parallel worker processes (default: the CPUs "
                             "available, here %(default)s)")
    parser.add_argument("--json", type=output_file, metavar="PATH",
                        help="write the proofs section as JSON to this path")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")


def cmd_prove(args: argparse.Namespace) -> int:
    """Exit codes: 0 every obligation proved, 1 otherwise; a usage error raises (exit 2)."""
    from overlap_spec.harness.prove.tier import (
        ProveJob,
        build_proofs_json,
        render_matrix,
        render_not_encoded,
        run_jobs,
    )
    from overlap_spec.proofs import solver as zs
    from overlap_spec.proofs.induction import Obligation

    cells = select_cells(args.cells, args.radix)  # no match: a UsageError, before anything runs
    started = time.perf_counter()

    def progress(name: str, rows: list[Obligation]) -> None:
        if not args.quiet:
            bad = sum(r.verdict != zs.PROVED for r in rows)
            print(f"{name:<{CELL_WIDTH}} {len(rows) - bad}/{len(rows)} proved", file=sys.stderr)

    job = ProveJob("", args.preset, args.batch_bound, args.timeout_ms,
                   None if args.no_bmc else (args.depth, args.requests), args.bmc_timeout_ms)
    results = run_jobs(cells, job, args.jobs, progress)
    document = build_proofs_json(results, time.perf_counter() - started, args.batch_bound)
    if not args.quiet:
        print(render_matrix(results))
        if document["not_encoded"]:
            print(render_not_encoded(document))
    counts = document["counts"]
    print(f"proofs: {counts[zs.PROVED]} proved, {counts[zs.COUNTEREXAMPLE]} counterexample, "
          f"{counts[zs.UNKNOWN]} unknown in {len(results)} cells, "
          f"{document['elapsed_s']:.1f} s (N={args.batch_bound}, BMC K={args.depth}, "
          f"B={args.requests})")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if document["ok"] else 1
