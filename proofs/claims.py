"""The invariants as Z3 predicates over :mod:`proofs.model` records, by spec ID.

Two kinds:

- *state* claims (:data:`STATE_INVARIANTS`) hold in every reachable state, and the
  strengthening conjuncts ``IND*`` that make the conjunction inductive, each with its
  one-line justification;
- *point* claims (:data:`POINT_INVARIANTS`) hold where the spec checks them, at one
  transition each (the launch, prepare_for_decode, resolve, result processing). A point
  claim is n/a at any other transition, and is reported as such.

A spec ID's claim and the cells it applies to are the spec's (``spec/invariants/``), read
through :func:`get_invariant`, never restated here; only the ``IND*`` conjuncts state their
own. The spec IDs no predicate here encodes are reported n/a by the proofs tier
(``harness/prove/tier.py``), with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.model import Context, Record, Step, get_extend_pending, get_lag, is_live
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.invariants import get_invariant

StateClaim = Callable[[Context, Record], Term]
PointClaim = Callable[[Context, Record, Step], Term]


@dataclass(frozen=True)
class StateInvariant:
    id: str
    justification: str  # for IND* conjuncts; the spec claim for spec IDs
    predicate: StateClaim
    applies: Callable[[Context], bool]


@dataclass(frozen=True)
class PointInvariant:
    id: str
    transition: str
    predicate: PointClaim
    applies: Callable[[Context], bool]


def _always(ctx: Context) -> bool:
    return True


def _spec(ctx: Context) -> bool:
    return ctx.is_spec


def _as_in_spec(invariant_id: str) -> Callable[[Context], bool]:
    """Where the spec's ``invariant_id`` applies (its cells), read from the spec."""
    applies = get_invariant(invariant_id).applies
    return lambda ctx: applies(ctx.config.cell)


def _claimed_decode_steps(r: Record) -> Term:
    return r["inflight_steps"] - zs.If(get_extend_pending(r), 1, 0)


# ----------------------------------------------------------------------------- state claims
def kv1(ctx: Context, r: Record) -> Term:
    width = ctx.config.row_width
    return zs.Implies(
        r["holds_kv"],
        zs.And(
            0 <= r["kv_committed_len"],
            r["kv_committed_len"] <= r["kv_allocated_len"],
            r["kv_allocated_len"] <= width,
        ),
    )


def kv2(ctx: Context, r: Record) -> Term:
    return zs.Implies(r["holds_kv"], r["kv_committed_len"] == r["kv_allocated_len"])


def kv4(ctx: Context, r: Record) -> Term:
    """KV4's page part: a holder owns exactly the pages its allocation covers."""
    page = ctx.config.page_size
    return zs.Implies(
        r["holds_kv"],
        r["page_count"] == lift(tr.compute_pages_for_len, r["kv_allocated_len"], page),
    )


def kv5(ctx: Context, r: Record) -> Term:
    return zs.Implies(
        r["is_retracted"],
        zs.And(r["kv_committed_len"] == 0, r["kv_allocated_len"] == 0, zs.Not(r["holds_kv"])),
    )


def sl5(ctx: Context, r: Record) -> Term:
    return zs.Implies(r["holds_kv"], r["seq_len"] >= 1)


def sl2(ctx: Context, r: Record) -> Term:
    """SL2 element-wise, for a batch whose mirror is kept (the batch flag is the caller's)."""
    return zs.Implies(r["holds_kv"], r["seq_len"] == r["seq_len_cpu"])


def ind_domain(ctx: Context, r: Record) -> Term:
    preset = ctx.config.preset
    return zs.And(
        1 <= r["prompt_len"],
        r["prompt_len"] <= preset.max_prompt_len,
        1 <= r["max_new_tokens"],
        r["max_new_tokens"] <= preset.max_new_tokens,
        0 <= r["output_len"],
        r["output_len"] <= r["max_new_tokens"],
        zs.Implies(zs.Not(r["finished"]), r["output_len"] < r["max_new_tokens"]),
        zs.Not(zs.And(r["holds_kv"], r["is_retracted"])),
        zs.Not(zs.And(r["holds_kv"], r["finished"])),
        zs.Not(zs.And(r["finished"], r["is_retracted"])),
    )


