"""Every invariant predicate can fail: a real observation, perturbed to break one claim,
is rejected with that ID (GUIDE: a check that cannot fail is a defect).

The mutant matrix shows the checker as a whole failing on each historical bug; this
shows each predicate individually rejecting a state that breaks its claim. The
observations come from clean reference runs, so every perturbation starts from a
state that passed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Flush,
    Iterate,
    Script,
    apply_op,
    get_factory,
)
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import MINIMAL, ModelConfig
from overlap_spec.spec.happens_before import FORWARD, HOST, SCHEDULE, Access, Race
from overlap_spec.spec.invariants import INVARIANT_IDS, InvariantViolation, get_invariant
from overlap_spec.spec.state import (
    SCHEDULE_SIDE_POINTS,
    IterationChoices,
    Observation,
    ObservationPoint,
)
from overlap_spec.spec.units import PoolRow, RequestId

CELLS = ("ov-p1-none", "nov-p4-none", "ov-p4-v2chain-cpu-preclaim", "ov-p1-v2chain-nocpu-honest",
         "nov-p1-v2tree-cpu-honest", "ov-p4-v2chain-cpu-honest-radix", "ov-p1-none-radix")


def _collect(cell: str) -> tuple[ModelConfig, list[Observation]]:
    observations: list[Observation] = []
    config = Script(cell, "minimal").get_config()
    model = get_factory("reference")(config, frozenset(), observations.append)
    rng = random.Random(7)
    admitted: list[RequestId] = []
    for index in range(160):
        model.set_step_index(index)
        if index in (3, 90):  # the longest prompt, capped to 0 new tokens (RP8's witness)
            apply_op(model, Admit(config.preset.max_context_len - 1, 2), admitted)
            continue
        x = rng.random()
        if x < 0.15:  # radix cells: mostly the first two requests' prompt families
            family = rng.choice((None, 0, 0, 1)) if config.cell.radix else None
            op: Admit | AdmitPrebuilt | Iterate | Abort = Admit(rng.randint(1, 5),
                                                               rng.randint(2, 8), family)
        elif x < 0.2:
            op = AdmitPrebuilt(rng.randint(1, 5), rng.randint(2, 8))
        elif x < 0.23:
            op = Abort(rng.randint(0, 9))
        else:
            op = Iterate(IterationChoices(
                rng.random() < 0.6, int(rng.random() < 0.2),
                tuple(rng.randint(1, 4) for _ in range(3)),
                frozenset({rng.randint(0, 2)}) if rng.random() < 0.15 else frozenset(),
                rng.random() < 0.1, rng.randint(0, 3)))
        apply_op(model, op, admitted)
    if config.cell.radix:  # RX8's witness: everything aborted, drained, then a flush
        drain = [*map(Abort, range(len(admitted))),
                 *[Iterate(IterationChoices(allow_prefill=False))] * 6, Flush()]
        for index, op in enumerate(drain, start=160):
            model.set_step_index(index)
            apply_op(model, op, admitted)
    return config, observations


_RUNS = {cell: _collect(cell) for cell in CELLS}


def _race(buffer: str, earlier: tuple[str, str], later: tuple[str, str]) -> Race:
    return Race(Access(earlier[0], 1, earlier[1], (buffer, 1), "earlier"),
                Access(later[0], 1, later[1], (buffer, 1), "later"))


def _first_request(obs: Observation, test: Callable[..., bool]) -> int:
    return next(i for i, r in enumerate(obs.requests) if test(r))


def _with_request(obs: Observation, test: Callable[..., bool], **changes: object) -> Observation:
    i = _first_request(obs, test)
    requests = list(obs.requests)
    requests[i] = replace(requests[i], **changes)  # type: ignore[arg-type]
    return replace(obs, requests=tuple(requests))


def _bump(values: tuple[int, ...], by: int = 1) -> tuple[int, ...]:
    return (values[0] + by, *values[1:])


def _with_member(obs: Observation, **changes: object) -> Observation:
    assert obs.launch is not None
    members = (replace(obs.launch.members[0], **changes), *obs.launch.members[1:])  # type: ignore[arg-type]
    return replace(obs, launch=replace(obs.launch, members=members))


def _settling(r: object) -> bool:
    return bool(r.is_live and not r.ghost.extend_inflight)  # type: ignore[attr-defined]


def _prefilling(r: object) -> bool:
    return bool(r.holds_kv and r.ghost.extend_inflight and not r.finished)  # type: ignore[attr-defined]


def _extended(r: object) -> bool:
    """A live request whose own extend starts at column 0 (KV14 judges it)."""
    return bool(r.is_live and not r.prebuilt and r.extend_end > 0  # type: ignore[attr-defined]
                and r.cache_protected_len == 0 and r.kv_contents)  # type: ignore[attr-defined]


PERTURB: dict[str, Callable[[Observation], Observation]] = {
    "SL1": lambda o: replace(o, forward=replace(o.forward, seq_lens_sum=(o.forward.seq_lens_sum or 0) + 1)),
    "SL2": lambda o: replace(o, batch=replace(o.batch, seq_lens=_bump(o.batch.seq_lens))),
    "SL3": lambda o: replace(o, batch=replace(o.batch, seq_lens_sum=(o.batch.seq_lens_sum or 0) + 1)),
    "SL4": lambda o: replace(o, batch=replace(o.batch, req_pool_indices_cpu=o.batch.req_pool_indices_cpu[1:])),
    "SL5": lambda o: replace(o, batch=replace(o.batch, seq_lens=(-1, *o.batch.seq_lens[1:]))),
    "SL6": lambda o: _with_member(o, seq_len=o.launch.members[0].seq_len + 1),
    "SL7": lambda o: replace(o, batch=replace(o.batch, seq_lens=_bump(o.batch.seq_lens))),
    "SL8": lambda o: replace(o, launch=replace(o.launch, publishes=(
        replace(o.launch.publishes[0], value=o.launch.publishes[0].value + 1),
        *o.launch.publishes[1:]))),
    "SL9": lambda o: replace(o, isolation=replace(o.isolation, exit=replace(
        o.isolation.exit, seq_lens_cpu=None if o.isolation.exit.seq_lens_cpu else (1,),
        seq_lens=_bump(o.isolation.exit.seq_lens)))),
    "SL10": lambda o: replace(o, forward=replace(o.forward, seq_lens=_bump(o.forward.seq_lens))),
    "SL11": lambda o: replace(o, batch=replace(o.batch, seq_len_cpu_ub=max(o.batch.seq_lens) - 1)),
    "KV1": lambda o: _with_request(o, lambda r: r.holds_kv,
                                   kv_committed_len=-1),
    "KV2": lambda o: _with_request(o, lambda r: r.holds_kv,
                                   kv_committed_len=o.requests[_first_request(o, lambda r: r.holds_kv)].kv_allocated_len - 1),
    "KV3": lambda o: _with_member(o, kv_allocated_len=o.launch.members[0].ghost_kv_len),
    "KV4": lambda o: _with_request(o, lambda r: r.holds_kv and r.owned_pages, owned_pages=()),
    "KV5": lambda o: _with_request(o, lambda r: r.is_retracted, kv_committed_len=1),
    "KV6": lambda o: _with_request(o, lambda r: r.finished, release_count=2),
    "KV7": lambda o: replace(o, allocator=replace(o.allocator, free_pages=o.allocator.free_pages[1:] or (999,))),
    "KV8": lambda o: _with_request(o, _settling, kv_committed_len=o.requests[_first_request(o, _settling)].kv_committed_len + 1),
    "KV9": lambda o: _with_request(o, lambda r: r.cached_len is not None,
                                   cached_len=o.requests[_first_request(o, lambda r: r.cached_len is not None)].cached_len + 1),
    "KV10": lambda o: _with_request(o, _settling, kv_committed_len=o.requests[_first_request(o, _settling)].kv_committed_len + 2),
    # No KV left to admit into: the first admitted request asked for more than remained.
    "KV11": lambda o: replace(o, admission=replace(o.admission, available_tokens=0)),
    # A pending prefill cut short of its fill while no request is the chunked one.
    "KV12": lambda o: _with_request(o, _prefilling, extend_end=next(
        r.extend_end for r in o.requests if _prefilling(r)) - 1),
    # A request outside the prefill shown running with 4096 tokens to go: by the re-derived
    # load the admitted request did not fit (KV11, on the scheduler's own load, passes).
    "KV13": lambda o: _with_request(o, lambda r: r.rid not in o.batch.rids, holds_kv=True,
                                    finished=False, waiting=False, is_retracted=False,
                                    max_new_tokens=10**6),
    # The first column of a live request's extend shows nothing written.
    "KV14": lambda o: _with_request(o, _extended, kv_contents=(None, *o.requests[
        _first_request(o, _extended)].kv_contents[1:])),
    "FM1": lambda o: replace(o, races=(_race("new_seq_lens_buf", (FORWARD, "write"), (SCHEDULE, "read")),)),
    "FM2": lambda o: replace(o, resolve=replace(o.resolve, uncovered_rows=o.resolve.rows[:1])),
    "FM3": lambda o: replace(o, races=(_race("output_tokens_buf", (SCHEDULE, "write"), (FORWARD, "read")),)),
    "FM4": lambda o: replace(o, launch=replace(o.launch, relay_gathers=(
        replace(o.launch.relay_gathers[0], stashes_since_last_gather=0), *o.launch.relay_gathers[1:]))),
    "FM5": lambda o: replace(o, launch=replace(o.launch, relay_gathers=(
        replace(o.launch.relay_gathers[0], written_by_current_owner=False), *o.launch.relay_gathers[1:]))),
    "FM6": lambda o: replace(o, resolve=replace(o.resolve, fresh_publish=False)),
    "FM7": lambda o: replace(o, resolve=replace(o.resolve, regathered_rows=o.resolve.rows[:1])),
    "ST1": lambda o: replace(o, races=(_race("req_to_token", (SCHEDULE, "write"), (FORWARD, "read")),)),
    "ST2": lambda o: replace(o, races=(_race("req_to_token", (FORWARD, "read"), (SCHEDULE, "write")),)),
    "ST3": lambda o: replace(o, host_syncs=(*o.host_syncs, "stream:schedule", "stream:schedule")),
    "ST4": lambda o: replace(o, races=(_race("tensor", (FORWARD, "read"), (HOST, "free")),)),
    "ST5": lambda o: replace(o, result=replace(o.result, previous_step=o.result.step)),
    "RP1": lambda o: replace(o, result=replace(o.result, entries=tuple(
        replace(e, output_after=e.output_before + 1) if e.stale else e for e in o.result.entries))),
    "RP2": lambda o: replace(o, result=replace(o.result, entries=(
        replace(o.result.entries[0], accept_len=o.result.entries[0].stride + 1), *o.result.entries[1:]))),
    "RP3": lambda o: replace(o, result=replace(o.result, num_correct_drafts=o.result.num_correct_drafts + 1)),
    "RP4": lambda o: _with_request(o, lambda r: r.rid == o.launch.members[0].rid,
                                   output_len=o.get_request(o.launch.members[0].rid).max_new_tokens),
    # A stop reported as a length finish (and the other way round).
    "RP5": lambda o: _with_request(o, lambda r: r.finished, finish_reason={
        "stop": "length", "length": "stop", "abort": "length"}[next(
            r.finish_reason for r in o.requests if r.finished)]),
    # One verify too many: a stale row counted.
    "RP6": lambda o: _with_request(o, lambda r: r.ghost.verify_ct > 0,
                                   spec_verify_ct=next(r.spec_verify_ct for r in o.requests
                                                       if r.ghost.verify_ct > 0) + 1),
    # The last token one off: what a forward that read the wrong relayed token emits.
    "RP7": lambda o: _with_request(o, lambda r: bool(r.output_ids), output_ids=(
        *next(r.output_ids for r in o.requests if r.output_ids)[:-1],
        next(r.output_ids for r in o.requests if r.output_ids)[-1] % 97 + 1)),
    # A batch holding a request with tokens to generate flagged prefill-only (B19).
    "RP8": lambda o: _with_request(replace(o, batch=replace(o.batch, is_prefill_only=True)),
                                   lambda r: r.rid == o.batch.rids[0], max_new_tokens=1),
    # A prompt the release refuses (18 tokens or more at the minimal context of 24) holding
    # KV: what an admission without validate_input_length runs (B24).
    "RP9": lambda o: _with_request(o, lambda r: r.holds_kv, prompt_len=23),
    # An unfinished request queued once more: in two places (B37 leaves one in none).
    "RP10": lambda o: replace(o, placement=replace(o.placement, waiting=(
        *o.placement.waiting, next(r.rid for r in o.requests if not r.finished)))),
    # A tree page freed as well (a release from below cache_protected_len: #13714).
    "RX1": lambda o: replace(o, allocator=replace(o.allocator, free_pages=(
        *o.allocator.free_pages, o.tree.nodes[0].pages[0]))),
    # A lock never taken back (a release without its unlock: #32170).
    "RX2": lambda o: replace(o, tree=replace(o.tree, nodes=(
        replace(o.tree.nodes[0], lock_ref=o.tree.nodes[0].lock_ref + 1), *o.tree.nodes[1:]))),
    "RX3": lambda o: replace(o, tree=replace(o.tree, protected_size=o.tree.protected_size + 1)),
    # The row not repointed at the tree's page (mini-sglang #142).
    "RX4": lambda o: _with_request(o, lambda r: r.holds_kv and r.cache_protected_len, row_slots=(
        -1, *next(r.row_slots for r in o.requests if r.holds_kv and r.cache_protected_len)[1:])),
    # A hit on another prompt's pages.
    "RX5": lambda o: _with_request(o, lambda r: r.holds_kv and r.cache_protected_len,
                                   prompt_family=next(r.prompt_family for r in o.requests
                                                      if r.holds_kv and r.cache_protected_len) + 7),
    "RX6": lambda o: replace(o, tree=replace(o.tree, nodes=(
        replace(o.tree.nodes[0], key=o.tree.nodes[0].key[:-1]), *o.tree.nodes[1:]))),
    # A finish whose insert never reached the tree.
    "RX7": lambda o: replace(o, tree=replace(o.tree, nodes=())),
    # A flush that left a page out of the free list (a tree reset without the clear).
    "RX8": lambda o: replace(o, allocator=replace(o.allocator,
                                                  free_pages=o.allocator.free_pages[1:])),
}


def test_every_invariant_has_a_perturbation() -> None:
    assert sorted(PERTURB) == sorted(INVARIANT_IDS)


# Perturbations of ``obs.batch`` need a point where the schedule-side batch is checked.
ON_SCHEDULE_BATCH = {"SL2", "SL3", "SL4", "SL5", "RP8"}


def _targets(invariant_id: str) -> list[tuple[ModelConfig, Observation]]:
    inv = get_invariant(invariant_id)
    found = []
    for config, observations in _RUNS.values():
        if not inv.applies(config.cell):
            continue
        for obs in observations:
            if invariant_id in ON_SCHEDULE_BATCH and obs.point not in SCHEDULE_SIDE_POINTS:
                continue
            if inv.check(config, obs) > 0:
                found.append((config, obs))
    return found


@pytest.mark.parametrize("invariant_id", INVARIANT_IDS)
def test_predicate_rejects_a_state_that_breaks_its_claim(invariant_id: str) -> None:
    inv = get_invariant(invariant_id)
    targets = _targets(invariant_id)
    assert targets, f"{invariant_id}: no exercised observation in {CELLS}"
    rejected = 0
    for config, obs in targets[:25]:
        try:
            broken = PERTURB[invariant_id](obs)
        except (StopIteration, AttributeError, IndexError, TypeError, ValueError):
            continue  # this observation lacks what the perturbation needs
        with pytest.raises(InvariantViolation) as info:
            inv.check(config, broken)
        assert info.value.invariant_id == invariant_id
        assert str(info.value).startswith(f"{invariant_id} violated ")
        rejected += 1
    assert rejected, f"{invariant_id}: no observation could be perturbed"


@pytest.mark.parametrize("row", [0, -1, MINIMAL.max_running_requests + 1])
def test_fm5_catches_a_relay_row_out_of_range(row: int) -> None:
    """Geometry (issue 13): a gather of the padding row, of a negative row (which a list
    would wrap silently) or past the last request row is caught, not clamped."""
    targets = [(c, o) for c, o in _targets("FM5") if o.launch and o.launch.relay_gathers]
    assert targets
    config, obs = targets[0]
    broken = replace(obs, launch=replace(obs.launch, relay_gathers=(
        replace(obs.launch.relay_gathers[0], row=row), *obs.launch.relay_gathers[1:])))
    with pytest.raises(InvariantViolation, match=f"FM5 violated relay row {row} read"):
        get_invariant("FM5").check(config, broken)


def _finished_and_released(r: object) -> bool:
    return bool(r.finished and r.committed_at_release is not None)  # type: ignore[attr-defined]


def _leaked(o: Observation) -> Observation:
    """A finished request whose finish release never ran: it still holds its KV, and
    nothing was recorded at release (committed_at_release, cached_len)."""
    return _with_request(o, _finished_and_released, holds_kv=True, committed_at_release=None,
                         cached_len=None, release_count=0)


def _result_points(cell: str) -> list[tuple[ModelConfig, Observation]]:
    config, observations = _RUNS[cell]
    return [(config, o) for o in observations if o.point is ObservationPoint.PROCESS_RESULT
            and any(_finished_and_released(r) for r in o.requests)]


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p4-v2chain-cpu-preclaim"])
def test_a_finished_request_that_leaks_its_kv_is_caught(cell: str) -> None:
    """KV6's "finished but not released" branch fires on a request no release touched (it
    used to skip every request without committed_at_release, which only a release sets)."""
    targets = _result_points(cell)
    assert targets, f"no processed finish in {cell}"
    for config, obs in targets[:10]:
        with pytest.raises(InvariantViolation) as info:
            get_invariant("KV6").check(config, _leaked(obs))
        assert info.value.invariant_id == "KV6" and "not released" in str(info.value)


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p4-v2chain-cpu-preclaim"])
def test_a_finish_before_the_environment_finished_is_caught_without_a_release(cell: str
                                                                               ) -> None:
    """RP2 judges a finish the environment did not make even when no release followed."""
    targets = _result_points(cell)
    assert targets
    for config, obs in targets[:10]:
        i = _first_request(obs, _finished_and_released)
        rid = obs.requests[i].rid
        broken = _with_request(_leaked(obs), lambda r, rid=rid: r.rid == rid,
                               ghost=replace(obs.requests[i].ghost, finished=False),
                               holds_kv=False)
        with pytest.raises(InvariantViolation) as info:
            get_invariant("RP2").check(config, broken)
        assert info.value.invariant_id == "RP2"


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p4-v2chain-cpu-preclaim"])
def test_a_finish_release_that_caches_nothing_is_caught(cell: str) -> None:
    targets = _result_points(cell)
    assert targets
    for config, obs in targets[:10]:
        broken = _with_request(obs, _finished_and_released, cached_len=None)
        with pytest.raises(InvariantViolation) as info:
            get_invariant("KV9").check(config, broken)
        assert info.value.invariant_id == "KV9" and "without caching" in str(info.value)


def test_sl10_catches_a_mistake_shared_with_the_function_the_implementation_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong draft-extend arithmetic in spec.transitions, used by the reference, must not
    also move SL10's expected value: the predicate states +D_tok itself."""
    from overlap_spec.harness.drive.script import run_script
    from overlap_spec.reference import worker
    from overlap_spec.spec import invariants, transitions

    def off_by_one(seq_lens: tuple[int, ...], draft_tokens: int) -> tuple[int, ...]:
        return tuple(s + draft_tokens - 1 for s in seq_lens)

    for module in (worker, invariants, transitions):
        monkeypatch.setattr(module, "compute_draft_extend_seq_lens", off_by_one, raising=False)
    ops = [Admit(3, 6), *[Iterate(IterationChoices(accept_lens=(2,))) for _ in range(4)]]
    # No CPU mirror: the device seq_lens are the only place the +D_tok shows.
    outcome = run_script(Script("ov-p1-v2chain-nocpu-honest", "minimal", ops))
    assert outcome.violation is not None and outcome.violation.invariant_id == "SL10"


