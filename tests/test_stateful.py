"""The Hypothesis stateful check in every configuration cell.

The default test tier runs the ``quick`` profile (``overlap-spec review``'s), which is
also the claim that profile makes: every applicable invariant has a witness in every
cell at the default seed. ``overlap-spec check`` runs ``ci``; ``HYPOTHESIS_PROFILE``
chooses here.
"""

from __future__ import annotations

import os

import pytest

from overlap_spec.harness.drive.stateful import check_cell, describe_failure, get_profile
from overlap_spec.spec.config import (
    MINIMAL,
    PRESETS,
    REALISTIC,
    ModelConfig,
    enumerate_cells,
    get_cell,
)
from overlap_spec.spec.invariants import INVARIANTS

SEED = int(os.environ.get("OVERLAP_SPEC_SEED", "20261122"))
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "quick")


def test_reference_holds_every_invariant(tier_cell: str) -> None:
    """The six default-tier cells (every cell under ``-m slow``): ``check`` runs the same
    machine in every cell at the ``ci`` budget, and the README's ``review --faults B3``
    example runs it at this profile and seed in the 23 cells B3 leaves alone, where a
    vacuous invariant is a failure too (tests/test_readme.py)."""
    config = ModelConfig(get_cell(tier_cell), MINIMAL)
    # With the committed witnesses replayed first, as check and review run it: a seed's
    # own draws move with the code's literals (Hypothesis mines them), so a search alone
    # witnessing every invariant would be luck.
    result = check_cell(config, get_profile(PROFILE), SEED, witnesses=True)
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


def test_a_run_that_records_no_forward_reads_leaves_st1_vacuous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ST1's witnesses are the (schedule write, forward read) pairs the happens-before
    record judged; with the forward's reads not recorded there are none, and the report
    says vacuous (a failure) instead of a pass."""
    from overlap_spec.harness.report import get_verdicts, hypothesis_tier_report
    from overlap_spec.harness.verdict import Verdict
    from overlap_spec.spec.happens_before import FORWARD, HappensBefore

    original = HappensBefore.read

    def read(self: HappensBefore, participant: str, key: tuple[str, int],
             operation: str) -> list[object]:
        if participant == FORWARD:
            return []
        return original(self, participant, key, operation)  # type: ignore[return-value]

    monkeypatch.setattr(HappensBefore, "read", read)
    config = ModelConfig(get_cell("ov-p1-none"), PRESETS["minimal"])
    result = check_cell(config, get_profile("quick"), 1)
    assert result.ok and result.exercised["ST1"] == 0
    assert get_verdicts([result])["ST1"][config.name] is Verdict.VACUOUS
    assert hypothesis_tier_report([result]).verdict is Verdict.VACUOUS
