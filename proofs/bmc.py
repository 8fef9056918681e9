"""Bounded model checking: K event-loop iterations of B symbolic requests, per cell.

The per-request rules are :mod:`proofs.model`'s transitions (the spec's ``compute_*``
run over Z3 terms); this module adds what the inductive proofs leave out: *which*
requests each transition fires on in each iteration, decided the way
``reference/scheduler.py`` ``run_iteration`` decides it::

    admissions (Admit ops before iteration i)
    1. the last extend batch is filtered and merged into the running batch
    2. prefill first: the waiting queue FIFO by the release's PrefillAdder budget, its
       batch_is_full latch and new-token ratio (``admit_by_budget``); else the decode path:
       filter_batch, retract_decode (memory or forced; spec and non-spec
       fewest outputs / longest prompt first), prepare_for_decode at this rung
    3. overlap with disable_overlap: the pending result first, then the re-filter
    4. run_batch: resolve_seq_lens_cpu (spec overlap), launch with accept lengths
    5. overlap: the previous iteration's result (stale ones skipped); else this one's

Every environment choice is a named Z3 constant that maps one-to-one onto a harness
script operation (``harness/mutants/z3.py`` decodes a model into ``Admit`` /
``Iterate(IterationChoices(...))`` ops): admission iteration, prompt_len and
max_new_tokens of each request (MINIMAL bounds), and per iteration allow_prefill,
retract, disable_overlap, spec_steps (the chain's rung), eos_offset, and per request
its accept length and EOS flag (placed at the request's batch position by the
decoder).

Checked at every sub-step: the state claims of :mod:`proofs.claims` (the spec IDs
and the strengthening conjuncts IND1..IND7), the point claims at their transitions,
and the batch claims SL1 (init_new), SL3 (lazy sum), SL10 (draft extend), RP3
(counters), RP4 (at a launch, outside the overshoot era) and KV7 (pool conservation).
``MODEL`` flags a transition fired by the loop outside :mod:`proofs.model`'s guard: the
two encodings disagree, which the clean model must also rule out. At each iteration's
end also ``LOOP``: the loop's own bookkeeping facts (``bmc_checks.check_loop``), which make
the inductive step and the windows of :func:`check_bounded` possible.

The module is the public API; the unrolling is built by one function per event-loop
phase, each named after the ``reference/scheduler.py`` method it mirrors:
:mod:`proofs.bmc_run` (``run_iteration``, ``run_batch``, ``process_batch_result``,
``on_idle``), :mod:`proofs.bmc_schedule` (``get_next_batch_to_run``, ``merge_batch``,
``filter_batch``, ``get_new_batch_prefill``, ``admit_by_budget``,
``update_running_batch``, ``retract_decode``, ``prepare_for_decode``),
:mod:`proofs.bmc_checks` (the checks) and :mod:`proofs.bmc_state` (the state record
``BmcState``, its frames and the rung helpers).

Modelling compromises, stated once:
- Aborts and PD-prebuilt admissions are not among the BMC's choices (stream bugs get
  hand-sized scripts in ``harness/mutants/z3.py``).
- A decode path where one request alone does not fit the pool (the release's
  out-of-memory abort of the last request, ``retract_decode``; the reference and
  gpu_impl take it) is excluded; the Hypothesis and differential tiers check it, most
  often at pool sizes set smaller than the presets' (``--sizes``).
- The tree cache is a sink whose pages are always evictable, so available pages are
  the pool minus what holders own (``get_available_pages``), except in a radix cell
  (``Cell.radix``): there :mod:`proofs.bmc_radix` keeps a bounded prefix tree of one
  prompt family (a shared trunk of at most T pages with per-page lock counts, a private
  branch per request, the allocator's free pages, the evictable / protected counters,
  each request's cache_protected_len, match and lock anchor), makes the reference's
  match, lock, checkpoints, releases and evictions on it (the eviction order a free
  choice; a flush_cache after each iteration, another), and checks RX1..RX4 at every
  sub-step, RX8 at a flush. A radix cell is unrolled at
  ``RADIX_BOUND`` (neither the inductive step nor the window: LOOP states no tree facts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.bmc_checks import check_loop, check_state
from overlap_spec.proofs.bmc_run import run_iteration
from overlap_spec.proofs.bmc_state import (
    EXTRA_BOOL,
    EXTRA_INT,
    LOOP_ID,
    MODEL_ID,
    RATIO_DECAY,
    RATIO_INIT,
    RATIO_MIN,
    RATIO_SCALE,
    IterationTerms,
    Unrolling,
    Violation,
    add,
    allocation_lemma,
    decode_step,
    new_state,
    rung_domain,
)
from overlap_spec.proofs.model import Context, make_record
from overlap_spec.proofs.solver import Term

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_REQUESTS",
    "DEFAULT_TIMEOUT_MS",
    "EXTRA_BOOL",
    "EXTRA_INT",
    "LOOP_ID",
    "MODEL_ID",
    "RADIX_BOUND",
    "RATIO_DECAY",
    "RATIO_INIT",
    "RATIO_MIN",
    "RATIO_SCALE",
    "BmcResult",
    "IterationTerms",
    "Unrolling",
    "Violation",
    "allocation_lemma",
    "build_inductive_step",
    "build_unrolling",
    "check_bounded",
    "check_inductive_step",
    "decode_step",
    "find_reachable_witnesses",
    "get_end_lemma",
    "get_targets",
    "prove_allocation_lemma",
    "rung_domain",
]

# The default bound is the issue's: K=6 iterations of B=3 requests. In every cell it is
# proved by the inductive step (check_inductive_step) plus iteration 0, about 2 s per
# cell on 2 cores (docs/proofs.md); the unrolling is the fallback and the mutant path.
DEFAULT_DEPTH: Final = 6
DEFAULT_REQUESTS: Final = 3
# A radix cell's bound (proofs/bmc_radix.py): its tree is unrolled, neither the inductive
# step nor the window applies, and K=3, B=2 takes about 4 to 10 s of CPU a cell
# (bench/results/2026-11-29-bmc-radix.md); K=4, B=2 already hits the query timeout in
# some.
RADIX_BOUND: Final = (3, 2)
# Per query. The slowest default-bound query takes about 1 s; a full K=6, B=3 unrolling
# query (the fallback) about 20 s in the slowest cell.
DEFAULT_TIMEOUT_MS: Final = 60_000


@dataclass
class BmcResult:
    cell: str
    depth: int
    requests: int
    verdict: str  # proved (no violation within the bound) | counterexample | unknown
    seconds: float
    invariant: str | None = None
    where: str = ""
    unrolling: Unrolling | None = None
    raw_model: object = None
    reason: str = ""
    lemma: str = ""  # ALLOC's verdict in this context: its instances are added only if proved
    windows: int = 0  # iterations proved by the one-iteration window (check_bounded)
    inductive: bool = False  # iterations 1..K-1 proved by check_inductive_step


def prove_allocation_lemma(ctx: Context, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> zs.Outcome:
    """Is ALLOC (``bmc_state.allocation_lemma``) valid in this context, for a symbolic
    request at any rung? Only then may the unrolling add its instances: a valid formula
    removes no run. Under a fault that changes the allocation (B12) it is not."""
    r = make_record("alloc")
    rung = zs.Int("alloc.rung")
    goal = allocation_lemma(ctx, r, rung, decode_step(ctx, r, rung))
    return zs.prove([rung_domain(ctx, rung)], goal, timeout_ms)


def build_unrolling(
    ctx: Context,
    depth: int = DEFAULT_DEPTH,
    requests: int = DEFAULT_REQUESTS,
    use_lemma: bool = False,
) -> Unrolling:
    """The constraints of every K-iteration run of B requests, with its violations;
    ``use_lemma`` adds ALLOC's instances (the caller has proved it valid)."""
    s = new_state(ctx, depth, requests, use_lemma, ratio_init=RATIO_INIT)
    for i in range(depth):
        run_iteration(s, i)
        s.out.frames.append(len(s.out.constraints))
    return s.out


