"""The BMC's scheduling phases: ``reference/scheduler.py`` ``get_next_batch_to_run`` over
symbolic requests (the merge of the last extend batch, the every-step filter, admission by
the release's budget, and the decode path: filter, retract, prepare_for_decode). One
function per phase, each named after the reference method (or the ``ScheduleBatch``
method) it mirrors; :mod:`proofs.bmc_run` calls them from ``run_iteration``."""

from __future__ import annotations

from dataclasses import dataclass

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.bmc_checks import check_point, check_state
from overlap_spec.proofs.bmc_radix import (
    evict,
    get_available,
    get_match_pages,
    lock_request,
    release,
)
from overlap_spec.proofs.bmc_state import (
    MODEL_ID,
    ORDER_STRIDE,
    RATIO_DECAY,
    RATIO_MIN,
    RATIO_SCALE,
    BmcState,
    add,
    allocation_lemma,
    available_pages,
    count,
    decode_pages_needed,
    decode_step,
    ite,
    snapshot,
    violate,
)
from overlap_spec.proofs.model import Record, prepare_for_extend, retract
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr


@dataclass
class Choices:
    """One iteration's environment choices (``IterationChoices``), as Z3 constants."""

    allow: Term
    forced: Term
    disable: Term
    rung: Term
    offset: Term
    accept: list[Term]
    eos: list[Term]


def get_next_batch_to_run(
    s: BmcState, i: int, now: Term, choices: Choices, pending: list[Term]
) -> tuple[Term, Term]:
    """``Scheduler.get_next_batch_to_run``: the last extend batch merged, the every-step
    filter, prefill first, else the decode path. Returns (prefill, decode): which batch
    this iteration launches, if any."""
    merge_batch(s, i, now)
    if not s.ctx.config.cell.overshoot:
        # The release filters the running batch at every step, before admission.
        filter_batch(s, zs.BoolVal(True))
        snapshot(s)
        check_state(s, i, "filter_batch(every step)")
    prefill = get_new_batch_prefill(s, i, choices.allow)
    decode = update_running_batch(s, i, now, prefill, choices, pending)
    return prefill, decode


def merge_batch(s: BmcState, i: int, now: Term) -> None:
    """The first step of ``get_next_batch_to_run``: the last extend batch is filtered
    (``filter_batch``), then replaces an empty running batch or is merged into it
    (``ScheduleBatch.merge_batch``: the sum is dropped, the mirror kept)."""
    ctx = s.ctx
    g = s.glob
    survivors = [
        zs.And(g["last_was_extend"], r["in_extend_batch"], zs.Not(r["finished"]))
        for r in s.reqs
    ]
    removed = zs.Or(
        *[zs.And(g["last_was_extend"], r["in_extend_batch"], r["finished"]) for r in s.reqs]
    )
    x_sum = (
        g["extend_sum_present"]
        if ctx.has("B1")
        else zs.And(g["extend_sum_present"], zs.Not(removed))
    )
    for b, r in enumerate(s.reqs):
        r["in_extend_batch"] = survivors[b]
    g["extend_sum_present"] = x_sum
    g["batch_is_full"] = zs.And(g["batch_is_full"], zs.Not(removed))
    check_state(s, i, "filter_batch(last extend)")
    any_survivor = zs.Or(*survivors)
    running_empty = zs.Not(zs.Or(*[r["in_running_batch"] for r in s.reqs]))
    replace = zs.And(any_survivor, running_empty)
    merge = zs.And(any_survivor, zs.Not(running_empty))
    g["running_has_cpu"] = zs.If(replace, True, g["running_has_cpu"])
    g["running_sum_present"] = zs.If(
        replace,
        x_sum,
        zs.If(
            merge,
            g["running_sum_present"] if ctx.has("B1") else zs.BoolVal(False),
            g["running_sum_present"],
        ),
    )
    g["running_seq_lens_sum"] = zs.If(
        replace, g["extend_seq_lens_sum"], g["running_seq_lens_sum"]
    )
    for r in s.reqs:
        joined = r["in_extend_batch"]
        r["running_order"] = zs.If(
            joined, ORDER_STRIDE * now + r["waiting_order"], r["running_order"]
        )
        r["in_running_batch"] = zs.Or(r["in_running_batch"], joined)
        r["in_extend_batch"] = zs.BoolVal(False)
    g["extend_sum_present"], g["extend_seq_lens_sum"] = (
        zs.BoolVal(False),
        zs.IntVal(0),
    )  # consumed
    snapshot(s)
    check_state(s, i, "merge_batch")


