"""gpu_impl traces: written from the race detector, checked by the spec like any trace."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from overlap_spec.harness.catalogue import get_bug
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Script,
    get_op_limits,
    load_script,
)
from overlap_spec.harness.trace.check import check_trace_file, record_script_trace
from overlap_spec.harness.trace.format import read_trace
from overlap_spec.harness.trace.render import render_trace_file
from overlap_spec.spec.config import PRESETS, ModelConfig, enumerate_cells, get_cell
from overlap_spec.spec.state import IterationChoices

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted((ROOT / "tests" / "data" / "mutant_scripts").glob("*.json"))


def _busy_script(cell: str) -> Script:
    # Accept lengths above 1 only where the cell speculates (a trace is range-checked
    # against its cell like a script).
    top = get_op_limits(ModelConfig(get_cell(cell), PRESETS["minimal"])).accept_len[1]

    def lens(*values: int) -> tuple[int, ...]:
        return tuple(min(v, top) for v in values)

    ops = [Admit(3, 6), Admit(2, 5), Iterate(IterationChoices(accept_lens=lens(2, 1))),
           AdmitPrebuilt(2, 4), Iterate(IterationChoices(accept_lens=lens(3, 1, 2))),
           Iterate(IterationChoices(retract=1, accept_lens=lens(1, 2))),
           Iterate(IterationChoices(eos_positions=frozenset({0}))),
           Iterate(IterationChoices(disable_overlap=True)), Iterate(IterationChoices())]
    return Script(cell, "minimal", ops, implementation="gpu_impl")


@pytest.mark.parametrize("cell", [c.name for c in enumerate_cells()])
def test_clean_gpu_impl_trace_passes(cell: str, tmp_path: Path) -> None:
    path = tmp_path / "run.trace.ndjson"
    verdict = record_script_trace(_busy_script(cell), path)
    assert verdict.ok, verdict.describe()
    parsed = read_trace(path)
    kinds = {e.raw.get("kind") for e in parsed.events if e.event == "stream"}
    assert {"read", "write", "record", "free", "synchronize_event"} <= kinds, kinds
    assert parsed.script.implementation == "gpu_impl"


def test_faulted_gpu_impl_traces_are_rejected_with_a_catalogue_id(tmp_path: Path) -> None:
    assert len(CORPUS) >= 30
    for path in CORPUS:
        script = dataclasses.replace(load_script(path), implementation="gpu_impl")
        bug = get_bug(script.faults[0])
        verdict = record_script_trace(script, tmp_path / f"{path.stem}.trace.ndjson")
        assert verdict.violation is not None, (path.name, verdict.describe())
        assert set(verdict.violation.all_ids) & set(bug.invariants), (path.name, verdict.describe())


def test_gpu_impl_race_trace_renders(tmp_path: Path) -> None:
    source = next(p for p in CORPUS if p.name.endswith("-B8.json"))
    script = dataclasses.replace(load_script(source), implementation="gpu_impl")
    trace = tmp_path / "b8.trace.ndjson"
    assert record_script_trace(script, trace).invariant_id == "ST2"
    assert check_trace_file(trace).invariant_id == "ST2"
    written = render_trace_file(trace, tmp_path / "pics")
    svg = next(p for p in written if p.suffix == ".svg")
    ElementTree.parse(svg)
    mermaid = next(p for p in written if p.suffix == ".mmd").read_text()
    assert "sequenceDiagram" in mermaid
