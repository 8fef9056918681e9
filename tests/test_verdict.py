"""The one verdict vocabulary: what passes a run, what fails it, and that nothing
unknown, crashed or unchecked is read as a pass."""

from __future__ import annotations

import pytest

from overlap_spec.harness.verdict import (
    ITEM_VERDICTS,
    CheckReport,
    TierReport,
    Verdict,
    as_verdict,
    combine,
)


def test_only_fail_vacuous_inconclusive_and_cannot_drive_fail_a_run() -> None:
    failing = {v for v in Verdict if v.fails_run}
    assert failing == {Verdict.FAIL, Verdict.VACUOUS, Verdict.INCONCLUSIVE,
                       Verdict.CANNOT_DRIVE}


@pytest.mark.parametrize("word,verdict", [
    ("killed", Verdict.PASS), ("survived", Verdict.FAIL), ("proved", Verdict.PASS),
    ("counterexample", Verdict.FAIL), ("unknown", Verdict.INCONCLUSIVE),
    ("ok", Verdict.PASS), ("violation", Verdict.FAIL), ("inconclusive", Verdict.INCONCLUSIVE),
    ("n/a", Verdict.NOT_APPLICABLE), ("vacuous", Verdict.VACUOUS),
])
def test_each_tier_word_means_one_verdict(word: str, verdict: Verdict) -> None:
    assert as_verdict(word) is verdict


def test_an_unknown_word_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="no verdict"):
        as_verdict("looks fine")
    assert "looks fine" not in ITEM_VERDICTS


def test_combine_takes_the_worst_and_never_invents_a_pass() -> None:
    assert combine([Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE]) is Verdict.FAIL
    assert combine([Verdict.PASS, Verdict.INCONCLUSIVE]) is Verdict.INCONCLUSIVE
    assert combine([Verdict.PASS, Verdict.VACUOUS]) is Verdict.VACUOUS
    assert combine([Verdict.NOT_APPLICABLE] * 2) is Verdict.NOT_APPLICABLE
    assert combine([Verdict.SKIPPED, Verdict.NOT_APPLICABLE]) is Verdict.SKIPPED
    assert combine([]) is Verdict.SKIPPED
    assert combine([Verdict.PASS, Verdict.NOT_APPLICABLE]) is Verdict.PASS


def test_a_check_report_fails_on_any_failing_tier_and_reports_skips() -> None:
    report = CheckReport(seed=1, profile="ci", elapsed_s=2.0)
    report.add(TierReport("hypothesis", Verdict.PASS, "2/2 cells clean",
                          {"cells": ["a", "b"]}))
    report.add(TierReport.skipped("proofs", "--no-proofs"))
    assert report.ok
    document = report.to_json()
    assert document["proofs"] == {"status": "skipped", "reason": "--no-proofs"}
    assert document["tiers"]["proofs"] == {"verdict": "skipped", "summary": "proofs skipped",
                                           "reason": "--no-proofs"}
    assert report.closing_line().startswith("OK: 2/2 cells clean, proofs skipped, seed 1")
    report.add(TierReport("upstream", Verdict.INCONCLUSIVE, "UPSTREAM FAILED"))
    assert not report.ok and report.to_json()["ok"] is False
    assert report.closing_line().startswith("FAILED:")
