"""Chunked prefill (``chunked_prefill_size``): the relation's chunk transitions, the
release's cut rules, the reference run step by step against the release's field table
(docs/upstream-chunked-prefill.md), the Hypothesis machine with chunking on, the new
claims shown able to fail, and gpu_impl differential-tested against the reference with it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from overlap_spec.harness.drive.cells import UsageError, check_sizes, make_preset
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    run_script,
)
from overlap_spec.harness.drive.stateful import (
    check_cell,
    describe_failure,
    get_profile,
    make_machine,
)
from overlap_spec.harness.exhaust.alphabet import get_alphabet
from overlap_spec.reference import scheduler as reference_scheduler
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec import relation, transitions
from overlap_spec.spec.config import ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation
from overlap_spec.spec.relation import GuardViolation
from overlap_spec.spec.state import IterationChoices, Observation, ObservationPoint
from overlap_spec.spec.transitions import (
    compute_chunk_continuation_end,
    compute_chunk_first_end,
)
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

SEED = 20261122
NON_SPEC = get_cell("ov-p1-none")


def chunked(cell: str, size: int = 4, **sizes: int) -> ModelConfig:
    return ModelConfig(get_cell(cell), make_preset("minimal",
                                                   {"chunked_prefill_size": size, **sizes}))


# --- the relation -------------------------------------------------------------------------
def test_a_middle_chunk_commits_its_end_and_its_result_only_counts_down() -> None:
    req = relation.admit(RequestId(3), TokenCount(10), TokenCount(4))
    req = relation.prepare_for_extend(req, PoolRow(1), 4)
    assert (req.kv_committed_len, req.kv_allocated_len, req.extend_end) == (4, 4, 4)
    assert req.inflight_middle_chunks == 1
    req = relation.forward_extend(relation.launch(req, StepId(0)), StepId(0), 4)
    req = relation.process_result(req, NON_SPEC, StepId(0), "extend", 1, None, (55,))
    assert req.inflight_middle_chunks == 0 and req.output_ids == ()
    assert req.ghost.extend_inflight and req.ghost.output_len_true == 0
    with pytest.raises(GuardViolation, match="prefix_len"):
        relation.prepare_next_chunk(req, 8)  # not checkpointed yet
    req = relation.prepare_next_chunk(relation.stash_chunked_request(req), 10)
    assert (req.prefix_len, req.extend_end, req.inflight_middle_chunks) == (4, 10, 0)
    req = relation.forward_extend(relation.launch(req, StepId(1)), StepId(1), 10)
    req = relation.process_result(req, NON_SPEC, StepId(1), "extend", 1, None, (56,))
    assert req.output_ids == (56,) and not req.ghost.extend_inflight
    assert req.ghost.output_len_true == 1 and req.ghost.settled_len == 10


def test_the_chunked_abort_needs_a_requested_abort_and_caches_nothing() -> None:
    req = relation.prepare_for_extend(
        relation.admit(RequestId(1), TokenCount(9), TokenCount(2)), PoolRow(1), 4)
    with pytest.raises(GuardViolation, match="to_finish"):
        relation.finish_chunked_abort(req)
    req = relation.finish_chunked_abort(relation.abort(req))
    assert req.finished_reason == "abort" and req.ghost.finished
    released = relation.release_kv_cache(req, NON_SPEC, False)
    assert (released.cached_len, released.committed_at_release) == (0, 4)


@pytest.mark.parametrize(("fill", "budget", "page", "end"), [
    (10, None, 1, 10),  # chunking off
    (4, 4, 1, 4),  # fits whole
    (10, 4, 1, 4),
    (10, 4, 4, 4),
    (10, 7, 4, 4),  # page-floored
    (3, 4, 4, 3),  # its paged length (4) fits
    (5, 4, 4, 4),
    (5, 3, 4, 0),  # no whole page left: OTHER
])
def test_a_first_chunk_is_the_budget_page_floored(fill: int, budget: int | None, page: int,
                                                  end: int) -> None:
    assert compute_chunk_first_end(fill, budget, page) == end


@pytest.mark.parametrize(("prefix", "fill", "budget", "remaining", "end"), [
    (4, 10, 4, 100, 8),
    (8, 10, 4, 100, 10),  # the last chunk
    (4, 10, 4, 3, 7),  # the budget's remaining total binds: not page-floored
    (4, 10, 4, 0, 8),  # none remaining: the chunk budget all the same
    (4, 10, 4, -5, 8),
])
def test_a_continuing_chunk_takes_the_budget_or_what_remains(
        prefix: int, fill: int, budget: int, remaining: int, end: int) -> None:
    assert compute_chunk_continuation_end(prefix, fill, budget, remaining) == end


def test_the_chunk_size_is_range_and_page_checked() -> None:
    with pytest.raises(UsageError, match="chunked_prefill_size"):
        make_preset("minimal", {"chunked_prefill_size": -1})
    message = check_sizes(chunked("ov-p4-none", 6))
    assert message is not None and "whole pages of 4" in message
    assert check_sizes(chunked("ov-p4-none", 8)) is None


# --- the reference, step by step ------------------------------------------------------------
@contextmanager
def observed(config: ModelConfig, faults: frozenset[str] = frozenset()
             ) -> Iterator[tuple[Scheduler, list[Observation]]]:
    """A reference scheduler whose every observation is checked against every invariant
    that applies in its cell (the first violation raises)."""
    seen: list[Observation] = []
    applying = [inv for inv in INVARIANTS if inv.applies(config.cell)]

    def observe(obs: Observation) -> None:
        for inv in applying:
            inv.check(config, obs)
        seen.append(obs)

    yield Scheduler(config, faults, observe), seen


@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p1-none", "ov-p1-v2chain-cpu-honest",
                                  "nov-p4-v2chain-cpu-honest"])
def test_a_prompt_goes_in_chunks_out_of_the_running_batch(cell: str) -> None:
    """A prompt of 2 then one of 10, chunks of 4 (the release's field table): on page 1 the
    short one leaves 2 of the first step's budget, so the long one is committed 2, 6, then
    10; on page 4 it leaves none, so 4, 8, then 10 a step later. No output until the last
    chunk's result; a step that admits nothing decodes the short one, the chunked one left
    out."""
    config = chunked(cell)
    page_1 = config.page_size == 1
    with observed(config) as (sched, seen):
        short = sched.admit(2, 6)
        rid = sched.admit(10, 3)
        committed = []
        for allow_prefill in (True, True, False, True, True):
            sched.run_iteration(IterationChoices(allow_prefill=allow_prefill))
            req = sched.requests[rid]
            committed.append(req.kv_committed_len)
            if sched.chunked_req is not None:
                assert req.output_ids == ()
        # (page 1: the fifth step decodes it, a non-spec decode claiming one more slot)
        assert committed[:4] == [2, 6, 6, 10] if page_1 else committed == [0, 4, 4, 8, 10]
        for _ in range(10):
            sched.run_iteration(IterationChoices())
        assert sched.requests[rid].finished_reason == "length"
        assert len(sched.requests[rid].output_ids) == 3
    decodes = [obs for obs in seen if obs.point is ObservationPoint.PREPARE_FOR_DECODE]
    mid_chunk = [obs for obs in decodes if obs.chunked_rid == rid]
    assert mid_chunk, "the short request decoded while the long one was chunked"
    assert all(obs.batch is not None and short in obs.batch.rids and rid not in obs.batch.rids
               for obs in mid_chunk)
    continued = [obs.admission.continued for obs in seen if obs.admission is not None
                 and obs.admission.continued is not None]
    assert [c[0] for c in continued] == [rid, rid]
    assert max(r.inflight_middle_chunks for obs in seen for r in obs.requests) == (
        2 if config.cell.overlap else 1)


def test_an_abort_mid_chunk_waits_for_the_next_step_and_frees_everything() -> None:
    """Under overlap the first chunk is still in flight at the teardown: its result then
    only counts down, and no token is shown."""
    config = chunked("ov-p1-none")
    with observed(config) as (sched, _):
        rid = sched.admit(10, 3)
        sched.run_iteration(IterationChoices())
        free_before = sched.get_observable_state().free_pages
        sched.abort(rid)
        req = sched.requests[rid]
        assert not req.finished() and req.holds_kv  # marked, not torn down
        assert req.inflight_middle_chunks == 1
        sched.run_iteration(IterationChoices())
        assert req.finished_reason == "abort" and not req.holds_kv
        assert req.cached_len == 0 and sched.chunked_req is None
        assert sched.get_observable_state().free_pages == free_before + 4
        for _ in range(2):
            sched.run_iteration(IterationChoices())
        assert req.inflight_middle_chunks == 0 and req.output_ids == ()
        assert not sched.result_queue


# --- the machine with chunking on ---------------------------------------------------------------
def test_the_reference_holds_every_invariant_with_chunking(tier_cell: str) -> None:
    """The six default-tier cells (every cell under ``-m slow``) with prompts in chunks of
    4 (on page 4 one page a chunk): clean, and KV12 witnessed. KV12's witnesses do not
    show a chunk by themselves (it counts whole prefills too), so the same budget and seed
    with B18 switched on must fail: the machine drew prompts of three chunks or more (with
    chunks of 8 on page 4 it did not, at this budget, in 6 of the 8 page-4 cells). The
    budget is the ci profile's: without prebuilt arrivals, which are not drawn with
    chunking, the quick one drew no such prompt in a pre-claim tree cell."""
    config = chunked(tier_cell)
    result = check_cell(config, get_profile("ci"), SEED)
    assert result.ok, describe_failure(result)
    assert result.exercised["KV12"] > 0 and result.exercised["KV11"] > 0
    faulted = check_cell(config, get_profile("ci"), SEED, frozenset({"B18"}), shrink=False)
    assert not faulted.ok, f"B18 survived in {config.name}: no prompt of three chunks drawn"


def _run_until_violation(config: ModelConfig,
                         faults: frozenset[str] = frozenset()) -> InvariantViolation:
    with observed(config, faults) as (sched, _):
        sched.admit(14, 2)
        sched.admit(3, 2)
        with pytest.raises(InvariantViolation) as caught:
            for _ in range(12):
                sched.run_iteration(IterationChoices())
    return caught.value


@pytest.mark.parametrize(("cell", "caught_by"), [("nov-p1-none", "RP2"),
                                                ("ov-p1-none", "KV12")])
def test_b18_a_continuing_chunk_left_uncounted_is_caught(cell: str, caught_by: str) -> None:
    """B18 (sgl-project/sglang-jax #971): the counter not bumped for a continuing middle
    chunk. Without overlap the chunk's result is taken for the last one's at once (RP2: a
    token the model never emitted); with overlap the iteration ends with the counter one
    short of the middle chunks in flight (KV12)."""
    violation = _run_until_violation(chunked(cell), frozenset({"B18"}))
    assert violation.invariant_id == caught_by, str(violation)


def test_a_chunked_request_merged_into_the_running_batch_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked request left in the merge (no ``reqs_to_exclude``): in the running batch
    and the chunked slot at the iteration's end (RP10), then decoded mid-prompt (KV12)."""
    monkeypatch.setattr(Scheduler, "get_merge_exclusions", lambda self, last: set())
    violation = _run_until_violation(chunked("ov-p1-none"))
    assert violation.invariant_id == "RP10", str(violation)
    assert "in 2 places (the running batch, the chunked slot)" in str(violation)
    monkeypatch.setitem(globals(), "INVARIANTS", [i for i in INVARIANTS if i.id != "RP10"])
    violation = _run_until_violation(chunked("ov-p1-none"))
    assert violation.invariant_id == "KV12", str(violation)


# --- gpu_impl against the reference with chunking on -------------------------------------------
def test_gpu_impl_agrees_with_the_reference_with_chunking(tier_cell: str) -> None:
    """The differential (``overlap-spec diff --sizes chunked_prefill_size=4``) in the six
    default-tier cells (every cell under ``-m slow``): gpu_impl's chunks, kept row, merge
    exclusions, middle-chunk results and deferred abort agree with the reference after
    every operation, with no race."""
    from overlap_spec.harness.differential.compare import check_cell_differential

    result = check_cell_differential(chunked(tier_cell), get_profile("quick"), SEED,
                                     max_examples=12, top_up=True)
    assert result.error is None, f"crash: {result.error!r}"
    assert result.failure is None, (
        f"{result.failure.outcome.describe()}\nscript: {result.failure.script.ops}")
    assert result.compared_ops > 0 and result.launches > 0


# --- mixed chunks (enable_mixed_chunk) ---------------------------------------------------------
MIXED_CELLS = ["ov-p1-none", "nov-p1-none", "ov-p4-none", "nov-p4-none", "ov-p1-none-trimmed",
               "ov-p1-none-overshoot"]


def mixed(cell: str, size: int = 4, **sizes: int) -> ModelConfig:
    return chunked(cell, size, mixed_chunk=1, **sizes)


def test_mixed_chunks_need_chunking() -> None:
    assert check_sizes(mixed("ov-p1-none")) is None
    alone = ModelConfig(NON_SPEC, make_preset("minimal", {"mixed_chunk": 1}))
    assert "without 'chunked_prefill_size'" in (check_sizes(alone) or "")
    with pytest.raises(UsageError, match="mixed_chunk"):
        make_preset("minimal", {"mixed_chunk": 2})


@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p1-none"])
def test_a_decode_rides_in_each_chunk(cell: str) -> None:
    """A prompt of 2 then one of 10, chunks of 4, mixed: the first step admits 2 + a first
    chunk of 2 (nothing runs yet); from then on the short request's decode takes one token
    of each step's chunk budget (``num_mixed_decode_tokens``), so the long one goes 2, 5,
    8, 10, each chunk launched in one "mixed" batch with that decode, the running batch
    left empty in between; once the prompt is whole both decode as usual. No new-token
    ratio decay at a mixed step (``update_running_batch`` does not run)."""
    config = mixed(cell)
    with observed(config) as (sched, seen):
        short = sched.admit(2, 6)
        rid = sched.admit(10, 3)
        committed, outputs, running = [], [], []
        for _ in range(4):
            sched.run_iteration(IterationChoices())
            committed.append(sched.requests[rid].kv_committed_len)
            outputs.append(len(sched.requests[short].output_ids))
            running.append(sched.get_observable_state().running)
        assert sched.new_token_ratio == 0.7  # nothing decayed it
        for _ in range(8):
            sched.run_iteration(IterationChoices())
        assert sched.requests[rid].finished_reason == "length"
        assert len(sched.requests[short].output_ids) == 6
    assert committed == [2, 5, 8, 10]
    lag = 1 if config.cell.overlap else 0  # under overlap a result lands a step later
    assert outputs == [1 - lag, 2 - lag, 3 - lag, 4 - lag]
    assert running[1:] == [None, None, None]  # the decodes ride in the mixed batch
    launches = [obs.launch for obs in seen if obs.point is ObservationPoint.LAUNCH]
    modes = [launch.forward_mode for launch in launches if launch is not None]
    assert modes[:5] == ["extend", "mixed", "mixed", "mixed", "decode"]
    for launch in launches[1:4]:
        assert launch is not None and [m.rid for m in launch.members] == [rid, short]
        assert [m.write_width for m in launch.members] == [0, 1]
    views = [obs.admission for obs in seen if obs.admission is not None]
    assert [v.mixed_decode_tokens for v in views] == [0, 1, 1, 1]
    assert [v.continued[4] for v in views[1:] if v.continued] == [5, 8, 10]


@pytest.mark.parametrize("cell", MIXED_CELLS)
def test_the_reference_holds_every_invariant_with_mixed_chunks(cell: str) -> None:
    """The non-spec cells with prompts in chunks of 8 and the decodes mixed in, on a pool of
    16 tokens (where prompts capped to 0 new tokens are common): clean, with KV11, KV12 and
    RP8 witnessed. The same budget and seed with B19 switched on must fail: mixed batches
    whose prefill is prefill-only were drawn."""
    config = mixed(cell, 8, kv_tokens=16)
    result = check_cell(config, get_profile("quick"), SEED)
    assert result.ok, describe_failure(result)
    assert all(result.exercised[i] > 0 for i in ("KV11", "KV12", "RP8"))
    faulted = check_cell(config, get_profile("quick"), SEED, frozenset({"B19"}), shrink=False)
    assert not faulted.ok, f"B19 survived in {config.name}: no prefill-only mixed batch drawn"


@pytest.mark.parametrize("cell", ["nov-p1-none", "ov-p1-none"])
def test_b19_a_mixed_batch_left_prefill_only_is_caught(cell: str) -> None:
    """B19 (#10889): a prompt the pool caps to 0 new tokens (22 tokens on the minimal preset,
    queued as one refused token) prefilled with a running decode mixed in. The merged batch
    keeps the prefill's prefill-only flag, so the decode it carries would never run again:
    RP8 at the mixed launch. Without the fault the flag is cleared."""
    for faults in (frozenset(), frozenset({"B19"})):
        with observed(mixed(cell), faults) as (sched, seen):
            sched.admit(2, 6)
            sched.run_iteration(IterationChoices())
            capped = sched.admit(22, 3)
            assert sched.requests[capped].max_new_tokens == 0
            if not faults:
                for _ in range(3):
                    sched.run_iteration(IterationChoices())
                flags = [(obs.batch.forward_mode, obs.batch.is_prefill_only) for obs in seen
                         if obs.point is ObservationPoint.LAUNCH and obs.batch is not None]
                assert ("mixed", False) in flags and ("extend", True) not in flags
                continue
            with pytest.raises(InvariantViolation) as caught:
                for _ in range(3):
                    sched.run_iteration(IterationChoices())
            assert caught.value.invariant_id == "RP8", str(caught.value)


def test_a_continuation_with_no_chunk_budget_left_is_refused() -> None:
    """Running decodes at or above the chunk size while a prompt is chunked would make the
    release prefill an empty (or negative) chunk (``available_chunk_tokens`` passes a
    non-positive budget through). Each step admits within what the running decodes leave,
    so admissions alone never get there; KV11 states it, and the relation refuses such a
    chunk."""
    from overlap_spec.spec.state import AdmissionView, BatchView

    config = mixed("nov-p1-none")
    view = AdmissionView(0.7, 32, 2, ((6, 1),) * 4, (), 0, chunk_size=4,
                         continued=(RequestId(4), 4, 10, 3, 4), mixed_decode_tokens=4)
    batch = BatchView("extend", (RequestId(4),), (4,), (4,), 4, (PoolRow(1),), (PoolRow(1),),
                      None, None)
    obs = Observation(point=ObservationPoint.PREPARE_FOR_EXTEND, step_index=0, requests=(),
                      batch=batch, allocator=None, races=(),  # type: ignore[arg-type]
                      admission=view)
    kv11 = next(inv for inv in INVARIANTS if inv.id == "KV11")
    with pytest.raises(InvariantViolation, match="empty chunk"):
        kv11.check(config, obs)
    record = relation.RequestRecord(RequestId(4), TokenCount(10), TokenCount(3),
                                    kv_committed_len=4, kv_allocated_len=4,
                                    req_pool_idx=PoolRow(1), holds_kv=True, waiting=False,
                                    prefix_len=4, extend_end=4)
    with pytest.raises(GuardViolation, match="extend_end"):
        relation.prepare_next_chunk(record, 4)


@pytest.mark.parametrize("cell", ["nov-p1-none", "ov-p1-none"])
def test_prebuilt_arrivals_make_the_chunk_wait_not_empty(cell: str) -> None:
    """PD-prebuilt requests join the running batch outside the chunk budget, so four of them
    leave a chunk of 4 nothing: the model's own rule (the release's decode instances do not
    chunk) lets the chunked prompt wait while they decode, then go on; every invariant
    holds throughout."""
    config = mixed(cell, 4, max_running_requests=6, kv_tokens=64)
    with observed(config) as (sched, seen):
        rid = sched.admit(10, 3)
        sched.run_iteration(IterationChoices())
        for _ in range(4):
            sched.admit_prebuilt(2, 3)
        for _ in range(8):
            sched.run_iteration(IterationChoices())
        assert sched.requests[rid].finished_reason == "length"
    launches = [(obs.launch.forward_mode, [m.rid for m in obs.launch.members]) for obs in seen
                if obs.point is ObservationPoint.LAUNCH and obs.launch is not None]
    assert launches[:4] == [("extend", [rid]), ("decode", [1, 2, 3, 4]),
                            ("decode", [1, 2, 3, 4]), ("extend", [rid])]


# Two of the seven (page 4 with overlap, about 2 s of CPU each) are ``slow``: .ci/run runs
# them (its step of the default tier's long tests), and CI's `./dev check` runs the
# differential with mixed chunks in every cell (its default run's size variants).
@pytest.mark.parametrize(("cell", "size"), [("ov-p1-none", 4), ("nov-p4-none", 8),
                                            pytest.param("ov-p4-none", 8,
                                                         marks=pytest.mark.slow),
                                            ("nov-p1-none", 4),
                                            ("ov-p1-v2chain-cpu-honest", 4),
                                            ("nov-p1-v2tree-cpu-honest", 4),
                                            pytest.param("ov-p4-v2chain-cpu-honest", 8,
                                                         marks=pytest.mark.slow)])
def test_gpu_impl_agrees_with_the_reference_with_mixed_chunks(cell: str, size: int) -> None:
    """The differential (``overlap-spec diff --sizes chunked_prefill_size=N,mixed_chunk=1``):
    gpu_impl's mixed batches (the decode rows' relay gather on the forward stream, the
    per-row result modes, the empty running batch; in spec cells the tails' rebinding from
    the relay and their commit) agree with the reference after every operation, with no
    race."""
    from overlap_spec.harness.differential.compare import check_cell_differential

    result = check_cell_differential(mixed(cell, size), get_profile("quick"), SEED,
                                     max_examples=12, top_up=True)
    assert result.error is None, f"crash: {result.error!r}"
    assert result.failure is None, (
        f"{result.failure.outcome.describe()}\nscript: {result.failure.script.ops}")
    assert result.compared_ops > 0 and result.launches > 0


# --- spec's mixed tails -----------------------------------------------------------------------
SPEC_MIXED_CELLS = ["ov-p1-v2chain-cpu-honest", "nov-p1-v2chain-cpu-honest",
                    "ov-p4-v2chain-cpu-honest", "nov-p4-v2chain-cpu-honest",
                    "ov-p1-v2tree-cpu-honest", "nov-p1-v2tree-cpu-honest"]


def test_spec_tails_are_modelled_in_the_release_cells_with_the_mirror_only() -> None:
    for cell in SPEC_MIXED_CELLS:
        assert check_sizes(mixed(cell)) is None, cell
    for cell in ("ov-p1-v2chain-nocpu-honest", "ov-p1-v2chain-cpu-preclaim",
                 "ov-p1-v2chain-cpu-honest-trimmed", "ov-p1-v2chain-cpu-honest-earlyfence"):
        assert "is not" in (check_sizes(mixed(cell)) or ""), cell


def run_spec_tail_scenario(config: ModelConfig, faults: frozenset[str] = frozenset()
                           ) -> dict[str, object]:
    """A prompt of 2 (3 new tokens) then one of 10 in chunks of 4, the decodes mixed in: what
    a spec cell's tails do, step by step (tests/test_upstream_tier.py runs the release the
    same way and compares)."""
    with observed(config, faults) as (sched, seen):
        short = sched.admit(2, 3)
        sched.admit(10, 3)
        committed, outputs = [], []
        for _ in range(6):
            sched.run_iteration(IterationChoices())
            req = sched.requests[short]
            committed.append(req.kv_committed_len)
            outputs.append(len(req.output_ids))
        req = sched.requests[short]
        summary: dict[str, object] = {
            "committed": committed, "outputs": outputs, "reason": req.finished_reason,
            "cached": req.cached_len, "at_release": req.committed_at_release}
    summary["modes"] = [obs.launch.forward_mode for obs in seen
                        if obs.point is ObservationPoint.LAUNCH and obs.launch is not None][:4]
    return summary


@pytest.mark.parametrize("cell", ["nov-p1-v2chain-cpu-honest", "ov-p1-v2chain-cpu-honest"])
def test_a_spec_tail_commits_its_bonus_slot_unless_it_finishes(cell: str) -> None:
    """The short request decodes as a tail of the long one's chunks: each tail writes its
    pending bonus token's slot and its result commits it (committed = prompt + output - 1
    after each, KV9), except the one that finishes it by length: that commits nothing, so
    3 is released and cached, one behind what the forward wrote (KV8's finishing-tail
    rule). Under overlap the third decode would finish it in flight: it sits out."""
    result = run_spec_tail_scenario(mixed(cell))
    assert result["reason"] == "length" and result["outputs"][-1] == 3
    assert result["at_release"] == 3 and result["cached"] == 3
    if cell.startswith("nov"):
        assert result["committed"][:3] == [2, 3, 3] and result["outputs"][:3] == [1, 2, 3]
        assert result["modes"] == ["extend", "mixed", "mixed", "extend"]
    else:
        assert result["modes"] == ["extend", "mixed", "mixed", "extend"]


# Two of the six cells in the default tier (a chain without overlap, a tree with it); the
# other four (about 4 s of CPU each) are ``slow``, and .ci/run runs them (its step of the
# default tier's long tests). CI's `./dev check` also runs the spec cells with mixed tails
# clean (its default run's size variants) and kills B20 (its mutant matrix).
SPEC_MIXED_DEFAULT = ("nov-p1-v2chain-cpu-honest", "ov-p1-v2tree-cpu-honest")


@pytest.mark.parametrize("cell", [
    pytest.param(cell, marks=() if cell in SPEC_MIXED_DEFAULT else pytest.mark.slow)
    for cell in SPEC_MIXED_CELLS])
def test_the_reference_holds_every_invariant_with_spec_tails(cell: str) -> None:
    """Spec cells with prompts in chunks of 8 and the decodes mixed in as tails: clean, KV8
    and KV9 witnessed, tails drawn; B20 at the same budget must fail at the seed or the next
    one tried. The ci profile's budget: with no prebuilt arrival (none is drawn with
    chunking) to decode from its first step, the quick one drew no tail in four of these
    cells. Since the pause operations (2026-11-29) the default seed draws 4 tail operations
    in ov-p1-v2chain-cpu-honest and B20 survives there; seed 1 draws 58 and catches it (and
    seeds 2 to 5 do)."""
    config = mixed(cell, 8)
    result = check_cell(config, get_profile("ci"), SEED)
    assert result.ok, describe_failure(result)
    assert all(result.exercised[i] > 0 for i in ("KV8", "KV9", "KV11", "KV12"))
    assert result.mechanisms["spec-mixed-tail"] > 0
    caught = [seed for seed in (SEED, 1) if not check_cell(
        config, get_profile("ci"), seed, frozenset({"B20"}), shrink=False).ok]
    assert caught, f"B20 survived in {config.name} at seeds {SEED} and 1"


@pytest.mark.parametrize("cell", ["nov-p1-v2chain-cpu-honest", "ov-p1-v2chain-cpu-honest"])
def test_b20_a_tail_left_uncommitted_is_caught(cell: str) -> None:
    """B20 (#27971's second entry point): the tail's commit dropped; committed falls one
    behind what the tail wrote: KV8 (or KV9) at that result."""
    with pytest.raises(InvariantViolation) as caught:
        run_spec_tail_scenario(mixed(cell), frozenset({"B20"}))
    assert caught.value.invariant_id in ("KV8", "KV9"), str(caught.value)


# -- a continued chunk into a pool the decodes hold (U8) ----------------------------------
# The release gives a continuing chunk the whole chunk budget once the budget's remaining
# total is spent ("Single-pool continuation must make progress", prefill_budget.py
# available_chunk_tokens), and raises "Prefill out of memory" when the pool is dry: the
# scheduler dies (U8, docs/upstream-findings.md). The model takes its own rule there: the
# chunk goes no further than the row's pages and the free ones, and waits when that is
# nothing (``transitions.compute_chunk_continuation_end``, KV11 with the cap). First met
# with a PD-prebuilt arrival beside a chunked prompt (no generator draws the two together),
# then by the default run's chunked variant with plain admissions (a page-4 tree, whose
# decodes each reserve 32 of the 96-token pool, seed 2): the release crashes on it.
PREBUILT_BESIDE_A_CHUNK = [
    Admit(13, 7), Iterate(IterationChoices(accept_lens=(1, 3, 3))),
    AdmitPrebuilt(12, 3), Iterate(IterationChoices(allow_prefill=False)),
    Iterate(IterationChoices(accept_lens=(2, 1, 3))),
    Iterate(IterationChoices(retract=1, accept_lens=(3, 3, 2))),
    Iterate(IterationChoices(accept_lens=(3, 1, 3))),
]
_STEP = Iterate(IterationChoices())
_NO_PREFILL = Iterate(IterationChoices(allow_prefill=False))
# Minimised from the seed-2 run (ov-p4-v2tree-cpu-honest, chunked_prefill_size=4); the
# same 25 operations crash sglang 0.5.23 in alloc_paged_token_slots_extend.
PLAIN_ADMITS_INTO_A_HELD_POOL = [
    Admit(1, 1), Admit(1, 1), Admit(5, 6), _NO_PREFILL, _NO_PREFILL, Admit(1, 1),
    Admit(13, 2), _NO_PREFILL, _STEP, Admit(5, 1), _NO_PREFILL, _STEP, _STEP, _STEP,
    _NO_PREFILL, _NO_PREFILL, _STEP, _STEP, _STEP, _STEP,
    Iterate(IterationChoices(allow_prefill=False, accept_lens=(2, 1, 1))), _STEP, _STEP,
    _NO_PREFILL, _STEP,
]


@pytest.mark.parametrize(("cell", "ops"), [
    ("nov-p1-v2tree-cpu-honest", PREBUILT_BESIDE_A_CHUNK),
    ("ov-p4-v2tree-cpu-honest", PLAIN_ADMITS_INTO_A_HELD_POOL),
])
def test_a_continued_chunk_waits_for_pages_the_decodes_hold(cell: str, ops: list[Op]) -> None:
    """Where the release dies (U8), the model's chunk is capped to what the allocator can
    give, or waits: clean, KV11 judged with the cap; without the cap (the release's rule
    alone) the same script runs the allocator dry, as the release does."""
    script = Script(cell, "minimal", list(ops), sizes={"chunked_prefill_size": 4})
    outcome = run_script(script, catch_crash=True)
    assert outcome.crash is None and outcome.violation is None, outcome
    assert outcome.checker.exercised["KV11"] > 0
    with pytest.MonkeyPatch.context() as patch:
        real = transitions.compute_chunk_continuation_end
        patch.setattr(reference_scheduler, "compute_chunk_continuation_end",
                      lambda *args: real(*args[:4]))
        crashed = run_script(script, catch_crash=True).crash
    assert crashed is not None and "OutOfMemory" in crashed, crashed


def test_no_generator_draws_prebuilt_arrivals_with_chunking() -> None:
    chunked = ModelConfig(get_cell("nov-p1-v2tree-cpu-honest"),
                          make_preset("minimal", {"chunked_prefill_size": 4}))
    plain = ModelConfig(chunked.cell, make_preset("minimal", {}))
    for config, expected in ((chunked, False), (plain, True)):
        ops = [op for seed in range(30)
               for op in generate_random_ops(config, random.Random(seed), 40)]
        alphabet = get_alphabet(config)
        assert any(isinstance(op, AdmitPrebuilt) for op in ops) == expected
        assert any(isinstance(op, AdmitPrebuilt) for op in alphabet.admissions) == expected
    # The Hypothesis machine: its prebuilt rule's precondition refuses with chunking.
    for config, expected in ((chunked, False), (plain, True)):
        machine = make_machine(config, frozenset())()
        rule = next(r for r in machine.rules if r.function.__name__ == "admit_prebuilt")
        assert all(p(machine) for p in rule.preconditions) == expected
