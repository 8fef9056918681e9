"""The GPU evidence run (``./dev cuda``): every check that needs a GPU, in one go, into one
folder, within 8 minutes on one H100 / H200.

In order, each step a child process of its own (a step cannot hang, crash or leave the
sanitizer on for the next; each has a time limit, and what it finished is kept):

1. ``environment``: the device, torch, CUDA and driver versions, Python, the commit,
   the date and the command line; whether this torch offers the sanitizer internals
   ``gpu_impl/race.py`` uses;
2. ``diff``: the differential tier (``overlap-spec diff --device cuda --cuda-sanitizer``)
   over every cell, torch's CUDA sanitizer watching gpu_impl's real streams;
3. ``sanitizer-control``: the same with B8 (no WAR fence) in one cell, which must be
   caught, so that step 2's "no race" is the word of a sanitizer that was watching;
4. ``syncs``: the sync contract on CUDA (``overlap-spec syncs --device cuda``);
5. ``bench``: ``overlap-spec bench gpu --device cuda`` (its .json and .md land here too);
6. ``upstream``: the upstream tier in the overlap cells. It needs sglang 0.5.23, which the
   device machine does not have (no registry there, and the release with its
   dependencies is far over the 64 MiB a call can carry), and ``upstream/session.py``
   builds the release on ``device="cpu"`` only: the step says which of the two stops it,
   as ``skipped: <reason>``, never as a pass.

Everything lands under ``--out`` (default ``bench/results/cuda-<date>/``): ``summary.json``
and ``summary.md`` (each step's status, ok / failed / skipped with the reason, its wall
time, its command and the function it called with the arguments), rewritten after every
step so that a run stopped half way still says what it finished; per step
``<step>.json`` (its result), ``<step>.log`` (its output) and, for ``diff``,
``diff.partial.json`` (the cells finished so far).

It runs on the machine as it is: the device machine's own ``python3`` (3.12, a
preinstalled torch 2.11 CUDA build, Hypothesis; no z3, no sglang, no registry), from the
repository root without installing the project (``overlap_spec/`` links to the packages).
Nothing on its path imports z3. ``--dry-run`` runs the same steps on CPU with small sizes
(two cells; the CPU race detector in place of the sanitizer); ``tests/test_gpu_evidence.py``
runs it, so the script works the first time it meets a GPU.

``python -m overlap_spec.harness.measure.gpu_evidence [--dry-run] [--out DIR]
[--steps a,b] [--budget S] [--jobs N]``; ``--step NAME`` (what the run starts its children
with) runs one step in this process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from overlap_spec.harness.measure.evidence_steps import (
    DRY_RUN,
    MODULE,
    ROOT,
    RUN,
    STATUSES,
    STEPS,
    SUMMARY_VERSION,
    Sizes,
    StepContext,
    get_default_jobs,
    get_default_out,
    run_step,
)

__all__ = ["STATUSES", "STEPS", "main", "run_evidence"]


# --------------------------------------------------------------------------- the run


@dataclass
class StepRecord:
    name: str
    status: str = "pending"  # then ok | failed | skipped
    reason: str | None = None
    seconds: float | None = None
    limit_s: float | None = None
    command: str | None = None  # the child's command line
    call: str | None = None  # the function(s) it called, with the arguments
    exit_code: int | None = None
    log: str | None = None
    result: str | None = None


@dataclass
class EvidenceRun:
    out: Path
    dry_run: bool
    sizes: Sizes
    command: str
    steps: list[StepRecord]
    started: str = ""
    finished: str | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    inject_failure: str | None = None
    wheels: list[str] = field(default_factory=list)  # carried wheels the steps import first
    child_env: dict[str, str] | None = None

    @property
    def status(self) -> str:
        if any(s.status == "failed" for s in self.steps):
            return "failed"
        if any(s.status == "pending" for s in self.steps):
            return "incomplete"
        return "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SUMMARY_VERSION, "status": self.status, "dry_run": self.dry_run,
            "command": self.command, "started": self.started, "finished": self.finished,
            "device": self.sizes.device, "budget_s": self.sizes.budget_s,
            "inject_failure": self.inject_failure, "wheels": self.wheels,
            "environment": self.environment,
            "steps": [vars(s) for s in self.steps],
        }

    def render(self) -> str:
        env = self.environment
        title = "GPU evidence" + (" (dry run, CPU)" if self.dry_run else "")
        lines = [f"# {title}: {self.status}", "",
                 f"- command: `{self.command}`",
                 f"- device: {env.get('device_name', '?')}"
                 + (f" (driver {env['driver']})" if env.get("driver") else ""),
                 f"- torch {env.get('torch', '?')}, CUDA {env.get('torch_cuda')}, Python "
                 f"{env.get('python', '?')}, Hypothesis {env.get('hypothesis', '?')}",
                 f"- commit {env.get('git_commit') or 'unknown (no git here)'}"
                 + (" (uncommitted changes)" if env.get("git_dirty") else "")
                 + f", source digest {str(env.get('source_digest', '?'))[:16]}",
                 f"- started {self.started}, finished {self.finished or '(not finished)'}"]
        if self.wheels:
            lines.append(f"- carried wheels, imported first: {', '.join(self.wheels)}")
        if self.inject_failure:
            lines.append(f"- a failure was injected into step {self.inject_failure}")
        lines += ["", "| step | status | seconds | limit | reason |", "|---|---|---:|---:|---|"]
        for step in self.steps:
            seconds = "" if step.seconds is None else f"{step.seconds:.1f}"
            limit = "" if step.limit_s is None else f"{step.limit_s:.0f}"
            reason = (step.reason or "").replace("|", "/").replace("\n", " ")
            lines.append(f"| {step.name} | {step.status} | {seconds} | {limit} | {reason} |")
        lines += ["", "## Commands", ""]
        for step in self.steps:
            if step.command is not None:
                lines += [f"- {step.name}: `{step.command}`", f"  - calls: {step.call}"]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.to_json(), indent=1) + "\n")
        (self.out / "summary.md").write_text(self.render())


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a timed-out step and the workers it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 5) -> str:
    if not path.is_file():
        return ""
    return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def run_step_child(run: EvidenceRun, record: StepRecord, deadline: float, jobs: int,
                   python: str) -> None:
    """Start one step as a child process, wait up to its limit, read what it wrote."""
    remaining = deadline - time.monotonic()
    limit = min(run.sizes.step_limits_s.get(record.name, 60.0), remaining)
    argv = [python, "-m", MODULE, "--step", record.name, "--out", str(run.out),
            "--jobs", str(jobs)]
    if run.dry_run:
        argv.append("--dry-run")
    if run.inject_failure == record.name:
        argv += ["--inject-failure", record.name]
    record.command = shlex.join(argv)
    record.limit_s = round(limit, 1)
    if remaining < 5:  # too little of the run's budget left to start a step
        record.status = "failed"
        record.reason = f"not started: the run's {run.sizes.budget_s:.0f} s budget was spent"
        return
    log = run.out / f"{record.name}.log"
    result = run.out / f"{record.name}.json"
    result.unlink(missing_ok=True)
    record.log = log.name
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env=run.child_env)
        try:
            record.exit_code = process.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(process)
            timed_out = True
        except BaseException:  # Ctrl-C or SIGTERM: the step and its workers end with us
            _stop(process)
            record.status = "failed"
            record.reason = "interrupted (the run was stopped)"
            record.seconds = round(time.monotonic() - started, 1)
            raise
    record.seconds = round(time.monotonic() - started, 1)
    document = json.loads(result.read_text()) if result.is_file() else None
    if document is not None:
        record.result = result.name
        record.call = document.get("call")
    if timed_out:
        record.status = "failed"
        partial = run.out / f"{record.name}.partial.json"
        finished = ""
        if partial.is_file():
            finished = f"; finished {json.loads(partial.read_text()).get('finished')}, " \
                        f"kept in {partial.name}"
        record.reason = f"timed out after {limit:g} s{finished}"
    elif document is None:
        record.status = "failed"
        record.reason = (f"exited {record.exit_code} without a result; the log ends: "
                         f"{_tail(log)}")
    elif document.get("status") not in STATUSES:
        record.status = "failed"
        record.reason = f"unknown status {document.get('status')!r}"
    else:
        record.status = document["status"]
        record.reason = document.get("reason")
        if record.status != "failed" and record.exit_code != 0:
            record.status = "failed"
            record.reason = f"exit code {record.exit_code} with status {document['status']}"
    if record.name == "environment" and document is not None:
        run.environment = document.get("details", {})


def unpack_wheels(wheels: Path) -> tuple[Path, list[str]]:
    """Every ``*.whl`` in ``wheels`` unpacked into one new folder (a wheel is a zip laid out
    as site-packages), for the steps' ``PYTHONPATH``: how a package the device machine lacks,
    or has at another version (Hypothesis: the pin), travels there without a registry. The
    wheels must fit that machine's Python (e.g. ``pip download hypothesis==6.170.15
    --no-deps --only-binary=:all: --python-version 3.12 --platform
    manylinux_2_17_x86_64``)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise ValueError(f"--wheels {wheels}: no .whl file there")
    site = Path(tempfile.mkdtemp(prefix="overlap-spec-wheels-"))
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    return site, [w.name for w in found]


