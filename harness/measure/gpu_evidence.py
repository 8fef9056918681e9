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
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODULE = "overlap_spec.harness.measure.gpu_evidence"
SUMMARY_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent.parent
STEPS = ("environment", "diff", "sanitizer-control", "syncs", "bench", "upstream")
STATUSES = ("ok", "failed", "skipped")

def get_locked_version(package: str) -> str | None:
    """``package``'s exact version in requirements.lock (what ./dev installs), or None."""
    lock = ROOT / "requirements.lock"
    if not lock.is_file():
        return None
    for line in lock.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package and version:
            return version.strip()
    return None


# requirements.lock's: a seed replays the same search only under the Hypothesis it names
HYPOTHESIS_PIN = get_locked_version("hypothesis")
CONTROL_FAULT = "B8"  # no WAR fence after launch: a cross-stream race the sanitizer must see
CONTROL_CELL = "ov-p1-v2chain-cpu-honest"
DRY_RUN_CELLS = ("ov-p1-v2chain-cpu-honest", "nov-p4-none")  # one overlap cell, one not
# Until the upstream session can build the release on a GPU, this is why the step skips
# on CUDA even where sglang imports.
UPSTREAM_CPU_ONLY = ("upstream/session.py builds sglang's scheduler on device='cpu' only "
                     "(its stand-in model, pools and tree cache); a CUDA session, with the "
                     "sanitizer on the release's own streams, is not written yet")


@dataclass(frozen=True)
class Sizes:
    """What the run and its dry run differ in; every step's code is the same."""

    device: str
    cells: tuple[str, ...] | None  # None: every cell
    diff_profile: str
    control_examples: int
    bench_batch_sizes: tuple[int, ...]
    bench_iterations: int
    upstream_profile: str
    budget_s: float  # the whole run
    step_limits_s: dict[str, float] = field(default_factory=dict)
    jobs: int | None = None  # differential cells at a time; None: get_default_jobs

    def get_cells_pattern(self) -> str | None:
        return ",".join(self.cells) if self.cells is not None else None


# On one H200 (16 cores): CUDA starts in each child (a few seconds); the differential is
# about 1.7 s a cell on CPU under the race detector at the ci profile, and the sanitizer's
# per-kernel Python is of the same order, with 8 cells at a time. The limits add up to
# under the 470 s budget, which leaves half a minute of the 8 minutes for the rest.
RUN = Sizes(
    device="cuda", cells=None, diff_profile="ci", control_examples=25,
    bench_batch_sizes=(1, 16, 64, 256, 1024), bench_iterations=20, upstream_profile="ci",
    budget_s=470.0,
    step_limits_s={"environment": 40, "diff": 240, "sanitizer-control": 45, "syncs": 45,
                   "bench": 70, "upstream": 30},
)
DRY_RUN = Sizes(
    device="cpu", cells=DRY_RUN_CELLS, diff_profile="ci", control_examples=25,
    bench_batch_sizes=(1, 4), bench_iterations=2, upstream_profile="quick", budget_s=300.0,
    step_limits_s={"environment": 60, "diff": 90, "sanitizer-control": 60, "syncs": 60,
                   "bench": 60, "upstream": 120},
    jobs=2,  # worker processes, as the real run's
)


def get_default_jobs(sizes: Sizes) -> int:
    """Cells at a time in the differential: on CUDA the sanitizer's Python is the cost, so
    up to 8 processes share the GPU; the dry run's two cells run on two."""
    if sizes.jobs is not None:
        return sizes.jobs
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(8, cpus))


def get_default_out(dry_run: bool) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    if dry_run:
        return Path(".overlap-spec") / f"cuda-dry-run-{stamp}"
    return Path("bench") / "results" / f"cuda-{stamp}"


# --------------------------------------------------------------------------- one step


@dataclass
class StepContext:
    name: str
    out: Path
    sizes: Sizes
    dry_run: bool
    jobs: int


@dataclass
class StepResult:
    status: str  # ok | failed | skipped
    reason: str | None
    call: str  # the function(s) called, with their arguments
    text: str = ""  # the step's table or verdict, as printed
    details: dict[str, Any] = field(default_factory=dict)


def _import_state() -> dict[str, bool]:
    """Which of the modules the device machine lacks this step imported."""
    return {name: name in sys.modules for name in ("z3", "sglang")}


def _run_command(argv: list[str], timeout: float = 10.0) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              check=False, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _get_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _get_imported_version(module: str) -> str | None:
    """The version of the module this Python imports (a carried wheel before the machine's)."""
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return None


