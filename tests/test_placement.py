"""RP10, one place per request: at the end of an iteration every unfinished request is in
exactly one of the waiting queue, the running batch, the last batch waiting for its merge and
the chunked slot; a finished one is in no waiting queue; what is in flight is the last batch's.

The clean reference shows each kind of place in an overlap cell, a chunked-prefill cell and a
radix cell (witnesses by construction, not by luck of a seed), and the claim holds on random
scripts. B37 (the retraction's re-queue skipped) loses a request: RP10 names it on the
reference, and gpu_impl with the same fault diverges from the clean reference. gpu_impl
reports no observations: the differential holds its queues and batches to the reference's.
"""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import (
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import InvariantViolation, get_invariant
from overlap_spec.spec.state import IterationChoices, Observation, ObservationPoint
from overlap_spec.spec.units import RequestId

RP10 = get_invariant("RP10")
CHUNKED = {"chunked_prefill_size": 4}


def iterate(**choices: object) -> Iterate:
    return Iterate(IterationChoices(**choices))  # type: ignore[arg-type]


# Two requests prefilled together and decoded; a third waits out an iteration without
# prefill, in which one running request is retracted (forced); both are admitted after. In a
# chunked cell the 10-token prompt is prefilled in three chunks; a radix cell's requests
# share a prompt family.
def _witness_ops(family: int | None = None) -> list[Op]:
    return [Admit(10, 6, family), Admit(3, 6, family), *[iterate() for _ in range(4)],
            Admit(2, 3, family), iterate(allow_prefill=False, retract=1),
            *[iterate() for _ in range(5)]]


def _run(script: Script) -> tuple[ModelConfig, list[Observation]]:
    """The reference's ITERATION_END observations of ``script``, each judged by RP10."""
    config = script.get_config()
    seen: list[Observation] = []
    model = get_factory("reference")(config, frozenset(script.faults), seen.append)
    admitted: list[RequestId] = []
    for index, op in enumerate(script.ops):
        model.set_step_index(index)
        apply_op(model, op, admitted)
    ends = [o for o in seen if o.point is ObservationPoint.ITERATION_END]
    for obs in ends:
        RP10.check(config, obs)
    return config, ends


def _places(obs: Observation) -> set[str]:
    """The kinds of place RP10 judged a live request in at ``obs``."""
    p = obs.placement
    assert p is not None
    kinds: set[str] = set()
    for r in obs.requests:
        if r.finished:
            continue
        if r.rid in p.waiting:
            kinds.add("retracted, waiting" if r.is_retracted else "waiting")
        if r.rid in p.running:
            kinds.add("running")
        if r.rid == obs.chunked_rid:
            kinds.add("chunked slot")
        elif r.rid in p.last and p.last_mode in ("extend", "mixed") and not p.last_is_running:
            kinds.add("last batch, before its merge")
        if any(r.rid in batch for batch in p.in_flight):
            kinds.add("in flight")
    return kinds


CASES = {
    "overlap": (Script("ov-p1-none", "minimal", _witness_ops()),
                {"waiting", "retracted, waiting", "running", "last batch, before its merge",
                 "in flight"}),
    "chunked prefill": (Script("ov-p1-none", "minimal", _witness_ops(), sizes=CHUNKED),
                        {"chunked slot", "retracted, waiting", "running",
                         "last batch, before its merge", "in flight"}),
    "radix": (Script("ov-p1-none-radix", "minimal", _witness_ops(family=0)),
              {"waiting", "retracted, waiting", "running", "last batch, before its merge",
               "in flight"}),
    "no overlap": (Script("nov-p4-none", "minimal", _witness_ops()),
                   {"waiting", "retracted, waiting", "running",
                    "last batch, before its merge"}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_clean_reference_witnesses_every_place(case: str) -> None:
    script, expected = CASES[case]
    config, ends = _run(script)
    judged = sum(RP10.check(config, obs) for obs in ends)
    assert judged > 0
    kinds = set().union(*(_places(obs) for obs in ends))
    assert expected <= kinds, sorted(expected - kinds)
    if "in flight" not in expected:  # without overlap every result is processed in its step
        assert all(not obs.placement or not obs.placement.in_flight for obs in ends)


@pytest.mark.parametrize("cell,sizes", [
    ("ov-p1-none", {}), ("nov-p4-none", {}), ("ov-p1-v2chain-cpu-honest", {}),
    ("ov-p4-v2chain-nocpu-preclaim", {}), ("ov-p1-none-overshoot", {}),
    ("ov-p1-none-radix", {}), ("ov-p1-none", CHUNKED), ("nov-p4-none", CHUNKED),
    ("ov-p1-none", {"chunked_prefill_size": 8, "mixed_chunk": 1, "kv_tokens": 16})])
def test_the_claim_holds_on_random_scripts(cell: str, sizes: dict[str, int]) -> None:
    for seed in range(3):
        script = Script(cell, "minimal", sizes=sizes)
        ops = generate_random_ops(script.get_config(), random.Random(seed), 60)
        outcome = run_script(replace(script, ops=ops))
        assert outcome.violation is None, (seed, str(outcome.violation))
        assert outcome.checker.exercised["RP10"] > 0


def test_a_retracted_request_dropped_from_every_queue_is_caught() -> None:
    """B37 on the reference: the forced retraction's victim is in no place at the end of
    that iteration. gpu_impl with B37 diverges from the clean reference."""
    script = replace(CASES["overlap"][0], faults=("B37",))
    with pytest.raises(InvariantViolation, match=r"RP10 violated for request r\d+: "
                       r"unfinished and in 0 places \(none\), expected one"):
        _run(script)
    faulted = run_differential(replace(script, implementation="gpu_impl"))
    assert faulted.divergence is not None, faulted.describe()
    assert run_differential(replace(script, faults=(), implementation="gpu_impl")).ok


def test_each_branch_of_the_claim_fails_and_a_view_without_placement_is_not_judged() -> None:
    config, ends = _run(CASES["chunked prefill"][0])
    obs = next(o for o in ends if o.placement and o.placement.in_flight
               and o.chunked_rid is not None)
    done = next(o for o in ends if any(r.finished for r in o.requests))
    assert obs.placement is not None and done.placement is not None
    chunked = obs.chunked_rid
    finished = next(r.rid for r in done.requests if r.finished)
    broken = {
        r"finished \(\w+\) and in 1 places \(the waiting queue\), expected not the": replace(
            done, placement=replace(done.placement, waiting=(*done.placement.waiting, finished))),
        "in flight, not in the last batch": replace(obs, placement=replace(
            obs.placement, in_flight=((*obs.placement.in_flight[0], RequestId(99)),))),
        # the chunked request merged as well as kept in its slot
        "in 2 places .*the running batch, the chunked slot": replace(obs, placement=replace(
            obs.placement, running=(*obs.placement.running, chunked))),
        # a request of the prefill dropped from the last batch before its merge
        "in 0 places": replace(obs, placement=replace(
            obs.placement, waiting=(), running=(), last=(chunked,), in_flight=())),
    }
    for message, view in broken.items():
        with pytest.raises(InvariantViolation, match=message):
            RP10.check(config, view)
    assert RP10.check(config, replace(obs, placement=None)) == 0  # a trace's call
    assert RP10.check(config, replace(obs, point=ObservationPoint.LAUNCH)) == 0


@pytest.mark.parametrize("case", ["overlap", "no overlap"])
def test_a_finished_request_waits_for_the_next_filter_in_its_batch(case: str) -> None:
    """Why RP10 lets a finished request stay in a batch at the end of an iteration: the
    result that finishes it is processed after the step's filter, so it leaves its batch at
    the next step's (get_next_batch_to_run, scheduler.py:3963-3968)."""
    _, ends = _run(CASES[case][0])
    def get_lingering(obs: Observation) -> set[RequestId]:
        p = obs.placement
        assert p is not None
        return {r.rid for r in obs.requests if r.finished and r.rid in (*p.running, *p.last)}

    lingering = [get_lingering(obs) for obs in ends]
    assert any(lingering)
    # each one leaves at the next step: never in a batch at two iterations' ends in a row
    assert not any(now & after for now, after in pairwise(lingering))
