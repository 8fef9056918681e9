"""The BMC's event-loop iteration: ``reference/scheduler.py`` ``run_iteration`` over
symbolic requests, and the phases after the batch is chosen (:mod:`proofs.bmc_schedule`
chooses it): the early result under disable_overlap, ``run_batch`` (the relay's resolve,
``ForwardBatch.init_new``, the launch, the isolation's exit), ``process_batch_result``
and ``on_idle``. One function per phase, each named after the reference method it
mirrors."""

from __future__ import annotations

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.bmc_checks import check_loop, check_point, check_state
from overlap_spec.proofs.bmc_radix import checkpoint, flush_cache, is_radix, release
from overlap_spec.proofs.bmc_schedule import Choices, filter_batch, get_next_batch_to_run
from overlap_spec.proofs.bmc_state import (
    BmcState,
    IterationTerms,
    add,
    count,
    ite,
    rung_domain,
    select_by_rung,
    snapshot,
    violate,
)
from overlap_spec.proofs.model import (
    Record,
    is_live,
    launch,
    process_result,
    resolve_seq_lens_cpu,
)
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import SpecShape


def run_iteration(s: BmcState, i: int, now: Term | None = None) -> None:
    """``Scheduler.run_iteration``: event-loop iteration ``i`` (its names and labels);
    ``now`` is its index as a term, a literal unless the inductive step makes it
    symbolic. Admissions, get_next_batch_to_run, under overlap with disable_overlap the
    pending result first and the re-filter, run_batch, then the previous result (overlap)
    or this one, on_idle; the end state is checked and recorded; then, in a radix cell, a
    flush (a free choice)."""
    now = zs.IntVal(i) if now is None else now
    ctx = s.ctx
    g = s.glob
    choices = _draw_choices(s, i)
    # Admissions before this iteration: waiting, in rid order.
    for r in s.reqs:
        r["waiting"] = zs.Or(r["waiting"], r["admit_at"] == now)
    pending = [r["launched_steps"] >= 1 for r in s.reqs]  # the previous iteration's result
    prefill, decode = get_next_batch_to_run(s, i, now, choices, pending)
    # Overlap, disable_overlap: the pending result first, then the re-filter.
    early = zs.BoolVal(False)
    if ctx.overlap:
        early = zs.And(choices.disable, g["last_launched"], zs.Or(*pending))
        process_batch_result(s, i, [zs.And(early, p) for p in pending],
                             "process_result(early)")
        if not ctx.has("B14"):
            filter_batch(s, zs.And(early, decode))
        decode = zs.And(decode, zs.Or(*[r["in_running_batch"] for r in s.reqs]))
        snapshot(s)
        check_state(s, i, "filter_batch(early)")
    launched = [
        zs.Or(zs.And(prefill, r["in_extend_batch"]), zs.And(decode, r["in_running_batch"]))
        for r in s.reqs
    ]
    run_batch(s, i, prefill, decode, launched, choices)
    # The previous result (overlap) or this one (no overlap).
    if ctx.overlap:
        late = zs.And(zs.Not(early), g["last_launched"])
        process_batch_result(s, i, [zs.And(late, p) for p in pending], "process_result")
    else:
        process_batch_result(s, i, launched, "process_result")
    on_idle(s, launched)
    g["last_was_extend"] = prefill
    g["last_launched"] = zs.Or(*launched)
    snapshot(s)
    _record_iteration_end(s, i, now, choices, launched, prefill)
    if is_radix(ctx):  # a flush_cache between this iteration and the next one's admissions
        s.out.iterations[-1].flushed = flush_cache(s, i)
        snapshot(s)


def _draw_choices(s: BmcState, i: int) -> Choices:
    """The iteration's environment choices as named constants, within their domains."""
    ctx = s.ctx
    n = len(s.reqs)
    allow = zs.Bool(f"i{i}.allow_prefill")
    forced = zs.Int(f"i{i}.retract")
    disable = zs.Bool(f"i{i}.disable_overlap")
    rung = zs.Int(f"i{i}.spec_steps")
    offset = zs.Int(f"i{i}.eos_offset")
    accept = [zs.Int(f"i{i}.r{b}.accept") for b in range(n)]
    eos = [zs.Bool(f"i{i}.r{b}.eos") for b in range(n)]
    add(
        s,
        zs.And(
            0 <= forced,
            forced <= max(n - 1, 0),
            0 <= offset,
            offset < ctx.config.max_accept_len,
        ),
    )
    if not ctx.overlap:
        add(s, zs.Not(disable))
    add(s, rung_domain(ctx, rung))
    return Choices(allow, forced, disable, rung, offset, accept, eos)