def ind_pipeline(ctx: Context, r: Record) -> Term:
    limit = ctx.max_pending + 1
    top = max(shape.max_accept_len for shape in ctx.shapes)

    def decode_slot(accept: Term) -> Term:
        return zs.And(1 <= accept, accept <= top) if ctx.is_spec else accept == 1

    return zs.And(
        0 <= r["launched_steps"],
        r["launched_steps"] <= limit,
        r["inflight_steps"] == r["launched_steps"] + zs.If(r["prepared"], 1, 0),
        zs.Implies(r["prepared"], zs.And(r["launched_steps"] <= ctx.max_pending, r["holds_kv"])),
        zs.Implies(r["resolved"], r["prepared"]),
        zs.Implies(
            r["launched_steps"] >= 1,
            zs.If(r["extend_inflight"], r["accept_oldest"] == 0, decode_slot(r["accept_oldest"])),
        ),
        zs.Implies(r["launched_steps"] >= 2, decode_slot(r["accept_newest"])),
        zs.Implies(
            r["prepared"],
            zs.Or(
                *[
                    zs.And(
                        r["write_width"] == lift(tr.compute_forward_write_width, s, "decode",
                                                 ctx.config.page_size),
                        r["max_accept_len"] == s.max_accept_len,
                    )
                    for s in ctx.shapes
                ]
            ),
        ),
    )


def ind_truth(ctx: Context, r: Record) -> Term:
    return zs.Implies(r["holds_kv"], r["kv_len_true"] == r["settled_len"] + get_lag(r))


def ind_lead(ctx: Context, r: Record) -> Term:
    return zs.Implies(
        r["holds_kv"],
        r["kv_committed_len"] == r["settled_len"] + ctx.get_lead(_claimed_decode_steps(r)),
    )


def ind_output(ctx: Context, r: Record) -> Term:
    pending = zs.If(get_extend_pending(r), 1, 0)
    return zs.Implies(
        is_live(r),
        zs.And(
            r["settled_len"] == r["prompt_len"] + r["output_len"] - 1 + pending,
            r["output_len"] + pending >= 1,
            r["output_len"] < r["max_new_tokens"],
        ),
    )