def get_targets(unrolling: Unrolling, invariants: tuple[str, ...] | None) -> list[Violation]:
    """The violations a query looks for: all (clean) or those with the bug's IDs."""
    if invariants is None:
        return unrolling.violations
    return [v for v in unrolling.violations if v.invariant in invariants]


def check_inductive_step(
    ctx: Context, depth: int, requests: int, use_lemma: bool, timeout_ms: int = DEFAULT_TIMEOUT_MS
) -> zs.Outcome:
    """Iteration n, for every n in 1..K-1 in one query, from *any* state that meets the
    checks of an iteration's end (``check_state`` "end of iteration" and ``LOOP`` at
    n-1): unsat means no check of iteration n can fail and the end checks hold again,
    which with iteration 0 from the initial state covers the whole bound (induction on
    n). The start state is otherwise free, so this over-approximates the runs: sat
    proves nothing either way (the caller falls back to the unrolling)."""
    step, assumed = build_inductive_step(ctx, depth, requests, use_lemma)
    solver = zs.Preprocessed(timeout_ms)
    solver.add(*step.constraints, *assumed)
    return solver.check([zs.Or(*[v.term for v in step.violations])])


def build_inductive_step(
    ctx: Context, depth: int, requests: int, use_lemma: bool
) -> tuple[Unrolling, list[Term]]:
    """The step's iteration (at index ``step.n`` in 1..K-1, named iteration 1) from a
    free start state, and the start state's assumptions (its end-of-iteration checks)."""
    s = new_state(ctx, depth, requests, use_lemma, symbolic_start=True, ratio_init=RATIO_INIT)
    now = zs.Int("step.n")
    add(s, zs.And(1 <= now, now <= depth - 1))
    check_state(s, 0, "start")
    check_loop(s, 0, now - 1)
    assumed = [zs.Not(v.term) for v in s.out.violations]
    s.out.violations.clear()
    run_iteration(s, 1, now)
    return s.out, assumed