def _record_iteration_end(
    s: BmcState, i: int, now: Term, choices: Choices, launched: list[Term], prefill: Term
) -> None:
    """The end of the iteration (``ObservationPoint.ITERATION_END``): the state claims
    and ``LOOP`` checked, the records and the iteration's terms kept for the decoder and
    the refinement test."""
    first = len(s.out.violations)
    check_state(s, i, "end of iteration")
    check_loop(s, i, now)
    s.out.ends.append((first, len(s.out.violations)))
    s.out.states.append([dict(r) for r in s.reqs])
    s.out.iterations.append(
        IterationTerms(
            choices.allow,
            choices.forced,
            choices.disable,
            choices.rung,
            choices.offset,
            choices.accept,
            choices.eos,
            launched,
            [zs.If(prefill, r["waiting_order"], r["running_order"]) for r in s.reqs],
            prefill,
        )
    )


def on_idle(s: BmcState, launched: list[Term]) -> None:
    """``Scheduler.on_idle`` once nothing runs, waits or is in flight: the new-token
    ratio starts over."""
    g = s.glob
    quiet = zs.Not(zs.Or(*launched))
    if s.ctx.overlap:
        quiet = zs.And(quiet, zs.Not(g["last_launched"]))
    busy = zs.Or(*[zs.Or(r["in_running_batch"], r["in_extend_batch"], r["waiting"],
                         r["launched_steps"] >= 1) for r in s.reqs])
    g["new_token_ratio"] = zs.If(zs.And(quiet, zs.Not(busy)), s.ratio_init,
                                 g["new_token_ratio"])


def process_batch_result(s: BmcState, i: int, which: list[Term], label: str) -> None:
    """``Scheduler.process_batch_result`` for the requests in ``which`` (their oldest
    slot), with RP3 on the spec metrics' counters."""
    ctx = s.ctx
    was_stale: list[Term] = []
    processed_live: list[Term] = []
    accepts: list[Term] = []
    extends: list[Term] = []
    posts: list[Record] = []
    notes: list[dict[str, Term]] = []
    for b, r in enumerate(s.reqs):
        step = process_result(ctx, r, r["eos_oldest"], r["eos_index_oldest"])
        check_point(s, "process_result", i, which[b], b, r, step)
        post = dict(step.post)
        post.update(
            eos_oldest=r["eos_newest"],
            eos_index_oldest=r["eos_index_newest"],
            eos_newest=zs.BoolVal(False),
            eos_index_newest=zs.IntVal(0),
        )
        posts.append(ite(which[b], post, r))
        was_stale.append(zs.And(which[b], zs.Not(is_live(r))))
        processed_live.append(zs.And(which[b], zs.Not(step.notes["stale"])))
        accepts.append(step.notes["accept"])
        extends.append(zs.And(which[b], step.notes["extend"]))
        notes.append(step.notes)
    if ctx.is_spec:
        # Only a decode result feeds the spec metrics (update_spec_metrics); a prefill
        # result reports none, so RP3 has nothing to judge there.
        metered = zs.Not(zs.Or(*extends))
        counted = which if ctx.has("B4") else processed_live
        expected = [zs.And(w, zs.Not(st)) for w, st in zip(which, was_stale, strict=True)]
        correct = zs.Sum([zs.If(c, a - 1, 0) for c, a in zip(counted, accepts, strict=True)])
        truth = zs.Sum([zs.If(e, a - 1, 0) for e, a in zip(expected, accepts, strict=True)])
        violate(
            s,
            "RP3",
            i,
            f"{label} counters",
            zs.And(metered, zs.Or(correct != truth, count(counted) != count(expected))),
            zs.And(metered, zs.Or(*expected)),
        )
    pres, s.reqs = s.reqs, posts
    if ctx.config.cell.radix:
        release_into_tree(s, which, pres, notes)
    snapshot(s)
    check_state(s, i, label)


def release_into_tree(s: BmcState, which: list[Term], pres: list[Record],
                      notes: list[dict[str, Term]]) -> None:
    """A radix cell's tree after a result, per request in rid order: a finish releases
    (its checkpoint up to the cached length, then the free from cpl and the unlock); a
    live prefill that did not finish checkpoints up to its extend's end."""
    for b, (pre, note) in enumerate(zip(pres, notes, strict=True)):
        finish = zs.And(which[b], note["finishing"])
        cached = note["cached"]
        cut = zs.If(cached > pre["kv_allocated_len"], pre["kv_allocated_len"], cached)
        release(s, b, pre, finish, zs.If(cut > 0, cut, 0))
        r = s.reqs[b]
        prefilled = zs.And(which[b], zs.Not(note["stale"]), note["extend"],
                           zs.Not(note["finishing"]), r["holds_kv"])
        checkpoint(s, b, r["extend_end"], prefilled)


