"""Per-cell time and states of the exhaustive tier at its default depths (or ``--depth``).

    .venv/bin/python bench/bench_exhaust.py --out bench/results            # every cell
    .venv/bin/python bench/bench_exhaust.py --cells 'ov-p1-*' --depth 3    # a few
    .venv/bin/python bench/bench_exhaust.py --radix                        # radix cells

Cells run one after another in this process (``-j 1``), so each cell's wall time is its own;
CPU time is measured too, because another process on the machine inflates wall time but not
CPU time. The load average before and after is recorded with the results. With ``--radix``
the radix cells run, each over its default alphabet (``shared``) unless ``--alphabet`` says
otherwise. Nothing here is an assertion: the tests assert counts, never times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from overlap_spec.harness.exhaust import SCOPES
from overlap_spec.harness.exhaust.tier import (
    ExhaustTask,
    get_default_depth,
    get_default_scope,
    render_cell_line,
    run_exhaust_task,
    select_exhaust_configs,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default=None, help="cell names or globs (default: all)")
    parser.add_argument("--depth", type=int, default=None,
                        help="one depth for every cell (default: each cell's default)")
    parser.add_argument("--radix", action="store_true",
                        help="the radix cells instead (overlap-spec cells --radix)")
    parser.add_argument("--alphabet", choices=SCOPES, default=None,
                        help="one alphabet for every cell (default: each cell's default, "
                             "shared in the radix cells, full elsewhere)")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. load)")
    parser.add_argument("--out", metavar="DIR", help="write exhaust-<date>.json here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        "machine": ", ".join(part for part in (platform.machine(), f"{os.cpu_count()} CPUs",
                                               platform.processor()) if part),
        "python": platform.python_version(),
        "command": "bench/bench_exhaust.py" + (f" --cells {args.cells}" if args.cells else "")
        + (f" --depth {args.depth}" if args.depth else "")
        + (" --radix" if args.radix else "")
        + (f" --alphabet {args.alphabet}" if args.alphabet else ""),
        "note": args.note,
        "load_average_before": os.getloadavg(),
        "cells": {},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for config in select_exhaust_configs(args.cells, args.radix, None):
            scope = args.alphabet or get_default_scope(config.cell)
            depth = args.depth or get_default_depth(config.cell, scope)
            report = run_exhaust_task(ExhaustTask(config, depth, frozenset(), Path(scratch),
                                                  scope=scope))
            print(render_cell_line(report), f"cpu {report.cpu_seconds:.1f}s", flush=True)
            results["cells"][report.cell] = {
                "depth": report.depth, "alphabet": scope, "verdict": report.verdict.value,
                "states": report.states, "transitions": report.transitions,
                "observations": report.observations,
                "levels": report.levels,
                "witnessed": sum(1 for i in report.applicable if report.exercised.get(i)),
                "applicable": len(report.applicable), "vacuous": list(report.vacuous),
                "wall_s": round(report.wall_seconds, 1), "cpu_s": round(report.cpu_seconds, 1),
            }
    results["load_average_after"] = os.getloadavg()
    results["total_wall_s"] = round(time.perf_counter() - started, 1)
    results["total_cpu_s"] = round(sum(c["cpu_s"] for c in results["cells"].values()), 1)
    print(f"total: {results['total_wall_s']} s wall, {results['total_cpu_s']} s CPU")
    if args.out:
        path = Path(args.out) / f"exhaust-{time.strftime('%Y%m%d')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