def find_reachable_witnesses(
    ctx: Context, depth: int = 2, requests: int = 2, timeout_ms: int = DEFAULT_TIMEOUT_MS
) -> dict[str, str]:
    """Per checked claim ID: is there a run of the unrolling (a reachable state, not a
    strengthened one) in which the check has something to check? "sat": a witness;
    "unsat": the check is vacuous within the bound; "unknown": undecided (never a pass).
    ``MODEL`` and ``LOOP`` are the encoding's own checks and are left out."""
    unrolling = build_unrolling(ctx, depth, requests)
    by_id: dict[str, list[Term]] = {}
    for v in unrolling.violations:
        if v.exercised is not None:
            by_id.setdefault(v.invariant, []).append(v.exercised)
    found: dict[str, str] = {}
    solver = zs.Preprocessed(timeout_ms)
    solver.add(*unrolling.constraints)
    while by_id:  # one run usually witnesses several IDs: ask for any of those left
        outcome = solver.check([zs.Or(*[t for terms in by_id.values() for t in terms])])
        if outcome.verdict != zs.SATISFIABLE:  # none of those left has a run (or unknown)
            found.update({invariant: outcome.verdict for invariant in by_id})
            break
        for invariant, terms in list(by_id.items()):
            if any(zs.evaluate(outcome.raw_model, t) is True for t in terms):
                found[invariant] = zs.SATISFIABLE
                del by_id[invariant]
    return found


def get_end_lemma(unrolling: Unrolling, i: int) -> Term:
    """Every check of the state at iteration i's end holds (once iteration i is proved)."""
    first, last = unrolling.ends[i]
    return zs.Not(zs.Or(*[v.term for v in unrolling.violations[first:last]]))