def get_source_digest(root: Path = ROOT) -> str:
    """SHA-256 of the project's Python sources and pyproject.toml: which code ran, where no
    git history came along (the device machine gets a copy of the working tree)."""
    digest = hashlib.sha256()
    files = sorted(p for package in ("spec", "reference", "gpu_impl", "proofs", "upstream",
                                     "harness")
                   for p in (root / package).rglob("*.py"))
    for path in [*files, root / "pyproject.toml"]:
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def step_environment(ctx: StepContext) -> StepResult:
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "hypothesis": _get_imported_version("hypothesis"), "triton": _get_version("triton"),
        "hypothesis_pinned": HYPOTHESIS_PIN,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "z3_importable": importlib.util.find_spec("z3") is not None,
        "sglang_importable": importlib.util.find_spec("sglang") is not None,
        "git_commit": _run_command(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(_run_command(["git", "status", "--porcelain", "--untracked-files=no"])),
        "source_digest": get_source_digest(),
    }
    try:  # gpu_impl/race.py checks the sanitizer's internals as it is imported
        from overlap_spec.gpu_impl.race import TESTED_TORCH, get_missing_sanitizer_api

        info["sanitizer_api_missing"] = get_missing_sanitizer_api()
        info["race_detector_tested_with"] = list(TESTED_TORCH)
    except ImportError as error:
        info["sanitizer_api_missing"] = [str(error)]
    if info["git_commit"] is None:
        info["git_dirty"] = None  # no git here: the source digest says which code ran
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = _run_command([smi, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"])
        info["nvidia_smi"] = query
        if query:
            info["driver"] = query.splitlines()[0].split(",")[1].strip()
    else:
        info["nvidia_smi"] = info["driver"] = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0),
                    device_count=torch.cuda.device_count(),
                    device_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    device_memory_gib=round(properties.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
    else:
        from overlap_spec.harness.measure.bench_gpu import get_device_name

        info["device_name"] = get_device_name(torch.device("cpu"))
    text = "\n".join(f"{key}: {value}" for key, value in info.items())
    call = "step_environment(): torch.cuda.get_device_name(0), nvidia-smi --query-gpu=name,"\
           "driver_version,memory.total --format=csv,noheader, git rev-parse HEAD"
    if ctx.sizes.device == "cuda" and not info["cuda_available"]:
        return StepResult("failed", "torch sees no CUDA device", call, text, info)
    if info["sanitizer_api_missing"]:
        return StepResult("failed", "this torch lacks sanitizer internals gpu_impl/race.py "
                          f"uses: {'; '.join(info['sanitizer_api_missing'])}", call, text, info)
    return StepResult("ok", None, call, text, info)


_sanitizer_on = False


def run_watched_cell(task: Any) -> Any:
    """One differential cell, with torch's CUDA sanitizer on in this process when the
    device is CUDA (a worker process enables it once, before its first cell)."""
    global _sanitizer_on
    from overlap_spec.harness.differential.tier import run_differential_task

    if task.device.startswith("cuda") and not _sanitizer_on:
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()  # type: ignore[no-untyped-call]
        _sanitizer_on = True
    return run_differential_task(task)


def step_diff(ctx: StepContext) -> StepResult:
    import torch

    from overlap_spec.harness.differential.compare import DifferentialResult
    from overlap_spec.harness.differential.tier import (
        DifferentialTask,
        build_differential_json,
        describe_race_check,
        differential_verdict,
        parse_device,
        render_differential,
    )
    from overlap_spec.harness.drive.cells import DEFAULT_SEED, select_configs
    from overlap_spec.harness.drive.stateful import get_profile
    from overlap_spec.harness.pool import run_tasks

    device = parse_device(ctx.sizes.device)
    cuda = device.type == "cuda"
    profile = get_profile(ctx.sizes.diff_profile)
    configs = select_configs(ctx.sizes.get_cells_pattern(), "minimal")
    failures = ctx.out / "diff-failures"
    tasks = [DifferentialTask(c, profile, DEFAULT_SEED, str(device), frozenset(), failures)
             for c in configs]
    done: list[DifferentialResult] = []
    partial = ctx.out / "diff.partial.json"

    def on_done(task: DifferentialTask, result: DifferentialResult) -> None:
        done.append(result)
        section = build_differential_json(done)
        section["finished"] = f"{len(done)}/{len(tasks)} cells"
        partial.write_text(json.dumps(section, indent=1) + "\n")
        print(f"[{len(done):2d}/{len(tasks)}] {task.config.name}: "
              f"{'ok' if result.ok else 'FAIL'} ({result.examples} runs, "
              f"{result.compared_ops} ops, {result.seconds:.1f}s)", flush=True)

    call = (f"run_tasks(run_watched_cell, [DifferentialTask(config, profile={profile.name}, "
            f"seed={DEFAULT_SEED}, device={device}, faults=(), out={failures}) for each of "
            f"{len(configs)} cells{'' if ctx.sizes.cells is None else ' ' + str(ctx.sizes.cells)}"
            f" at preset minimal], jobs={ctx.jobs}); run_watched_cell = "
            f"{'enable_cuda_sanitizer() once per process, then ' if cuda else ''}"
            "run_differential_task(task) (= overlap-spec diff --device "
            f"{device.type}{' --cuda-sanitizer' if cuda else ''} --profile {profile.name} "
            f"--seed {DEFAULT_SEED})")
    results = run_tasks(run_watched_cell, tasks, ctx.jobs, on_done)
    race_check = describe_race_check(device, cuda_sanitizer=cuda)
    text = render_differential(results, race_check)
    verdict = differential_verdict(results)
    details = build_differential_json(results)
    details["race_check"] = race_check
    details["torch"] = torch.__version__
    status = "failed" if verdict.fails_run else "ok"
    return StepResult(status, None if status == "ok" else f"differential verdict {verdict.value}",
                      call, text, details)


def step_sanitizer_control(ctx: StepContext) -> StepResult:
    """B8 in one cell: the sanitizer (or the CPU race detector) must report a race, else the
    clean run's "no race" says nothing."""
    from overlap_spec.harness.differential.compare import (
        check_cell_differential,
        get_finding_kind,
    )
    from overlap_spec.harness.differential.tier import parse_device
    from overlap_spec.harness.drive.cells import DEFAULT_SEED, select_configs
    from overlap_spec.harness.drive.stateful import get_profile

    global _sanitizer_on
    device = parse_device(ctx.sizes.device)
    cuda = device.type == "cuda"
    (config,) = select_configs(CONTROL_CELL, "minimal")
    profile = get_profile(ctx.sizes.diff_profile)
    call = (f"{'enable_cuda_sanitizer(); ' if cuda else ''}check_cell_differential("
            f"{config.name}, profile={profile.name}, seed={DEFAULT_SEED}, "
            f"faults={{{CONTROL_FAULT}}}, max_examples={ctx.sizes.control_examples}, "
            f"device={device}, shrink=False)")
    if cuda:
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()  # type: ignore[no-untyped-call]
        _sanitizer_on = True
    result = check_cell_differential(config, profile, DEFAULT_SEED,
                                     frozenset({CONTROL_FAULT}),
                                     max_examples=ctx.sizes.control_examples, device=device,
                                     shrink=False)
    details: dict[str, Any] = {"cell": config.name, "fault": CONTROL_FAULT,
                               "examples": result.examples, "seconds": round(result.seconds, 2)}
    if result.failure is None:
        error = "" if result.error is None else f" (crash {type(result.error).__name__}: " \
                                                f"{result.error})"
        return StepResult("failed", f"{CONTROL_FAULT} was not caught in {result.examples} "
                          f"runs{error}: the race check is not watching", call,
                          "not caught", details)
    outcome = result.failure.outcome
    kind = get_finding_kind(outcome)
    found = outcome.describe()
    details.update(finding=found, kind=kind)
    # On CUDA the sanitizer raises inside gpu_impl (a crash the reference did not have);
    # on CPU the race detector reports the race.
    caught = "CUDASanitizerErrors" in found if cuda else kind.startswith("race:")
    text = f"{CONTROL_FAULT} in {config.name}: {found}"
    if not caught:
        return StepResult("failed", f"{CONTROL_FAULT} was found, but not as a race: {found}",
                          call, text, details)
    return StepResult("ok", None, call, text, details)


def step_syncs(ctx: StepContext) -> StepResult:
    from overlap_spec.harness.differential.tier import parse_device
    from overlap_spec.harness.measure.sync_contract import get_sync_table, render_sync_table
    from overlap_spec.spec.config import enumerate_cells
    from overlap_spec.spec.transitions import compute_host_sync_budget

    device = parse_device(ctx.sizes.device)
    rows = get_sync_table(device, 4)
    cells = {c.name: c for c in enumerate_cells()}
    # The rule of `overlap-spec syncs`: the spec's budget of host syncs, and none on the
    # schedule stream in an overlap cell.
    broken = [r for r in rows if len(r.host_syncs) != compute_host_sync_budget(cells[r.cell])
              or (cells[r.cell].overlap and r.schedule_stream_syncs)]
    details = {"cells": {r.cell: {"host_syncs": list(r.host_syncs),
                                  "budget": compute_host_sync_budget(cells[r.cell]),
                                  "d2h_copies": list(r.d2h_copies), "launches": r.launches}
                         for r in rows},
               "broken": [r.cell for r in broken]}
    text = render_sync_table(rows)
    call = (f"get_sync_table(device={device}, batch_size=4) over {len(rows)} cells (= "
            f"overlap-spec syncs --device {device.type} --batch-size 4)")
    if broken:
        return StepResult("failed", f"sync contract broken in {', '.join(details['broken'])}",
                          call, text, details)
    return StepResult("ok", None, call, text, details)


def step_bench(ctx: StepContext) -> StepResult:
    from dataclasses import asdict

    import torch

    from overlap_spec.harness.differential.tier import parse_device
    from overlap_spec.harness.measure.bench_gpu import render_bench, run_bench_gpu, write_bench

    device = parse_device(ctx.sizes.device)
    torch.set_num_threads(1)  # as `bench gpu --threads 1`, its default
    sizes = ",".join(map(str, ctx.sizes.bench_batch_sizes))
    command = (f"overlap-spec bench gpu --device {device.type} --batch-sizes {sizes} "
               f"--iterations {ctx.sizes.bench_iterations} --threads 1 --out {ctx.out}")
    call = (f"torch.set_num_threads(1); run_bench_gpu(device={device}, batch_sizes=({sizes}), "
            f"iterations={ctx.sizes.bench_iterations}); write_bench(rows, {ctx.out}, ...) "
            f"(= {command})")
    rows = run_bench_gpu(device, ctx.sizes.bench_batch_sizes, ctx.sizes.bench_iterations)
    path = write_bench(rows, ctx.out, command + " (run by gpu_evidence)")
    details = {"written": path.name, "rows": [asdict(r) for r in rows]}
    return StepResult("ok", None, call, render_bench(rows), details)


def step_upstream(ctx: StepContext) -> StepResult:
    from overlap_spec.spec.config import enumerate_cells

    overlap = [c.name for c in enumerate_cells() if c.overlap
               and (ctx.sizes.cells is None or c.name in ctx.sizes.cells)]
    call = (f"harness.conformance.tier.main(['--cell', CELL, '--profile', "
            f"'{ctx.sizes.upstream_profile}', '--out', '{ctx.out / 'upstream'}']) for CELL in "
            f"{overlap}")
    if importlib.util.find_spec("sglang") is None:
        return StepResult(
            "skipped", f"sglang is not importable in this Python ({sys.executable}); the "
            "upstream tier needs the sglang 0.5.23 environment (./dev upstream), which is "
            "not on this machine and, with its dependencies, far over what a device call "
            "can carry", call)
    if ctx.sizes.device == "cuda":
        return StepResult("skipped", UPSTREAM_CPU_ONLY, call)
    # The dry run in the upstream environment: the tier as it runs today (on CPU).
    from overlap_spec.harness.conformance.tier import main as run_upstream_cell

    out = ctx.out / "upstream"
    cells: dict[str, Any] = {}
    for name in overlap:
        code = run_upstream_cell(["--cell", name, "--profile", ctx.sizes.upstream_profile,
                                  "--out", str(out)])
        path = out / f"{name}.json"
        result = json.loads(path.read_text()) if code == 0 and path.is_file() else None
        cells[name] = {"exit": code, "verdict": None if result is None else result["verdict"]}
    bad = [name for name, cell in cells.items() if cell["verdict"] != "pass"]
    text = "\n".join(f"{name}: {cell['verdict']} (exit {cell['exit']})"
                     for name, cell in cells.items())
    if bad:
        return StepResult("failed", f"upstream tier not passed in {', '.join(bad)}", call, text,
                          {"cells": cells})
    return StepResult("ok", None, call, text, {"cells": cells})


STEP_FUNCTIONS: dict[str, Callable[[StepContext], StepResult]] = {
    "environment": step_environment, "diff": step_diff,
    "sanitizer-control": step_sanitizer_control, "syncs": step_syncs, "bench": step_bench,
    "upstream": step_upstream,
}


class InjectedFailure(RuntimeError):
    """``--inject-failure STEP``: the step raises at once (how a failing step is shown to
    be reported as failed)."""


def run_step(ctx: StepContext, inject_failure: bool = False) -> int:
    """Run one step in this process; write ``<step>.json``. Exit 0 ok or skipped, 1 failed."""
    started = time.perf_counter()
    try:
        if inject_failure:
            raise InjectedFailure(f"failure injected into step {ctx.name} (--inject-failure)")
        result = STEP_FUNCTIONS[ctx.name](ctx)
    except BaseException as error:  # noqa: BLE001 - a crash is a failed step, with its trace
        result = StepResult("failed", f"crash {type(error).__name__}: {error}",
                            f"step_{ctx.name.replace('-', '_')}()",
                            "".join(traceback.format_exception(error)))
    document = {"name": ctx.name, "status": result.status, "reason": result.reason,
                "call": result.call, "seconds": round(time.perf_counter() - started, 2),
                "imported": _import_state(), "details": result.details}
    (ctx.out / f"{ctx.name}.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(result.text, flush=True)
    print(f"{ctx.name}: {result.status}" + (f": {result.reason}" if result.reason else ""),
          flush=True)
    return 1 if result.status == "failed" else 0


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
