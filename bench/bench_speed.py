"""Wall time of the commands the README times: ``overlap-spec review``, ``overlap-spec
check`` (per tier, from its JSON report) and the default test tier.

    .venv/bin/python bench/bench_speed.py --out bench/results

Run it on a quiet machine: the figures are what the README states. Nothing here is an
assertion; the tests assert counts, never times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    "test": [sys.executable, "-m", "pytest", "-q"],
}


def run(name: str, extra: list[str], scratch: Path) -> dict[str, Any]:
    command = COMMANDS[name] + extra
    report = scratch / f"{name}.json"
    if name in ("review", "check"):
        command += ["--json", str(report), "--out", str(scratch / name)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                          env=dict(os.environ, OVERLAP_SPEC_OUT=str(scratch / "out")))
    entry: dict[str, Any] = {
        "command": " ".join(command[2:] if command[1] == "-m" else command),
        "exit": done.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "last_line": (done.stdout.strip().splitlines() or [""])[-1],
    }
    if report.exists():
        document = json.loads(report.read_text())
        entry["tiers"] = {tier: {"verdict": v["verdict"], "seconds": v.get("seconds")}
                          for tier, v in document["tiers"].items()}
    return entry


def measure_calibration_loop() -> float:
    """CPU seconds of a fixed 20-million-iteration pure-Python loop: this machine's speed
    at the moment (it varied 3x on one machine kind), so figures taken at different times
    can be compared. The README's timings quote it."""
    started = time.process_time()
    total = 0
    for i in range(20_000_000):
        total += i * i % 7
    return round(time.process_time() - started, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="review,check,test",
                        help="comma-separated: review, check, test (default: all three)")
    parser.add_argument("--test-args", default="",
                        help="extra pytest arguments, e.g. '-n 2' (quoted)")
    parser.add_argument("--out", metavar="DIR", help="write speed-<date>.json here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(COMMANDS)
    if unknown:
        parser.error(f"unknown --only entries {sorted(unknown)}; choose from {list(COMMANDS)}")
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                               "python": platform.python_version(),
                               "calibration_loop_s": {"before": measure_calibration_loop()},
                               "runs": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            extra = args.test_args.split() if name == "test" else []
            results["runs"][name] = run(name, extra, Path(scratch))
            print(f"{name}: {results['runs'][name]['seconds']} s, exit "
                  f"{results['runs'][name]['exit']}: {results['runs'][name]['last_line']}")
    results["calibration_loop_s"]["after"] = measure_calibration_loop()
    print(f"calibration loop: {results['calibration_loop_s']['before']} s before, "
          f"{results['calibration_loop_s']['after']} s after")
    if args.out:
        path = Path(args.out) / f"speed-{time.strftime('%Y%m%d')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
