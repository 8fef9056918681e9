"""The per-request transition relation: which transition fires, its guard, frame and ghost.

``transitions.py`` holds the arithmetic; this module says where it applies. A request is a
frozen :class:`RequestRecord` (the fields of upstream's ``Req`` / ``req.kv.*`` the spec
talks about) carrying its :class:`Ghost`, the truth the scheduler does not keep. Every
transition is a pure function ``(record, parameters) -> record`` and states

- its guard: a violated precondition raises :class:`GuardViolation` naming the
  transition, the request and the field;
- its frame: the fields it may change. :func:`transition` checks after every call that
  every other field is unchanged and raises :class:`FrameViolation` otherwise (always on:
  a few dozen comparisons per call);
- its ghost update, by the ghost transitions (``ghost_*``) at the end of the module.

One request's life (sglang 0.5.23 names)::

    admit ─▶ prepare_for_extend ─▶ launch ─▶ forward_extend ─▶ process_result ─┐
                 ▲            ┌────────────────────────────────────────────────┘
                 │            ▼
                 │      prepare_for_decode(_spec_v2) ─▶ launch ─▶ forward_decode
                 │            ▲                                        │
                 │            └──────────── process_result ◀───────────┘
                 │                                │ finished
                 │                                ▼
                 │                        release_kv_cache(is_insert=True)
                 └─ reset_for_retract ◀─ release_kv_cache(is_insert=False)   (retract_decode)

With chunked prefill the prefill goes in chunks: ``prepare_for_extend`` to the first
chunk's end, then per step ``stash_chunked_request`` (the checkpoint) and
``prepare_next_chunk``, each chunk launched, forwarded and processed (a middle chunk's
result only counts down ``inflight_middle_chunks``); an abort of the chunked request ends
in ``finish_chunked_abort`` and a release without caching. With mixed chunks the running
decodes, prepared as usual, ride in the chunk's batch (``mix_with_running``) and their
results are decodes'.

``abort`` fires at any time before the finish; ``process_prebuilt`` replaces the prefill's
result for a PD-decode request. Pages and ``req_to_token`` columns are the allocator's: an
implementation backs the lengths decided here with memory (``reference/mem_cache.py``).

Bug switches that change a per-request update arrive as ``faults`` (the B-ids of
``spec/bugs.py``); with none the relation is the intended design.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from overlap_spec.spec.config import Cell
from overlap_spec.spec.state import get_last_prompt_token
from overlap_spec.spec.transitions import (
    compute_cached_len,
    compute_committed_after_result,
    compute_committed_run,
    compute_decode_seq_len_ns,
    compute_fill_len,
    compute_output_budget,
    compute_run_len,
    compute_v2_alloc_target,
)
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

NO_FAULTS: frozenset[str] = frozenset()


class GuardViolation(Exception):
    """A transition fired in a state its guard excludes."""


class FrameViolation(Exception):
    """A transition changed a field outside its frame."""


@dataclass(frozen=True)
class GhostStep:
    """One launched step of a request, until its result is processed."""

    epoch: int  # the request's epoch at launch: a result of an older epoch settles nothing
    kv_len: int | None = None  # kv_len_true after this step's forward
    is_extend: bool = False  # the forward was the prefill
    middle_chunk: bool = False  # a prefill chunk that left part of the fill unwritten


@dataclass(frozen=True)
class Ghost:
    """Truth per request the scheduler does not keep (read as :class:`spec.state.GhostView`).

    Written only by the ``ghost_*`` transitions, at fixed places no scheduler decision can
    move (launch, forward, result, retract, release); faults never change them.
    """

    epoch: int = 0  # bumps at each retraction
    kv_len_true: int = 0
    settled_len: int = 0
    inflight_steps: int = 0  # launched in this epoch, result not yet processed
    prepared_steps: int = 0  # a decode prepared (claim made) but not yet launched
    extend_inflight: bool = False  # prefill prepared, the result of its last chunk unprocessed
    output_len_true: int = 0
    finished: bool = False
    # Why the environment ended the output: "abort" (requested before the result that
    # ended it), "stop" (EOS inside the kept run), "length" (max_new_tokens reached).
    finish_reason: str | None = None
    abort_requested: bool = False
    # Verify results processed while live, and their accepted drafts (accept_len - 1).
    verify_ct: int = 0
    correct_drafts: int = 0
    inflight_at_release: int = 0  # launched, unprocessed steps at the finish release
    finished_at_tail: bool = False  # the finishing result was a spec mixed tail's
    claimed_at_release: int = 0  # the same plus a prepared, never-launched step
    steps: Mapping[StepId, GhostStep] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the relation sees it (upstream ``Req`` and ``req.kv``, M2)."""

    rid: RequestId
    prompt_len: TokenCount
    max_new_tokens: TokenCount
    output_ids: tuple[int, ...] = ()
    kv_committed_len: int = 0  # int, not TokenCount: a bug can make it negative
    kv_allocated_len: int = 0
    req_pool_idx: PoolRow | None = None
    finished_reason: str | None = None
    to_finish: str | None = None  # deferred abort, promoted by update_finish_state
    is_retracted: bool = False
    prebuilt: bool = False  # PD decode: KV and the first token arrive without a prefill
    waiting: bool = True
    holds_kv: bool = False
    release_count: int = 0  # releases in the current epoch
    cached_len: int | None = None
    committed_at_release: int | None = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    # Chunked prefill (``Req.prefix_len``, ``extend_end``, ``inflight_middle_chunks``): the
    # positions earlier chunks wrote (checkpointed at the next step's top), the end of the
    # latest extend, and its middle chunks launched with their results unprocessed.
    prefix_len: int = 0
    extend_end: int = 0
    inflight_middle_chunks: int = 0
    # The radix cache (``req.kv.cache_protected_len``): row[0:cpl] are the tree's slots (a
    # matched prefix, then what checkpoints inserted); the request's own KV is past it.
    cache_protected_len: int = 0
    ghost: Ghost = field(default_factory=Ghost)
    last_prompt_token: int = 0  # origin_input_ids[-1], where the token chain starts (RP7)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    def is_finished(self) -> bool:
        return self.finished_reason is not None