def test_the_reference_relay_keeps_what_upstreams_ci_guards_keep() -> None:
    """FM6 / FM7 from the reference's own bookkeeping, not from a perturbed view: a
    resolve that no publish re-armed (a stale publish_ready) and that gathers a row it
    gathered before (upstream's CI would read the -1 poison) is rejected by both."""
    cell = "ov-p1-v2chain-nocpu-honest"
    config, observations = _RUNS[cell]
    sched = Scheduler(config, frozenset(), None)
    fm = sched.future_map
    req = sched.requests[sched.admit(2, 8)]
    sched.run_iteration(IterationChoices(allow_prefill=True))  # the prefill publishes its row
    assert req.req_pool_idx is not None
    row = req.req_pool_idx
    # Just what resolve_seq_lens_cpu reads and writes of a ScheduleBatch.
    batch = cast(Any, SimpleNamespace(future_indices=[row], reqs=[req],
                                      req_pool_indices_cpu=[row], seq_lens=None,
                                      seq_lens_cpu=None, seq_lens_sum=None,
                                      seq_len_cpu_ub=None))
    first = fm.resolve_seq_lens_cpu(batch)
    assert first is not None and first.fresh_publish is True and not first.regathered_rows
    second = fm.resolve_seq_lens_cpu(batch)  # no publish in between
    assert second is not None and second.fresh_publish is False
    assert second.regathered_rows == (row,)
    obs = next(o for o in observations if o.resolve is not None)
    for invariant_id in ("FM6", "FM7"):
        with pytest.raises(InvariantViolation, match=f"^{invariant_id} violated"):
            get_invariant(invariant_id).check(config, replace(obs, resolve=second))
    fm.publish([req], [row], [5])  # a publish re-arms both
    third = fm.resolve_seq_lens_cpu(batch)
    assert third is not None and third.fresh_publish is True and not third.regathered_rows


