"""Wall time, CPU time and load of the commands the README times: ``overlap-spec review``,
``overlap-spec check`` (per tier, from its JSON report) and the default test tier.

    .venv/bin/python bench/bench_speed.py                    # review (about 15 s) + the table
    .venv/bin/python bench/bench_speed.py --only check,test  # the rest: about 10 min each
    .venv/bin/python bench/bench_speed.py --only review,check,test --out bench/results

Every figure comes with the CPU seconds its processes used and the load average before and
after it: a figure taken beside other work shows the load that explains it. ``--out DIR``
writes ``speed-<date>.json`` and rewrites ``DIR/speed-current.md``, the one current table
(the newest measurement of each command among ``DIR/speed-*.json``). Nothing here is an
assertion; the tests assert counts, never times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

COMMANDS: dict[str, list[str]] = {
    "review": [sys.executable, "-m", "overlap_spec", "review", "-q"],
    "check": [sys.executable, "-m", "overlap_spec", "check", "-q"],
    # as `./dev test` runs it: on every CPU (pytest-xdist)
    "test": [sys.executable, "-m", "pytest", "-q", "-n", "auto"],
}


def get_load() -> float:
    """The 1-minute load average (runnable processes, this machine's cores included)."""
    return round(os.getloadavg()[0], 2)


def get_children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(name: str, extra: list[str], scratch: Path) -> dict[str, Any]:
    command = COMMANDS[name] + extra
    report = scratch / f"{name}.json"
    if name in ("review", "check"):
        command += ["--json", str(report), "--out", str(scratch / name)]
    load_before, cpu_before = get_load(), get_children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                          env=dict(os.environ, OVERLAP_SPEC_OUT=str(scratch / "out")))
    entry: dict[str, Any] = {
        "command": " ".join(command[2:] if command[1] == "-m" else command),
        "exit": done.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        # every process of the command, its workers included
        "cpu_seconds": round(get_children_cpu() - cpu_before, 1),
        "load": {"before": load_before, "after": get_load()},
        "last_line": (done.stdout.strip().splitlines() or [""])[-1],
    }
    if report.exists():
        document = json.loads(report.read_text())
        entry["tiers"] = {tier: {"verdict": v["verdict"], "seconds": v.get("seconds")}
                          for tier, v in document["tiers"].items()}
    return entry


def measure_calibration_loop() -> dict[str, float]:
    """A fixed 20-million-iteration pure-Python loop: its wall and CPU seconds and the load
    average at its start. CPU time is this core's speed (it varied 3x on one machine kind);
    wall time above CPU time, with the load, is the share other work took."""
    load = get_load()
    started, cpu_started = time.perf_counter(), time.process_time()
    total = 0
    for i in range(20_000_000):
        total += i * i % 7
    return {"wall_s": round(time.perf_counter() - started, 2),
            "cpu_s": round(time.process_time() - cpu_started, 2), "load": load}


def get_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def load_measurements(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """(date, document) of every ``speed-YYYYMMDD.json`` under ``directory``, oldest first."""
    found = []
    for path in sorted(directory.glob("speed-*.json")):
        date = path.stem.removeprefix("speed-")
        found.append((f"{date[:4]}-{date[4:6]}-{date[6:]}", json.loads(path.read_text())))
    return found


def render_table(measurements: list[tuple[str, dict[str, Any]]]) -> str:
    """The current table: the newest figure of each command, with its CPU time and load."""
    newest: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for date, document in measurements:
        for name, entry in document.get("runs", {}).items():
            newest[name] = (date, document, entry)
    lines = ["| command | wall s | CPU s | load before / after | exit | date | commit | "
             "machine |", "|---|---:|---:|---|---:|---|---|---|"]
    for name in COMMANDS:
        if name not in newest:
            lines.append(f"| {name} | not measured | | | | | | |")
            continue
        date, document, entry = newest[name]
        load = entry.get("load")
        load_text = (f"{load['before']} / {load['after']}" if load
                     else "not recorded")
        cpu = entry.get("cpu_seconds")
        lines.append(f"| {name} | {entry['seconds']} | "
                     f"{'not recorded' if cpu is None else cpu} | {load_text} | "
                     f"{entry['exit']} | {date} | {document.get('commit') or '?'} | "
                     f"{document.get('machine', '?')} |")
    return "\n".join(lines)


def write_current_table(directory: Path) -> Path:
    path = directory / "speed-current.md"
    path.write_text(
        "# Current speed (written by `bench/bench_speed.py --out bench/results`)\n\n"
        "The newest measurement of each command among `bench/results/speed-*.json`. Wall time "
        "is what a user waits; CPU time is the work (on 2 cores a run can use up to twice its "
        "wall time); the load average before and after shows other work on the machine. "
        "Do not edit by hand.\n\n" + render_table(load_measurements(directory)) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="review",
                        help="comma-separated: review, check, test (default: review, the "
                             "short one; check and test take about 10 minutes each)")
    parser.add_argument("--test-args", default="",
                        help="extra pytest arguments, e.g. '--durations=20' (quoted)")
    parser.add_argument("--out", metavar="DIR", help="write speed-<date>.json here and "
                        "rewrite DIR/speed-current.md")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(COMMANDS)
    if unknown:
        parser.error(f"unknown --only entries {sorted(unknown)}; choose from {list(COMMANDS)}")
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                               "python": platform.python_version(), "commit": get_commit(),
                               "calibration_loop": {"before": measure_calibration_loop()},
                               "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            extra = args.test_args.split() if name == "test" else []
            results["runs"][name] = run(name, extra, Path(scratch))
            entry = results["runs"][name]
            print(f"{name}: {entry['seconds']} s wall, {entry['cpu_seconds']} s CPU, load "
                  f"{entry['load']['before']} -> {entry['load']['after']}, exit "
                  f"{entry['exit']}: {entry['last_line']}")
    results["calibration_loop"]["after"] = measure_calibration_loop()
    for moment in ("before", "after"):
        loop = results["calibration_loop"][moment]
        print(f"calibration loop {moment}: {loop['wall_s']} s wall, {loop['cpu_s']} s CPU, "
              f"load {loop['load']}")
    print()
    print(render_table([(time.strftime("%Y-%m-%d"), results)]))
    rest = [name for name in COMMANDS if name not in names]
    if rest:
        print(f"\nthe rest: --only {','.join(rest)} (check and test about 10 minutes each); "
              "--out bench/results writes the JSON and the current table")
    if args.out:
        directory = Path(args.out)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"speed-{time.strftime('%Y%m%d')}.json"
        if path.exists():  # a second run the same day adds to the day's file
            earlier = json.loads(path.read_text())
            results["runs"] = {**earlier.get("runs", {}), **results["runs"]}
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written: {path} and {write_current_table(directory)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