# --- guards and frames ---------------------------------------------------------------------
R = TypeVar("R")
P = ParamSpec("P")


def _describe(record: object) -> str:
    rid = getattr(record, "rid", None)
    return "the ghost" if rid is None else f"request r{rid}"


def require(ok: bool, name: str, record: object, field_name: str, detail: str) -> None:
    """Raise :class:`GuardViolation` unless ``ok``: which transition, request and field."""
    if not ok:
        value = getattr(record, field_name, "?")
        raise GuardViolation(f"{name} guard violated for {_describe(record)}: "
                             f"{field_name}={value!r}, {detail}")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(record_type: type) -> tuple[str, ...]:
    """A record type's field names, kept (``dataclasses.fields`` rebuilds them on every
    call, and every transition call checks its frame)."""
    names = _FIELD_NAMES.get(record_type)
    if names is None:
        names = _FIELD_NAMES[record_type] = tuple(f.name for f in fields(record_type))
    return names


def get_frame_violations(frame: frozenset[str], pre: Any, post: Any,
                         prefix: str = "") -> list[str]:
    """Fields outside ``frame`` whose value differs between ``pre`` and ``post``.

    A dotted name (``ghost.epoch``) frames one field of a nested record; the plain name
    (``ghost``) frames all of it.
    """
    changed: list[str] = []
    for attribute in _field_names(type(pre)):
        name = prefix + attribute
        before, after = getattr(pre, attribute), getattr(post, attribute)
        if name in frame or before == after:
            continue
        if any(entry.startswith(name + ".") for entry in frame):
            changed += get_frame_violations(frame, before, after, name + ".")
        else:
            changed.append(f"{name}: {before!r} -> {after!r}")
    return changed


# Every transition's frame by name, for reports and tests.
FRAMES: dict[str, frozenset[str]] = {}


def transition(*frame: str) -> Callable[[Callable[Concatenate[R, P], R]],
                                        Callable[Concatenate[R, P], R]]:
    """Declare a transition's frame; every call checks nothing outside it changed."""
    allowed = frozenset(frame)

    def decorate(fn: Callable[Concatenate[R, P], R]) -> Callable[Concatenate[R, P], R]:
        def checked(pre: R, /, *args: P.args, **kwargs: P.kwargs) -> R:
            post = fn(pre, *args, **kwargs)
            changed = get_frame_violations(allowed, pre, post)
            if changed:
                raise FrameViolation(f"{fn.__name__} changed {_describe(pre)} outside its "
                                     f"frame: {'; '.join(changed)}")
            return post

        functools.update_wrapper(checked, fn)
        FRAMES[fn.__name__] = allowed
        return checked

    return decorate


# --- the scheduler's transitions -------------------------------------------------------------
def _require_decodable(name: str, req: RequestRecord) -> None:
    require(req.holds_kv, name, req, "holds_kv", "expected a request holding KV")
    require(not req.is_finished(), name, req, "finished_reason", "expected None")