def ind_reserve(ctx: Context, r: Record) -> Term:
    # Allocations are whole pages (or a prefill's fill length, shorter): the row's tail
    # past its last whole page (the p>1 headroom's page - 1) is never allocated.
    page = ctx.config.page_size
    covered = zs.Implies(r["holds_kv"], zs.And(
        r["kv_allocated_len"] >= r["kv_len_true"],
        r["kv_allocated_len"] <= ctx.config.row_width // page * page))
    if not ctx.is_spec:
        return zs.And(covered, zs.Implies(r["holds_kv"], r["seq_len"] == r["kv_committed_len"]))
    reserved = _get_reserve_claim(ctx, r)
    return zs.And(covered, zs.Implies(zs.And(r["holds_kv"], r["prepared"]), reserved))


def _get_reserve_claim(ctx: Context, r: Record) -> Term:
    """KV3 on a prepared spec step: the allocation covers the write width and, on pages
    > 1, is whole pages (the spec-v2 prepare rounds its target up, #31616)."""
    covers = r["kv_allocated_len"] >= r["kv_len_true"] + r["write_width"]
    page = ctx.config.page_size
    return covers if page == 1 else zs.And(covers, r["kv_allocated_len"] % page == 0)


def ind_relay(ctx: Context, r: Record) -> Term:
    if not ctx.is_spec:
        return zs.BoolVal(True)
    if not ctx.overlap:
        return zs.Implies(r["holds_kv"], r["seq_len"] == r["kv_len_true"])
    return zs.Implies(
        r["holds_kv"],
        zs.And(
            r["published_seq_len"] == r["kv_len_true"],
            r["seq_len"] >= r["prompt_len"],
            zs.Implies(r["resolved"], r["seq_len"] == r["kv_len_true"]),
        ),
    )


def _state(invariant_id: str, predicate: StateClaim, justification: str = "") -> StateInvariant:
    """A spec ID's state claim: its claim (or the part encoded) and its cells, the spec's."""
    return StateInvariant(invariant_id, justification or get_invariant(invariant_id).claim,
                          predicate, _as_in_spec(invariant_id))


def _point(invariant_id: str, transition: str, predicate: PointClaim) -> PointInvariant:
    return PointInvariant(invariant_id, transition, predicate, _as_in_spec(invariant_id))


STATE_INVARIANTS: Final[tuple[StateInvariant, ...]] = (
    _state("KV1", kv1),
    _state("KV2", kv2),
    _state("KV4", kv4, "pages owned == pages covering kv_allocated_len"),
    _state("KV5", kv5),
    _state("SL2", sl2),
    _state("SL5", sl5),
    StateInvariant(
        "IND1",
        "sizes stay in the admission domain and live/finished/retracted "
        "exclude each other (admission checks; release at finish and retract)",
        ind_domain,
        _always,
    ),
    StateInvariant(
        "IND2",
        "at most one result pending at prepare under overlap, none "
        "without (ST5), each slot's accept in [1, max] (SL8)",
        ind_pipeline,
        _always,
    ),
    StateInvariant(
        "IND3",
        "the true KV length is the settled length plus the accepts of "
        "launched, unprocessed steps (the ghost's definition)",
        ind_truth,
        _always,
    ),
    StateInvariant(
        "IND4",
        "committed leads the settled truth by one claim per claimed decode "
        "step (non-spec, pre-claim) or not at all (PR 28754)",
        ind_lead,
        _always,
    ),
    StateInvariant(
        "IND5",
        "settled = prompt + output - 1 for a live request (the newest "
        "token has no KV; a pending prefill counts its first token)",
        ind_output,
        _always,
    ),
    StateInvariant(
        "IND6",
        "the allocation covers the true length within the row's whole pages, and a "
        "prepared spec step's reservation its writes from it, in whole pages on pages > 1 "
        "(non-spec: seq_lens == committed)",
        ind_reserve,
        _always,
    ),
    StateInvariant(
        "IND7",
        "the relay row holds the true length and a resolved seq_lens "
        "equals it (spec overlap); without overlap run_batch re-applies it",
        ind_relay,
        _spec,
    ),
)


# ----------------------------------------------------------------------------- point claims
def sl7(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    expected = lift(
        tr.compute_ns_expected_seq_len,
        p["prompt_len"],
        p["output_len"],
        p["inflight_steps"] + zs.If(get_extend_pending(p), 0, 0),
    )
    return zs.And(
        p["seq_len"] == p["kv_committed_len"],
        p["kv_committed_len"] == p["kv_allocated_len"],
        p["kv_allocated_len"] == expected,
    )


def sl11(ctx: Context, r: Record, step: Step) -> Term:
    """seq_len_cpu_ub is max(kv_allocated_len) over the batch: each entry's
    kv_allocated_len bounds its seq_len."""
    p = step.post
    return p["kv_allocated_len"] >= p["seq_len"]


def kv3(ctx: Context, r: Record, step: Step) -> Term:
    return _get_reserve_claim(ctx, r)


def sl6(ctx: Context, r: Record, step: Step) -> Term:
    claim = r["seq_len"] == r["kv_len_true"]
    return zs.And(claim, r["seq_len"] == r["published_seq_len"]) if ctx.relay else claim


def sl8(ctx: Context, r: Record, step: Step) -> Term:
    accept = step.notes["accept"]
    return zs.And(
        step.post["published_seq_len"] == r["seq_len"] + accept,
        1 <= accept,
        accept <= ctx.config.max_accept_len,
    )


def rp1_launch(ctx: Context, r: Record, step: Step) -> Term:
    return r["holds_kv"]


def _settling(p: Record) -> Term:
    return zs.And(is_live(p), zs.Not(get_extend_pending(p)))


def kv8(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    n = step.notes
    live = zs.Implies(
        _settling(p), p["kv_committed_len"] == p["settled_len"] + ctx.get_lead(p["inflight_steps"])
    )
    if ctx.config.cell.trimmed_finish:  # commits less than it settled at a finish (KV9)
        return live
    # At a finish release (not a prefill's): the whole accepted run is committed.
    finish = zs.Implies(
        zs.And(n["finishing"], zs.Not(n["extend"])),
        p["kv_committed_len"] == p["settled_len"] + ctx.get_lead(n["claimed"]),
    )
    return zs.And(live, finish)


def kv9(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    n = step.notes
    live = zs.Implies(
        _settling(p),
        p["kv_committed_len"] - ctx.get_lead(p["inflight_steps"])
        == p["prompt_len"] + p["output_len"] - 1,
    )
    if not ctx.is_spec:
        live = zs.BoolVal(True)
    # At a finish release (the cached length is checked at every one, a prefill's result
    # included: the overlap loop may have prepared a decode before it). The release caches
    # owned_kv_len == min(committed, prompt + output) (KV8 checks what it committed); the
    # trimmed finish commits and caches prompt + output - 1.
    committed = p["kv_committed_len"]
    if ctx.config.cell.trimmed_finish:
        finish = zs.And(
            zs.Implies(
                zs.And(n["finishing"], zs.Not(n["extend"])),
                committed - ctx.get_lead(n["claimed"]) == n["with_kv"],
            ),
            zs.Implies(n["finishing"], n["cached"] == n["with_kv"]),
        )
    else:
        shown = p["prompt_len"] + p["output_len"]
        finish = zs.Implies(n["finishing"],
                            n["cached"] == zs.If(committed < shown, committed, shown))
    return zs.And(live, finish)


def kv10(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    return zs.Implies(
        _settling(p),
        zs.And(
            p["kv_committed_len"] - p["settled_len"] == p["inflight_steps"],
            0 <= p["inflight_steps"],
            p["inflight_steps"] <= 1,
        ),
    )


def rp1_result(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    refund = 1 if (ctx.is_spec and ctx.config.cell.preclaim) else 0
    was_stale = zs.And(zs.Not(is_live(r)), zs.Not(r["extend_inflight"]))
    expected = r["kv_committed_len"] - zs.If(r["finished"], refund, 0)
    return zs.Implies(
        was_stale, zs.And(p["output_len"] == r["output_len"], p["kv_committed_len"] == expected)
    )


def rp2(ctx: Context, r: Record, step: Step) -> Term:
    p = step.post
    n = step.notes
    stride = max(shape.draft_tokens for shape in ctx.shapes)
    top = min(stride, ctx.config.max_accept_len)
    return zs.And(
        p["output_len"] <= p["max_new_tokens"],
        0 <= n["run_len"],
        n["run_len"] <= n["accept"],
        1 <= n["accept"],
        n["accept"] <= top,
    )


POINT_INVARIANTS: Final[tuple[PointInvariant, ...]] = (
    _point("SL7", "prepare_for_decode", sl7),
    _point("SL11", "resolve_seq_lens_cpu", sl11),
    _point("KV3", "launch", kv3),
    _point("SL6", "launch", sl6),
    _point("SL8", "launch", sl8),
    _point("RP1", "launch", rp1_launch),
    _point("KV8", "process_result", kv8),
    _point("KV9", "process_result", kv9),
    _point("KV10", "process_result", kv10),
    _point("RP1", "process_result", rp1_result),
    _point("RP2", "process_result", rp2),
)


# The record field a state claim's antecedent reads (default: the request holds a row).
_ANTECEDENT_FIELDS: Final = {"KV5": "is_retracted"}


def get_antecedent(invariant_id: str, r: Record) -> Term:
    """When a state claim has something to check in ``r`` (witnesses look for it true)."""
    return r[_ANTECEDENT_FIELDS.get(invariant_id, "holds_kv")]


def get_state_invariants(ctx: Context) -> list[StateInvariant]:
    return [inv for inv in STATE_INVARIANTS if inv.applies(ctx)]


def get_strengthened(ctx: Context, r: Record) -> Term:
    """The conjunction every consecution check assumes of the pre-state."""
    return zs.And(*[inv.predicate(ctx, r) for inv in get_state_invariants(ctx)])
