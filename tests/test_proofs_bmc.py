"""Bounded model checking: the clean model has no violation within the bound in every
cell, every B-id mutant has a counterexample that replays on the reference and fails
a catalogue invariant, and a model decodes into the script it describes.

Default tier: every cell at K=2, B=2 and the mutant column at its default bounds. The
slow tier runs K=3, B=2 (the default bound, bmc.DEFAULT_DEPTH / DEFAULT_REQUESTS: about
32 s for all cells on 2 cores) and K=4, B=2 in every cell. The issue's target K=6,
B=3 is not reached in the page-4 chain cells (docs/proofs.md has the measured times).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.differential import run_differential
from harness.prove import (
    decode_counterexample,
    replay_counterexample,
    run_z3_mutant_column,
)
from harness.script import Admit, Iterate, load_script, run_script
from harness.trace import record_script_trace
from proofs import bmc
from proofs import solver as zs
from proofs.model import Context
from spec.bugs import BUG_IDS, get_bug
from spec.config import MINIMAL, ModelConfig, enumerate_cells, get_cell

CELLS = [c.name for c in enumerate_cells()]


def _check(cell: str, depth: int, requests: int, faults: frozenset[str] = frozenset(),
           invariants: tuple[str, ...] | None = None) -> bmc.BmcResult:
    ctx = Context(ModelConfig(get_cell(cell), MINIMAL), faults)
    return bmc.check_bounded(ctx, depth, requests, invariants, timeout_ms=120_000)


@pytest.mark.parametrize("cell", CELLS)
def test_clean_model_has_no_violation_within_small_bound(cell: str) -> None:
    result = _check(cell, 2, 2)
    assert result.verdict == zs.PROVED, (result.verdict, result.invariant, result.where,
                                         result.reason)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_clean_model_has_no_violation_within_k4_b2(cell: str) -> None:
    result = _check(cell, 4, 2)
    assert result.verdict == zs.PROVED, (result.verdict, result.invariant, result.where,
                                         result.reason)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_clean_model_has_no_violation_within_default_bound(cell: str) -> None:
    result = _check(cell, bmc.DEFAULT_DEPTH, bmc.DEFAULT_REQUESTS)
    assert result.verdict == zs.PROVED, (result.verdict, result.invariant, result.where,
                                         result.reason)


def test_z3_column_kills_every_bug_with_a_replaying_script(tmp_path: Path) -> None:
    column = run_z3_mutant_column(save_dir=tmp_path)
    assert set(column) == set(BUG_IDS)
    gpu_missed: list[tuple[str, str]] = []
    for bug_id, kill in column.items():
        bug = get_bug(bug_id)
        assert kill.verdict == "killed", (bug_id, kill.reason)
        assert kill.cells, bug_id
        for cell_kill in kill.cells:
            assert cell_kill.verdict == "killed", (bug_id, cell_kill.cell, cell_kill.reason)
            assert cell_kill.script is not None and cell_kill.script_path is not None
            assert cell_kill.script.faults == (bug_id,)
            # The saved file replays to a catalogue invariant (overlap-spec replay FILE).
            outcome = run_script(load_script(cell_kill.script_path))
            assert outcome.violation is not None, (bug_id, cell_kill.cell)
            assert set(outcome.violation.all_ids) & set(bug.invariants), (
                bug_id, cell_kill.cell, outcome.violation.all_ids)
            # Without the fault the same script passes: the bug, not the script, fails it.
            clean = load_script(cell_kill.script_path)
            clean.faults = ()
            assert run_script(clean).violation is None, (bug_id, cell_kill.cell)
            # Cross-checker agreement: the same counterexample as a trace is rejected by
            # `trace check` with the invariant the replay reported, and as a gpu_impl run
            # it is caught by the differential checker or the race detector.
            verdict = record_script_trace(cell_kill.script, tmp_path / "z3.trace.ndjson")
            assert verdict.invariant_id == outcome.violation.invariant_id, (
                bug_id, verdict.describe())
            as_gpu = dataclasses.replace(cell_kill.script, implementation="gpu_impl")
            if run_differential(as_gpu).ok:
                gpu_missed.append((bug_id, cell_kill.cell))
    # Not visible in the state after an operation (README, "Agreement between checkers"):
    # B1's stale sum mid-iteration, B7 without overlap.
    assert {bug for bug, _ in gpu_missed} <= {"B1", "B7"}, gpu_missed


def test_counterexample_decodes_to_the_script_it_describes() -> None:
    """A handmade bounded query (B11 in ov-p1-none, one request admitted before iteration
    0 with prompt 2 and budget 1, default choices) decodes into exactly those operations,
    and the model's verdict is the reference's."""
    ctx = Context(ModelConfig(get_cell("ov-p1-none"), MINIMAL), frozenset({"B11"}))
    unrolling = bmc.build_unrolling(ctx, 2, 1)
    pins = [unrolling.admit_at[0] == 0, unrolling.prompt_len[0] == 2,
            unrolling.max_new_tokens[0] == 1]
    for it in unrolling.iterations:
        pins += [it.allow_prefill, it.retract == 0, zs.Not(it.disable_overlap),
                 it.eos_offset == 0, it.accept[0] == 1, zs.Not(it.eos[0])]
    outcome = zs.check_sat([*unrolling.constraints, *pins])
    assert outcome.verdict == zs.SATISFIABLE
    result = bmc.BmcResult("ov-p1-none", 2, 1, zs.COUNTEREXAMPLE, outcome.seconds,
                           unrolling=unrolling, raw_model=outcome.raw_model)
    script = decode_counterexample(result, ("B11",))
    assert script.cell == "ov-p1-none" and script.faults == ("B11",)
    assert isinstance(script.ops[0], Admit) and script.ops[0] == Admit(2, 1)
    iterations = [op for op in script.ops if isinstance(op, Iterate)]
    assert len(iterations) == 2
    first = iterations[0].choices
    assert first.allow_prefill and first.retract == 0 and first.accept_lens == (1,)
    assert not first.eos_positions and not first.disable_overlap
    # The decoded run is the one the model describes: the overlap loop prepares a decode
    # (the overshoot tick) before the prefill's result finishes the request, so with B11
    # the model violates KV9 at the finish release, and so does the reference.
    fired = {v.invariant for v in unrolling.violations
             if zs.evaluate(outcome.raw_model, v.term) is True}
    assert "KV9" in fired, fired
    replays, found, message = replay_counterexample(script, get_bug("B11").invariants)
    assert replays and found == "KV9", message


def test_unknown_is_not_a_pass() -> None:
    """A query that cannot finish in 1 ms is reported unknown, never proved."""
    ctx = Context(ModelConfig(get_cell("ov-p4-v2chain-cpu-preclaim"), MINIMAL))
    result = bmc.check_bounded(ctx, 4, 3, timeout_ms=1)
    assert result.verdict == zs.UNKNOWN
