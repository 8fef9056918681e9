"""Cross-checker agreement: every counterexample replays in every other checker with the
same verdict and invariant (script replay, trace with snapshots, trace with inferred state,
conformance vector). Z3 counterexamples join when proofs/ produces scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlap_spec.harness.catalogue import get_bug
from overlap_spec.harness.drive.script import load_script, run_script
from overlap_spec.harness.drive.stateful import get_profile
from overlap_spec.harness.trace.check import check_trace, record_script_trace
from overlap_spec.harness.trace.format import (
    VIOLATION,
    get_trace_path,
    parse_trace,
    strip_snapshots,
)
from overlap_spec.harness.trace.record import record_script
from overlap_spec.harness.vectors import build_vector, check_vector

CORPUS = sorted((Path(__file__).parent / "data" / "mutant_scripts").glob("*.json"))


def _verdicts(script_path: Path, tmp_path: Path) -> dict[str, tuple[str, ...]]:
    script = load_script(script_path)
    replayed = run_script(script).violation
    trace = tmp_path / "t.ndjson"
    with_state = record_script_trace(script, trace)
    inferred = check_trace(parse_trace(strip_snapshots(trace.read_text())))
    run = record_script(script, snapshots=False)
    assert run.failed_at is not None
    vector = json.loads(json.dumps(build_vector(script, run.failed_at, run, "x")))
    assert check_vector(vector, "x") is None
    return {
        "replay": replayed.all_ids if replayed else (),
        "trace": with_state.violation.all_ids if with_state.violation else (),
        "trace-inferred": inferred.violation.all_ids if inferred.violation else (),
        "vector": tuple(vector["post"]["all"]) if not vector["post"]["valid"] else (),
    }


@pytest.mark.parametrize("script_path", CORPUS, ids=lambda p: p.stem)
def test_checkers_agree_on_every_mutant_counterexample(script_path: Path,
                                                       tmp_path: Path) -> None:
    verdicts = _verdicts(script_path, tmp_path)
    assert len(set(verdicts.values())) == 1, verdicts
    ids = verdicts["replay"]
    bug = get_bug(script_path.stem.rsplit("-", 1)[-1])
    assert ids and set(ids) & set(bug.invariants), verdicts


@pytest.mark.slow
def test_fresh_mutant_matrix_kills_are_saved_as_rejected_traces(tmp_path: Path) -> None:
    """The whole ci matrix, regenerated: each kill's script, saved as a trace, is rejected
    by trace check with an ID of the bug's catalogue entry (the lead's wiring does this in
    harness/drive/minimize.py; here it is done after the fact)."""
    from overlap_spec.harness.mutants.matrix import run_mutants

    results = run_mutants(get_profile("ci"), 20261122, save_dir=tmp_path)
    for result in results:
        for cell in result.cells:
            assert cell.replay is not None, (result.bug.id, cell.cell)
            script_path = Path(cell.replay.split()[-1])
            verdict = record_script_trace(load_script(script_path), get_trace_path(script_path))
            assert verdict.status == VIOLATION and verdict.violation is not None
            assert set(verdict.violation.all_ids) & set(result.bug.invariants), (
                result.bug.id, cell.cell, verdict.describe())
            assert _verdicts(script_path, tmp_path)["trace-inferred"] == \
                verdict.violation.all_ids