def filter_batch(s: BmcState, when: Term, leave_out: list[Term] | None = None) -> None:
    """``ScheduleBatch.filter_batch`` on the running batch: drop finished (and
    ``leave_out``); sum reset and the admission latch cleared if anything left."""
    drop = [
        zs.And(when, zs.Or(r["finished"], leave_out[b]) if leave_out else r["finished"])
        for b, r in enumerate(s.reqs)
    ]
    removed = zs.Or(*[zs.And(r["in_running_batch"], d) for r, d in zip(s.reqs, drop,
                                                                        strict=True)])
    for r, d in zip(s.reqs, drop, strict=True):
        r["in_running_batch"] = zs.And(r["in_running_batch"], zs.Not(d))
    s.glob["batch_is_full"] = zs.And(s.glob["batch_is_full"], zs.Not(removed))
    if not s.ctx.has("B1"):
        s.glob["running_sum_present"] = zs.And(
            s.glob["running_sum_present"], zs.Not(removed)
        )


def get_new_batch_prefill(s: BmcState, i: int, allow: Term) -> Term:
    """``Scheduler.get_new_batch_prefill``: the requests ``admit_by_budget`` chooses run
    prepare_for_extend and form the extend batch (its sum from their mirrors). Returns
    whether there is one."""
    ctx = s.ctx
    g = s.glob
    radix = ctx.config.cell.radix
    matches = [get_match_pages(s, r) for r in s.reqs] if radix else None
    chosen = admit_by_budget(s, i, allow, matches)
    prefill = zs.Or(*chosen)
    posts = []
    for b, r in enumerate(s.reqs):
        step = prepare_for_extend(ctx, r)
        check_point(s, "prepare_for_extend", i, chosen[b], b, r, step)
        post = dict(step.post)
        post.update(waiting=zs.BoolVal(False), in_extend_batch=zs.BoolVal(True))
        posts.append(ite(chosen[b], post, r))
    s.reqs = posts
    if matches is not None:
        alloc_for_extend(s, i, chosen, matches)
    g["extend_sum_present"] = zs.If(prefill, True, g["extend_sum_present"])
    g["extend_seq_lens_sum"] = zs.If(
        prefill,
        zs.Sum([zs.If(c, r["seq_len_cpu"], 0) for c, r in zip(chosen, s.reqs, strict=True)]),
        g["extend_seq_lens_sum"],
    )
    snapshot(s)
    check_state(s, i, "prepare_for_extend")
    return prefill


@dataclass
class _Budget:
    """The ``PrefillAdder`` budget's parts, in tokens x ``RATIO_SCALE``: the free tokens,
    the running requests' remaining max_new_tokens x ratio, and per request what it asks
    and what its admission reserves (total and current)."""

    free: Term
    running_offset: Term
    asked: list[Term]
    reserved: list[Term]
    paged: list[Term]


def _get_budget(s: BmcState, i: int, free: Term, prefixes: list[Term] | None = None) -> _Budget:
    """The budget's per-request terms (the remaining max_new_tokens flagged ``MODEL``
    outside 0..max_new_tokens, where the linear ratio product below is not exact); in a
    radix cell each asks for and reserves its extend past its matched ``prefixes``."""
    page = s.ctx.config.page_size
    ratio = s.glob["new_token_ratio"]
    top = s.ctx.config.preset.max_new_tokens
    offset = []
    for b, r in enumerate(s.reqs):
        left = r["max_new_tokens"] - r["output_len"]
        # rem x ratio, linear: one term per value rem can take (0..max_new_tokens).
        offset.append(zs.Sum([zs.If(zs.And(r["in_running_batch"], left == v), v * ratio, 0)
                              for v in range(1, top + 1)]))
        violate(s, MODEL_ID, i, f"admission r{b} remaining max_new_tokens",
                zs.And(r["in_running_batch"], zs.Or(left < 0, left > top)))
    running_offset = zs.Sum(offset)
    fill = [lift(tr.compute_fill_len, r["prompt_len"], r["output_len"]) for r in s.reqs]
    if prefixes is None:
        asked = [lift(tr.compute_prefill_check_tokens, f, r["max_new_tokens"], r["output_len"],
                      page) for f, r in zip(fill, s.reqs, strict=True)]
    else:
        asked = [lift(tr.compute_prefill_check_tokens, f, r["max_new_tokens"], r["output_len"],
                      page, x) for f, r, x in zip(fill, s.reqs, prefixes, strict=True)]
        fill = [f - x for f, x in zip(fill, prefixes, strict=True)]  # the extends
    reserved = [lift(tr.compute_prefill_reserved_tokens, f, r["max_new_tokens"], page)
                for f, r in zip(fill, s.reqs, strict=True)]
    paged = [lift(tr.compute_page_align_up, f, page) + page for f in fill]
    return _Budget(free, running_offset, asked, reserved, paged)


