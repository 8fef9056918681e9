"""The live-process shim: wrap upstream-named methods of a scheduler, write a checkable trace.

The shim is exercised on the reference and on gpu_impl: both name their ScheduleBatch /
FutureMap / Scheduler methods as upstream does, so the same wrapping applies.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from harness.script import apply_op
from harness.trace import OK, VIOLATION, check_trace_file
from harness.trace_shim import TraceShim
from harness.vectors import generate_random_ops
from reference.schedule_batch import ScheduleBatch
from reference.scheduler import Scheduler
from spec.config import PRESETS, ModelConfig, get_cell
from spec.units import RequestId


def _run(tmp_path: Path, cell: str, faults: frozenset[str], seed: int = 1,
         implementation: str = "reference") -> Path:
    """A random run of either implementation inside the shim (both use upstream names)."""
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    if implementation == "gpu_impl":
        from gpu_impl.schedule_batch import ScheduleBatch as GpuScheduleBatch
        from gpu_impl.scheduler import Scheduler as GpuScheduler

        scheduler: Any = GpuScheduler(config, faults)
        batch_class: type = GpuScheduleBatch
    else:
        scheduler, batch_class = Scheduler(config, faults, None), ScheduleBatch
    path = tmp_path / f"live-{implementation}.ndjson"
    ops = generate_random_ops(config, random.Random(seed), 14)
    admitted: list[RequestId] = []
    with TraceShim(path, cell, "minimal", batch_class=batch_class, scheduler=scheduler,
                   future_map=scheduler.future_map, implementation=f"{implementation}-shim",
                   faults=tuple(sorted(faults))):
        for op in ops:
            apply_op(scheduler, op, admitted)
    return path


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-v2chain-cpu-honest", "nov-p4-none",
                                  "ov-p1-v2tree-nocpu-preclaim"])
def test_shim_trace_of_a_clean_run_passes(cell: str, tmp_path: Path) -> None:
    path = _run(tmp_path, cell, frozenset())
    methods = {json.loads(line).get("method") for line in path.read_text().splitlines()}
    assert {"ScheduleBatch.prepare_for_extend", "ScheduleBatch.filter_batch",
            "Scheduler.run_batch", "FutureMap.stash"} <= methods
    verdict = check_trace_file(path)
    assert verdict.status == OK and verdict.observations > 10, verdict.describe()


@pytest.mark.parametrize(("fault", "cell", "expected"), [
    ("B1", "ov-p1-none", "SL3"), ("B8", "ov-p1-none", "ST2"),
    ("B6", "ov-p1-v2chain-cpu-honest", "SL2")])
def test_shim_trace_of_a_mutant_is_rejected(fault: str, cell: str, expected: str,
                                            tmp_path: Path) -> None:
    for seed in range(40):
        verdict = check_trace_file(_run(tmp_path, cell, frozenset({fault}), seed))
        if verdict.status == VIOLATION:
            assert verdict.violation is not None
            assert expected in verdict.violation.all_ids, verdict.describe()
            return
    pytest.fail(f"{fault} never rejected through the shim")


def test_shim_restores_the_wrapped_methods(tmp_path: Path) -> None:
    before = dict(ScheduleBatch.__dict__)
    _run(tmp_path, "ov-p1-none", frozenset())
    for name in ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"):
        assert ScheduleBatch.__dict__[name] is before[name]


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-v2chain-cpu-honest", "nov-p4-none"])
def test_shim_around_gpu_impl_writes_a_passing_trace(cell: str, tmp_path: Path) -> None:
    path = _run(tmp_path, cell, frozenset(), implementation="gpu_impl")
    methods = {json.loads(line).get("method") for line in path.read_text().splitlines()}
    assert {"ScheduleBatch.prepare_for_extend", "ScheduleBatch.filter_batch",
            "Scheduler.run_batch"} <= methods, methods
    verdict = check_trace_file(path)
    assert verdict.status == OK and verdict.observations > 10, verdict.describe()


def test_shim_around_a_faulted_gpu_impl_is_rejected(tmp_path: Path) -> None:
    for seed in range(40):
        verdict = check_trace_file(_run(tmp_path, "ov-p1-none", frozenset({"B1"}), seed,
                                        implementation="gpu_impl"))
        if verdict.status == VIOLATION:
            assert verdict.violation is not None
            assert "SL3" in verdict.violation.all_ids, verdict.describe()
            return
    pytest.fail("no seed in 0..39 made the B1 shim trace fail")
