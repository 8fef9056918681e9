"""Z3 proofs: every default proof proved, witnesses exist, the z3 mutant column kills what
it claims, and the lifted transitions agree with the spec's Python (drift test)."""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable
from typing import Any

import pytest

from overlap_spec.harness.drive.script import Admit, Iterate, Script, run_script
from overlap_spec.harness.prove.tier import run_proofs
from overlap_spec.proofs import model
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.induction import find_witnesses
from overlap_spec.proofs.model import Context
from overlap_spec.proofs.streams import get_expected_ids, prove_protocol
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import relation
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import MINIMAL, ModelConfig, enumerate_cells, get_cell
from overlap_spec.spec.state import IterationChoices


def test_every_default_proof_is_proved_in_every_cell(tier_cell: str) -> None:
    """The proofs tier of ``check`` (which covers every cell): six cells by default, the
    rest under ``-m slow`` (tests/conftest.py, ``tier_cell``)."""
    results = run_proofs([get_cell(tier_cell)])
    assert list(results) == [tier_cell]
    for cell, rows in results.items():
        bad = [(r.transition, r.invariant, r.verdict, r.detail) for r in rows
               if r.verdict != zs.PROVED]
        assert not bad, f"{cell}: {bad[:5]}"
        ids = {r.invariant for r in rows}
        assert set(get_expected_ids(get_cell(cell))) <= ids


@pytest.mark.parametrize("cell", [c.name for c in enumerate_cells()])
def test_every_encoded_invariant_has_a_witness(cell: str) -> None:
    found = find_witnesses(Context(ModelConfig(get_cell(cell), MINIMAL)))
    missing = [key for key, verdict in found.items() if verdict != zs.SATISFIABLE]
    assert found and not missing, f"{cell}: no witness for {missing}"


def test_stream_protocol_counterexample_schedules_are_concrete() -> None:
    cell = get_cell("ov-p1-v2chain-cpu-honest")
    results = {r.invariant: r for r in prove_protocol(cell, frozenset({"B5"}))}
    assert results["FM1"].verdict == zs.COUNTEREXAMPLE
    assert results["FM1"].schedule, "the counterexample names an execution order"


# ----------------------------------------------------------------------------- drift
LIFTED = (
    tr.compute_ceil_div, tr.compute_page_align_up, tr.compute_pages_for_len,
    tr.compute_fill_len, tr.compute_decode_seq_len_ns, tr.compute_v2_alloc_target,
    tr.compute_v2_decode_pages_needed, tr.compute_ns_decode_pages_needed,
    tr.compute_verify_new_seq_len, tr.compute_forward_write_width,
    tr.compute_draft_extend_seq_lens, tr.compute_run_len, tr.compute_committed_after_result,
    tr.compute_committed_run, tr.compute_cached_len, tr.compute_committed_lead,
    tr.compute_ns_expected_seq_len,
)


def _symbolic_args(args: tuple[Any, ...], bools: bool
                   ) -> tuple[tuple[Any, ...], list[tuple[Any, Any]]]:
    """Ints become Z3 variables, and with ``bools`` so do bools (other values stay
    concrete)."""
    pairs: list[tuple[Any, Any]] = []

    def convert(value: Any) -> Any:
        if isinstance(value, bool) and bools:
            var = zs.Bool(f"b{len(pairs)}")
            pairs.append((var, zs.BoolVal(value)))
            return var
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, tuple):
                return tuple(convert(v) for v in value)
            return value
        var = zs.Int(f"x{len(pairs)}")
        pairs.append((var, zs.IntVal(value)))
        return var

    return tuple(convert(a) for a in args), pairs


def _agrees(function: Callable[..., Any], args: tuple[Any, ...], bools: bool = False) -> bool:
    try:
        expected = function(*args)
    except ZeroDivisionError:
        return True
    symbolic, values = _symbolic_args(args, bools)
    lifted = lift(function, *symbolic)
    if isinstance(lifted, tuple):
        got: Any = tuple(zs.as_python(zs.substitute(t, values)) for t in lifted)
        return got == tuple(expected)
    return zs.as_python(zs.substitute(lifted, values)) == expected