def _left_after(budget: _Budget, among: list[Term], free: Term | None = None
                ) -> tuple[Term, Term]:
    """(free - total offset, free - current offset) after admitting ``among`` (``free``:
    a radix cell's free tokens as that check reads them)."""
    scale = RATIO_SCALE
    free = budget.free if free is None else free
    total = budget.running_offset + scale * zs.Sum(
        [zs.If(a, budget.reserved[c], 0) for c, a in enumerate(among)])
    current = scale * zs.Sum([zs.If(a, budget.paged[c], 0) for c, a in enumerate(among)])
    return free - total, free - current


def _room_after(s: BmcState, budget: _Budget, among: list[Term], name: str,
                free: Term | None = None) -> Term:
    """A choice: budget is left after admitting ``among``."""
    left_total, left_current = _left_after(budget, among, free)
    room = zs.Bool(name)
    add(s, zs.Implies(room, zs.And(left_total >= 0, left_current > 0)))
    add(s, zs.Implies(zs.Not(room), zs.Or(left_total <= 0, left_current <= 0)))
    return room


def admit_by_budget(s: BmcState, i: int, allow: Term, matches: list[Term] | None = None
                    ) -> list[Term]:
    """``Scheduler.admit_by_budget`` (``PrefillAdder``): which waiting requests this
    iteration admits, and the latch it leaves.

    In queue order, no skipping, a request is admitted while a row is left, it asks
    (fill + remaining max_new_tokens + a page) for less than the free tokens less the
    running requests' remaining max_new_tokens x ratio and the earlier admissions'
    reservations (paged fill + a page + max_new_tokens), and after an admission some
    budget is left. Each comparison is a choice (``fits``, ``room``) pinned to the exact
    arithmetic except where that is an equality (see ``RATIO_SCALE``). In a radix cell
    (``matches``: each request's match, in pages) the asks are the extends past the
    matches, and each check reads the free KV after the matched paths before it are
    locked (``reference/scheduler.py``)."""
    g, scale = s.glob, RATIO_SCALE
    reqs = s.reqs
    n = len(reqs)
    running = count([r["in_running_batch"] for r in reqs])
    free_rows = s.rows - count([r["holds_kv"] for r in reqs])
    rows = zs.If(s.rows - running < free_rows, s.rows - running, free_rows)
    free = available_pages(s) * s.ctx.config.page_size * scale
    latched = zs.And(g["batch_is_full"], running > 0)  # an empty batch's latch is dropped
    ahead = [[zs.And(c["waiting"], c["waiting_order"] < r["waiting_order"]) if c is not r
              else zs.BoolVal(False) for c in reqs] for r in reqs]
    radix = s.ctx.config.cell.radix
    # A radix cell: each candidate's match, and the free KV each check reads: after the
    # candidates before it (and, for its own fit, itself) locked their matched paths.
    matches = matches or []
    page = s.ctx.config.page_size

    def free_with(pinned: list[Term]) -> Term:
        return get_available(s, pinned, matches) * page * scale if radix else free

    budget = _get_budget(s, i, free, [m * page for m in matches] if radix else None)
    attempted = zs.And(allow, zs.Not(latched), zs.Or(*[r["waiting"] for r in reqs]))
    fits, room, step_ok = [], [], []
    for b, r in enumerate(reqs):
        own = [zs.Or(a, zs.BoolVal(c == b)) for c, a in enumerate(ahead[b])]
        left_total, _ = _left_after(budget, ahead[b], free_with(own))
        fit = zs.Bool(f"i{i}.r{b}.fits")
        add(s, zs.Implies(fit, scale * budget.asked[b] <= left_total))
        add(s, zs.Implies(zs.Not(fit), scale * budget.asked[b] >= left_total))
        fits.append(fit)
        room.append(_room_after(s, budget, ahead[b], f"i{i}.r{b}.room", free_with(ahead[b])))
        ahead_count = count(ahead[b])
        step_ok.append(zs.And(r["waiting"], ahead_count < rows, fit,
                              zs.Or(ahead_count == 0, room[b])))
    chosen = [zs.And(attempted, step_ok[b],
                     *[zs.Implies(ahead[b][c], step_ok[c]) for c in range(n) if c != b])
              for b in range(n)]
    # The latch: no row at all; the first request left waiting found no row, no budget
    # left after the one before it, or (with something running or admitted) did not fit;
    # or no budget is left after the last one admitted.
    admitted = count(chosen)
    latch = zs.BoolVal(False)
    stopped = zs.BoolVal(False)
    for b, r in enumerate(reqs):
        first_left = zs.And(r["waiting"], zs.Not(chosen[b]),
                            *[zs.Implies(ahead[b][c], chosen[c]) for c in range(n)
                              if c != b])
        ahead_count = count(ahead[b])
        why = zs.Or(ahead_count >= rows, zs.And(ahead_count > 0, zs.Not(room[b])),
                    zs.And(zs.Not(fits[b]), zs.Or(ahead_count > 0, running > 0)))
        latch = zs.Or(latch, zs.And(first_left, why))
        stopped = zs.Or(stopped, first_left)
    spent = zs.And(zs.Not(stopped), admitted > 0,
                   zs.Not(_room_after(s, budget, chosen, f"i{i}.room_after", free_with(chosen))))
    after = zs.If(rows <= 0, zs.BoolVal(True), zs.Or(latch, spent))
    # Set on an empty running batch it is dropped before it is read again.
    g["batch_is_full"] = zs.And(zs.If(attempted, after, latched), running > 0)
    return chosen