def check_bounded(
    ctx: Context,
    depth: int = DEFAULT_DEPTH,
    requests: int = DEFAULT_REQUESTS,
    invariants: tuple[str, ...] | None = None,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    window: bool = True,
) -> BmcResult:
    """Is a violation (of ``invariants``, default all) reachable within K iterations?

    ALLOC is proved first; its instances are added only if it is valid here. With all
    checks asked and ``window`` on, the inductive step (:func:`check_inductive_step`)
    is tried: if it holds, only iteration 0 is unrolled and asked.

    Otherwise the unrolling, iteration by iteration: iteration i's checks are one
    query; once unsat, their negation is kept (it holds in every run). Each query is a
    fresh solver run through z3's preprocessing (``solver.Preprocessed``: solve-eqs
    removes the frame equalities; a push / pop solver skips that and was about 8x
    slower at K=3). The window (``window``, all checks only): for i >= 1 the query is
    first asked of iteration i alone, from any state that meets the checks of iteration
    i-1's end (:func:`get_end_lemma`: the state claims, SL3 / KV7, LOOP) and the
    admission domain, dropping the history before it. Dropping constraints only adds
    runs, so unsat there is unsat for the unrolling; anything else (a state no run
    reaches, or a real violation) falls back to the query with the whole history.

    proved: no violation within the bound; counterexample: a model of the full query
    whose first violated check is named; unknown: a query hit ``timeout_ms`` (each
    query has it; never a pass).
    """
    started = time.perf_counter()
    lemma = prove_allocation_lemma(ctx, timeout_ms)
    use_lemma = lemma.verdict == zs.PROVED
    # A radix cell unrolls: its tree's state is not among LOOP's facts, so the inductive
    # step and the window would start from tree states no run reaches.
    windowed = window and invariants is None and not ctx.config.cell.radix
    inductive = (
        windowed
        and depth >= 2
        and check_inductive_step(ctx, depth, requests, use_lemma, timeout_ms).verdict
        == zs.UNSATISFIABLE
    )
    # With the step proved, only iteration 0 from the initial state is left to ask.
    unrolling = build_unrolling(ctx, 1 if inductive else depth, requests, use_lemma)
    targets = get_targets(unrolling, invariants)
    name = ctx.config.cell.name
    solver = zs.Preprocessed(timeout_ms)
    previous = 0
    proved_last: Term | None = None  # the lemma of iteration i-1
    windows = 0

    def finish(
        verdict: str,
        invariant: str | None = None,
        where: str = "",
        raw_model: object = None,
        reason: str = "",
    ) -> BmcResult:
        return BmcResult(
            name,
            depth,
            requests,
            verdict,
            time.perf_counter() - started,
            invariant,
            where,
            unrolling,
            raw_model,
            reason,
            lemma.verdict,
            windows,
            inductive,
        )

    for i in range(unrolling.depth):
        solver.add(*unrolling.constraints[previous : unrolling.frames[i]])
        here = [v for v in targets if v.iteration == i]
        query = zs.Or(*[v.term for v in here])
        start, previous = previous, unrolling.frames[i]
        if not here:
            continue
        if windowed and proved_last is not None:
            local = zs.Preprocessed(timeout_ms)
            local.add(
                *unrolling.constraints[: unrolling.initial],
                proved_last,
                *unrolling.constraints[start : unrolling.frames[i]],
            )
            if local.check([query]).verdict == zs.UNSATISFIABLE:
                windows += 1
                solver.add(zs.Not(query))
                proved_last = get_end_lemma(unrolling, i)
                continue
        outcome = solver.check([query])
        if outcome.verdict == zs.UNKNOWN:
            return finish(zs.UNKNOWN, reason=f"iteration {i}: {outcome.reason or 'timeout'}")
        if outcome.verdict == zs.SATISFIABLE:
            fired = [v for v in here if zs.evaluate(outcome.raw_model, v.term) is True]
            first = fired[0] if fired else None
            return finish(
                zs.COUNTEREXAMPLE,
                invariant=first.invariant if first else None,
                where=f"iteration {i}: {first.where}" if first else f"iteration {i}",
                raw_model=outcome.raw_model,
            )
        solver.add(zs.Not(query))
        proved_last = get_end_lemma(unrolling, i)
    return finish(zs.PROVED)
