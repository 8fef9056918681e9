"""The Hypothesis stateful check in every configuration cell (ci profile by default)."""

from __future__ import annotations

import os

import pytest

from overlap_spec.harness.drive.stateful import check_cell, describe_failure, get_profile
from overlap_spec.spec.config import MINIMAL, REALISTIC, ModelConfig, enumerate_cells
from overlap_spec.spec.invariants import INVARIANTS

SEED = int(os.environ.get("OVERLAP_SPEC_SEED", "20261122"))


@pytest.mark.parametrize("cell", enumerate_cells(), ids=lambda c: c.name)
def test_reference_holds_every_invariant(cell: object) -> None:
    config = ModelConfig(cell, MINIMAL)  # type: ignore[arg-type]
    result = check_cell(config, get_profile(), SEED)
    assert result.ok, describe_failure(result)
    assert result.runs > 0
    # Non-vacuity: every invariant that applies here had something to check.
    vacuous = [inv.id for inv in INVARIANTS
               if inv.applies(config.cell) and result.exercised[inv.id] == 0]
    assert not vacuous, f"no witness in {config.name} for {vacuous}"


@pytest.mark.slow
@pytest.mark.parametrize("cell", enumerate_cells(), ids=lambda c: c.name)
def test_reference_holds_every_invariant_at_realistic_sizes(cell: object) -> None:
    config = ModelConfig(cell, REALISTIC)  # type: ignore[arg-type]
    result = check_cell(config, get_profile(), SEED)
    assert result.ok, describe_failure(result)