def update_running_batch(
    s: BmcState, i: int, now: Term, prefill: Term, choices: Choices, pending: list[Term]
) -> Term:
    """``Scheduler.update_running_batch``, the decode path when nothing is admitted:
    filter (under overlap leaving out a request its queued result finishes by length),
    no decode if only those are short of KV, retract_decode, prepare_for_decode.
    Returns whether the running batch decodes."""
    decode = zs.And(zs.Not(prefill), zs.Or(*[r["in_running_batch"] for r in s.reqs]))
    path = decode
    finishing: list[Term] = []
    if s.ctx.config.cell.skips_finishing_decode:
        # _reqs_finishing_inflight: a member of the queued result's batch (a pending
        # result) that one more output token finishes by length sits out the decode.
        finishing = [
            zs.And(
                decode,
                r["in_running_batch"],
                zs.Not(r["finished"]),
                pending[b],
                lift(tr.is_next_output_finishing_by_length, r["output_len"],
                     r["max_new_tokens"]),
            )
            for b, r in enumerate(s.reqs)
        ]
    filter_batch(s, decode, finishing)
    snapshot(s)
    check_state(s, i, "filter_batch")
    decode = zs.And(decode, zs.Or(*[r["in_running_batch"] for r in s.reqs]))
    if finishing:
        # Short of KV with such requests left out: no decode this step (their result
        # frees KV at its end) instead of a retraction.
        fits = zs.Sum(
            [zs.If(r["in_running_batch"], decode_pages_needed(s.ctx, r, choices.rung), 0)
             for r in s.reqs]
        ) <= available_pages(s)
        decode = zs.And(decode, zs.Not(zs.And(zs.Or(*finishing), zs.Not(fits))))
    retract_decode(s, i, decode, choices.forced, choices.rung, now)
    for r in s.reqs:
        r["in_running_batch"] = zs.And(r["in_running_batch"], zs.Not(r["is_retracted"]))
    snapshot(s)
    check_state(s, i, "retract_decode")
    prepare_for_decode(s, i, decode, choices.rung, path)
    return decode