def admit(rid: RequestId, prompt_len: TokenCount, max_new_tokens: TokenCount,
          prebuilt: bool = False, refused: bool = False,
          family: int | None = None) -> RequestRecord:
    """A new request in the waiting queue (``Scheduler.handle_generate_request``), with
    ``max_new_tokens`` already capped (``transitions.compute_admission``).

    A PD-decode request (``prebuilt``) arrives with its first token, so it needs room
    for at least one more. A ``refused`` prompt (too long) is queued anyway, as
    ``set_finish_with_abort`` leaves it: one prompt token and an abort that its first
    result promotes. A prompt of another request's ``family`` shares its tokens.
    """
    if prebuilt:
        max_new_tokens = TokenCount(max(max_new_tokens, 2))
    last = get_last_prompt_token(rid if family is None else family, prompt_len, refused)
    if refused:
        return RequestRecord(rid, TokenCount(1), max_new_tokens, prebuilt=prebuilt,
                             to_finish="abort", ghost=Ghost(abort_requested=True),
                             last_prompt_token=last)
    return RequestRecord(rid, prompt_len, max_new_tokens, prebuilt=prebuilt,
                         last_prompt_token=last)


@transition("finished_reason", "to_finish", "ghost.abort_requested", "ghost.finished",
            "ghost.finish_reason")
def finish_chunked_abort(req: RequestRecord) -> RequestRecord:
    """``process_pending_chunked_abort`` (the next step's top): the chunked request an abort
    marked finishes "abort" at once, before its release (``prepare_abort``)."""
    _require_decodable("finish_chunked_abort", req)
    require(req.to_finish == "abort", "finish_chunked_abort", req, "to_finish",
            "expected an abort requested")
    return replace(req, finished_reason="abort", to_finish=None,
                   ghost=ghost_abort(req.ghost, waiting=True))


@transition("waiting", "is_retracted", "finished_reason", "to_finish",
            "ghost.abort_requested", "ghost.finished", "ghost.finish_reason")
def abort(req: RequestRecord) -> RequestRecord:
    """``Scheduler.abort_request``: a waiting request leaves finished; a running one is
    marked ``to_finish`` and finishes at its next result (update_finish_state)."""
    require(not req.is_finished(), "abort", req, "finished_reason", "expected None")
    ghost = ghost_abort(req.ghost, waiting=req.waiting)
    if req.waiting:
        return replace(req, waiting=False, is_retracted=False, finished_reason="abort",
                       ghost=ghost)
    return replace(req, to_finish="abort", ghost=ghost)


@transition("req_pool_idx", "holds_kv", "kv_allocated_len", "kv_committed_len",
            "is_retracted", "waiting", "extend_end", "inflight_middle_chunks", "prefix_len",
            "cache_protected_len", "ghost.extend_inflight", "ghost.kv_len_true",
            "ghost.settled_len")
def prepare_for_extend(req: RequestRecord, row: PoolRow, extend_end: int | None = None,
                       prefix_len: int = 0, faults: frozenset[str] = NO_FAULTS
                       ) -> RequestRecord:
    """``ScheduleBatch.prepare_for_extend`` / ``alloc_for_extend`` for one request: a pool
    row and committed = allocated = the extend's end, ``extend_end``: fill_len (prompt plus
    every output token, so a retracted request is re-prefilled) unless chunked prefill cut
    a first chunk. A chunk short of fill_len is a middle chunk (``inflight_middle_chunks``
    + 1, as ``_get_new_batch_prefill_raw`` counts it). Leaves output_ids.

    With the radix cache the extend starts past the prefix admission matched
    (``match_kv_cache``: ``prefix_len`` and ``cache_protected_len``, common.py:244,
    schedule_batch.py:1742), whose KV another request wrote and settled. B36: a retracted
    request's extend starts at the stale offset its retraction kept (cpl and the ghost do
    not move: only the forward's writes start late)."""
    name = "prepare_for_extend"
    require(req.waiting, name, req, "waiting", "expected a waiting request")
    require(not req.holds_kv, name, req, "holds_kv", "expected a request without KV")
    require(not req.is_finished(), name, req, "finished_reason", "expected None")
    fill_len = compute_fill_len(req.prompt_len, req.output_len)
    end, middle = compute_extend_kv(req.prompt_len, req.output_len, extend_end)
    require(0 <= prefix_len < end <= fill_len, name, req, "extend_end",
            f"extend [{prefix_len}, {end}) outside 1..{fill_len}")
    stale = "B36" in faults and req.is_retracted and prefix_len < req.prefix_len < end
    return replace(req, req_pool_idx=row, holds_kv=True, kv_allocated_len=end,
                   kv_committed_len=end, is_retracted=False, waiting=False, extend_end=end,
                   inflight_middle_chunks=req.inflight_middle_chunks + middle,
                   prefix_len=req.prefix_len if stale else prefix_len,
                   cache_protected_len=prefix_len,
                   ghost=ghost_prepare_extend(req.ghost, prefix_len))