def run_evidence(out: Path, dry_run: bool, steps: tuple[str, ...] = STEPS,
                 jobs: int | None = None, budget_s: float | None = None,
                 limits: dict[str, float] | None = None, inject_failure: str | None = None,
                 python: str = sys.executable, command: str | None = None,
                 echo: Callable[[str], None] | None = None,
                 wheels: Path | None = None) -> EvidenceRun:
    """Every step in order, each in a child process; ``summary.{json,md}`` after each."""
    sizes = DRY_RUN if dry_run else RUN
    if budget_s is not None or limits:
        sizes = replace(sizes, budget_s=budget_s or sizes.budget_s,
                        step_limits_s={**sizes.step_limits_s, **(limits or {})})
    out.mkdir(parents=True, exist_ok=True)
    run = EvidenceRun(out.resolve(), dry_run, sizes,
                      command or shlex.join([python, "-m", MODULE, *sys.argv[1:]]),
                      [StepRecord(name) for name in steps],
                      inject_failure=inject_failure)
    site: Path | None = None
    if wheels is not None:
        site, run.wheels = unpack_wheels(wheels)
        path = os.environ.get("PYTHONPATH")
        run.child_env = {**os.environ,
                         "PYTHONPATH": str(site) + (os.pathsep + path if path else "")}
    run.started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    run.write()
    deadline = time.monotonic() + sizes.budget_s
    chosen_jobs = jobs if jobs is not None else get_default_jobs(sizes)
    try:
        for record in run.steps:
            run_step_child(run, record, deadline, chosen_jobs, python)
            run.write()
            if echo is not None:
                echo(f"[gpu-evidence] {record.name}: {record.status}"
                     + (f": {record.reason}" if record.reason else "")
                     + ("" if record.seconds is None else f" ({record.seconds:.1f}s)"))
    finally:
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)
        # Also when interrupted: the summary says what finished (the rest stays pending).
        run.finished = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        run.write()
    return run


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _step_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
    return tuple(n for n in STEPS if n in names)  # always in the run's order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m " + MODULE,
        description="The GPU evidence run: differential under CUDA's sanitizer over every "
                    "cell, its positive control, the sync contract and bench gpu on CUDA, "
                    "the upstream tier where it can run; results in one folder.")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results/cuda-<date>; with "
                             "--dry-run .overlap-spec/cuda-dry-run-<date>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on CPU with small sizes (two cells)")
    parser.add_argument("--steps", type=_step_list, default=STEPS,
                        help=f"comma-separated subset of {','.join(STEPS)} (default all)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="the whole run's limit (default 470; dry run 300)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="differential cells at a time (default: up to 8 on CUDA, 2 in "
                             "the dry run)")
    parser.add_argument("--inject-failure", choices=STEPS, default=None, metavar="STEP",
                        help="make STEP raise at once, to see a failing step reported as "
                             "failed (recorded in the summary)")
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="unpack the wheels in DIR and let every step import them first "
                             "(packages carried to a machine with no registry)")
    parser.add_argument("--step", choices=STEPS, default=None,
                        help="run this one step in this process (the run's children)")
    args = parser.parse_args(argv)
    dry_run: bool = args.dry_run
    out: Path = args.out or get_default_out(dry_run)
    sizes = DRY_RUN if dry_run else RUN
    if args.step is not None:
        out.mkdir(parents=True, exist_ok=True)
        jobs = args.jobs if args.jobs is not None else get_default_jobs(sizes)
        ctx = StepContext(args.step, out, sizes, dry_run, jobs)
        return run_step(ctx, inject_failure=args.inject_failure == args.step)

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # A runner's timeout (SIGTERM) ends the step in progress and still writes the summary.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        run = run_evidence(out, dry_run, args.steps, args.jobs, args.budget,
                           inject_failure=args.inject_failure, echo=echo, wheels=args.wheels)
    except (ValueError, zipfile.BadZipFile) as error:
        print(f"gpu-evidence: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gpu-evidence: interrupted; what finished is in {out / 'summary.md'}",
              file=sys.stderr)
        return 130
    print((run.out / "summary.md").read_text())
    print(f"written: {run.out}")
    return 0 if run.status == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