def _is_retracted_before(s: BmcState, reqs: list[Record], c: int, b: int) -> Term:
    """Request c is retracted before request b (when both are candidates):
    ``transitions.compute_retraction_order``."""
    rc, rb = reqs[c], reqs[b]
    if s.ctx.config.cell.retracts_spec_from_back:
        # The pre-claim era, before #32023: spec retracts from the back.
        return rc["running_order"] > rb["running_order"]
    # Spec and non-spec alike (#32023): fewest outputs, then longest prompt, first.
    lower = zs.Or(
        rc["output_len"] < rb["output_len"],
        zs.And(rc["output_len"] == rb["output_len"], rc["prompt_len"] > rb["prompt_len"]),
    )
    tie = zs.And(
        rc["output_len"] == rb["output_len"],
        rc["prompt_len"] == rb["prompt_len"],
        rc["running_order"] > rb["running_order"],
    )
    return zs.Or(lower, tie)


def retract_decode(
    s: BmcState, i: int, decode: Term, forced: Term, rung: Term, now: Term
) -> None:
    """``Scheduler.retract_decode``: victims in retract order until the rest fits, plus
    ``forced``; keep one; the kept requests then stand in the policy's order
    (``filter_batch(keep_indices=sorted_indices)``)."""
    reqs = s.reqs
    n = len(reqs)
    member = [zs.And(decode, r["in_running_batch"]) for r in reqs]
    need = [decode_pages_needed(s.ctx, r, rung) for r in reqs]
    avail = available_pages(s)
    radix = s.ctx.config.cell.radix

    def needed(of: list[Term]) -> Term:
        return zs.Sum([zs.If(m, need[b], 0) for b, m in enumerate(of)])

    def available_after(released: list[Term]) -> Term:
        """What ``_fits`` reads once ``released`` are retracted: their pages (in a radix
        cell their own pages, and the tree's they alone locked, evictable)."""
        if radix:
            return get_available(s, released=released)
        return avail + zs.Sum([zs.If(e, reqs[c]["page_count"], 0)
                               for c, e in enumerate(released)])

    trigger = zs.Not(zs.And(forced == 0, needed(member) <= avail))
    # The new-token ratio: re-estimated over the kept requests when retract_decode runs,
    # else decayed by the decode (update_running_batch).
    retracting = zs.And(zs.Or(*member), trigger)
    victims: list[Term] = []
    for b in range(n):
        earlier = [
            zs.And(member[c], _is_retracted_before(s, reqs, c, b)) if c != b
            else zs.BoolVal(False) for c in range(n)
        ]
        kept = [zs.And(member[c], zs.Not(earlier[c])) for c in range(n)]
        victims.append(
            zs.And(
                member[b],
                trigger,
                count(kept) > 1,
                zs.Or(forced > count(earlier), needed(kept) > available_after(earlier)),
            )
        )
    kept = [zs.And(m, zs.Not(v)) for m, v in zip(member, victims, strict=True)]
    after = available_after(victims)
    s.reqs = _retract_victims(s, i, reqs, victims, kept, now)
    if radix:  # release_req: the KV released without caching
        for b, v in enumerate(victims):
            release(s, b, reqs[b], v, None)
    # min(1, (outputs + 20 x kept) / (max_new_tokens + 1)) is 1 here unless the kept
    # requests' max_new_tokens exceed 19 each on average: flagged, not modelled.
    estimate = zs.Sum([zs.If(k, reqs[b]["output_len"] + tr.RETRACT_DECODE_STEPS
                             - reqs[b]["max_new_tokens"], 0) for b, k in enumerate(kept)])
    violate(s, MODEL_ID, i, "retract_decode new_token_ratio below 1",
            zs.And(retracting, estimate < 1))
    g_ratio = s.glob["new_token_ratio"]
    decayed = zs.If(g_ratio - RATIO_DECAY < RATIO_MIN, RATIO_MIN, g_ratio - RATIO_DECAY)
    s.glob["new_token_ratio"] = zs.If(
        retracting, RATIO_SCALE, zs.If(zs.Or(*member), decayed, g_ratio))
    s.glob["batch_is_full"] = zs.And(s.glob["batch_is_full"], zs.Not(zs.Or(*victims)))
    _assume_the_rest_fits(s, rung, kept, after)
    if not s.ctx.has("B1"):
        s.glob["running_sum_present"] = zs.And(
            s.glob["running_sum_present"], zs.Not(zs.Or(*victims))
        )
    s.glob["waiting_counter"] = s.glob["waiting_counter"] + count(victims)