def compute_extend_kv(prompt_len: int, output_len: int, extend_end: int | None = None
                      ) -> tuple[int, int]:
    """``prepare_for_extend``'s integer core (lifted into the proofs): the extend's end,
    which both KV lengths become, and the middle chunks it adds (1 short of fill_len)."""
    fill_len = compute_fill_len(prompt_len, output_len)
    end = fill_len if extend_end is None else extend_end
    return end, 1 if end < fill_len else 0


@transition("kv_allocated_len", "kv_committed_len", "extend_end", "inflight_middle_chunks")
def prepare_next_chunk(req: RequestRecord, extend_end: int,
                       faults: frozenset[str] = NO_FAULTS) -> RequestRecord:
    """``PrefillAdder.add_chunked_req`` then ``alloc_for_extend``: the chunked request's next
    chunk, in the row it kept, from its checkpointed ``prefix_len`` to ``extend_end``;
    committed = allocated = ``extend_end``, counted as a middle chunk unless it ends the fill
    (B18: not counted, sglang-jax #971)."""
    name = "prepare_next_chunk"
    _require_decodable(name, req)
    fill_len = compute_fill_len(req.prompt_len, req.output_len)
    require(req.prefix_len == req.extend_end == req.kv_committed_len, name, req, "prefix_len",
            f"expected the last chunk checkpointed (extend_end={req.extend_end}, "
            f"committed={req.kv_committed_len})")
    require(req.prefix_len < extend_end <= fill_len, name, req, "extend_end",
            f"chunk end {extend_end} outside {req.prefix_len + 1}..{fill_len}")
    return replace(req, kv_allocated_len=extend_end, kv_committed_len=extend_end,
                   extend_end=extend_end,
                   inflight_middle_chunks=req.inflight_middle_chunks + (
                       extend_end < fill_len and "B18" not in faults))


@transition("prefix_len")
def stash_chunked_request(req: RequestRecord) -> RequestRecord:
    """``Scheduler.stash_chunked_request`` / ``checkpoint_kv_cache`` at the top of the next
    step: the chunk scheduled last is the prefix of the next one (``prefix_len :=
    extend_end``; with the radix cache off nothing else changes, the row is kept)."""
    _require_decodable("stash_chunked_request", req)
    return replace(req, prefix_len=req.extend_end)


@transition("cache_protected_len")
def checkpoint_into_tree(req: RequestRecord, inserted_len: int) -> RequestRecord:
    """``checkpoint_into_tree`` (unified_radix_cache.py:1164-1318), at the chunk stash, a
    prefill's completion and a finish release: the tree holds the request's first
    ``inserted_len`` positions (its key's whole pages), now its protected prefix."""
    require(req.holds_kv, "checkpoint_into_tree", req, "holds_kv", "expected its row held")
    require(req.cache_protected_len <= inserted_len <= req.kv_committed_len,
            "checkpoint_into_tree", req, "cache_protected_len",
            f"inserted {inserted_len}, committed {req.kv_committed_len}")
    return replace(req, cache_protected_len=inserted_len)


@transition("kv_allocated_len", "kv_committed_len", "ghost.prepared_steps")
def prepare_for_decode(req: RequestRecord, seq_len: int) -> RequestRecord:
    """Non-spec ``prepare_for_decode`` / ``alloc_for_decode``: one slot at column seq_len,
    so allocated = seq_len + 1, and the slot is claimed now: committed += 1."""
    _require_decodable("prepare_for_decode", req)
    return replace(req, kv_allocated_len=compute_decode_seq_len_ns(seq_len),
                   kv_committed_len=req.kv_committed_len + 1,
                   ghost=ghost_prepare_decode(req.ghost))


@transition("extend_end")
def mix_with_running(req: RequestRecord, seq_len: int) -> RequestRecord:
    """``ScheduleBatch.mix_with_running`` for a prepared decode row: it rides in the prefill
    chunk's batch as a one-token extend ending at its decode ``seq_len`` (``extend_end =
    prefix + 1``); ``prefix_len`` keeps the last prefill's end, and its result is a decode's
    (a decode row is never checkpointed)."""
    _require_decodable("mix_with_running", req)
    return replace(req, extend_end=seq_len)


