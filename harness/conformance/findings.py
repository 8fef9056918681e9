"""What the upstream tier knows about sglang 0.5.23: listed findings, allowed divergences,
and the invariants it cannot judge on CPU. Pure data; ``docs/upstream-findings.md`` is the
prose twin of this file (a test keeps them in step).

* A **finding** is an invariant sglang violates. Listed ones carry the upstream file:line,
  what the spec expects and the evidence (a replayable script the tier re-derives and
  minimises in every run). A violation that matches no listed finding fails the tier.
* An **allowed divergence** is a field where the reference and the release differ on
  purpose or by a documented modelling difference; anything else the differential sees
  fails the tier. Each entry names the upstream code and the reason, and whether the
  realignment issue (#12) is meant to remove it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from overlap_spec.spec.config import Cell, SpecMode
from overlap_spec.spec.interface import ObservableState
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.upstream.fields import NOT_JUDGED_ON_RELEASE

UPSTREAM_CHECKER_ID: Final = "UC"
"""Upstream's own ``SchedulerInvariantChecker.self_check_during_busy`` (pool conservation,
per-owner committed <= allocated <= width, no owner page in the free list), run after
every iteration beside the spec's invariants."""

UPSTREAM_NOT_APPLICABLE: Final[dict[str, str]] = NOT_JUDGED_ON_RELEASE
"""Invariants the tier cannot judge on the release, with why (:mod:`upstream.fields`)."""


@dataclass(frozen=True)
class KnownFinding:
    id: str  # U1, U2, ...
    invariant: str
    pattern: str  # regular expression the violation's text must match
    applies: Callable[[Cell], bool]
    upstream: str  # file:line in sglang 0.5.23
    summary: str
    expected: str
    reference: str  # upstream issue / PR / digest entry
    # The same mechanism as another invariant reports it: (invariant, pattern) pairs.
    also: tuple[tuple[str, str], ...] = ()
    # Why nothing after it in the same run is judged (the release corrupted its own state),
    # or "" when the run is judged on.
    halts: str = ""

    def matches(self, violation: InvariantViolation, cell: Cell) -> bool:
        if not self.applies(cell):
            return False
        return any(violation.invariant_id == invariant
                   and re.search(pattern, str(violation)) is not None
                   for invariant, pattern in ((self.invariant, self.pattern), *self.also))


def _spec(cell: Cell) -> bool:
    return cell.is_spec


def _page_1_tree(cell: Cell) -> bool:
    return cell.spec_mode is SpecMode.V2_TREE and cell.page_size == 1


def _non_spec_overlap(cell: Cell) -> bool:
    return not cell.is_spec and cell.overlap


# Retired (ids are not reused): U1, SL4 claiming one length for the fields of an emptied
# batch, which 0.5.23's filter_batch leaves stale (callers check is_empty()): SL4 now
# judges batches that hold requests. U2 and U4, KV9 claiming the trimmed finish (the run cut
# before committing, prompt + output - 1 cached) of every cell. KV9 now states the release's
# finish (the whole accepted run committed, Req.owned_kv_len() cached) and keeps the stronger
# claim for the trimmed finish proposal's cell, which the tier does not drive.
KNOWN_FINDINGS: Final[tuple[KnownFinding, ...]] = (
    KnownFinding(
        "U3", "RP3", r"num_correct_drafts=\d+, batch size \d+; live requests give", _spec,
        "python/sglang/srt/managers/scheduler_components/batch_result_processor.py:785 "
        "(_resolve_spec_v2_tokens: num_correct_drafts over every row) and :986 "
        "(update_spec_metrics(batch.batch_size(), ...))",
        "the accept counters and the adaptive controller's feed count every row of a "
        "decode result, including requests that finished or were retracted while it was "
        "in flight (their rows are skipped only for output and commit)",
        "counters count requests live when the result is processed",
        "bug B4 (#18848, #23456 review); digest D7"),
    KnownFinding(
        "U5", "RP2", r"\d+ output tokens > max_new_tokens=\d+", _spec,
        "python/sglang/srt/managers/schedule_batch.py:2011 (Req.update_finish_state returns "
        "on to_finish before the length cap)",
        "an abort promoted by the same verify result that crosses max_new_tokens finishes "
        "the request with finished_len=None, so the whole accepted run is visible output",
        "visible output never exceeds max_new_tokens",
        "digest D4; observed in sglang 0.5.23 on CPU; the catalogue's B17"),
    KnownFinding(
        "U6", "RP5", r"finished \(abort\) with \d+ visible output tokens, the environment "
        r"ended it \(abort\) with \d+", _spec,
        "python/sglang/srt/managers/schedule_batch.py:2011 (Req.update_finish_state returns "
        "on to_finish before the stop-token and length checks that set finished_len)",
        "U5's mechanism as RP5 sees it, and with a stop token too: an abort promoted by the "
        "verify result that crosses max_new_tokens or holds a stop token leaves "
        "finished_len=None, so the client sees the whole accepted run, tokens past the "
        "stop or the cap included",
        "an aborted request's visible output is the environment's, cut at the stop and "
        "the cap",
        "found by RP5 in sglang 0.5.23 on CPU (the catalogue's B17); RP7 sees the stop-token "
        "case as a stop "
        "token inside the visible output, or, where only the newest token is checked, as "
        "a token after the stop",
        also=(("RP7", r"output token \d+ is 0; .*\(EOS only ends the output\)"),
              ("RP7", r"output token \d+ is \d+; the environment emitted \d+ at position "
                      r"\d+ after 0\b"))),
    KnownFinding(
        "U7", "KV1", r"\(allocated past the row\)", _page_1_tree,
        "python/sglang/srt/mem_cache/allocation_sizing.py:96 "
        "(get_req_to_token_extra_context_len: the row widened to the decode reserve only on "
        "pages > 1, #26972)",
        "a page-1 tree's decode reserve 2 * steps * topk exceeds the row's headroom past the "
        "context length (4 + D_tok), so a request capped a few tokens below the context "
        "allocates past its req_to_token row",
        "kv_allocated_len <= row width (the release's _check_kv_page_invariants asserts it)",
        "predicted by KV1 on the reference (tests/test_admission.py), confirmed on sglang "
        "0.5.23 at the realistic preset (tests/test_upstream_tier.py); KV4 then sees the "
        "row hold fewer slots than allocated (or, for the next row's request, a slot the "
        "overflow wrote) and KV7 the slot past the row in no account",
        also=(("KV4", r"\(r\d+ allocated past its row\)"),
              ("KV7", r"\(r\d+ allocated past its row\)"),
              # The release's own check asserts KV1's bound bare (a committed > allocated
              # there would fail KV1 too, without this finding's text, and fail the run).
              ("UC", r"AssertionError at srt/managers/scheduler_components/"
                     r"invariant_checker\.py:\d+ in _add_owner")),
        halts="the release wrote the slots past the row into the next row's first columns "
              "(the assign kernel has no column bound): the rest of the run follows from "
              "that corruption (pages leaked at release, a neighbour's row overwritten)"),
)


