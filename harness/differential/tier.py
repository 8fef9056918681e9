"""The differential tier: gpu_impl against the reference in every selected cell, with the
CPU race detector (or CUDA's sanitizer), as a table and as JSON; ``overlap-spec diff``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from overlap_spec.gpu_impl.scheduler import SUPPORTED_FAULTS as GPU_SUPPORTED_FAULTS
from overlap_spec.harness.differential.compare import (
    MAX_TOP_UPS,
    MIN_COMPARED_OPS,
    MIN_LAUNCHES,
    DifferentialResult,
    check_cell_differential,
    get_default_device,
    get_differential_examples,
    get_share_minimum,
)
from overlap_spec.harness.drive.cells import (
    CONFIG_WIDTH,
    UsageError,
    get_budget_shares,
    get_fault_sizes,
    get_share_examples,
    select_configs,
)
from overlap_spec.harness.drive.script import save_script
from overlap_spec.harness.drive.stateful import (
    Profile,
    get_failure_dir,
    get_profile,
)
from overlap_spec.harness.pool import run_tasks
from overlap_spec.harness.verdict import TierReport, Verdict, combine
from overlap_spec.spec.config import ModelConfig


def parse_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return get_default_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA device")
    return device


@dataclass(frozen=True)
class DifferentialTask:
    """One cell of the differential tier, as sent to a worker process."""

    config: ModelConfig
    profile: Profile
    seed: int
    device: str
    faults: frozenset[str]
    out: Path | None
    # The configuration's share of the profile's sequences (cells.get_budget_shares) and
    # of the minimum its cell must compare; a clean run is topped up to that share.
    share: float = 1.0


def run_differential_task(task: DifferentialTask) -> DifferentialResult:
    examples = get_share_examples(get_differential_examples(task.profile), task.share)
    # A share of the sequences may top up in as many more rounds, so that it can reach
    # the minimum with what a whole cell may run (MAX_TOP_UPS rounds of the whole count).
    top_ups = max(MAX_TOP_UPS, round(MAX_TOP_UPS / task.share))
    result = check_cell_differential(task.config, task.profile, task.seed, task.faults,
                                     max_examples=examples, top_ups=top_ups,
                                     device=torch.device(task.device), top_up=True,
                                     minimum=get_share_minimum(task.share))
    directory = task.out or get_failure_dir()
    name = "-".join([task.config.name.replace("@", "-"), *sorted(task.faults), "gpu_impl"])
    if result.failure is not None:
        result.failure.script_path = save_script(result.failure.script,
                                                 directory / f"{name}.json")
    if result.unreplayed is not None:
        result.unreplayed.script_path = save_script(result.unreplayed.script,
                                                    directory / f"{name}-unreplayed.json")
    return result


def run_differential_tier(configs: list[ModelConfig], profile: Profile, seed: int,
                          device: torch.device, quiet: bool, out: Path | None,
                          faults: frozenset[str] = frozenset(),
                          jobs: int = 1) -> list[DifferentialResult]:
    """gpu_impl against the reference in each cell, races watched (CPU) - the diff tier.
    On CUDA the cells share one device, so they run in this process whatever ``jobs``."""
    tasks = [DifferentialTask(c, profile, seed, str(device), faults, out, share)
             for c, share in zip(configs, get_budget_shares(configs), strict=True)]
    finished = 0

    def report(task: DifferentialTask, result: DifferentialResult) -> None:
        nonlocal finished
        finished += 1
        if not quiet:
            status = "ok" if result.ok else "FAIL"
            rounds = f", {result.rounds} rounds" if result.rounds > 1 else ""
            print(f"[{finished:2d}/{len(tasks)}] differential {device.type:<4} "
                  f"{task.config.name:<{CONFIG_WIDTH}} {status} ({result.examples} runs"
                  f"{rounds}, {result.seconds:.2f}s)", file=sys.stderr, flush=True)

    return run_tasks(run_differential_task, tasks, jobs if device.type == "cpu" else 1, report)


def describe_race_check(device: torch.device, cuda_sanitizer: bool = False) -> str:
    """What the run says of races: only a detector that watched them can say "no race"."""
    if device.type == "cpu":
        return "no race (CPU race detector)"
    if cuda_sanitizer:
        return "no race reported by CUDA's sanitizer"
    return "races not checked (real CUDA streams; add --cuda-sanitizer)"


def render_differential(results: list[DifferentialResult],
                        race_check: str = "no race (CPU race detector)") -> str:
    lines = []
    for result in results:
        if result.failure is not None:
            path = result.failure.script_path
            lines.append(f"  {result.config.name}: {result.failure.outcome.describe()}"
                         f" (seed {result.seed}; replay: overlap-spec replay {path})")
        elif result.unreplayed is not None:
            lines.append(f"  {result.config.name}: inconclusive, nondeterministic: a run found "
                         f"\"{result.unreplayed.outcome.describe()}\" and Hypothesis's replay "
                         f"of the same draws did not (seed {result.seed}; that run's script: "
                         f"overlap-spec replay {result.unreplayed.script_path})")
        elif result.error is not None:
            lines.append(f"  {result.config.name}: inconclusive, crash "
                         f"{type(result.error).__name__}: {result.error}")
    for result in results:
        if result.ok and not result.exercised_enough:
            lines.append(f"  {result.config.name}: vacuous, compared {result.compared_ops} ops "
                         f"and {result.launches} launches (minimum {result.minimum[0]} and "
                         f"{result.minimum[1]})")
    clean = sum(r.ok and r.exercised_enough for r in results)
    compared = sum(r.compared_ops for r in results)
    launches = sum(r.launches for r in results)
    aborts = sum(r.aborts for r in results)
    lines.append(f"differential gpu_impl vs reference: {clean}/{len(results)} cells agree, "
                 f"{compared} ops ({aborts} aborts) and {launches} launches compared, "
                 f"{race_check}")
    return "\n".join(lines)


def build_differential_json(results: list[DifferentialResult]) -> dict[str, Any]:
    if not results:
        return {"status": "skipped"}
    return {
        "status": differential_verdict(results).value,
        # a cell's minimum; a size set of a default run compares its share of it
        "minimum": {"compared_ops": MIN_COMPARED_OPS, "launches": MIN_LAUNCHES},
        "cells": {
            r.config.name: {
                "verdict": _cell_verdict(r).value,
                "examples": r.examples, "compared_ops": r.compared_ops,
                "launches": r.launches, "aborts": r.aborts, "seconds": round(r.seconds, 3),
                "seed": r.seed,
                "rounds": r.rounds,
                "minimum": {"compared_ops": r.minimum[0], "launches": r.minimum[1]},
                **({"finding": r.failure.outcome.describe(),
                    "replay": f"overlap-spec replay {r.failure.script_path}"}
                   if r.failure is not None else {}),
                **({"error": f"{type(r.error).__name__}: {r.error}"}
                   if r.error is not None else {}),
                **({"unreplayed_finding": r.unreplayed.outcome.describe(),
                    "replay": f"overlap-spec replay {r.unreplayed.script_path}"}
                   if r.unreplayed is not None else {}),
            }
            for r in results
        },
    }


def cmd_diff(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    device = parse_device(args.device)
    if args.cuda_sanitizer:
        if device.type != "cuda":
            print("overlap-spec: --cuda-sanitizer needs --device cuda", file=sys.stderr)
            return 2
        # torch's own CSAN watches the real streams; a race raises inside gpu_impl and is
        # reported as a divergence (an exception the reference did not raise).
        from torch.cuda._sanitizer import enable_cuda_sanitizer
        enable_cuda_sanitizer()  # type: ignore[no-untyped-call]
    faults = frozenset(f.strip() for f in (args.faults or "").split(",") if f.strip())
    if faults - GPU_SUPPORTED_FAULTS:
        print(f"overlap-spec: gpu_impl does not know faults {sorted(faults - GPU_SUPPORTED_FAULTS)}"
              f"; supported: {', '.join(sorted(GPU_SUPPORTED_FAULTS))}", file=sys.stderr)
        return 2
    configs = select_configs(args.cells, args.preset, get_fault_sizes(args.sizes, faults))
    started = time.perf_counter()
    results = run_differential_tier(configs, profile, args.seed, device, args.quiet,
                                    Path(args.out) if args.out else None, faults)
    print(render_differential(results, describe_race_check(device, args.cuda_sanitizer)))
    ok = not differential_verdict(results).fails_run
    print(f"{'OK' if ok else 'FAILED'}: seed {args.seed}, profile {profile.name}, "
          f"device {device}, {time.perf_counter() - started:.1f}s")
    return 0 if ok else 1


def _cell_verdict(result: DifferentialResult) -> Verdict:
    if result.failure is not None:
        return Verdict.FAIL
    if result.error is not None:
        return Verdict.INCONCLUSIVE
    return Verdict.PASS if result.exercised_enough else Verdict.VACUOUS


def differential_verdict(results: list[DifferentialResult]) -> Verdict:
    """PASS when gpu_impl agreed with the reference in every cell, with no race, after
    comparing at least the minimum budget; a cell under it is vacuous."""
    return combine([_cell_verdict(r) for r in results])


def differential_tier_report(results: list[DifferentialResult]) -> TierReport:
    verdict = differential_verdict(results)
    clean = sum(_cell_verdict(r) is Verdict.PASS for r in results)
    return TierReport("differential", verdict, f"differential {clean}/{len(results)} cells",
                      {"differential": build_differential_json(results)})
