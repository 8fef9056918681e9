"""The steps of the GPU evidence run (``harness/measure/gpu_evidence.py``, ``./dev cuda``):
what each step checks, run in a child process of its own by :func:`run_step`; the sizes of a
full run and of ``--dry-run``. The run around them (children, time limits, the summary) is
in ``gpu_evidence``."""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
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


# On one H200 (16 cores), measured 2026-11-29 (bench/results/cuda-20261129/): environment
# 4-6 s, diff 150-177 s (32 cells, 8 at a time, under the sanitizer), the control 49 s
# (its cell twice: clean, then B8), syncs 16 s, bench 17-25 s. The limits add up
# to the 470 s budget, which leaves half a minute of the 8 minutes for the rest.
RUN = Sizes(
    device="cuda", cells=None, diff_profile="ci", control_examples=25,
    bench_batch_sizes=(1, 16, 64, 256, 1024), bench_iterations=20, upstream_profile="ci",
    budget_s=470.0,
    step_limits_s={"environment": 30, "diff": 240, "sanitizer-control": 80, "syncs": 40,
                   "bench": 50, "upstream": 30},
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
    clean run's "no race" says nothing; and the same cell without B8, with the same runs,
    must report none, else the catch may be a race every run has (as a scheduler whose
    schedule stream was not the current stream had) and says nothing about B8."""
    from overlap_spec.harness.differential.compare import check_cell_differential
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
            f"faults=F, max_examples={ctx.sizes.control_examples}, "
            f"device={device}, shrink=False) for F in ({{}}, {{{CONTROL_FAULT}}})")
    if cuda:
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()  # type: ignore[no-untyped-call]
        _sanitizer_on = True
    clean, faulty = (check_cell_differential(config, profile, DEFAULT_SEED, faults,
                                             max_examples=ctx.sizes.control_examples,
                                             device=device, shrink=False)
                     for faults in (frozenset(), frozenset({CONTROL_FAULT})))
    return judge_control(config.name, cuda, clean, faulty, call)


def judge_control(cell: str, cuda: bool, clean: Any, faulty: Any, call: str) -> StepResult:
    """The control's verdict from the clean run and the run with B8 (two
    ``DifferentialResult``): ok only when the clean run found nothing and B8's was a race
    (on CUDA the sanitizer raises inside gpu_impl, a crash the reference did not have; on
    CPU the race detector reports it)."""
    from overlap_spec.harness.differential.compare import get_finding_kind

    details: dict[str, Any] = {"cell": cell, "fault": CONTROL_FAULT,
                               "clean_examples": clean.examples,
                               "examples": faulty.examples,
                               "seconds": round(clean.seconds + faulty.seconds, 2)}
    if clean.failure is not None or clean.error is not None:
        found = (clean.failure.outcome.describe() if clean.failure is not None
                 else f"crash {type(clean.error).__name__}: {clean.error}")
        details["clean_finding"] = found
        return StepResult("failed", f"the clean {cell} already fails: {found}; a catch of "
                          f"{CONTROL_FAULT} would say nothing", call,
                          f"clean {cell}: {found}", details)
    if faulty.failure is None:
        error = "" if faulty.error is None else f" (crash {type(faulty.error).__name__}: " \
                                                f"{faulty.error})"
        return StepResult("failed", f"{CONTROL_FAULT} was not caught in {faulty.examples} "
                          f"runs{error}: the race check is not watching", call,
                          "not caught", details)
    outcome = faulty.failure.outcome
    kind = get_finding_kind(outcome)
    found = outcome.describe()
    details.update(finding=found, kind=kind)
    caught = "CUDASanitizerErrors" in found if cuda else kind.startswith("race:")
    text = (f"clean {cell}: no finding in {clean.examples} runs; "
            f"{CONTROL_FAULT} in {cell}: {found}")
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
