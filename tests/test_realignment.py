"""The release's loop around a length finish and a retraction (issue 12: A2, A7, A10, A11).

sglang 0.5.23's ``event_loop_overlap`` sets ``enable_skip_finishing_decode``: a member of
the queued result's batch that one more output token finishes by length sits out the
next decode (``_reqs_finishing_inflight``), and a decode short of KV only because of
them is skipped rather than retracted; ``get_next_batch_to_run`` filters the running
batch at every step; ``retract_decode`` leaves the kept requests in the retraction
policy's order. The ``overshoot`` era cells keep the earlier loop. Each behaviour is
pinned here in the reference, and gpu_impl must agree op by op.
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    apply_op,
    run_script,
)
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.units import RequestId


def _run(cell: str, admissions: list[tuple[int, int]], iterations: int) -> Scheduler:
    scheduler = Scheduler(ModelConfig(get_cell(cell), MINIMAL))
    for prompt_len, max_new_tokens in admissions:
        scheduler.admit(prompt_len, max_new_tokens)
    for _ in range(iterations):
        scheduler.run_iteration(IterationChoices())
    return scheduler


@pytest.mark.parametrize(("cell", "launches", "committed", "cached"), [
    ("ov-p1-none", 2, 3, 3),  # prefill, one decode; the queued decode result finishes it
    ("ov-p1-none-overshoot", 3, 4, 4),  # the era decodes it once more (#24590)
    ("ov-p1-v2chain-cpu-honest", 2, 3, 3),
    # The pre-claim era is an overshoot era: the tick's claimed bonus is committed at the
    # finish release (and cached), refunded when its stale result lands.
    ("ov-p1-v2chain-cpu-preclaim", 3, 3, 4),
    ("nov-p1-none", 2, 3, 3),  # without overlap nothing is in flight at scheduling
])
def test_a_length_finish_is_decoded_once_more_only_in_the_overshoot_era(
        cell: str, launches: int, committed: int, cached: int) -> None:
    scheduler = Scheduler(ModelConfig(get_cell(cell), MINIMAL))
    scheduler.admit(2, 2)
    launched = 0
    for _ in range(5):
        scheduler.run_iteration(IterationChoices())
        launched += scheduler.last_batch is not None
    request = scheduler.get_observable_state().requests[0]
    assert (request.status, len(request.output_ids)) == ("finished", 2)
    assert launched == launches
    assert request.kv_committed_len == committed
    # owned_kv_len: committed at the release, cut at prompt + the visible output (4); the
    # era's overshoot slot is cached too (what #24590 asked about).
    assert request.cached_len == cached


# r0 is admitted by the budget; two PD-prebuilt requests, which admission does not budget
# (the model's own rule for them: a row and the prompt's pages), fill the page-4 pool. At
# iteration 5 r0's queued result finishes it by length, and r1 and r2 each need a new page
# with none free but r0's.
SHORT_OF_KV = [Admit(5, 5), AdmitPrebuilt(4, 7), AdmitPrebuilt(4, 7)] + [
    Iterate(IterationChoices()) for _ in range(8)]


def test_a_decode_short_of_only_the_finishing_requests_kv_is_skipped_not_retracted() -> None:
    scheduler = Scheduler(ModelConfig(get_cell("ov-p4-none"), MINIMAL))
    for op in SHORT_OF_KV[:3]:
        if isinstance(op, AdmitPrebuilt):
            scheduler.admit_prebuilt(op.prompt_len, op.max_new_tokens)
        else:
            scheduler.admit(op.prompt_len, op.max_new_tokens)
    launched: list[tuple[int, ...] | None] = []
    for _ in range(8):
        scheduler.run_iteration(IterationChoices())
        assert not scheduler.waiting_queue  # nothing is ever retracted
        batch = scheduler.last_batch
        launched.append(None if batch is None else tuple(int(r.rid) for r in batch.reqs))
    assert launched[4] == (1, 2, 0) and launched[5] is None and launched[6] == (1, 2)
    states = {int(r.rid): r for r in scheduler.get_observable_state().requests}
    assert states[0].status == "finished" and len(states[0].output_ids) == 5
    assert states[1].status == states[2].status == "running"


@pytest.mark.parametrize("cell", ["ov-p4-none", "ov-p1-none", "ov-p1-none-overshoot"])
def test_gpu_impl_agrees_around_a_length_finish(cell: str) -> None:
    outcome = run_differential(Script(cell, "minimal", list(SHORT_OF_KV)))
    assert outcome.ok, outcome


def test_the_running_batch_is_filtered_at_every_step() -> None:
    """Without overlap, r0 finishes in iteration 1; iteration 2 prefills r1, and the
    running batch no longer lists r0 (the release filters before admission)."""
    scheduler = _run("nov-p1-none", [(2, 2)], 2)
    assert scheduler.requests[0].finished()  # type: ignore[index]
    scheduler.admit(1, 3)
    scheduler.run_iteration(IterationChoices())
    assert scheduler.last_batch is not None and scheduler.last_batch.forward_mode == "extend"
    state = scheduler.get_observable_state()
    assert state.running is None, state.running


# Prompts 3, 1, 5: a forced retraction takes r2 and leaves r1 before r0 (the release's
# filter_batch(keep_indices=sorted_indices)), so the EOS at position 0 two iterations
# later finishes r1, not r0 (A11, realigned). A 64-token pool: the release's budget admits
# all three at once (the page-4 cell's third asks 5 + 8 + 4 tokens of 32 left).
POOL_64 = {"kv_tokens": 64}
POLICY_ORDER = [Admit(3, 8), Admit(1, 8), Admit(5, 8), Iterate(IterationChoices()),
                Iterate(IterationChoices(retract=1)), Iterate(IterationChoices()),
                Iterate(IterationChoices(eos_positions=frozenset({0}))),
                Iterate(IterationChoices())]


@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p4-none", "ov-p1-v2chain-cpu-honest"])
def test_a_retraction_leaves_the_kept_requests_in_the_policy_order(cell: str) -> None:
    scheduler = Scheduler(Script(cell, "minimal", sizes=POOL_64).get_config())
    for op in POLICY_ORDER[:3]:
        scheduler.admit(op.prompt_len, op.max_new_tokens)  # type: ignore[union-attr]
    scheduler.run_iteration(IterationChoices())
    scheduler.run_iteration(IterationChoices(retract=1))
    assert scheduler.running_batch is not None
    assert [int(r.rid) for r in scheduler.running_batch.reqs] == [1, 0]
    assert run_differential(Script(cell, "minimal", list(POLICY_ORDER), sizes=POOL_64)).ok


@pytest.mark.parametrize(("cell", "fails"), [("ov-p1-none-overshoot", True),
                                             ("ov-p1-v2chain-cpu-preclaim", True),
                                             ("ov-p1-none", False),
                                             ("ov-p1-v2chain-cpu-honest", False)])
def test_rp4_fails_on_the_overshoot_decode_and_holds_in_the_release(cell: str,
                                                                      fails: bool) -> None:
    """RP4 is n/a in the overshoot era's cells; applied there anyway, it names the decode
    the release skips (the request its queued result finishes by length)."""
    from overlap_spec.spec.invariants import InvariantViolation, check_rp4, get_invariant

    config = ModelConfig(get_cell(cell), MINIMAL)
    assert get_invariant("RP4").applies(config.cell) is not fails
    seen: list[str] = []
    witnesses = 0

    def observe(obs: object) -> None:
        nonlocal witnesses
        try:
            witnesses += check_rp4(config, obs)  # type: ignore[arg-type]
        except InvariantViolation as violation:
            seen.append(str(violation))

    scheduler = Scheduler(config, observer=observe)
    scheduler.admit(2, 3)
    scheduler.admit(1, 2)
    for _ in range(6):
        scheduler.run_iteration(IterationChoices())
    assert witnesses > 0
    assert bool(seen) is fails, seen
    if fails:
        assert seen[0].startswith("RP4 violated for request r1: launched with 1 output tokens"
                                  " and 1 result(s) in flight"), seen[0]


# ---- the release's out-of-memory abort of the last request (retract_decode, #19881)
def _sized(cell: str, ops: list[Op]) -> Script:
    return Script(cell, "minimal", ops, sizes={"kv_tokens": 12})


ALONE = [Admit(5, 8)] + [Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset()))] * 4
# Two requests of 4: the first decode needs 2 * 4 + 4 = 12 slots each with 8 held, so r1 is
# retracted; two decodes later r0 alone outgrows the pool and is aborted; r1 comes back.
TWO = [Admit(4, 8), Admit(4, 8)] + [Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset()))] * 7


@pytest.mark.parametrize("cell", ["ov-p1-v2chain-cpu-honest", "nov-p1-v2chain-cpu-honest",
                                  "ov-p1-v2chain-cpu-preclaim", "ov-p1-v2tree-cpu-honest"])
def test_the_last_request_that_cannot_fit_is_aborted_not_a_crash(cell: str) -> None:
    """One request whose next decode alone outgrows a 12-token pool: the release aborts it
    ("Out of memory even after retracting all other requests") rather than raise; it leaves
    finished "abort" in no queue, its KV all freed, and every invariant holds."""
    script = _sized(cell, ALONE)
    outcome = run_script(script, catch_crash=True)
    assert outcome.crash is None and outcome.violation is None, outcome
    scheduler = Scheduler(script.get_config())
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(scheduler, op, admitted)
    state = scheduler.get_observable_state()
    (request,) = state.requests
    assert (request.status, request.finish_reason) == ("finished", "abort")
    assert (request.kv_committed_len, request.kv_allocated_len) == (0, 0)
    assert state.free_pages == 12 and state.running is None and not scheduler.waiting_queue
    # Under overlap the prefill's result was in flight at the abort: it is stale, dropped.
    assert len(request.output_ids) == (0 if script.get_config().cell.overlap else 1)
    assert run_differential(script).ok


def test_the_others_are_retracted_first_and_the_last_one_aborted() -> None:
    script = _sized("ov-p1-v2chain-cpu-honest", TWO)
    scheduler = Scheduler(script.get_config())
    admitted: list[RequestId] = []
    statuses = []
    for op in script.ops:
        apply_op(scheduler, op, admitted)
        statuses.append(tuple((r.status, r.finish_reason)
                              for r in scheduler.get_observable_state().requests))
    assert statuses[3] == (("running", None), ("waiting", None))  # r1 retracted
    assert statuses[5] == (("finished", "abort"), ("waiting", None))  # r0 alone: aborted
    assert statuses[6] == (("finished", "abort"), ("running", None))  # r1 re-admitted
    assert run_script(script).violation is None
    assert run_differential(script).ok
