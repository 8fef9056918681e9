"""RP5 (the finish reason and visible output are the environment's) and RP6 (a request's
own speculative metrics count only the verify results processed while it was live).

The environment's account is the ghost (``spec.relation.ghost_result``): upstream's
precedence in ``Req.update_finish_state`` is an abort requested before the result, then a
stop token inside the kept run (one past ``max_new_tokens`` is demoted to a length finish,
``_cap_finished_len_at_max_new_tokens``), then the length cap. Each case is pinned in the
reference, gpu_impl must agree op by op, and each check is shown failing on a wrong
scheduler. On sglang 0.5.23 the upstream tier finds U6 with RP5 (tests/test_upstream_tier.py).
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.spec import relation
from overlap_spec.spec.interface import RequestState
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.units import RequestId

CELL = "ov-p1-v2chain-cpu-honest"


def _iterate(prefill: bool = False, eos: bool = False, eos_offset: int = 0) -> Iterate:
    return Iterate(IterationChoices(allow_prefill=prefill, accept_lens=(4, 4, 4),
                                    eos_positions=frozenset({0}) if eos else frozenset(),
                                    eos_offset=eos_offset))


def _final(ops: list[Op], cell: str = CELL) -> tuple[RequestState, InvariantChecker]:
    script = Script(cell, "minimal", ops, ())
    config = script.get_config()
    checker = InvariantChecker(config)
    model = get_factory("reference")(config, frozenset(), checker)
    admitted: list[RequestId] = []
    for op in ops:
        apply_op(model, op, admitted)
    assert run_differential(script).ok
    return model.get_observable_state().requests[0], checker


# The prefill emits one token; the verify accepts 4 with the stop token at `index`, two
# tokens short of max_new_tokens=3.
@pytest.mark.parametrize(("index", "reason", "output"), [
    (0, "stop", 2),
    (1, "stop", 3),  # the stop token is the cap's token: a stop
    (2, "length", 3),  # one past the cap: demoted to a length finish
    (3, "length", 3),
])
def test_a_stop_token_past_the_cap_is_a_length_finish(index: int, reason: str,
                                                      output: int) -> None:
    ops: list[Op] = [Admit(1, 3), _iterate(prefill=True), _iterate(eos=True, eos_offset=3 - index),
                     _iterate(), _iterate()]
    request, checker = _final(ops)
    assert (request.status, request.finish_reason, len(request.output_ids)) == (
        "finished", reason, output)
    assert checker.exercised["RP5"] > 0


# The stop token ends the verify's run at 2 of its 4 tokens; an abort requested while it
# flew is promoted by the same result: the reason is the abort, the output the
# environment's 1 + 2 tokens (the release shows all 5: finding U6).
ABORT_WITH_A_STOP: list[Op] = [Admit(1, 8), _iterate(prefill=True),
                               _iterate(eos=True, eos_offset=2), Abort(0), _iterate()]


def test_an_abort_promoted_with_a_stop_keeps_the_environments_output() -> None:
    request, _ = _final(ABORT_WITH_A_STOP)
    assert (request.finish_reason, len(request.output_ids)) == ("abort", 3)


def test_rp5_catches_a_length_check_before_the_stop_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The order upstream fixed in update_finish_state ("Stop token/EOS beats the length
    cap"): checking the cap first labels a stop at the cap a length finish."""

    def length_first(to_finish: str | None, eos_at: int | None, run_len: int,
                     output_len: int, max_new_tokens: int, reason: str | None) -> str | None:
        if to_finish is None and output_len >= max_new_tokens:
            return "length"
        return original(to_finish, eos_at, run_len, output_len, max_new_tokens, reason)

    original = relation.compute_finished_reason
    monkeypatch.setattr(relation, "compute_finished_reason", length_first)
    ops: list[Op] = [Admit(1, 3), _iterate(prefill=True), _iterate(eos=True, eos_offset=2),
                     _iterate(), _iterate()]
    outcome = run_script(Script(CELL, "minimal", ops, ()))
    assert outcome.violation is not None and outcome.violation.invariant_id == "RP5"
    assert ("finished (length) with 3 visible output tokens, the environment ended it (stop)"
            in str(outcome.violation))


# r0's stop token finishes it at the verify launched second; the verify launched third,
# in flight by then, is a stale row when it is processed.
STALE_VERIFY: list[Op] = [Admit(1, 8), _iterate(prefill=True), _iterate(eos=True), _iterate(),
                          _iterate(), _iterate()]


def test_a_stale_verify_row_feeds_no_per_request_metrics() -> None:
    request, checker = _final(STALE_VERIFY)
    assert (request.finish_reason, request.spec_verify_ct,
            request.spec_num_correct_drafts) == ("stop", 1, 3)
    assert checker.exercised["RP6"] > 0


def test_rp6_catches_a_stale_row_processed_as_live(monkeypatch: pytest.MonkeyPatch) -> None:
    # No catalogue bug does this (B3 commits a stale row's run but keeps its output and
    # metrics skip): a mutant of the staleness test itself, every row processed as live.
    monkeypatch.setattr(relation, "is_stale", lambda req: False)
    outcome = run_script(Script(CELL, "minimal", STALE_VERIFY))
    assert outcome.violation is not None
    assert "RP6" in outcome.violation.all_ids
    assert "spec_verify_ct=2, spec_num_correct_drafts=6; its live verifies were 1" in str(
        outcome.violation)


def test_rp6_is_not_applicable_without_speculation() -> None:
    _, checker = _final([Admit(1, 3), _iterate(prefill=True), *[_iterate()] * 4],
                        cell="ov-p1-none")
    assert "RP6" not in checker.exercised and checker.exercised["RP5"] > 0


def test_the_differential_catches_a_gpu_impl_that_checks_the_cap_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap_spec.gpu_impl.req import Req

    def length_first(self: Req, hit_eos: bool) -> None:
        if self.to_finish is None and len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"
        else:
            original(self, hit_eos)

    original = Req.update_finish_state
    monkeypatch.setattr(Req, "update_finish_state", length_first)
    ops: list[Op] = [Admit(1, 3), _iterate(prefill=True), _iterate(eos=True, eos_offset=2),
                     _iterate(), _iterate()]
    outcome = run_differential(Script(CELL, "minimal", ops, ()))
    assert outcome.divergence is not None
    assert outcome.divergence.field.endswith("finish_reason"), outcome.describe()