@transition("kv_allocated_len", "kv_committed_len", "ghost.prepared_steps")
def prepare_for_decode_spec_v2(req: RequestRecord, reserve: int, page_size: int,
                               preclaim: bool, faults: frozenset[str] = NO_FAULTS
                               ) -> RequestRecord:
    """Spec-v2 ``prepare_for_decode``: reserve up to max(cur, committed + reserve), page
    aligned; with the pre-claim (PR 23456) the bonus slot is claimed now. seq_lens is
    untouched (batch state).

    B12 drops the max(cur, ...) clamp: a down-switch can shrink the allocation. B22 drops
    the page rounding (#31616's "before"): the record stops inside its last page.
    """
    _require_decodable("prepare_for_decode_spec_v2", req)
    target = compute_v2_alloc_target(req.kv_committed_len, req.kv_allocated_len, reserve,
                                     page_size, faults)
    return replace(req, kv_allocated_len=target,
                   kv_committed_len=req.kv_committed_len + (1 if preclaim else 0),
                   ghost=ghost_prepare_decode(req.ghost))


@transition("ghost.inflight_steps", "ghost.prepared_steps", "ghost.steps")
def launch(req: RequestRecord, step: StepId) -> RequestRecord:
    """``run_batch``: the step is launched for this request. Only the ghost changes; a
    request released before the launch (B14) is launched all the same."""
    return replace(req, ghost=ghost_launch(req.ghost, step))


@transition("ghost.kv_len_true", "ghost.steps")
def forward_extend(req: RequestRecord, step: StepId, end: int) -> RequestRecord:
    """The prefill forward (environment): KV for prompt and output is really written up to
    ``end``, the batch's seq_len (a chunk's end)."""
    return replace(req, ghost=ghost_forward_extend(req.ghost, step, req.prompt_len, end))


@transition("ghost.kv_len_true", "ghost.steps")
def forward_decode(req: RequestRecord, step: StepId, advanced_by: int) -> RequestRecord:
    """A decode forward (environment): ``advanced_by`` positions settle (1, or accept_len
    after verify)."""
    return replace(req, ghost=ghost_forward_decode(req.ghost, step, advanced_by))


def compute_finished_reason(to_finish: str | None, eos_at: int | None, run_len: int,
                            output_len: int, max_new_tokens: int,
                            finished_reason: str | None) -> str | None:
    """``Req.update_finish_state`` after a row kept ``run_len`` tokens: a deferred abort
    wins, then an EOS inside the kept run, then the length limit."""
    if to_finish is not None:
        return to_finish
    if eos_at is not None and eos_at < run_len:
        return "stop"
    if output_len >= max_new_tokens:
        return "length"
    return finished_reason


def is_stale(req: RequestRecord) -> bool:
    """A result row of a finished or retracted request: skipped (PR 23456, #18848)."""
    return req.is_finished() or req.is_retracted


@transition("output_ids", "kv_committed_len", "finished_reason", "spec_verify_ct",
            "spec_num_correct_drafts", "inflight_middle_chunks", "prefix_len",
            "ghost.inflight_steps",
            "ghost.extend_inflight",
            "ghost.steps", "ghost.settled_len", "ghost.output_len_true", "ghost.finished",
            "ghost.finish_reason", "ghost.finished_at_tail", "ghost.verify_ct",
            "ghost.correct_drafts")
