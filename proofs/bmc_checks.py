"""The BMC's checks: the claims at every sub-step (``check_state``), the point claims and
``MODEL`` at a transition (``check_point``), and ``LOOP`` at an iteration's end
(``check_loop``). Each adds violations to the state's unrolling; none adds a constraint."""

from __future__ import annotations

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.bmc_radix import check_radix, get_own_pages, get_tree_pages
from overlap_spec.proofs.bmc_state import (
    LOOP_ID,
    MODEL_ID,
    ORDER_STRIDE,
    RATIO_MIN,
    RATIO_SCALE,
    BmcState,
    count,
    violate,
)
from overlap_spec.proofs.claims import POINT_INVARIANTS, get_antecedent, get_state_invariants
from overlap_spec.proofs.model import Record, Step
from overlap_spec.proofs.solver import Term


def check_state(s: BmcState, iteration: int, where: str) -> None:
    """The state claims per request (SL2 with its batch's mirror flag), SL3 per batch and
    KV7 (pool conservation)."""
    ctx = s.ctx
    for inv in get_state_invariants(ctx):
        if inv.id == "SL2":
            continue  # needs the batch's mirror flag: below
        for b, r in enumerate(s.reqs):
            violate(
                s,
                inv.id,
                iteration,
                f"{where} r{b}",
                zs.Not(inv.predicate(ctx, r)),
                get_antecedent(inv.id, r),
            )
    g = s.glob
    for b, r in enumerate(s.reqs):
        mirrored = zs.Or(
            zs.And(r["in_running_batch"], g["running_has_cpu"]), r["in_extend_batch"]
        )
        violate(
            s,
            "SL2",
            iteration,
            f"{where} r{b}",
            zs.And(mirrored, r["holds_kv"], r["seq_len"] != r["seq_len_cpu"]),
            zs.And(mirrored, r["holds_kv"]),
        )
    for batch, members, cpu in (
        ("running", [r["in_running_batch"] for r in s.reqs], g["running_has_cpu"]),
        ("extend", [r["in_extend_batch"] for r in s.reqs], zs.BoolVal(True)),
    ):
        present, total = (
            ("running_sum_present", "running_seq_lens_sum")
            if batch == "running"
            else ("extend_sum_present", "extend_seq_lens_sum")
        )
        mirror_sum = zs.Sum(
            [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(members, s.reqs, strict=True)]
        )
        violate(
            s,
            "SL3",
            iteration,
            f"{where} {batch} batch",
            zs.And(g[present], zs.Not(zs.And(cpu, g[total] == mirror_sum))),
            zs.And(g[present], zs.Or(*members)),
        )
    if ctx.config.cell.radix:  # rows share the tree's pages: the holders' own and the tree's
        owned = get_tree_pages(s) + zs.Sum(
            [zs.If(r["holds_kv"], get_own_pages(ctx, r), 0) for r in s.reqs])
    else:
        owned = zs.Sum([zs.If(r["holds_kv"], r["page_count"], 0) for r in s.reqs])
    holders = count([r["holds_kv"] for r in s.reqs])
    violate(
        s, "KV7", iteration, where, zs.Or(owned > s.kv_pages, holders > s.rows), holders >= 2
    )
    if ctx.config.cell.radix:
        check_radix(s, iteration, where)


def check_point(
    s: BmcState, transition: str, iteration: int, fires: Term, b: int, r: Record, step: Step
) -> None:
    """``MODEL`` (the loop fires the transition outside its guard) and the point claims
    of ``transition``."""
    ctx = s.ctx
    violate(s, MODEL_ID, iteration, f"{transition} r{b}", zs.And(fires, zs.Not(step.guard)))
    for inv in POINT_INVARIANTS:
        if inv.transition == transition and inv.applies(ctx):
            violate(
                s,
                inv.id,
                iteration,
                f"{transition} r{b}",
                zs.And(fires, zs.Not(inv.predicate(ctx, r, step))),
                fires,
            )


