"""The non-spec decode-time memory check (``check_decode_mem`` with
``spec.transitions.compute_ns_decode_pages_needed``) under a full pool.

Found by mutation testing (``bench/results/mutation-20261125.json``): 23 mutants of that
function, ``return 0`` among them (a decode never needs a page), survived the Hypothesis
tier at every profile, the exhaustive tier and the upstream tier, because no generated
script then filled the minimal pool at a non-spec decode. Three requests of the longest
prompt and budget do, in 17 operations: the decode must retract rather than run out of
pages. Since prompts are drawn up to the context length the generator gets there too
(the last test here).
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.script import (
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.reference import mem_cache
from overlap_spec.spec.state import IterationChoices, Observation, ObservationPoint
from overlap_spec.spec.units import RequestId

FULL_POOL: list[Op] = [Admit(5, 8)] * 3 + [Iterate(IterationChoices())] * 14


def _retractions(cell: str) -> int:
    script = Script(cell, "minimal", FULL_POOL, ())
    observations: list[Observation] = []
    model = get_factory("reference")(script.get_config(), frozenset(), observations.append)
    admitted: list[RequestId] = []
    for op in FULL_POOL:
        apply_op(model, op, admitted)
    return sum(1 for o in observations if o.point is ObservationPoint.RETRACT_DECODE)


@pytest.mark.parametrize(("cell", "retractions"), [
    ("ov-p1-none", 2), ("nov-p1-none", 1), ("ov-p4-none", 4), ("nov-p4-none", 1)])
def test_a_full_pool_at_a_non_spec_decode_retracts_instead_of_running_out(
        cell: str, retractions: int) -> None:
    script = Script(cell, "minimal", FULL_POOL, ())
    assert run_script(script).violation is None
    assert _retractions(cell) == retractions
    assert run_differential(script).ok


def test_a_decode_that_never_asks_for_a_page_runs_out_of_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mem_cache, "compute_ns_decode_pages_needed", lambda s, p: 0)
    outcome = run_script(Script("ov-p1-none", "minimal", FULL_POOL, ()), catch_crash=True)
    assert outcome.crash is not None and "OutOfMemory" in outcome.crash


def test_the_generator_itself_reaches_a_full_pool_at_a_non_spec_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the directed script: the Hypothesis tier's own sequences (quick profile, the
    review budget) now fill the minimal pool at a non-spec decode (prompts reach the
    context length since the last distribution change), so the mutant that never asks for
    a page crashes there (4 of the 5 non-spec cells at the default seed, measured)."""
    from overlap_spec.harness.drive.cells import select_configs
    from overlap_spec.harness.drive.stateful import check_cell, get_profile

    monkeypatch.setattr(mem_cache, "compute_ns_decode_pages_needed", lambda s, p: 0)
    crashed = []
    for config in select_configs("*-none*", "minimal"):
        result = check_cell(config, get_profile("quick"), 20261122, shrink=False)
        if result.error is not None and "OutOfMemory" in repr(result.error):
            crashed.append(config.name)
    assert crashed, "no generated sequence filled the pool at a non-spec decode"