def match_finding(violation: InvariantViolation, cell: Cell) -> KnownFinding | None:
    for known in KNOWN_FINDINGS:
        if known.matches(violation, cell):
            return known
    return None


def get_known_finding(finding_id: str) -> KnownFinding:
    for known in KNOWN_FINDINGS:
        if known.id == finding_id:
            return known
    raise KeyError(finding_id)


@dataclass(frozen=True)
class DivergenceContext:
    """What an allow-list predicate may look at: both states after the operation, and
    which requests the release retracted during it (a retraction is the one event the
    states alone cannot tell apart from a request not yet admitted)."""

    reference: ObservableState
    upstream: ObservableState
    upstream_retracted: frozenset[int]
    is_spec: bool


@dataclass(frozen=True)
class AllowedDivergence:
    id: str  # A1, A2, ...
    field: str  # the ObservableState path pattern (regular expression)
    upstream: str  # file:line in sglang 0.5.23
    reason: str
    realign: bool  # the realignment issue is meant to remove it (the reference changes)
    when: Callable[[str, Any, Any, DivergenceContext], bool]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "field": self.field, "upstream": self.upstream,
                "reason": self.reason, "realign": self.realign}


# Retired (the reference now does what the release does; ids are not reused): A1, a
# release sets kv_allocated_len to 0 (ReqKvInfo.mark_kv_released); A3, a result that feeds
# no spec metrics reports (0, 0) accept counters; A6, spec retracts by the same policy
# sort as non-spec (#32023); A2, under overlap a request whose queued result finishes it by
# length is left out of the next decode (enable_skip_finishing_decode); A7 and A10, the
# running batch is filtered at every step, before admission counts it; A11, after a
# retraction the batch stands in the retraction policy's order; A9, at a finish the
# reference commits the whole accepted run and caches Req.owned_kv_len() as the release
# does (the trimmed finish is a proposal's cell); A5, admission is the release's PrefillAdder
# budget with its new-token ratio and batch_is_full latch (both compared as state); A8,
# the release's accept counters count stale rows (U3): the differential's reference runs
# with the catalogue's current-upstream bugs switched on (B4 among them), and the counters
# are compared exactly. A4, a batch's seq_lens_sum, was retired the other way round: the
# stand-in worker now hands each launch's ScheduleBatch to the release's own
# ForwardBatch.init_new (upstream/forward_batch.py), which back-fills the lazy sum
# (forward_batch_info.py:1019-1020) as the reference's init_new does.
ALLOWED_DIVERGENCES: Final[tuple[AllowedDivergence, ...]] = ()


def get_allowed(path: str, reference_value: Any, upstream_value: Any,
                ctx: DivergenceContext) -> AllowedDivergence | None:
    for entry in ALLOWED_DIVERGENCES:
        if re.fullmatch(entry.field, path) and entry.when(path, reference_value, upstream_value,
                                                         ctx):
            return entry
    return None
