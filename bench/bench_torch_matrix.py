"""Which torch releases the race detector works on: one throwaway venv per release.

    python3 bench/bench_torch_matrix.py --work /tmp/overlap-spec-torch-matrix \\
        --find-links /work/wheels/t214 --out bench/results

For each version (default: 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0) it asks the registry for
that torch (``pip download --no-deps``: a version the registry lacks is recorded as
absent, not failed), builds a venv under ``--work``, installs that torch with its own
dependencies, then this project with ``--no-deps`` and the exact hypothesis,
sortedcontainers, z3-solver and pytest of ``requirements.lock``, and runs the CPU tests
that exercise ``gpu_impl/race.py`` (:data:`TESTS`) in one process. The project is copied
to ``--work`` first, so every venv runs the same code whatever changes in the checkout
meanwhile. A venv, its downloaded torch wheel and pip's cache are deleted after their
version unless ``--keep``: a CUDA build with its libraries is about 3 GB.

The result, ``<date>-torch-matrix.md`` and ``.json`` under ``--out``, is what
``gpu_impl/race.py``'s ``TESTED_TORCH`` lists and what ``pyproject.toml``'s torch range
covers (``tests/test_race_detector.py`` asserts both). Not part of the default tests: it
installs gigabytes.

This machine's pip configuration may cap torch with a constraint file (the releases on its
disk); the installs here replace that constraint by an empty one (``PIP_CONSTRAINT``), so a
newer release the registry offers is tried rather than reported absent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ("2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
# The CPU tests that import gpu_impl/race.py and drive it: its own file, the check of the
# sanitizer internals it uses, gpu_impl traces written from it, and a whole differential
# run under it. About half a minute per version on 2 cores.
TESTS = (
    "tests/test_race_detector.py",
    "tests/test_gpu_evidence.py::test_the_race_detector_names_a_missing_sanitizer_internal",
    "tests/test_trace_gpu.py",
    "tests/test_gpu_impl.py::test_race_detector_sees_the_whole_run_in_a_clean_cell",
)
# The one test that reads this script's committed result: it cannot pass before there is one.
DESELECTED = ("tests/test_race_detector.py::test_tested_torch_is_the_committed_matrix_result",)
# What requirements.lock pins that a test run needs (the dev tools are not needed here).
LOCKED_FOR_TESTS = ("hypothesis", "sortedcontainers", "z3-solver", "pytest")
COPY_IGNORED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".hypothesis", ".mypy_cache",
    ".ruff_cache", ".overlap-spec", "ci-*.json")


def get_locked_requirements(lock: Path) -> list[str]:
    """The lines of ``lock`` that pin one of :data:`LOCKED_FOR_TESTS`."""
    lines = [line.split("#")[0].strip() for line in lock.read_text().splitlines()]
    return [line for line in lines if line.split("==")[0].lower() in LOCKED_FOR_TESTS]


def run_logged(command: list[str], log: Path, env: dict[str, str],
               cwd: Path | None = None) -> tuple[int, float]:
    """Run ``command`` with its output appended to ``log``: (exit status, seconds)."""
    started = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                              check=False)
    return done.returncode, round(time.perf_counter() - started, 1)


def count_junit(path: Path) -> dict[str, Any]:
    """Counts and the failing test ids of a pytest ``--junitxml`` file."""
    if not path.exists():
        return {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                "failing": []}
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    counts = {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors",
                                                        "skipped")}
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    return {"tests": counts["tests"],
            "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "failing": failing}


def run_version(version: str, args: argparse.Namespace, source: Path, wheel: Path,
                env: dict[str, str]) -> dict[str, Any]:
    """Download, install and test one torch version; the entry the result records."""
    work: Path = args.work
    log = work / f"torch-{version}.log"
    log.unlink(missing_ok=True)
    downloads = work / "downloads" / version
    links = [flag for folder in [downloads, *args.find_links]
             for flag in ("--find-links", str(folder))]
    entry: dict[str, Any] = {"requested": version, "log": str(log)}
    status, seconds = run_logged(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"torch=={version}",
         "-d", str(downloads), *links], log, env)
    entry["download_seconds"] = seconds
    if status != 0:
        entry["result"] = "absent"
        entry["detail"] = "pip download found no such torch in the registry"
        return entry
    venv = work / f"venv-{version}"
    shutil.rmtree(venv, ignore_errors=True)
    python = venv / "bin" / "python"
    steps = [
        ("venv", [args.python, "-m", "venv", str(venv)]),
        ("torch", [str(python), "-m", "pip", "install", "-q", f"torch=={version}", *links]),
        ("project", [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)]),
        ("test dependencies", [str(python), "-m", "pip", "install", "-q",
                               *get_locked_requirements(source / "requirements.lock")]),
    ]
    try:
        for name, command in steps:
            status, seconds = run_logged(command, log, env)
            entry[f"{name.replace(' ', '_')}_seconds"] = seconds
            if status != 0:
                entry["result"] = "install failed"
                entry["detail"] = f"{name}: {' '.join(command)} exited {status}"
                return entry
        probe = subprocess.run(
            [str(python), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
            capture_output=True, text=True, check=False, env=env)
        if probe.returncode != 0:
            entry["result"] = "install failed"
            entry["detail"] = "import torch: " + probe.stderr.strip().splitlines()[-1]
            return entry
        torch_version, cuda = probe.stdout.split()
        entry["torch_version"] = torch_version
        entry["build"] = "cpu" if cuda == "None" else f"cuda {cuda}"
        junit = work / f"junit-{version}.xml"
        junit.unlink(missing_ok=True)
        pytest_command = [str(python), "-m", "pytest", "-q", f"--junitxml={junit}", *TESTS,
                          *[flag for test in DESELECTED for flag in ("--deselect", test)]]
        test_env = dict(env, OVERLAP_SPEC_OUT=str(work / "out" / version))
        status, seconds = run_logged(pytest_command, log, test_env, cwd=source)
        entry["test_seconds"] = seconds
        entry["pytest_exit"] = status
        entry.update(count_junit(junit))
        passed = status == 0 and entry["tests"] > 0 and entry["passed"] > 0
        entry["result"] = "pass" if passed else "fail"
        return entry
    finally:
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
            shutil.rmtree(downloads, ignore_errors=True)
            shutil.rmtree(env["PIP_CACHE_DIR"], ignore_errors=True)


def write_markdown(document: dict[str, Any], path: Path) -> None:
    lines = [
        f"# torch matrix: gpu_impl/race.py's tests per torch release ({document['date']})",
        "",
        f"command: `{document['command']}`",
        "",
        f"Machine: {document['machine']}, Python {document['python']}; one throwaway venv "
        "per release (torch and its own dependencies from the registry, the project with "
        "`--no-deps`, hypothesis / sortedcontainers / z3-solver / pytest at "
        "`requirements.lock`'s versions). CUDA builds run on the CPU here: the tests use "
        "the race detector's virtual streams, not a device. The installs replace this "
        "machine's pip constraint file (it caps torch at the releases on its disk) by an "
        "empty one, so 2.15.0, above that cap, installs from the registry.",
        "",
        "Tests (one process): " + ", ".join(f"`{test}`" for test in document["tests_run"])
        + "; deselected: " + ", ".join(f"`{test}`" for test in document["deselected"])
        + " (it reads this result).",
        "",
        "| requested | result | torch | build | passed | failed | errors | skipped | "
        "install s | test s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in document["versions"]:
        install = sum(entry.get(key, 0) for key in ("download_seconds", "venv_seconds",
                                                    "torch_seconds", "project_seconds",
                                                    "test_dependencies_seconds"))
        lines.append(
            f"| {entry['requested']} | {entry['result']} | {entry.get('torch_version', '-')} "
            f"| {entry.get('build', '-')} | {entry.get('passed', '-')} "
            f"| {entry.get('failed', '-')} | {entry.get('errors', '-')} "
            f"| {entry.get('skipped', '-')} | {round(install, 1)} "
            f"| {entry.get('test_seconds', '-')} |")
    notes = [entry for entry in document["versions"] if entry.get("detail")
             or entry.get("failing")]
    if notes:
        lines += ["", "Details:", ""]
        for entry in notes:
            what = entry.get("detail") or ", ".join(entry["failing"][:5])
            lines.append(f"- {entry['requested']}: {what}")
    passing = [entry["requested"] for entry in document["versions"] if entry["result"] == "pass"]
    lines += ["", f"Passed on: {', '.join(passing) or 'none'} (`gpu_impl/race.py`'s "
              "`TESTED_TORCH`).", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS),
                        help="torch versions (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/overlap-spec-torch-matrix"),
                        help="folder for the project's copy, the venvs and logs")
    parser.add_argument("--find-links", type=Path, action="append", default=[],
                        help="a folder of wheels pip may take torch and its dependencies "
                             "from (repeatable)")
    parser.add_argument("--python", default="python3", help="the Python the venvs are made from")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--keep", action="store_true",
                        help="keep the venvs, downloads and pip cache")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PIP_CONSTRAINT=os.devnull, PIP_CACHE_DIR=str(args.work / "pip-cache"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    source = args.work / "src"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(ROOT, source, symlinks=True, ignore=COPY_IGNORED)
    dist = args.work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    status, _ = run_logged([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            str(source), "-w", str(dist)],
                           args.work / "wheel.log", env)
    if status != 0:
        print(f"building the project's wheel failed: {args.work / 'wheel.log'}", file=sys.stderr)
        return 1
    wheel = next(dist.glob("overlap_spec-*.whl"))
    command = "python3 bench/bench_torch_matrix.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    versions = []
    for version in args.versions:
        entry = run_version(version, args, source, wheel, env)
        versions.append(entry)
        print(f"torch {version}: {entry['result']} {entry.get('torch_version', '')} "
              f"{entry.get('passed', '')} passed, {entry.get('failed', '')} failed, "
              f"{entry.get('test_seconds', '')} s", flush=True)
    document = {
        "date": args.date, "command": command.strip(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "tests_run": list(TESTS), "deselected": list(DESELECTED),
        "versions": versions,
        "passed": [entry["requested"] for entry in versions if entry["result"] == "pass"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.date}-torch-matrix"
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    write_markdown(document, stem.with_suffix(".md"))
    print(f"wrote {stem}.json and .md")
    if not args.keep:
        shutil.rmtree(args.work / "downloads", ignore_errors=True)
    return 0 if all(entry["result"] in ("pass", "absent") for entry in versions) else 1


if __name__ == "__main__":
    sys.exit(main())