def process_result(req: RequestRecord, cell: Cell, step: StepId, forward_mode: str,
                   accept_len: int, eos_at: int | None, tokens: tuple[int, ...],
                   faults: frozenset[str] = NO_FAULTS) -> RequestRecord:
    """One row of ``process_batch_result_prefill / _decode`` (``_resolve_spec_v2_tokens``).

    The ghost settles the step first, by the environment's own cut. A live row shows the
    accepted run cut at EOS and max_new_tokens (``tokens``: the row's sampled tokens; the
    visible output, ``output_ids_through_stop``), commits the whole run (the release) or
    the cut one (``trimmed_finish``; compute_committed_run, compute_committed_after_result)
    and updates the finish state; a stale row only settles its pre-claim. The release of a
    finished request is :func:`release_kv_cache`, next.

    A prefill's live row that does not finish checkpoints (``prefix_len := extend_end``).
    A spec decode mixed into a prefill (``forward_mode`` "tail") runs one token from its
    pending bonus token, is no verify, and commits that bonus slot unless the result
    finishes it (``process_batch_result_prefill``: ``kv_committed_len += 1`` for a decoding
    request not finished).
    A middle chunk's row (``inflight_middle_chunks`` > 0 at an extend result, retracted
    or not finished) only takes one off the counter: no token, no finish check, no commit
    (``process_batch_result_prefill``'s chunked branch); its sampled token is thrown away.

    Faults: B3 commits a stale row's run as if live (the pre-claim era's commit loop before
    #23456; output, finish and release kept their skip); B11 commits the uncut run (the
    trimmed finish's cell too); B20 leaves a tail's slot uncommitted (#27971).
    """
    name = "process_result"
    require(accept_len >= 1, name, req, "output_ids", f"accept_len={accept_len} < 1")
    verified = cell.is_spec and forward_mode == "decode"
    tail = forward_mode == "tail"
    ghost = ghost_result(req.ghost, step, req.max_new_tokens, accept_len, eos_at, verified,
                         tail)
    if forward_mode == "extend" and req.inflight_middle_chunks > 0 and not req.is_retracted:
        return replace(req, inflight_middle_chunks=req.inflight_middle_chunks - 1, ghost=ghost)
    stale = is_stale(req)
    run_len = compute_run_len(accept_len, compute_output_budget(
        req.max_new_tokens, req.output_len, req.to_finish is not None), eos_at)
    if "B17" in faults and verified and req.to_finish is not None:
        run_len = accept_len  # the release: no finished_len once an abort is pending
    committed = compute_result_kv(cell, forward_mode, req.kv_committed_len, accept_len, run_len,
                                  stale, req.is_finished(), faults)
    if stale:
        return replace(req, kv_committed_len=committed, ghost=ghost)
    require(run_len <= len(tokens), name, req, "output_ids",
            f"the row holds {len(tokens)} tokens, the run keeps {run_len}")
    grown = replace(req, output_ids=req.output_ids + tokens[:run_len],
                    kv_committed_len=committed, ghost=ghost,
                    spec_verify_ct=req.spec_verify_ct + (1 if verified else 0),
                    spec_num_correct_drafts=req.spec_num_correct_drafts
                    + (accept_len - 1 if verified else 0))
    reason = compute_finished_reason(req.to_finish, eos_at, run_len, grown.output_len,
                                     req.max_new_tokens, req.finished_reason)
    if forward_mode == "extend" and reason is None:  # checkpoint_kv_cache: the prefix now
        grown = replace(grown, prefix_len=req.extend_end)
    if tail and reason is None and "B20" not in faults:  # the second commit site (#27971)
        grown = replace(grown, kv_committed_len=committed + 1)
    return replace(grown, finished_reason=reason)


def compute_result_kv(cell: Cell, forward_mode: str, committed: int, accept_len: int,
                      run_len: int, stale: bool, finished: bool,
                      faults: frozenset[str] = NO_FAULTS) -> int:
    """``process_result``'s commit over the row's fields (lifted into the proofs):
    kv_committed_len after a row whose accepted run keeps ``run_len`` tokens."""
    if forward_mode != "decode":
        return committed
    if stale:
        if "B3" in faults and cell.is_spec and cell.preclaim:
            # Before #23456 the commit loop had no skip: accept_len - 1 for every row.
            return compute_committed_after_result(cell, committed, accept_len, False, False)
        return compute_committed_after_result(cell, committed, run_len, True, finished)
    settled = accept_len if "B11" in faults else compute_committed_run(cell, accept_len, run_len)
    return compute_committed_after_result(cell, committed, settled, False, False)


@transition("release_count", "holds_kv", "req_pool_idx", "kv_allocated_len", "cached_len",
            "committed_at_release", "ghost.inflight_at_release", "ghost.claimed_at_release")
def release_kv_cache(req: RequestRecord, cell: Cell, is_insert: bool,
                     faults: frozenset[str] = NO_FAULTS) -> RequestRecord:
    """``release_kv_cache`` (mem_cache/common.py): the row and KV are released once.

    At a finish (``is_insert``) the tree caches ``Req.owned_kv_len()``, never past the
    allocation (compute_cached_len). kv_committed_len is unchanged; kv_allocated_len
    becomes 0 (``ReqKvInfo.mark_kv_released``, the end of upstream's release). B11 caches
    kv_committed_len itself, past the stop; B10 caches ``owned_kv_len`` in a trimmed
    finish's cell, the newest token's unwritten slot included (#24590).
    """
    name = "release_kv_cache"
    require(req.holds_kv, name, req, "holds_kv", "released twice")
    require(req.req_pool_idx is not None, name, req, "req_pool_idx", "released twice")
    released = replace(req, release_count=req.release_count + 1, holds_kv=False,
                       req_pool_idx=None, kv_allocated_len=0)
    if not is_insert and req.is_finished():  # a chunked request's abort: nothing cached
        return replace(released, cached_len=0, committed_at_release=req.kv_committed_len,
                       ghost=ghost_release(req.ghost))
    if not is_insert:
        return released
    committed = req.kv_committed_len
    cached = compute_release_cached(cell, committed, req.prompt_len, req.output_len,
                                    req.finished_reason == "abort", faults)
    return replace(released, cached_len=max(0, min(cached, req.kv_allocated_len)),
                   committed_at_release=committed, ghost=ghost_release(req.ghost))