def _random_args(function: Callable[..., Any], rng: random.Random) -> tuple[Any, ...]:
    cells = enumerate_cells()
    config = ModelConfig(rng.choice(cells), MINIMAL)
    params = list(inspect.signature(function).parameters)
    values: list[Any] = []
    for name in params:
        if name == "cell":
            values.append(config.cell)
        elif name == "shape":
            values.append(config.get_shape(rng.randint(0, 3)))
        elif name == "forward_mode":
            values.append(rng.choice(["decode", "extend", "tail"]))
        elif name in ("stale", "finished", "spec", "preclaim", "aborted", "aborting",
                      "hit_eos"):
            values.append(rng.random() < 0.5)
        elif name == "faults":
            values.append(frozenset(b for b in ("B3", "B10", "B11", "B12", "B16", "B17")
                                    if rng.random() < 0.3))
        elif name in ("eos_at", "extend_end"):
            values.append(None if rng.random() < 0.4 else rng.randint(-1, 6))
        elif name == "seq_lens":
            values.append(tuple(rng.randint(-3, 40) for _ in range(rng.randint(0, 4))))
        elif name in ("divisor", "page_size"):
            values.append(rng.choice([1, 2, 4, 16, -3]))
        else:
            values.append(rng.randint(-8, 40))
    return tuple(values)


# What proofs/model.py lifts from spec.relation instead of restating it: the relation's
# integer cores, and the model's wrappers that run a relation transition on a record.
LIFTED_RELATION = (
    model.decode_kv, relation.compute_extend_kv, relation.compute_result_kv,
    relation.compute_release_cached, model.extend_forward_kv, model.decode_forward_kv,
    model.release_kv, model.retract_kv, model.finishes,
)


@pytest.mark.parametrize("function", LIFTED_RELATION, ids=lambda f: f.__name__)
def test_the_lifted_relation_transitions_agree_with_the_relation(
        function: Callable[..., Any]) -> None:
    """Ints and Booleans alike symbolic (the model passes a request's flags as terms)."""
    rng = random.Random(20261124)
    for _ in range(300):
        args = _random_args(function, rng)
        assert _agrees(function, args, bools=True), (function.__name__, args)


def test_lifted_transitions_agree_with_the_spec_on_random_states() -> None:
    rng = random.Random(20261122)
    checked = 0
    for function in LIFTED:
        for _ in range(250):
            args = _random_args(function, rng)
            assert _agrees(function, args), (function.__name__, args)
            checked += 1
    assert checked >= 4000


def _record_reference_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, tuple[Any, ...]]]:
    from overlap_spec.reference import mem_cache, schedule_batch, scheduler, worker

    calls: list[tuple[Any, tuple[Any, ...]]] = []
    for module in (mem_cache, schedule_batch, scheduler, worker):
        for name in dir(module):
            function = getattr(module, name)
            if name.startswith("compute_") and function in LIFTED:
                def wrapper(*args: Any, _f: Any = function) -> Any:
                    calls.append((_f, args))
                    return _f(*args)
                monkeypatch.setattr(module, name, functools.wraps(function)(wrapper))
    return calls


def test_lifted_transitions_agree_on_states_from_reference_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_reference_calls(monkeypatch)
    rng = random.Random(7)
    for cell in enumerate_cells():
        for _ in range(2):
            ops: list[Any] = [Admit(rng.randint(1, 5), rng.randint(2, 8))
                              for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(3, 8)):
                ops.append(Iterate(IterationChoices(
                    accept_lens=tuple(rng.randint(1, 4) for _ in range(3)),
                    eos_positions=frozenset({0}) if rng.random() < 0.15 else frozenset(),
                    retract=1 if rng.random() < 0.1 else 0,
                    spec_steps=rng.randint(0, 3))))
            outcome = run_script(Script(cell.name, "minimal", ops))
            assert outcome.violation is None, str(outcome.violation)
    seen = {f for f, _ in calls}
    assert len(calls) >= 1000 and len(seen) >= 8, (len(calls), len(seen))
    for function, args in calls[:3000]:
        assert _agrees(function, args), (function.__name__, args)
