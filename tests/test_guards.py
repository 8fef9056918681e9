"""A guard switched off by hand makes the stateful check fail with the right invariant.

The systematic matrix over B1-B15 belongs to the mutant runner; these are the
spot checks that the checkers can fail at all, each with the ID the digest names.
"""

from __future__ import annotations

import json

import pytest

from overlap_spec.harness.catalogue import get_bug
from overlap_spec.harness.drive.script import load_script, run_script
from overlap_spec.harness.drive.stateful import check_cell, get_profile
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell

CASES = [
    ("B3", "ov-p1-v2chain-cpu-preclaim"),  # stale rows' runs committed (pre-claim era)
    ("B3", "ov-p4-v2chain-nocpu-preclaim"),
    ("B4", "ov-p4-v2chain-nocpu-preclaim"),  # counters over stale rows
    ("B5", "ov-p1-v2tree-cpu-honest"),  # read new_seq_lens without publish_ready
    ("B7", "nov-p4-v2chain-cpu-honest"),  # draft-extend +D_tok written to SB
    ("B8", "ov-p1-none"),  # no WAR fence after launch
    ("B15", "ov-p1-v2chain-nocpu-honest"),  # keep-alive ring of one slot
    ("B2", "nov-p1-none"),  # init_new without the sum backfill
    ("B11", "ov-p4-v2chain-nocpu-honest"),  # cache kv_committed_len, not owned_kv_len
]


@pytest.mark.parametrize(("fault", "cell"), CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_fault_is_caught_with_its_invariant(fault: str, cell: str) -> None:
    config = ModelConfig(get_cell(cell), MINIMAL)
    # Hypothesis's shrinker was 95 % of this test's time (about 5 s of CPU a case): the
    # failing script is minimised as review and the mutant runner do (same first
    # invariant), which leaves the search, the kill and the saved script's replay as they
    # were. The shrinker itself runs in `check`'s failing path
    # (tests/test_script_cli.py::test_check_with_a_fault_fails_and_reports_fail and the
    # README's `check --faults B3` example, tests/test_readme.py).
    result = check_cell(config, get_profile("ci"), 1, frozenset({fault}), shrink=False,
                        minimize=True)
    assert result.violation is not None, f"{fault} survived in {cell}"
    expected = set(get_bug(fault).invariants)
    assert expected & set(result.violation.all_ids), str(result.violation)
    # The counterexample was saved and replays to the same violation.
    assert result.script_path is not None and result.script_path.exists()
    saved = json.loads(result.script_path.read_text())
    assert saved["faults"] == [fault] and saved["seed"] == 1
    replay = run_script(load_script(result.script_path))
    assert replay.violation is not None
    assert replay.violation.invariant_id == result.violation.invariant_id


def test_failure_message_names_id_request_values_and_replay() -> None:
    config = ModelConfig(get_cell("ov-p1-v2chain-cpu-preclaim"), MINIMAL)
    result = check_cell(config, get_profile("ci"), 1, frozenset({"B3"}), shrink=False,
                        minimize=True)  # as above
    assert result.violation is not None
    text = str(result.violation)
    assert text.split()[0] in get_bug("B3").invariants
    assert text.split()[1:3] == ["violated", "for"]
    assert " r" in text and "(op " in text and "cell ov-p1-v2chain" in text
    from overlap_spec.harness.drive.stateful import describe_failure
    described = describe_failure(result)
    assert "seed 1" in described and "overlap-spec replay" in described


def test_b6s_reader_consumes_the_sentinel() -> None:
    """B6 is the sentinel and its reader: SL2 and SL5 see the sentinel the step it is
    left, and with them set aside the non-spec decode prepared from it (#26020's
    alloc_for_decode site) breaks the KV accounting there."""
    from overlap_spec.harness.drive.script import Admit, Iterate, Script, apply_op, get_factory
    from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation
    from overlap_spec.spec.state import IterationChoices, Observation
    from overlap_spec.spec.units import RequestId

    script = Script("ov-p1-none", "minimal", [Admit(3, 4)] + [Iterate(IterationChoices())] * 3,
                    ("B6",))
    config = script.get_config()
    seen: set[tuple[str, str]] = set()

    def observe(obs: Observation) -> None:
        for inv in INVARIANTS:
            if inv.applies(config.cell) and inv.id not in ("SL2", "SL5"):
                try:
                    inv.check(config, obs)
                except InvariantViolation:
                    seen.add((obs.point.value, inv.id))

    model = get_factory("reference")(config, frozenset(script.faults), observe)
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    assert {("prepare_for_decode", "SL7"), ("prepare_for_decode", "KV1")} <= seen