def compute_release_cached(cell: Cell, committed: int, prompt_len: int, output_len: int,
                           aborted: bool, faults: frozenset[str] = NO_FAULTS) -> int:
    """What a finish release keys into the tree before the cut to the allocation
    (lifted into the proofs, whose KV claims bound it unclamped)."""
    if "B11" in faults:
        return committed
    rule = replace(cell, trimmed_finish=False) if "B10" in faults else cell
    return compute_cached_len(rule, committed, prompt_len, output_len, aborted)


@transition("is_retracted", "prebuilt", "kv_committed_len", "kv_allocated_len",
            "req_pool_idx", "holds_kv", "waiting", "release_count", "prefix_len", "extend_end",
            "inflight_middle_chunks", "cache_protected_len", "ghost.epoch",
            "ghost.kv_len_true", "ghost.settled_len", "ghost.inflight_steps",
            "ghost.prepared_steps", "ghost.extend_inflight")
def reset_for_retract(req: RequestRecord, faults: frozenset[str] = NO_FAULTS
                      ) -> RequestRecord:
    """``Req.reset_for_retract`` after ``release_req`` (``retract_decode``): back to the
    waiting queue with no KV; output_ids are kept for the re-prefill, a prebuilt request
    is re-prefilled here. The ghost starts a new epoch. B36 keeps ``prefix_len``."""
    require(not req.holds_kv, "reset_for_retract", req, "holds_kv",
            "expected the KV released first (release_kv_cache)")
    return replace(req, is_retracted=True, prebuilt=False, kv_committed_len=0,
                   kv_allocated_len=0, req_pool_idx=None, holds_kv=False, waiting=True,
                   release_count=0, prefix_len=req.prefix_len if "B36" in faults else 0,
                   extend_end=0, inflight_middle_chunks=0, cache_protected_len=0,
                   ghost=ghost_retract(req.ghost))


@transition("output_ids", "ghost.kv_len_true", "ghost.settled_len", "ghost.output_len_true",
            "ghost.extend_inflight")
def process_prebuilt(req: RequestRecord, token: int) -> RequestRecord:
    """PD decode ``process_prebuilt``: the prefill ran elsewhere; its KV and first output
    token arrive settled, after :func:`prepare_for_extend` gave the request its row."""
    name = "process_prebuilt"
    require(req.prebuilt, name, req, "prebuilt", "expected a PD-decode request")
    require(req.holds_kv, name, req, "holds_kv", "expected prepare_for_extend first")
    require(req.output_len == 0, name, req, "output_ids", "expected no output yet")
    return replace(req, output_ids=(*req.output_ids, token),
                   ghost=ghost_prebuilt(req.ghost, req.prompt_len))


def count_middle_chunks(ghost: Ghost) -> int:
    """Middle prefill chunks of the current epoch forwarded, their results unprocessed (the
    truth ``Req.inflight_middle_chunks`` counts, once each chunk is launched)."""
    return sum(1 for s in ghost.steps.values() if s.middle_chunk and s.epoch == ghost.epoch)


# --- the ghost's transitions (the environment's account) ---------------------------------------
@transition("extend_inflight", "kv_len_true", "settled_len")
def ghost_prepare_extend(ghost: Ghost, prefix_len: int = 0) -> Ghost:
    """A prefill claims its whole fill length at prepare time; nothing of it is settled
    yet but a matched radix prefix (another request wrote it)."""
    return replace(ghost, extend_inflight=True, kv_len_true=prefix_len, settled_len=prefix_len)


@transition("prepared_steps")
def ghost_prepare_decode(ghost: Ghost) -> Ghost:
    return replace(ghost, prepared_steps=1)


@transition("inflight_steps", "prepared_steps", "steps")
def ghost_launch(ghost: Ghost, step: StepId) -> Ghost:
    require(step not in ghost.steps, "ghost_launch", ghost, "steps", f"step {step} launched twice")
    return replace(ghost, inflight_steps=ghost.inflight_steps + 1, prepared_steps=0,
                   steps={**ghost.steps, step: GhostStep(ghost.epoch)})


def _require_launched(name: str, ghost: Ghost, step: StepId) -> GhostStep:
    launched = ghost.steps.get(step)
    require(launched is not None, name, ghost, "steps", f"step {step} was never launched")
    assert launched is not None
    return launched