def test_rp2_catches_a_recorded_run_that_is_not_what_was_appended() -> None:
    """A live row's recorded run must be the tokens appended (found by mutation testing:
    the reference's recorded run was only checked against accept_len)."""
    targets = [(c, o) for c, o in _targets("RP2")
               if o.result and any(not e.stale and e.run_len for e in o.result.entries)]
    assert targets
    config, obs = targets[0]
    assert obs.result is not None
    j = next(i for i, e in enumerate(obs.result.entries) if not e.stale and e.run_len)
    entries = list(obs.result.entries)
    entries[j] = replace(entries[j], run_len=entries[j].run_len - 1)
    with pytest.raises(InvariantViolation, match="^RP2 violated .* grew output_ids by"):
        get_invariant("RP2").check(config, replace(obs, result=replace(
            obs.result, entries=tuple(entries))))


def test_the_reference_relay_knows_who_stashed_a_reused_row() -> None:
    """FM5 from the reference's own bookkeeping: a row stashed by its previous owner and
    gathered for its next one (row reuse, before the new owner stashed) reports
    ``written_by_current_owner=False``, for an older and a newer previous owner alike
    (found by mutation testing: an ordering comparison in place of the equality passed
    every other check)."""
    config, _ = _RUNS["ov-p1-none"]
    sched = Scheduler(config, frozenset(), None)
    fm = sched.future_map
    first, second = (sched.requests[sched.admit(2, 8)] for _ in range(2))
    row = PoolRow(1)
    for stasher, reader in ((first, second), (second, first)):
        fm.stash([stasher], [row], [7])
        (gather,), tokens = fm.resolve_forward_inputs([reader], [row])
        assert gather.written_by_current_owner is False, (stasher.rid, reader.rid)
        assert tokens == [7]  # the value read is the value stashed
        fm.stash([reader], [row], [8])
        (gather,), tokens = fm.resolve_forward_inputs([reader], [row])
        assert gather.written_by_current_owner is True and tokens == [8]