def _retract_victims(
    s: BmcState, i: int, reqs: list[Record], victims: list[Term], kept: list[Term], now: Term
) -> list[Record]:
    """The retract transition on each victim (back to the queue, after what waits). After
    a retraction the kept requests are renumbered in the policy's order: b's rank is the
    number of kept requests the policy prefers to it."""
    n = len(reqs)
    posts = []
    for b, r in enumerate(reqs):
        step = retract(s.ctx, r)
        check_point(s, "retract_decode", i, victims[b], b, r, step)
        position = count([zs.And(victims[c], _is_retracted_before(s, reqs, c, b))
                          for c in range(n) if c != b])
        post = dict(step.post)
        post.update(
            waiting=zs.BoolVal(True),
            in_running_batch=zs.BoolVal(False),
            waiting_order=s.glob["waiting_counter"] + position,
        )
        posts.append(ite(victims[b], post, r))
    reorder = zs.Or(*victims)
    for b, post in enumerate(posts):
        rank = count([zs.And(kept[c], _is_retracted_before(s, reqs, b, c))
                      for c in range(n) if c != b])
        post["running_order"] = zs.If(
            zs.And(reorder, kept[b]), ORDER_STRIDE * now + rank, post["running_order"]
        )
    return posts


def _assume_the_rest_fits(s: BmcState, rung: Term, kept: list[Term], available: Term) -> None:
    """The rest fits, else the reference aborts the last request for want of memory:
    excluded (module header of ``proofs/bmc.py``). Stated over the post records (a kept
    request's post is its pre record), the terms prepare_for_decode and ALLOC use next."""
    add(
        s,
        zs.Sum(
            [
                zs.If(k, decode_pages_needed(s.ctx, r, rung), 0)
                for k, r in zip(kept, s.reqs, strict=True)
            ]
        )
        <= available,
    )


def prepare_for_decode(s: BmcState, i: int, decode: Term, rung: Term,
                       path: Term | None = None) -> None:
    """``ScheduleBatch.prepare_for_decode`` at this iteration's rung on every running
    request when the batch decodes (with ALLOC's instance where it is proved); a
    non-spec decode drops the batch's sum. ``path``: the decode path ran (a radix cell's
    tree may evict there even when nothing decodes)."""
    path = decode if path is None else path
    posts = []
    for b, r in enumerate(s.reqs):
        fires = zs.And(decode, r["in_running_batch"])
        merged = decode_step(s.ctx, r, rung)
        check_point(s, "prepare_for_decode", i, fires, b, r, merged)
        if s.use_lemma:
            add(s, allocation_lemma(s.ctx, r, rung, merged))
        posts.append(ite(fires, merged.post, r))
    pres, s.reqs = s.reqs, posts
    if s.ctx.config.cell.radix:
        # alloc_for_decode: the tree evicts (the decode path's _fits, a retraction's
        # release_req, the batch's demand: at least the shortfall when it decodes), then
        # the new pages are allocated.
        new = zs.Sum([zs.If(zs.And(decode, r["in_running_batch"]),
                            post["page_count"] - r["page_count"], 0)
                      for r, post in zip(pres, posts, strict=True)])
        evict(s, f"i{i}.decode.evict", path, zs.If(decode, new - s.glob["free"], 0))
        s.glob["free"] = s.glob["free"] - new
    if not s.ctx.is_spec:
        s.glob["running_sum_present"] = zs.And(s.glob["running_sum_present"], zs.Not(decode))
    snapshot(s)
    check_state(s, i, "prepare_for_decode")


def alloc_for_extend(s: BmcState, i: int, chosen: list[Term], matches: list[Term]) -> None:
    """A radix cell's admission, after ``admit_by_budget``: each admitted request keeps the
    lock on its matched path (cpl = the match), the tree evicts for the extends, and the
    pages past each prefix are allocated (``alloc_for_extend``)."""
    for b, r in enumerate(s.reqs):
        lock_request(s, b, matches[b], chosen[b])
        for name, value in (("cpl_pages", matches[b]), ("matched_pages", matches[b]),
                            ("row_path", matches[b]),
                            ("extend_end", r["kv_allocated_len"])):
            r[name] = zs.If(chosen[b], value, r[name])
    needed = zs.Sum([zs.If(c, r["page_count"] - m, 0)
                     for c, r, m in zip(chosen, s.reqs, matches, strict=True)])
    evict(s, f"i{i}.extend.evict", zs.Or(*chosen), needed - s.glob["free"])
    s.glob["free"] = s.glob["free"] - needed