def run_batch(
    s: BmcState, i: int, prefill: Term, decode: Term, launched: list[Term], choices: Choices
) -> None:
    """``Scheduler.run_batch``: the relay's resolve (spec overlap decode),
    ``ForwardBatch.init_new``'s read of the batch's sum, the launch of every member,
    and (spec without overlap) the isolation's exit."""
    g = s.glob
    # ForwardBatch.init_new (SL1) reads the launched batch's mirror and sum.
    cpu = zs.If(prefill, True, g["running_has_cpu"])
    present = zs.If(prefill, g["extend_sum_present"], g["running_sum_present"])
    total = zs.If(prefill, g["extend_seq_lens_sum"], g["running_seq_lens_sum"])
    if s.ctx.relay:
        cpu, present, total = resolve_relay(s, i, prefill, decode, launched)
    init_new(s, i, prefill, decode, launched, (cpu, present, total))
    launch_members(s, i, prefill, decode, launched, choices)
    if s.ctx.is_spec and not s.ctx.overlap:
        exit_isolation(s, prefill, decode, launched)
    snapshot(s)
    check_state(s, i, "run_batch")


def resolve_relay(
    s: BmcState, i: int, prefill: Term, decode: Term, launched: list[Term]
) -> tuple[Term, Term, Term]:
    """``Scheduler._resolve_relay``: resolve_seq_lens_cpu on every decoding member (spec
    overlap); the batch keeps the resolved mirror and sum where the cell needs them.
    Returns what init_new then reads (mirror, sum present, sum)."""
    cfg = s.ctx.config
    g = s.glob
    posts = []
    for b, r in enumerate(s.reqs):
        fires = zs.And(decode, launched[b])
        step = resolve_seq_lens_cpu(s.ctx, r)
        check_point(s, "resolve_seq_lens_cpu", i, fires, b, r, step)
        posts.append(ite(fires, step.post, r))
    s.reqs = posts
    keeps = cfg.cell.needs_cpu_seq_lens
    resolved_sum = zs.Sum(
        [
            zs.If(m, r["published_seq_len"], 0)
            for m, r in zip(launched, s.reqs, strict=True)
        ]
    )
    g["running_has_cpu"] = zs.If(decode, keeps, g["running_has_cpu"])
    g["running_sum_present"] = zs.If(decode, keeps, g["running_sum_present"])
    g["running_seq_lens_sum"] = zs.If(
        decode,
        resolved_sum if keeps else g["running_seq_lens_sum"],
        g["running_seq_lens_sum"],
    )
    cpu = zs.If(prefill, True, g["running_has_cpu"])
    present = zs.If(prefill, g["extend_sum_present"], g["running_sum_present"])
    total = zs.If(prefill, g["extend_seq_lens_sum"], g["running_seq_lens_sum"])
    snapshot(s)
    check_state(s, i, "resolve_seq_lens_cpu")
    return cpu, present, total


def init_new(
    s: BmcState,
    i: int,
    prefill: Term,
    decode: Term,
    launched: list[Term],
    view: tuple[Term, Term, Term],
) -> None:
    """``ForwardBatch.init_new``: SL1 on the sum it reads (``view``: the batch's mirror,
    sum present, sum), the backfill from the mirror when the sum is absent; and RP4 at
    the launch."""
    ctx = s.ctx
    g = s.glob
    cpu, present, total = view
    mirror_sum = zs.Sum(
        [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(launched, s.reqs, strict=True)]
    )
    backfill = zs.And(zs.Not(present), cpu, zs.BoolVal(not ctx.has("B2")))
    fb_present = zs.Or(present, backfill)
    fb_value = zs.If(present, total, mirror_sum)
    anything = zs.Or(*launched)
    violate(
        s,
        "SL1",
        i,
        "init_new",
        zs.And(anything, cpu, zs.Not(zs.And(fb_present, fb_value == mirror_sum))),
        zs.And(anything, cpu),
    )
    if not ctx.config.cell.overshoot:
        # RP4: no launch of a request its results in flight already finish by length
        # (prepare_for_extend folds the prefill's launch in: it is counted already).
        for b, r in enumerate(s.reqs):
            before = r["launched_steps"] - zs.If(prefill, 1, 0)
            violate(
                s,
                "RP4",
                i,
                f"launch r{b}",
                zs.And(launched[b], r["output_len"] + before >= r["max_new_tokens"]),
                launched[b],
            )
    if not ctx.is_spec:  # the backfill stays on the ScheduleBatch (no isolation)
        g["running_sum_present"] = zs.If(
            zs.And(decode, backfill), True, g["running_sum_present"]
        )
        g["running_seq_lens_sum"] = zs.If(
            zs.And(decode, backfill), mirror_sum, g["running_seq_lens_sum"]
        )
        g["extend_sum_present"] = zs.If(
            zs.And(prefill, backfill), True, g["extend_sum_present"]
        )
        g["extend_seq_lens_sum"] = zs.If(
            zs.And(prefill, backfill), mirror_sum, g["extend_seq_lens_sum"]
        )