def check_loop(s: BmcState, i: int, now: Term) -> None:
    """``LOOP``: what the event loop's own bookkeeping (queues, batches, order keys,
    the EOS slots) keeps true between iterations. Not spec claims: checked like
    them, they let a deep query start from any state meeting every claim
    (``check_bounded``'s window) instead of replaying the whole history."""
    g = s.glob
    for b, r in enumerate(s.reqs):
        admitted = r["admit_at"] <= now
        facts = _membership_facts(s, r, admitted, now)
        facts.update(_inflight_facts(s, b, r, admitted, now))
        for c, other in enumerate(s.reqs[:b]):
            facts[f"keys r{c}"] = zs.And(
                r["waiting_order"] != other["waiting_order"],
                zs.Implies(
                    zs.And(r["in_running_batch"], other["in_running_batch"]),
                    r["running_order"] != other["running_order"],
                ),
            )
        for what, fact in facts.items():
            violate(s, LOOP_ID, i, f"end of iteration r{b} {what}", zs.Not(fact))
    admission = zs.And(RATIO_MIN <= g["new_token_ratio"], g["new_token_ratio"] <= RATIO_SCALE,
                       zs.Implies(g["batch_is_full"],
                                  zs.Or(*[r["in_running_batch"] for r in s.reqs])))
    violate(s, LOOP_ID, i, "end of iteration admission state", zs.Not(admission))


def _membership_facts(s: BmcState, r: Record, admitted: Term, now: Term) -> dict[str, Term]:
    """``LOOP``'s facts about the queues and batches a request is in."""
    g = s.glob
    return {
        # waiting: no row, not finished, in no batch; a retracted request waits
        "waiting": zs.Implies(
            r["waiting"],
            zs.And(
                r["launched_steps"] == 0,
                zs.Not(
                    zs.Or(
                        r["holds_kv"],
                        r["finished"],
                        r["in_running_batch"],
                        r["in_extend_batch"],
                    )
                ),
            ),
        ),
        "retracted": zs.Implies(r["is_retracted"], r["waiting"]),
        # the running batch: holders, or finished ones the next filter drops
        "running": zs.Implies(
            r["in_running_batch"],
            zs.And(
                zs.Not(r["in_extend_batch"]),
                zs.Or(r["holds_kv"], r["finished"]),
                r["running_order"] < ORDER_STRIDE * (now + 1),
            ),
        ),
        # the last extend batch is this iteration's prefill
        "extend": zs.Implies(
            r["in_extend_batch"],
            zs.And(
                g["last_was_extend"],
                zs.Or(r["holds_kv"], r["finished"]),
                r["launched_steps"] == s.ctx.max_pending,
                zs.Implies(
                    r["launched_steps"] >= 1, zs.And(r["extend_inflight"], r["holds_kv"])
                ),
            ),
        ),
        "holder": zs.Implies(
            r["holds_kv"], zs.Or(r["in_running_batch"], r["in_extend_batch"])
        ),
        # not admitted yet: untouched; admitted: somewhere in its life
        "pristine": zs.If(
            admitted,
            zs.Or(r["waiting"], r["holds_kv"], r["finished"], r["is_retracted"]),
            zs.And(
                zs.Not(
                    zs.Or(r["waiting"], r["holds_kv"], r["finished"], r["is_retracted"])
                ),
                r["launched_steps"] == 0,
                r["inflight_steps"] == 0,
                r["output_len"] == 0,
            ),
        ),
    }


def _inflight_facts(
    s: BmcState, b: int, r: Record, admitted: Term, now: Term
) -> dict[str, Term]:
    """``LOOP``'s facts about a request's results in flight, its EOS slots and its queue key."""
    g = s.glob
    return {
        # EOS slots follow the in-flight slots; positions inside the accept run
        "eos": zs.And(
            zs.Implies(r["eos_oldest"], r["launched_steps"] >= 1),
            zs.Implies(r["eos_newest"], r["launched_steps"] >= 2),
            0 <= r["eos_index_oldest"],
            0 <= r["eos_index_newest"],
            zs.Implies(
                r["launched_steps"] >= 1,
                r["eos_index_oldest"] < zs.If(r["extend_inflight"], 1, r["accept_oldest"]),
            ),
            zs.Implies(
                r["launched_steps"] >= 2, r["eos_index_newest"] < r["accept_newest"]
            ),
        ),
        # a result in flight belongs to the batch launched last
        "pending": zs.And(
            r["launched_steps"] <= s.ctx.max_pending,
            zs.Implies(r["launched_steps"] >= 1, g["last_launched"]),
        ),
        # queue keys: handed out from the counter, never reused
        "queue": zs.And(
            0 <= r["waiting_order"],
            r["waiting_order"] < g["waiting_counter"],
            zs.Implies(zs.Not(admitted), r["waiting_order"] == b),
            g["waiting_counter"] >= len(s.reqs),
            g["waiting_counter"] <= len(s.reqs) * (now + 2),
        ),  # one retract pass per iteration
        # every prepared step was launched (or dropped with its finished request)
        "launched": zs.Not(zs.Or(r["prepared"], r["resolved"])),
    }