def _held_row(o: Observation) -> int:
    return next(r.req_pool_idx for r in o.requests if r.req_pool_idx is not None)


# Each way a page or a pool row can be misplaced without changing how many there are:
# KV7 decides the usual case on whole collections, so each of these must fall through
# to the walk that names the culprit.
KV7_MISPLACED: dict[str, Callable[[Observation], Observation]] = {
    "a page both free and cached": lambda o: replace(o, allocator=replace(
        o.allocator, tree_pages=(o.allocator.free_pages[0], *o.allocator.tree_pages[1:]))),
    "a page owned twice": lambda o: _with_request(
        o, lambda r: len(r.owned_pages) > 1,
        owned_pages=(o.requests[_first_request(o, lambda r: len(r.owned_pages) > 1)]
                     .owned_pages[0],) * 2),
    "a row both free and held": lambda o: replace(o, allocator=replace(
        o.allocator, free_pool_rows=(_held_row(o), *o.allocator.free_pool_rows[1:]))),
    "a free row listed twice": lambda o: replace(o, allocator=replace(
        o.allocator, free_pool_rows=(o.allocator.free_pool_rows[0],)
        * len(o.allocator.free_pool_rows))),
}


@pytest.mark.parametrize("how", sorted(KV7_MISPLACED))
def test_kv7_names_a_misplaced_page_or_row(how: str) -> None:
    inv = get_invariant("KV7")
    rejected = 0
    for config, obs in _targets("KV7")[:25]:
        try:
            broken = KV7_MISPLACED[how](obs)
        except (StopIteration, AttributeError, IndexError, TypeError, ValueError):
            continue
        if broken == obs:
            continue  # nothing to duplicate here (one free row, say)
        with pytest.raises(InvariantViolation, match="^KV7 violated for (page|pool row|the)"):
            inv.check(config, broken)
        rejected += 1
    assert rejected, f"no observation could be broken as {how}"