@transition("kv_len_true", "steps")
def ghost_forward_extend(ghost: Ghost, step: StepId, prompt_len: int, end: int) -> Ghost:
    """The forward writes up to ``end``, never past the fill; short of it, a middle chunk."""
    launched = _require_launched("ghost_forward_extend", ghost, step)
    fill = prompt_len + ghost.output_len_true
    kv_len = min(end, fill)
    return replace(ghost, kv_len_true=kv_len, steps={**ghost.steps, step: replace(
        launched, kv_len=kv_len, is_extend=True, middle_chunk=kv_len < fill)})


@transition("kv_len_true", "steps")
def ghost_forward_decode(ghost: Ghost, step: StepId, advanced_by: int) -> Ghost:
    launched = _require_launched("ghost_forward_decode", ghost, step)
    kv_len = ghost.kv_len_true + advanced_by
    return replace(ghost, kv_len_true=kv_len,
                   steps={**ghost.steps, step: replace(launched, kv_len=kv_len)})


@transition("inflight_steps", "extend_inflight", "steps", "settled_len", "output_len_true",
            "finished", "finish_reason", "finished_at_tail", "verify_ct", "correct_drafts")
def ghost_result(ghost: Ghost, step: StepId, max_new_tokens: int, accept_len: int,
                 eos_at: int | None, verified: bool, tail: bool = False) -> Ghost:
    """Settle a step by the environment's own cut: EOS and max_new_tokens end the visible
    output. Written out here rather than with compute_run_len, so that a wrong cut in the
    scheduler cannot hide in the truth it is checked against. A result of an older epoch
    (launched before a retraction) settles nothing, and a middle chunk's settles its KV
    but no token: the prefill ends with its last chunk. ``verified``: a speculative verify
    result, which feeds the request's verify count and accepted drafts when it is live;
    ``tail``: a spec mixed tail's, whose finish the release does not commit.

    The finish reason is upstream's precedence (``Req.update_finish_state``): a requested
    abort, then a stop token inside the kept run (one past the cap is a length finish,
    ``_cap_finished_len_at_max_new_tokens``), then the length cap."""
    launched = ghost.steps.get(step)
    steps = {k: v for k, v in ghost.steps.items() if k != step}
    if launched is None or launched.epoch != ghost.epoch:
        return replace(ghost, steps=steps)
    settled = replace(ghost, steps=steps, inflight_steps=ghost.inflight_steps - 1,
                      extend_inflight=ghost.extend_inflight and not (
                          launched.is_extend and not launched.middle_chunk))
    if launched.middle_chunk:
        return settled if ghost.finished or launched.kv_len is None else replace(
            settled, settled_len=launched.kv_len)
    if ghost.finished:
        return settled
    run_len = min(accept_len, max(compute_output_budget(max_new_tokens, ghost.output_len_true,
                                                        ghost.abort_requested), 0))
    if eos_at is not None and eos_at + 1 < run_len:
        run_len = eos_at + 1
    output_len = ghost.output_len_true + run_len
    hit_eos = eos_at is not None and eos_at < run_len
    reason = ("abort" if ghost.abort_requested else "stop" if hit_eos
              else "length" if output_len >= max_new_tokens else None)
    return replace(settled, output_len_true=output_len,
                   settled_len=ghost.settled_len if launched.kv_len is None else launched.kv_len,
                   finished=reason is not None, finish_reason=reason,
                   finished_at_tail=tail and reason is not None,
                   verify_ct=ghost.verify_ct + (1 if verified else 0),
                   correct_drafts=ghost.correct_drafts + (accept_len - 1 if verified else 0))


@transition("kv_len_true", "settled_len", "output_len_true", "extend_inflight")
def ghost_prebuilt(ghost: Ghost, prompt_len: int) -> Ghost:
    return replace(ghost, kv_len_true=prompt_len, settled_len=prompt_len, output_len_true=1,
                   extend_inflight=False)


@transition("abort_requested", "finished", "finish_reason")
def ghost_abort(ghost: Ghost, waiting: bool) -> Ghost:
    """An abort is requested; a waiting request is finished at once."""
    if ghost.finished or not waiting:
        return replace(ghost, abort_requested=True)
    return replace(ghost, abort_requested=True, finished=True, finish_reason="abort")


@transition("inflight_at_release", "claimed_at_release")
def ghost_release(ghost: Ghost) -> Ghost:
    return replace(ghost, inflight_at_release=ghost.inflight_steps,
                   claimed_at_release=ghost.inflight_steps + ghost.prepared_steps)


@transition("epoch", "kv_len_true", "settled_len", "inflight_steps", "prepared_steps",
            "extend_inflight")
def ghost_retract(ghost: Ghost) -> Ghost:
    return replace(ghost, epoch=ghost.epoch + 1, kv_len_true=0, settled_len=0,
                   inflight_steps=0, prepared_steps=0, extend_inflight=False)