def launch_members(
    s: BmcState, i: int, prefill: Term, decode: Term, launched: list[Term], choices: Choices
) -> None:
    """``Scheduler._launch_members`` with the forward: the launch transition on each
    decoding member with its accept length (SL10 at the draft extend), and each launched
    member's EOS choice stored in its next in-flight slot."""
    ctx = s.ctx
    rung, offset = choices.rung, choices.offset
    posts = []
    for b, r in enumerate(s.reqs):
        fires = zs.And(decode, launched[b])
        top = (
            select_by_rung(ctx, rung, lambda shape: zs.IntVal(shape.max_accept_len))
            if ctx.is_spec
            else zs.IntVal(1)
        )
        add(s, zs.And(1 <= choices.accept[b], choices.accept[b] <= top))
        step = launch(ctx, r, choices.accept[b])
        check_point(s, "launch", i, fires, b, r, step)
        if ctx.is_spec:
            _check_draft_extend(s, i, b, r, fires, rung)
        post = dict(step.post)
        run_accept = zs.If(fires, choices.accept[b], 1)
        eos_at = zs.If(run_accept - 1 - offset >= 0, run_accept - 1 - offset, 0)
        second = r["launched_steps"] >= 1
        post.update(
            eos_oldest=zs.If(second, r["eos_oldest"], choices.eos[b]),
            eos_index_oldest=zs.If(second, r["eos_index_oldest"], eos_at),
            eos_newest=zs.If(second, choices.eos[b], r["eos_newest"]),
            eos_index_newest=zs.If(second, eos_at, r["eos_index_newest"]),
        )
        # The extend launch is folded into prepare_for_extend: only its EOS is stored.
        extend_post = dict(r)
        extend_post.update(eos_oldest=choices.eos[b], eos_index_oldest=eos_at)
        posts.append(ite(fires, post, ite(zs.And(prefill, launched[b]), extend_post, r)))
    s.reqs = posts


def _check_draft_extend(
    s: BmcState, i: int, b: int, r: Record, fires: Term, rung: Term
) -> None:
    """SL10: the draft extend's forward sees seq_len + D_tok, the ScheduleBatch keeps
    seq_len."""
    ctx = s.ctx
    d_tok = select_by_rung(ctx, rung, lambda shape: zs.IntVal(shape.draft_tokens))
    seq_len = r["seq_len"]

    def forward_seq_len(shape: SpecShape) -> Term:
        return lift(tr.compute_draft_extend_seq_lens, (seq_len,), shape.draft_tokens)[0]

    forward = select_by_rung(ctx, rung, forward_seq_len)
    # B7 writes the +D_tok to the ScheduleBatch too (reference worker).
    schedule_after = forward if ctx.has("B7") else r["seq_len"]
    violate(
        s,
        "SL10",
        i,
        f"draft_extend r{b}",
        zs.And(
            fires,
            zs.Not(zs.And(forward == r["seq_len"] + d_tok, schedule_after == r["seq_len"])),
        ),
        fires,
    )


def exit_isolation(s: BmcState, prefill: Term, decode: Term, launched: list[Term]) -> None:
    """``Scheduler._exit_isolation`` (spec without overlap): run_batch re-applies
    new_seq_lens; the host copy refreshes the sum."""
    g = s.glob
    reapplied = zs.Sum(
        [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(launched, s.reqs, strict=True)]
    )
    g["running_sum_present"] = zs.If(decode, g["running_has_cpu"], g["running_sum_present"])
    g["running_seq_lens_sum"] = zs.If(decode, reapplied, g["running_seq_lens_sum"])
    g["extend_sum_present"] = zs.If(prefill, True, g["extend_sum_present"])
    g["extend_seq_lens_sum"] = zs.If(prefill, reapplied, g["extend_seq_lens_sum"])
