"""The per-request transition relation (spec/relation.py): guards reject bad pre-states,
frames are enforced (and the check can fail), concrete runs give the expected records, and
the reference's requests change only through it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from overlap_spec.reference.req import Req
from overlap_spec.spec import relation
from overlap_spec.spec.config import get_cell
from overlap_spec.spec.relation import (
    FRAMES,
    FrameViolation,
    Ghost,
    GuardViolation,
    RequestRecord,
    get_frame_violations,
    transition,
)
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

NON_SPEC = get_cell("ov-p1-none")
PRECLAIM = get_cell("ov-p1-v2chain-cpu-preclaim")
HONEST = get_cell("ov-p1-v2chain-cpu-honest")
TRIMMED = get_cell("ov-p1-v2chain-cpu-honest-trimmed")
NS_TRIMMED = get_cell("ov-p1-none-trimmed")
S0, S1, S2 = StepId(0), StepId(1), StepId(2)


def new(prompt_len: int = 4, max_new_tokens: int = 3) -> RequestRecord:
    return relation.admit(RequestId(7), TokenCount(prompt_len), TokenCount(max_new_tokens))


def prefilled(prompt_len: int = 4, max_new_tokens: int = 3) -> RequestRecord:
    """Prefilled and its first token processed: a running request holding KV."""
    req = relation.prepare_for_extend(new(prompt_len, max_new_tokens), PoolRow(1))
    req = relation.forward_extend(relation.launch(req, S0), S0, prompt_len)
    return relation.process_result(req, NON_SPEC, S0, "extend", 1, None, (11,))


def launched_ghost() -> Ghost:
    return relation.ghost_launch(Ghost(), S0)


# A valid call of every transition: (name, pre-state, arguments).
VALID_CALLS: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("abort", new(), ()),
    ("prepare_for_extend", new(), (PoolRow(1),)),
    ("prepare_next_chunk", relation.stash_chunked_request(
        relation.prepare_for_extend(new(), PoolRow(1), 2)), (4,)),
    ("stash_chunked_request", relation.prepare_for_extend(new(), PoolRow(1), 2), ()),
    ("checkpoint_into_tree", relation.prepare_for_extend(new(), PoolRow(1)), (4,)),
    ("finish_chunked_abort", relation.abort(relation.prepare_for_extend(new(), PoolRow(1), 2)),
     ()),
    ("prepare_for_decode", prefilled(), (5,)),
    ("mix_with_running", relation.prepare_for_decode(prefilled(), 5), (6,)),
    ("prepare_for_decode_spec_v2", prefilled(), (4, 1, True)),
    ("launch", prefilled(), (S1,)),
    ("forward_extend", relation.launch(prefilled(), S1), (S1, 5)),
    ("forward_decode", relation.launch(prefilled(), S1), (S1, 1)),
    ("process_result", relation.launch(prefilled(), S1), (NON_SPEC, S1, "decode", 1, None, (12,))),
    ("release_kv_cache", prefilled(), (NON_SPEC, True)),
    ("reset_for_retract", relation.release_kv_cache(prefilled(), NON_SPEC, False), ()),
    ("process_prebuilt",
     relation.prepare_for_extend(relation.admit(RequestId(1), TokenCount(4), TokenCount(3),
                                                prebuilt=True), PoolRow(2)), (9,)),
    ("ghost_prepare_extend", Ghost(), ()),
    ("ghost_prepare_decode", Ghost(), ()),
    ("ghost_launch", Ghost(), (S0,)),
    ("ghost_forward_extend", launched_ghost(), (S0, 4, 4)),
    ("ghost_forward_decode", launched_ghost(), (S0, 2)),
    ("ghost_result", launched_ghost(), (S0, 3, 1, None, False)),
    ("ghost_prebuilt", Ghost(), (4,)),
    ("ghost_abort", Ghost(), (False,)),
    ("ghost_release", launched_ghost(), ()),
    ("ghost_retract", Ghost(), ()),
]


def test_every_transition_has_a_valid_call_here() -> None:
    assert {name for name, _, _ in VALID_CALLS} == set(FRAMES)


@pytest.mark.parametrize(("name", "pre", "args"), VALID_CALLS, ids=[c[0] for c in VALID_CALLS])
def test_a_valid_call_changes_only_its_frame(name: str, pre: Any, args: tuple[Any, ...]) -> None:
    post = getattr(relation, name)(pre, *args)
    assert post != pre, f"{name} changed nothing"
    assert get_frame_violations(FRAMES[name], pre, post) == []


# --- guards ------------------------------------------------------------------------------------
def _finished() -> RequestRecord:
    return replace(prefilled(), finished_reason="length")


BAD_CALLS: list[tuple[str, Callable[[], Any], str]] = [
    ("abort", lambda: relation.abort(_finished()), "finished_reason"),
    ("prepare_for_extend", lambda: relation.prepare_for_extend(prefilled(), PoolRow(2)),
     "waiting"),
    ("prepare_for_extend",
     lambda: relation.prepare_for_extend(replace(new(), finished_reason="abort"), PoolRow(2)),
     "finished_reason"),
    ("prepare_for_decode", lambda: relation.prepare_for_decode(new(), 4), "holds_kv"),
    ("prepare_for_decode", lambda: relation.prepare_for_decode(_finished(), 5),
     "finished_reason"),
    ("prepare_for_decode_spec_v2",
     lambda: relation.prepare_for_decode_spec_v2(new(), 4, 1, False), "holds_kv"),
    ("ghost_launch", lambda: relation.launch(relation.launch(prefilled(), S1), S1), "steps"),
    ("ghost_forward_extend", lambda: relation.forward_extend(prefilled(), S2, 5), "steps"),
    ("ghost_forward_decode", lambda: relation.forward_decode(prefilled(), S2, 1), "steps"),
    ("process_result",
     lambda: relation.process_result(prefilled(), NON_SPEC, S2, "decode", 0, None, (1,)),
     "output_ids"),
    ("process_result",
     lambda: relation.process_result(prefilled(max_new_tokens=8), HONEST, S2, "decode", 3,
                                     None, (1, 2)),
     "output_ids"),
    ("release_kv_cache",
     lambda: relation.release_kv_cache(relation.release_kv_cache(prefilled(), NON_SPEC, True),
                                       NON_SPEC, True),
     "holds_kv"),
    ("reset_for_retract", lambda: relation.reset_for_retract(prefilled()), "holds_kv"),
    ("process_prebuilt", lambda: relation.process_prebuilt(prefilled(), 9), "prebuilt"),
]


@pytest.mark.parametrize(("name", "call", "field"), BAD_CALLS,
                         ids=[f"{c[0]}-{c[2]}" for c in BAD_CALLS])
def test_a_guard_rejects_a_bad_pre_state(name: str, call: Callable[[], Any], field: str) -> None:
    with pytest.raises(GuardViolation, match=rf"^{name} guard violated for .*{field}="):
        call()


def test_a_guard_message_names_request_field_and_value() -> None:
    with pytest.raises(GuardViolation) as caught:
        relation.prepare_for_decode(new(), 4)
    assert str(caught.value) == ("prepare_for_decode guard violated for request r7: "
                                 "holds_kv=False, expected a request holding KV")


# --- frames ------------------------------------------------------------------------------------
def _outside(frame: frozenset[str], record: Any) -> str:
    """A field of ``record`` the frame does not cover."""
    prefix = "ghost." if isinstance(record, RequestRecord) else ""
    candidates = ["rid", "prompt_len", "max_new_tokens", "prebuilt"] if prefix else []
    candidates += [prefix + name for name in ("epoch", "abort_requested", "claimed_at_release")]
    return next(c for c in candidates if c not in frame and c.split(".")[0] not in frame)


def _tamper(record: Any, path: str) -> Any:
    head, _, rest = path.partition(".")
    if rest:
        return replace(record, **{head: _tamper(getattr(record, head), rest)})
    value = getattr(record, head)
    return replace(record, **{head: (not value) if isinstance(value, bool) else value + 100})


@pytest.mark.parametrize(("name", "pre", "args"), VALID_CALLS, ids=[c[0] for c in VALID_CALLS])
def test_a_write_outside_the_frame_is_caught(name: str, pre: Any, args: tuple[Any, ...]) -> None:
    """The same transition with one extra write outside its frame: the check fails."""
    real = getattr(relation, name).__wrapped__
    field = _outside(FRAMES[name], pre)

    def overreaching(record: Any, *call_args: Any) -> Any:
        return _tamper(real(record, *call_args), field)

    overreaching.__name__ = name
    broken = transition(*FRAMES[name])(overreaching)
    with pytest.raises(FrameViolation, match=rf"^{name} changed .* outside its frame: {field}"):
        broken(pre, *args)


def test_a_nested_frame_entry_frames_only_that_ghost_field() -> None:
    pre = prefilled()
    post = replace(pre, ghost=replace(pre.ghost, prepared_steps=1, epoch=3))
    assert get_frame_violations(frozenset({"ghost.prepared_steps"}), pre, post) == [
        "ghost.epoch: 0 -> 3"]
    assert get_frame_violations(frozenset({"ghost"}), pre, post) == []


# --- concrete runs -----------------------------------------------------------------------------
def test_non_spec_run_to_a_length_finish() -> None:
    req = prefilled(prompt_len=4, max_new_tokens=2)
    assert (req.output_ids, req.kv_committed_len, req.kv_allocated_len) == ((11,), 4, 4)
    assert (req.ghost.settled_len, req.ghost.output_len_true, req.ghost.inflight_steps) == (
        4, 1, 0)
    req = relation.prepare_for_decode(req, 4)  # seq_lens = 4: the token being processed
    assert (req.kv_committed_len, req.kv_allocated_len, req.ghost.prepared_steps) == (5, 5, 1)
    req = relation.forward_decode(relation.launch(req, S1), S1, 1)
    req = relation.process_result(req, NON_SPEC, S1, "decode", 1, None, (12,))
    assert req.output_ids == (11, 12) and req.finished_reason == "length"
    assert req.kv_committed_len == 5 and req.ghost.finished and req.ghost.settled_len == 5
    released = relation.release_kv_cache(req, NON_SPEC, True)
    # owned_kv_len: committed, cut at prompt + the visible output (not reached here).
    assert (released.cached_len, released.committed_at_release, released.holds_kv) == (
        5, 5, False)


def test_spec_preclaim_commits_the_run_minus_the_claimed_bonus() -> None:
    req = prefilled(prompt_len=4, max_new_tokens=8)
    req = relation.prepare_for_decode_spec_v2(req, 6, 4, True)
    assert (req.kv_committed_len, req.kv_allocated_len) == (5, 12)  # align(4 + 6, 4)
    req = relation.forward_decode(relation.launch(req, S1), S1, 3)
    req = relation.process_result(req, PRECLAIM, S1, "decode", 3, None, (12, 13, 14))
    assert req.kv_committed_len == 5 + 3 - 1 and req.output_ids == (11, 12, 13, 14)
    assert (req.spec_verify_ct, req.spec_num_correct_drafts) == (1, 2)


def test_eos_cuts_the_visible_run_the_release_commits_all_of_it() -> None:
    req = relation.prepare_for_decode_spec_v2(prefilled(max_new_tokens=8), 6, 1, False)
    req = relation.forward_decode(relation.launch(req, S1), S1, 4)
    released = relation.process_result(req, HONEST, S1, "decode", 4, 1, (12, 0, 14, 15))
    assert released.output_ids == (11, 12, 0) and released.finished_reason == "stop"
    assert released.kv_committed_len == 4 + 4  # the whole accepted run
    # owned_kv_len: cut at prompt + the visible output, the newest token included
    assert relation.release_kv_cache(released, HONEST, True).cached_len == 4 + 3
    trimmed = relation.process_result(req, TRIMMED, S1, "decode", 4, 1, (12, 0, 14, 15))
    assert trimmed.output_ids == (11, 12, 0) and trimmed.kv_committed_len == 4 + 2
    assert relation.release_kv_cache(trimmed, TRIMMED, True).cached_len == 4 + 3 - 1
    # An abort sets no finished_len: the release keys all it committed.
    aborted = relation.process_result(relation.abort(req), HONEST, S1, "decode", 4, 1,
                                      (12, 0, 14, 15))
    assert aborted.finished_reason == "abort" and aborted.kv_committed_len == 8
    assert relation.release_kv_cache(aborted, HONEST, True).cached_len == 8


def test_retraction_starts_a_new_epoch_and_a_late_result_settles_nothing() -> None:
    req = relation.prepare_for_decode(prefilled(), 4)
    req = relation.forward_decode(relation.launch(req, S1), S1, 1)
    req = relation.reset_for_retract(relation.release_kv_cache(req, NON_SPEC, False))
    assert (req.is_retracted, req.waiting, req.kv_committed_len, req.ghost.epoch) == (
        True, True, 0, 1)
    late = relation.process_result(req, NON_SPEC, S1, "decode", 1, None, (12,))
    assert late.output_ids == req.output_ids and late.ghost == replace(req.ghost, steps={})
    again = relation.prepare_for_extend(late, PoolRow(3))
    assert again.kv_committed_len == again.kv_allocated_len == 4 + 1  # prompt + output


def test_abort_waiting_finishes_at_once_running_at_the_next_result() -> None:
    waiting = relation.abort(new())
    assert waiting.finished_reason == "abort" and waiting.ghost.finished
    running = relation.abort(relation.prepare_for_decode(prefilled(), 4))
    assert running.to_finish == "abort" and not running.is_finished()
    running = relation.forward_decode(relation.launch(running, S1), S1, 1)
    done = relation.process_result(running, NON_SPEC, S1, "decode", 1, None, (12,))
    assert done.finished_reason == "abort" and done.ghost.finished


# --- bug switches ------------------------------------------------------------------------------
def test_faults_change_the_relation_where_the_catalogue_says() -> None:
    shrunk = replace(relation.prepare_for_decode_spec_v2(prefilled(), 8, 1, False),
                     kv_committed_len=4)
    assert relation.prepare_for_decode_spec_v2(shrunk, 2, 1, False).kv_allocated_len == 12
    assert relation.prepare_for_decode_spec_v2(shrunk, 2, 1, False,
                                               frozenset({"B12"})).kv_allocated_len == 6
    finishing = relation.process_result(
        relation.launch(relation.prepare_for_decode_spec_v2(prefilled(max_new_tokens=2), 6, 1,
                                                            False), S1),
        HONEST, S1, "decode", 3, None, (12, 13, 14), frozenset({"B11"}))
    assert finishing.output_ids == (11, 12) and finishing.kv_committed_len == 4 + 3
    assert relation.release_kv_cache(finishing, HONEST, True,
                                     frozenset({"B11"})).cached_len == 7
    assert relation.release_kv_cache(finishing, HONEST, True).cached_len == 4 + 2
    trimmed = relation.process_result(
        relation.launch(relation.prepare_for_decode_spec_v2(prefilled(max_new_tokens=2), 6, 1,
                                                            False), S1),
        TRIMMED, S1, "decode", 3, None, (12, 13, 14))
    assert trimmed.kv_committed_len == 4 + 1
    assert relation.release_kv_cache(trimmed, TRIMMED, True).cached_len == 4 + 2 - 1
    # B10 (#24590): under overlap the next decode has claimed the newest token's slot when
    # a stop finishes a non-spec request; owned_kv_len caches it, the trimmed finish not.
    claimed = relation.prepare_for_decode(relation.launch(relation.prepare_for_decode(
        prefilled(), 4), S1), 5)
    stopped = relation.process_result(relation.forward_decode(claimed, S1, 1), NS_TRIMMED, S1,
                                      "decode", 1, 0, (12,))
    assert (stopped.finished_reason, stopped.kv_committed_len) == ("stop", 4 + 2)
    assert relation.release_kv_cache(stopped, NS_TRIMMED, True).cached_len == 4 + 2 - 1
    assert relation.release_kv_cache(stopped, NS_TRIMMED, True,
                                     frozenset({"B10"})).cached_len == 4 + 2
    # B3 (before #23456): a stale row's run committed all the same; its output still skipped.
    stale = relation.launch(relation.prepare_for_decode_spec_v2(prefilled(), 8, 1, True), S1)
    stale = replace(stale, finished_reason="abort")
    assert stale.kv_committed_len == 5  # the pre-claimed bonus
    kept = relation.process_result(stale, PRECLAIM, S1, "decode", 3, None, (12, 13, 14))
    assert (kept.output_ids, kept.kv_committed_len) == ((11,), 4)  # the refund
    b3 = relation.process_result(stale, PRECLAIM, S1, "decode", 3, None, (12, 13, 14),
                                 frozenset({"B3"}))
    assert (b3.output_ids, b3.kv_committed_len) == ((11,), 5 + 3 - 1)


# --- the reference goes through the relation ---------------------------------------------------
def test_the_reference_request_cannot_be_written_around_the_relation() -> None:
    req = Req(RequestId(1), TokenCount(4), TokenCount(3))
    with pytest.raises(AttributeError):
        req.kv_committed_len = 3  # type: ignore[misc]
    req.apply(relation.prepare_for_extend, PoolRow(1))
    assert req.kv_committed_len == 4 and req.state.holds_kv
    with pytest.raises(GuardViolation):
        req.apply(relation.prepare_for_extend, PoolRow(2))


def test_retraction_order_is_the_release_policy_or_the_pre_claim_eras_back() -> None:
    """The next victim is last. The release (#32023), spec and non-spec: fewest outputs,
    then longest prompt. The pre-claim era's spec cells: the back of the batch."""
    from overlap_spec.spec.transitions import compute_retraction_order

    outputs, prompts = [3, 1, 1, 5], [2, 4, 2, 1]
    for release in ("ov-p1-v2chain-cpu-honest", "ov-p1-none", "nov-p4-none"):
        assert compute_retraction_order(get_cell(release), outputs, prompts) == [3, 0, 2, 1]
    for era in ("ov-p1-v2chain-cpu-preclaim", "nov-p1-v2tree-cpu-preclaim"):
        assert compute_retraction_order(get_cell(era), outputs, prompts) == [0, 1, 2, 3]
    # Ties keep batch order: the later position goes first.
    assert compute_retraction_order(get_cell("ov-p1-none"), [1, 1], [2, 2]) == [0, 1]
