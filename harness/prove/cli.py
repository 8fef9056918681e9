"""``overlap-spec prove``: its arguments and its command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from overlap_spec.harness.drive.cells import NoCellMatches, select_cells
from overlap_spec.harness.prove.tier import (
    DEFAULT_BMC_TIMEOUT_MS,
    DEFAULT_DEPTH,
    DEFAULT_REQUESTS,
    DEFAULT_TIMEOUT_MS,
    ProveJob,
    build_proofs_json,
    get_default_jobs,
    render_matrix,
    run_jobs,
)
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.induction import DEFAULT_BATCH_BOUND, Obligation
from overlap_spec.spec.config import PRESETS


def add_prove_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cells", help="comma-separated cell names or globs (default: all)")
    parser.add_argument("-N", "--batch-bound", type=int, default=DEFAULT_BATCH_BOUND,
                        help="largest batch size for the sum claims (default 16)")
    parser.add_argument("-K", "--depth", type=int, default=DEFAULT_DEPTH,
                        help=f"BMC depth in event-loop iterations (default {DEFAULT_DEPTH})")
    parser.add_argument("-B", "--requests", type=int, default=DEFAULT_REQUESTS,
                        help=f"BMC symbolic requests (default {DEFAULT_REQUESTS})")
    parser.add_argument("--bmc-timeout-ms", type=int, default=DEFAULT_BMC_TIMEOUT_MS,
                        help="per BMC query; a timeout is a failure (default 60000)")
    parser.add_argument("--no-bmc", action="store_true",
                        help="skip the bounded model check and its reachable witnesses")
    parser.add_argument("--timeout-ms", type=int, default=DEFAULT_TIMEOUT_MS,
                        help="per solver call; a timeout is a failure (default 20000)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="minimal")
    parser.add_argument("-j", "--jobs", type=int, default=get_default_jobs(),
                        help="cells proved in parallel worker processes (default: the CPUs "
                             "available, here %(default)s)")
    parser.add_argument("--json", help="write the proofs section as JSON to this path")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")


def cmd_prove(args: argparse.Namespace) -> int:
    try:
        cells = select_cells(args.cells)
    except NoCellMatches as error:
        print(f"overlap-spec: {error}", file=sys.stderr)
        return 2
    if (args.batch_bound < 0 or args.timeout_ms <= 0 or args.depth < 1 or args.requests < 1
            or args.jobs < 1 or args.bmc_timeout_ms <= 0):
        print("overlap-spec: --batch-bound must be >= 0, --timeout-ms and --bmc-timeout-ms "
              "> 0, -K, -B and --jobs >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def progress(name: str, rows: list[Obligation]) -> None:
        if not args.quiet:
            bad = sum(r.verdict != zs.PROVED for r in rows)
            print(f"{name:<32} {len(rows) - bad}/{len(rows)} proved", file=sys.stderr)

    job = ProveJob("", args.preset, args.batch_bound, args.timeout_ms,
                   None if args.no_bmc else (args.depth, args.requests), args.bmc_timeout_ms)
    results = run_jobs(cells, job, args.jobs, progress)
    document = build_proofs_json(results, time.perf_counter() - started, args.batch_bound)
    if not args.quiet:
        print(render_matrix(results))
    counts = document["counts"]
    print(f"proofs: {counts[zs.PROVED]} proved, {counts[zs.COUNTEREXAMPLE]} counterexample, "
          f"{counts[zs.UNKNOWN]} unknown in {len(results)} cells, "
          f"{document['elapsed_s']:.1f} s (N={args.batch_bound}, BMC K={args.depth}, "
          f"B={args.requests})")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if document["ok"] else 1
