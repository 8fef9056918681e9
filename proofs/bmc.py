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
end also ``LOOP``: the loop's own bookkeeping facts (``_Builder.check_loop``), which make
the inductive step and the windows of :func:`check_bounded` possible.

Modelling compromises, stated once:
- Aborts and PD-prebuilt admissions are not among the BMC's choices (stream bugs get
  hand-sized scripts in ``harness/mutants/z3.py``).
- A decode path where one request alone does not fit the pool (the release's
  out-of-memory abort of the last request, ``retract_decode``; the reference and
  gpu_impl take it) is excluded; the Hypothesis and differential tiers check it, most
  often at pool sizes set smaller than the presets' (``--sizes``).
- The tree cache is a sink whose pages are always evictable, so available pages are
  the pool minus what holders own (``get_available_pages``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.claims import (
    POINT_INVARIANTS,
    get_antecedent,
    get_state_invariants,
    get_strengthened,
)
from overlap_spec.proofs.model import (
    Context,
    Record,
    Step,
    is_fresh,
    is_live,
    launch,
    make_record,
    prepare_for_decode,
    prepare_for_extend,
    process_result,
    resolve_seq_lens_cpu,
    retract,
)
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import SpecMode, SpecShape

# The default bound is the issue's: K=6 iterations of B=3 requests. In every cell it is
# proved by the inductive step (check_inductive_step) plus iteration 0, about 2 s per
# cell on 2 cores (docs/proofs.md); the unrolling is the fallback and the mutant path.
DEFAULT_DEPTH: Final = 6
DEFAULT_REQUESTS: Final = 3
# Per query. The slowest default-bound query takes about 1 s; a full K=6, B=3 unrolling
# query (the fallback) about 20 s in the slowest cell.
DEFAULT_TIMEOUT_MS: Final = 60_000
MODEL_ID: Final = "MODEL"
LOOP_ID: Final = "LOOP"
# Order keys: a batch merged at iteration i sorts after everything merged before it.
_ORDER_STRIDE: Final = 1000
# Admission's new-token ratio in exact units of 1/300000: the release's 0.7 is 210000, its
# decay step (0.7 - 0.098) / 600 is 301, its floor 0.098 is 29400, a retraction's estimate
# 1.0 is 300000 (tests/test_proofs_bmc.py checks these against spec.transitions). The
# floats the release sums differ from these exact values by far less than one unit, so a
# comparison can come out otherwise only where the exact values are equal: there the BMC
# lets it go either way.
RATIO_SCALE: Final = 300_000
RATIO_INIT: Final = round(tr.INIT_NEW_TOKEN_RATIO * RATIO_SCALE)
RATIO_DECAY: Final = round(tr.NEW_TOKEN_RATIO_DECAY * RATIO_SCALE)
RATIO_MIN: Final = round(tr.MIN_NEW_TOKEN_RATIO * RATIO_SCALE)

EXTRA_INT: Final = (
    "admit_at",
    "waiting_order",
    "running_order",
    "eos_index_oldest",
    "eos_index_newest",
)
EXTRA_BOOL: Final = ("waiting", "in_running_batch", "in_extend_batch", "eos_oldest", "eos_newest")


@dataclass
class Violation:
    invariant: str
    iteration: int
    where: str
    term: Term  # true when violated
    exercised: Term = None  # true when the check has something to check (its antecedent)


@dataclass
class IterationTerms:
    """The choices of one iteration and what the decoder needs to place them."""

    allow_prefill: Term
    retract: Term
    disable_overlap: Term
    rung: Term
    eos_offset: Term
    accept: list[Term]
    eos: list[Term]
    launched: list[Term]  # request b is in the batch launched this iteration
    order: list[Term]  # its position key in that batch (ascending)
    prefill: Term


@dataclass
class Unrolling:
    ctx: Context
    depth: int
    requests: int
    constraints: list[Term] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    iterations: list[IterationTerms] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)  # len(constraints) after iteration i
    initial: int = 0  # len(constraints) after the initial state (the admission domain)
    ends: list[tuple[int, int]] = field(default_factory=list)  # violations at iteration i's end
    admit_at: list[Term] = field(default_factory=list)
    prompt_len: list[Term] = field(default_factory=list)
    max_new_tokens: list[Term] = field(default_factory=list)
    # Each request's record at the end of iteration i (the refinement test reads it).
    states: list[list[Record]] = field(default_factory=list)


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


def _ite(condition: Term, then: Record, other: Record) -> Record:
    return {name: zs.If(condition, then[name], other[name]) for name in other}


def _count(terms: list[Term]) -> Term:
    return zs.Sum([zs.If(t, 1, 0) for t in terms])


class _Builder:
    """Builds the unrolling; ``state`` is the current frame (fresh constants per frame)."""

    def __init__(
        self,
        ctx: Context,
        depth: int,
        requests: int,
        use_lemma: bool = False,
        symbolic_start: bool = False,
    ) -> None:
        self.ctx = ctx
        self.use_lemma = use_lemma  # add ALLOC instances (only once it is proved valid)
        self.out = Unrolling(ctx, depth, requests)
        self.frame = 0
        cfg = ctx.config
        self.page = cfg.page_size
        self.kv_pages = cfg.kv_pages
        self.rows = cfg.preset.max_running_requests
        self.chain = cfg.cell.spec_mode is SpecMode.V2_CHAIN
        self.reqs: list[Record] = []
        for b in range(requests):
            r = make_record(f"r{b}.f0")
            for name in EXTRA_INT:
                r[name] = zs.Int(f"r{b}.f0.{name}")
            for name in EXTRA_BOOL:
                r[name] = zs.Bool(f"r{b}.f0.{name}")
            self.reqs.append(r)
        self.glob: dict[str, Term] = {
            "last_was_extend": zs.BoolVal(False),
            "last_launched": zs.BoolVal(False),
            "running_has_cpu": zs.BoolVal(True),
            "running_sum_present": zs.BoolVal(False),
            "running_seq_lens_sum": zs.IntVal(0),
            "extend_sum_present": zs.BoolVal(False),
            "extend_seq_lens_sum": zs.IntVal(0),
            "waiting_counter": zs.IntVal(requests),
            "new_token_ratio": zs.IntVal(RATIO_INIT),  # NewTokenRatioTracker, scaled
            "batch_is_full": zs.BoolVal(False),  # the running batch's admission latch
        }
        if symbolic_start:  # any state: the caller constrains it (check_inductive_step)
            self.glob = {
                name: (zs.Bool if zs.is_bool(term) else zs.Int)(f"g.f0.{name}")
                for name, term in self.glob.items()
            }
        else:
            self._initial()
        self.out.initial = len(self.out.constraints)

    # ------------------------------------------------------------------ plumbing
    def add(self, term: Term) -> None:
        self.out.constraints.append(term)

    def violate(
        self, invariant: str, iteration: int, where: str, term: Term, exercised: Term = None
    ) -> None:
        self.out.violations.append(Violation(invariant, iteration, where, term, exercised))

    def snapshot(self) -> None:
        """Fresh constants for the current frame: keeps every term linear in K."""
        self.frame += 1
        fresh: list[Record] = []
        for b, r in enumerate(self.reqs):
            new: Record = {}
            for name, term in r.items():
                if zs.is_name(term) or zs.is_literal(term):
                    new[name] = term  # unchanged since the last frame, or a literal
                    continue
                var = (zs.Bool if zs.is_bool(term) else zs.Int)(f"r{b}.f{self.frame}.{name}")
                self.add(var == term)
                new[name] = var
            fresh.append(new)
        self.reqs = fresh
        for name, term in list(self.glob.items()):
            if zs.is_name(term) or zs.is_literal(term):
                continue
            var = (zs.Bool if zs.is_bool(term) else zs.Int)(f"g.f{self.frame}.{name}")
            self.add(var == term)
            self.glob[name] = var

    def _initial(self) -> None:
        preset = self.ctx.config.preset
        depth = self.out.depth
        for b, r in enumerate(self.reqs):
            self.add(
                zs.And(
                    is_fresh(r),
                    r["seq_len"] == 0,
                    r["seq_len_cpu"] == 0,
                    r["published_seq_len"] == 0,
                    r["accept_oldest"] == 0,
                    r["accept_newest"] == 0,
                    r["write_width"] == 0,
                    r["max_accept_len"] == 0,
                    1 <= r["prompt_len"],
                    r["prompt_len"] <= preset.max_prompt_len,
                    1 <= r["max_new_tokens"],
                    r["max_new_tokens"] <= preset.max_new_tokens,
                    0 <= r["admit_at"],
                    r["admit_at"] <= depth,
                    r["waiting_order"] == b,
                    r["running_order"] == 0,
                    r["eos_index_oldest"] == 0,
                    r["eos_index_newest"] == 0,
                    zs.Not(r["waiting"]),
                    zs.Not(r["in_running_batch"]),
                    zs.Not(r["in_extend_batch"]),
                    zs.Not(r["eos_oldest"]),
                    zs.Not(r["eos_newest"]),
                )
            )
            if b > 0:  # requests are admitted in rid order (symmetry breaking)
                self.add(self.reqs[b - 1]["admit_at"] <= r["admit_at"])
            self.out.admit_at.append(r["admit_at"])
            self.out.prompt_len.append(r["prompt_len"])
            self.out.max_new_tokens.append(r["max_new_tokens"])

    # ------------------------------------------------------------------ checks
    def check_state(self, iteration: int, where: str) -> None:
        ctx = self.ctx
        for inv in get_state_invariants(ctx):
            if inv.id == "SL2":
                continue  # needs the batch's mirror flag: below
            for b, r in enumerate(self.reqs):
                self.violate(
                    inv.id,
                    iteration,
                    f"{where} r{b}",
                    zs.Not(inv.predicate(ctx, r)),
                    get_antecedent(inv.id, r),
                )
        g = self.glob
        for b, r in enumerate(self.reqs):
            mirrored = zs.Or(
                zs.And(r["in_running_batch"], g["running_has_cpu"]), r["in_extend_batch"]
            )
            self.violate(
                "SL2",
                iteration,
                f"{where} r{b}",
                zs.And(mirrored, r["holds_kv"], r["seq_len"] != r["seq_len_cpu"]),
                zs.And(mirrored, r["holds_kv"]),
            )
        for batch, members, cpu in (
            ("running", [r["in_running_batch"] for r in self.reqs], g["running_has_cpu"]),
            ("extend", [r["in_extend_batch"] for r in self.reqs], zs.BoolVal(True)),
        ):
            present, total = (
                ("running_sum_present", "running_seq_lens_sum")
                if batch == "running"
                else ("extend_sum_present", "extend_seq_lens_sum")
            )
            mirror_sum = zs.Sum(
                [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(members, self.reqs, strict=True)]
            )
            self.violate(
                "SL3",
                iteration,
                f"{where} {batch} batch",
                zs.And(g[present], zs.Not(zs.And(cpu, g[total] == mirror_sum))),
                zs.And(g[present], zs.Or(*members)),
            )
        owned = zs.Sum([zs.If(r["holds_kv"], r["page_count"], 0) for r in self.reqs])
        holders = _count([r["holds_kv"] for r in self.reqs])
        self.violate(
            "KV7", iteration, where, zs.Or(owned > self.kv_pages, holders > self.rows), holders >= 2
        )

    def check_loop(self, i: int, now: Term) -> None:
        """``LOOP``: what the event loop's own bookkeeping (queues, batches, order keys,
        the EOS slots) keeps true between iterations. Not spec claims: checked like
        them, they let a deep query start from any state meeting every claim
        (``check_bounded``'s window) instead of replaying the whole history."""
        g = self.glob
        for b, r in enumerate(self.reqs):
            admitted = r["admit_at"] <= now
            facts = {
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
                        r["running_order"] < _ORDER_STRIDE * (now + 1),
                    ),
                ),
                # the last extend batch is this iteration's prefill
                "extend": zs.Implies(
                    r["in_extend_batch"],
                    zs.And(
                        g["last_was_extend"],
                        zs.Or(r["holds_kv"], r["finished"]),
                        r["launched_steps"] == self.ctx.max_pending,
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
                    r["launched_steps"] <= self.ctx.max_pending,
                    zs.Implies(r["launched_steps"] >= 1, g["last_launched"]),
                ),
                # queue keys: handed out from the counter, never reused
                "queue": zs.And(
                    0 <= r["waiting_order"],
                    r["waiting_order"] < g["waiting_counter"],
                    zs.Implies(zs.Not(admitted), r["waiting_order"] == b),
                    g["waiting_counter"] >= len(self.reqs),
                    g["waiting_counter"] <= len(self.reqs) * (now + 2),
                ),  # one retract pass per iteration
                # every prepared step was launched (or dropped with its finished request)
                "launched": zs.Not(zs.Or(r["prepared"], r["resolved"])),
            }
            for c, other in enumerate(self.reqs[:b]):
                facts[f"keys r{c}"] = zs.And(
                    r["waiting_order"] != other["waiting_order"],
                    zs.Implies(
                        zs.And(r["in_running_batch"], other["in_running_batch"]),
                        r["running_order"] != other["running_order"],
                    ),
                )
            for what, fact in facts.items():
                self.violate(LOOP_ID, i, f"end of iteration r{b} {what}", zs.Not(fact))
        admission = zs.And(RATIO_MIN <= g["new_token_ratio"], g["new_token_ratio"] <= RATIO_SCALE,
                           zs.Implies(g["batch_is_full"],
                                      zs.Or(*[r["in_running_batch"] for r in self.reqs])))
        self.violate(LOOP_ID, i, "end of iteration admission state", zs.Not(admission))

    def check_point(
        self, transition: str, iteration: int, fires: Term, b: int, r: Record, step: Step
    ) -> None:
        ctx = self.ctx
        self.violate(MODEL_ID, iteration, f"{transition} r{b}", zs.And(fires, zs.Not(step.guard)))
        for inv in POINT_INVARIANTS:
            if inv.transition == transition and inv.applies(ctx):
                self.violate(
                    inv.id,
                    iteration,
                    f"{transition} r{b}",
                    zs.And(fires, zs.Not(inv.predicate(ctx, r, step))),
                    fires,
                )

    # ------------------------------------------------------------------ helpers
    def available_pages(self) -> Term:
        owned = zs.Sum([zs.If(r["holds_kv"], r["page_count"], 0) for r in self.reqs])
        return self.kv_pages - owned

    def rung_shapes(self, rung: Term) -> list[tuple[Term, SpecShape]]:
        """(selector, shape) per rung the chain may run this iteration."""
        if not self.chain:
            return [(zs.BoolVal(True), self.ctx.shapes[0])]
        return [(rung == shape.steps, shape) for shape in self.ctx.shapes]

    def select_by_rung(self, rung: Term, build: object) -> Term:
        """An If chain over the rungs of ``build(shape)`` (a term)."""
        options = self.rung_shapes(rung)
        assert callable(build)
        value = build(options[-1][1])
        for selector, shape in reversed(options[:-1]):
            value = zs.If(selector, build(shape), value)
        return value

    def decode_step(self, r: Record, rung: Term) -> Step:
        """prepare_for_decode at this iteration's rung: an If chain over the rungs."""
        options = [
            (sel, prepare_for_decode(self.ctx, r, shape)) for sel, shape in self.rung_shapes(rung)
        ]
        post, guard = options[-1][1].post, options[-1][1].guard
        for sel, step in reversed(options[:-1]):
            post = _ite(sel, step.post, post)
            guard = zs.If(sel, step.guard, guard)
        return Step(guard, post)

    def allocation_lemma(self, r: Record, rung: Term, step: Step) -> Term:
        """ALLOC: from a state meeting the state claims and the transition's guard (a
        live request), prepare_for_decode adds exactly
        the pages retract_decode counted for the request (its fit check). Proved valid
        per context by :func:`prove_allocation_lemma` before it is added; it restates
        what KV4's page count gives, which the solver otherwise re-derives through the
        page rounding of every rung in each deep KV7 query."""
        return zs.Implies(
            zs.And(step.guard, get_strengthened(self.ctx, r)),
            step.post["page_count"] == r["page_count"] + self.decode_pages_needed(r, rung),
        )

    def rung_domain(self, rung: Term) -> Term:
        if self.chain:
            return zs.And(1 <= rung, rung <= self.ctx.config.preset.chain_steps)
        return rung == 0

    def decode_pages_needed(self, r: Record, rung: Term) -> Term:
        if not self.ctx.is_spec:
            return lift(tr.compute_ns_decode_pages_needed, r["seq_len"], self.page)
        return self.select_by_rung(
            rung,
            lambda shape: lift(
                tr.compute_v2_decode_pages_needed,
                r["kv_committed_len"],
                r["kv_allocated_len"],
                self.ctx.get_reserve(shape),
                self.page,
            ),
        )

    # ------------------------------------------------------------------ the loop
    def process(self, i: int, which: list[Term], label: str) -> None:
        """process_batch_result for the requests in ``which`` (their oldest slot)."""
        ctx = self.ctx
        was_stale: list[Term] = []
        processed_live: list[Term] = []
        accepts: list[Term] = []
        extends: list[Term] = []
        posts: list[Record] = []
        for b, r in enumerate(self.reqs):
            step = process_result(ctx, r, r["eos_oldest"], r["eos_index_oldest"])
            self.check_point("process_result", i, which[b], b, r, step)
            post = dict(step.post)
            post.update(
                eos_oldest=r["eos_newest"],
                eos_index_oldest=r["eos_index_newest"],
                eos_newest=zs.BoolVal(False),
                eos_index_newest=zs.IntVal(0),
            )
            posts.append(_ite(which[b], post, r))
            was_stale.append(zs.And(which[b], zs.Not(is_live(r))))
            processed_live.append(zs.And(which[b], zs.Not(step.notes["stale"])))
            accepts.append(step.notes["accept"])
            extends.append(zs.And(which[b], step.notes["extend"]))
        if ctx.is_spec:
            # Only a decode result feeds the spec metrics (update_spec_metrics); a prefill
            # result reports none, so RP3 has nothing to judge there.
            metered = zs.Not(zs.Or(*extends))
            counted = which if ctx.has("B4") else processed_live
            expected = [zs.And(w, zs.Not(s)) for w, s in zip(which, was_stale, strict=True)]
            correct = zs.Sum([zs.If(c, a - 1, 0) for c, a in zip(counted, accepts, strict=True)])
            truth = zs.Sum([zs.If(e, a - 1, 0) for e, a in zip(expected, accepts, strict=True)])
            self.violate(
                "RP3",
                i,
                f"{label} counters",
                zs.And(metered, zs.Or(correct != truth, _count(counted) != _count(expected))),
                zs.And(metered, zs.Or(*expected)),
            )
        self.reqs = posts
        self.snapshot()
        self.check_state(i, label)

    def filter_running(self, when: Term, leave_out: list[Term] | None = None) -> None:
        """filter_batch on the running batch: drop finished (and ``leave_out``); sum reset
        and the admission latch cleared if anything left."""
        drop = [
            zs.And(when, zs.Or(r["finished"], leave_out[b]) if leave_out else r["finished"])
            for b, r in enumerate(self.reqs)
        ]
        removed = zs.Or(*[zs.And(r["in_running_batch"], d) for r, d in zip(self.reqs, drop,
                                                                            strict=True)])
        for r, d in zip(self.reqs, drop, strict=True):
            r["in_running_batch"] = zs.And(r["in_running_batch"], zs.Not(d))
        self.glob["batch_is_full"] = zs.And(self.glob["batch_is_full"], zs.Not(removed))
        if not self.ctx.has("B1"):
            self.glob["running_sum_present"] = zs.And(
                self.glob["running_sum_present"], zs.Not(removed)
            )

    def iteration(self, i: int, now: Term | None = None) -> None:
        """Event-loop iteration ``i`` (its names and labels); ``now`` is its index as a
        term, a literal unless the inductive step makes it symbolic."""
        now = zs.IntVal(i) if now is None else now
        ctx = self.ctx
        cfg = ctx.config
        g = self.glob
        n = len(self.reqs)
        allow = zs.Bool(f"i{i}.allow_prefill")
        forced = zs.Int(f"i{i}.retract")
        disable = zs.Bool(f"i{i}.disable_overlap")
        rung = zs.Int(f"i{i}.spec_steps")
        offset = zs.Int(f"i{i}.eos_offset")
        accept = [zs.Int(f"i{i}.r{b}.accept") for b in range(n)]
        eos = [zs.Bool(f"i{i}.r{b}.eos") for b in range(n)]
        self.add(
            zs.And(0 <= forced, forced <= max(n - 1, 0), 0 <= offset, offset < cfg.max_accept_len)
        )
        if not ctx.overlap:
            self.add(zs.Not(disable))
        self.add(self.rung_domain(rung))
        # Admissions before this iteration: waiting, in rid order.
        for r in self.reqs:
            r["waiting"] = zs.Or(r["waiting"], r["admit_at"] == now)
        pending = [r["launched_steps"] >= 1 for r in self.reqs]  # the previous iteration's result
        # 1. the last extend batch: filter, then replace or merge into the running batch.
        survivors = [
            zs.And(g["last_was_extend"], r["in_extend_batch"], zs.Not(r["finished"]))
            for r in self.reqs
        ]
        removed = zs.Or(
            *[zs.And(g["last_was_extend"], r["in_extend_batch"], r["finished"]) for r in self.reqs]
        )
        x_sum = (
            g["extend_sum_present"]
            if ctx.has("B1")
            else zs.And(g["extend_sum_present"], zs.Not(removed))
        )
        for b, r in enumerate(self.reqs):
            r["in_extend_batch"] = survivors[b]
        g["extend_sum_present"] = x_sum
        g["batch_is_full"] = zs.And(g["batch_is_full"], zs.Not(removed))
        self.check_state(i, "filter_batch(last extend)")
        any_survivor = zs.Or(*survivors)
        running_empty = zs.Not(zs.Or(*[r["in_running_batch"] for r in self.reqs]))
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
        for r in self.reqs:
            joined = r["in_extend_batch"]
            r["running_order"] = zs.If(
                joined, _ORDER_STRIDE * now + r["waiting_order"], r["running_order"]
            )
            r["in_running_batch"] = zs.Or(r["in_running_batch"], joined)
            r["in_extend_batch"] = zs.BoolVal(False)
        g["extend_sum_present"], g["extend_seq_lens_sum"] = (
            zs.BoolVal(False),
            zs.IntVal(0),
        )  # consumed
        self.snapshot()
        self.check_state(i, "merge_batch")
        if not ctx.config.cell.overshoot:
            # The release filters the running batch at every step, before admission.
            self.filter_running(zs.BoolVal(True))
            self.snapshot()
            self.check_state(i, "filter_batch(every step)")
        # 2a. prefill first: the release's PrefillAdder (admit).
        chosen = self.admit(i, allow)
        prefill = zs.Or(*chosen)
        posts = []
        for b, r in enumerate(self.reqs):
            step = prepare_for_extend(ctx, r)
            self.check_point("prepare_for_extend", i, chosen[b], b, r, step)
            post = dict(step.post)
            post.update(waiting=zs.BoolVal(False), in_extend_batch=zs.BoolVal(True))
            posts.append(_ite(chosen[b], post, r))
        self.reqs = posts
        g["extend_sum_present"] = zs.If(prefill, True, g["extend_sum_present"])
        g["extend_seq_lens_sum"] = zs.If(
            prefill,
            zs.Sum([zs.If(c, r["seq_len_cpu"], 0) for c, r in zip(chosen, self.reqs, strict=True)]),
            g["extend_seq_lens_sum"],
        )
        self.snapshot()
        self.check_state(i, "prepare_for_extend")
        # 2b. otherwise the decode path: filter, retract, prepare_for_decode.
        decode = zs.And(zs.Not(prefill), zs.Or(*[r["in_running_batch"] for r in self.reqs]))
        finishing: list[Term] = []
        if ctx.config.cell.skips_finishing_decode:
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
                for b, r in enumerate(self.reqs)
            ]
        self.filter_running(decode, finishing)
        self.snapshot()
        self.check_state(i, "filter_batch")
        decode = zs.And(decode, zs.Or(*[r["in_running_batch"] for r in self.reqs]))
        if finishing:
            # Short of KV with such requests left out: no decode this step (their result
            # frees KV at its end) instead of a retraction.
            fits = zs.Sum(
                [zs.If(r["in_running_batch"], self.decode_pages_needed(r, rung), 0)
                 for r in self.reqs]
            ) <= self.available_pages()
            decode = zs.And(decode, zs.Not(zs.And(zs.Or(*finishing), zs.Not(fits))))
        self.retract_decode(i, decode, forced, rung, now)
        for r in self.reqs:
            r["in_running_batch"] = zs.And(r["in_running_batch"], zs.Not(r["is_retracted"]))
        self.snapshot()
        self.check_state(i, "retract_decode")
        posts = []
        for b, r in enumerate(self.reqs):
            fires = zs.And(decode, r["in_running_batch"])
            merged = self.decode_step(r, rung)
            self.check_point("prepare_for_decode", i, fires, b, r, merged)
            if self.use_lemma:
                self.add(self.allocation_lemma(r, rung, merged))
            posts.append(_ite(fires, merged.post, r))
        self.reqs = posts
        if not ctx.is_spec:
            g["running_sum_present"] = zs.And(g["running_sum_present"], zs.Not(decode))
        self.snapshot()
        self.check_state(i, "prepare_for_decode")
        # 3. overlap, disable_overlap: the pending result first, then the re-filter.
        early = zs.BoolVal(False)
        if ctx.overlap:
            early = zs.And(disable, g["last_launched"], zs.Or(*pending))
            self.process(i, [zs.And(early, p) for p in pending], "process_result(early)")
            if not ctx.has("B14"):
                self.filter_running(zs.And(early, decode))
            decode = zs.And(decode, zs.Or(*[r["in_running_batch"] for r in self.reqs]))
            self.snapshot()
            self.check_state(i, "filter_batch(early)")
        # 4. run_batch.
        launched = [
            zs.Or(zs.And(prefill, r["in_extend_batch"]), zs.And(decode, r["in_running_batch"]))
            for r in self.reqs
        ]
        self.launch(i, prefill, decode, launched, accept, eos, offset, rung)
        # 5. the previous result (overlap) or this one (no overlap).
        if ctx.overlap:
            late = zs.And(zs.Not(early), g["last_launched"])
            self.process(i, [zs.And(late, p) for p in pending], "process_result")
        else:
            self.process(i, launched, "process_result")
        # on_idle once nothing runs, waits or is in flight: the ratio starts over.
        quiet = zs.Not(zs.Or(*launched))
        if ctx.overlap:
            quiet = zs.And(quiet, zs.Not(g["last_launched"]))
        busy = zs.Or(*[zs.Or(r["in_running_batch"], r["in_extend_batch"], r["waiting"],
                             r["launched_steps"] >= 1) for r in self.reqs])
        g["new_token_ratio"] = zs.If(zs.And(quiet, zs.Not(busy)), RATIO_INIT,
                                     g["new_token_ratio"])
        g["last_was_extend"] = prefill
        g["last_launched"] = zs.Or(*launched)
        self.snapshot()
        first = len(self.out.violations)
        self.check_state(i, "end of iteration")
        self.check_loop(i, now)
        self.out.ends.append((first, len(self.out.violations)))
        self.out.states.append([dict(r) for r in self.reqs])
        self.out.iterations.append(
            IterationTerms(
                allow,
                forced,
                disable,
                rung,
                offset,
                accept,
                eos,
                launched,
                [zs.If(prefill, r["waiting_order"], r["running_order"]) for r in self.reqs],
                prefill,
            )
        )

    def admit(self, i: int, allow: Term) -> list[Term]:
        """``get_new_batch_prefill`` with ``PrefillAdder`` (as ``Scheduler.admit_by_budget``):
        which waiting requests this iteration admits, and the latch it leaves.

        In queue order, no skipping, a request is admitted while a row is left, it asks
        (fill + remaining max_new_tokens + a page) for less than the free tokens less the
        running requests' remaining max_new_tokens x ratio and the earlier admissions'
        reservations (paged fill + a page + max_new_tokens), and after an admission some
        budget is left. Each comparison is a choice (``fits``, ``room``) pinned to the exact
        arithmetic except where that is an equality (see ``RATIO_SCALE``)."""
        g, page, scale = self.glob, self.page, RATIO_SCALE
        reqs = self.reqs
        n = len(reqs)
        running = _count([r["in_running_batch"] for r in reqs])
        free_rows = self.rows - _count([r["holds_kv"] for r in reqs])
        rows = zs.If(self.rows - running < free_rows, self.rows - running, free_rows)
        free = self.available_pages() * page * scale
        latched = zs.And(g["batch_is_full"], running > 0)  # an empty batch's latch is dropped
        ratio = g["new_token_ratio"]
        top = self.ctx.config.preset.max_new_tokens
        offset = []
        for b, r in enumerate(reqs):
            left = r["max_new_tokens"] - r["output_len"]
            # rem x ratio, linear: one term per value rem can take (0..max_new_tokens).
            offset.append(zs.Sum([zs.If(zs.And(r["in_running_batch"], left == v), v * ratio, 0)
                                  for v in range(1, top + 1)]))
            self.violate(MODEL_ID, i, f"admission r{b} remaining max_new_tokens",
                         zs.And(r["in_running_batch"], zs.Or(left < 0, left > top)))
        running_offset = zs.Sum(offset)
        fill = [lift(tr.compute_fill_len, r["prompt_len"], r["output_len"]) for r in reqs]
        asked = [lift(tr.compute_prefill_check_tokens, f, r["max_new_tokens"], r["output_len"],
                      page) for f, r in zip(fill, reqs, strict=True)]
        reserved = [lift(tr.compute_prefill_reserved_tokens, f, r["max_new_tokens"], page)
                    for f, r in zip(fill, reqs, strict=True)]
        paged = [lift(tr.compute_page_align_up, f, page) + page for f in fill]

        def budget(among: list[Term]) -> tuple[Term, Term]:
            """(free - total offset, free - current offset) after admitting ``among``."""
            total = running_offset + scale * zs.Sum(
                [zs.If(a, reserved[c], 0) for c, a in enumerate(among)])
            current = scale * zs.Sum([zs.If(a, paged[c], 0) for c, a in enumerate(among)])
            return free - total, free - current

        def room_after(among: list[Term], name: str) -> Term:
            left_total, left_current = budget(among)
            room = zs.Bool(name)
            self.add(zs.Implies(room, zs.And(left_total >= 0, left_current > 0)))
            self.add(zs.Implies(zs.Not(room), zs.Or(left_total <= 0, left_current <= 0)))
            return room

        ahead = [[zs.And(c["waiting"], c["waiting_order"] < r["waiting_order"]) if c is not r
                  else zs.BoolVal(False) for c in reqs] for r in reqs]
        attempted = zs.And(allow, zs.Not(latched), zs.Or(*[r["waiting"] for r in reqs]))
        fits, room, step_ok = [], [], []
        for b, r in enumerate(reqs):
            left_total, _ = budget(ahead[b])
            fit = zs.Bool(f"i{i}.r{b}.fits")
            self.add(zs.Implies(fit, scale * asked[b] <= left_total))
            self.add(zs.Implies(zs.Not(fit), scale * asked[b] >= left_total))
            fits.append(fit)
            room.append(room_after(ahead[b], f"i{i}.r{b}.room"))
            count = _count(ahead[b])
            step_ok.append(zs.And(r["waiting"], count < rows, fit,
                                  zs.Or(count == 0, room[b])))
        chosen = [zs.And(attempted, step_ok[b],
                         *[zs.Implies(ahead[b][c], step_ok[c]) for c in range(n) if c != b])
                  for b in range(n)]
        # The latch: no row at all; the first request left waiting found no row, no budget
        # left after the one before it, or (with something running or admitted) did not fit;
        # or no budget is left after the last one admitted.
        admitted = _count(chosen)
        latch = zs.BoolVal(False)
        stopped = zs.BoolVal(False)
        for b, r in enumerate(reqs):
            first_left = zs.And(r["waiting"], zs.Not(chosen[b]),
                                *[zs.Implies(ahead[b][c], chosen[c]) for c in range(n)
                                  if c != b])
            count = _count(ahead[b])
            why = zs.Or(count >= rows, zs.And(count > 0, zs.Not(room[b])),
                        zs.And(zs.Not(fits[b]), zs.Or(count > 0, running > 0)))
            latch = zs.Or(latch, zs.And(first_left, why))
            stopped = zs.Or(stopped, first_left)
        spent = zs.And(zs.Not(stopped), admitted > 0,
                       zs.Not(room_after(chosen, f"i{i}.room_after")))
        after = zs.If(rows <= 0, zs.BoolVal(True), zs.Or(latch, spent))
        # Set on an empty running batch it is dropped before it is read again.
        g["batch_is_full"] = zs.And(zs.If(attempted, after, latched), running > 0)
        return chosen

    def retract_decode(self, i: int, decode: Term, forced: Term, rung: Term, now: Term) -> None:
        """Victims in retract order until the rest fits, plus ``forced``; keep one; the
        kept requests then stand in the policy's order (``filter_batch(keep_indices=
        sorted_indices)``)."""
        ctx = self.ctx
        reqs = self.reqs
        n = len(reqs)
        member = [zs.And(decode, r["in_running_batch"]) for r in reqs]
        need = [self.decode_pages_needed(r, rung) for r in reqs]
        avail = self.available_pages()

        def needed(of: list[Term]) -> Term:
            return zs.Sum([zs.If(m, need[b], 0) for b, m in enumerate(of)])

        def before(c: int, b: int) -> Term:
            """Request c is retracted before request b (when both are candidates):
            ``transitions.compute_retraction_order``."""
            rc, rb = reqs[c], reqs[b]
            if ctx.config.cell.retracts_spec_from_back:
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

        trigger = zs.Not(zs.And(forced == 0, needed(member) <= avail))
        # The new-token ratio: re-estimated over the kept requests when retract_decode runs,
        # else decayed by the decode (update_running_batch).
        retracting = zs.And(zs.Or(*member), trigger)
        victims: list[Term] = []
        for b in range(n):
            earlier = [
                zs.And(member[c], before(c, b)) if c != b else zs.BoolVal(False) for c in range(n)
            ]
            kept = [zs.And(member[c], zs.Not(earlier[c])) for c in range(n)]
            freed = zs.Sum([zs.If(earlier[c], reqs[c]["page_count"], 0) for c in range(n)])
            victims.append(
                zs.And(
                    member[b],
                    trigger,
                    _count(kept) > 1,
                    zs.Or(forced > _count(earlier), needed(kept) > avail + freed),
                )
            )
        kept = [zs.And(m, zs.Not(v)) for m, v in zip(member, victims, strict=True)]
        freed = zs.Sum([zs.If(v, reqs[b]["page_count"], 0) for b, v in enumerate(victims)])
        posts = []
        for b, r in enumerate(reqs):
            step = retract(ctx, r)
            self.check_point("retract_decode", i, victims[b], b, r, step)
            position = _count([zs.And(victims[c], before(c, b)) for c in range(n) if c != b])
            post = dict(step.post)
            post.update(
                waiting=zs.BoolVal(True),
                in_running_batch=zs.BoolVal(False),
                waiting_order=self.glob["waiting_counter"] + position,
            )
            posts.append(_ite(victims[b], post, r))
        # After a retraction the kept requests are renumbered in the policy's order: b's
        # rank is the number of kept requests the policy prefers to it.
        reorder = zs.Or(*victims)
        for b, post in enumerate(posts):
            rank = _count([zs.And(kept[c], before(b, c)) for c in range(n) if c != b])
            post["running_order"] = zs.If(
                zs.And(reorder, kept[b]), _ORDER_STRIDE * now + rank, post["running_order"]
            )
        self.reqs = posts
        # min(1, (outputs + 20 x kept) / (max_new_tokens + 1)) is 1 here unless the kept
        # requests' max_new_tokens exceed 19 each on average: flagged, not modelled.
        estimate = zs.Sum([zs.If(k, reqs[b]["output_len"] + tr.RETRACT_DECODE_STEPS
                                 - reqs[b]["max_new_tokens"], 0) for b, k in enumerate(kept)])
        self.violate(MODEL_ID, i, "retract_decode new_token_ratio below 1",
                     zs.And(retracting, estimate < 1))
        g_ratio = self.glob["new_token_ratio"]
        decayed = zs.If(g_ratio - RATIO_DECAY < RATIO_MIN, RATIO_MIN, g_ratio - RATIO_DECAY)
        self.glob["new_token_ratio"] = zs.If(
            retracting, RATIO_SCALE, zs.If(zs.Or(*member), decayed, g_ratio))
        self.glob["batch_is_full"] = zs.And(self.glob["batch_is_full"],
                                            zs.Not(zs.Or(*victims)))
        # The rest fits, else the reference aborts the last request for want of memory:
        # excluded (module header). Stated over the post records (a kept request's post is
        # its pre record), the terms prepare_for_decode and ALLOC use next.
        self.add(
            zs.Sum(
                [
                    zs.If(k, self.decode_pages_needed(r, rung), 0)
                    for k, r in zip(kept, posts, strict=True)
                ]
            )
            <= avail + freed
        )
        if not ctx.has("B1"):
            self.glob["running_sum_present"] = zs.And(
                self.glob["running_sum_present"], zs.Not(zs.Or(*victims))
            )
        self.glob["waiting_counter"] = self.glob["waiting_counter"] + _count(victims)

    def launch(
        self,
        i: int,
        prefill: Term,
        decode: Term,
        launched: list[Term],
        accept: list[Term],
        eos: list[Term],
        offset: Term,
        rung: Term,
    ) -> None:
        ctx = self.ctx
        cfg = ctx.config
        g = self.glob
        # ForwardBatch.init_new (SL1) reads the launched batch's mirror and sum.
        cpu = zs.If(prefill, True, g["running_has_cpu"])
        present = zs.If(prefill, g["extend_sum_present"], g["running_sum_present"])
        total = zs.If(prefill, g["extend_seq_lens_sum"], g["running_seq_lens_sum"])
        if ctx.relay:
            posts = []
            for b, r in enumerate(self.reqs):
                fires = zs.And(decode, launched[b])
                step = resolve_seq_lens_cpu(ctx, r)
                self.check_point("resolve_seq_lens_cpu", i, fires, b, r, step)
                posts.append(_ite(fires, step.post, r))
            self.reqs = posts
            keeps = cfg.cell.needs_cpu_seq_lens
            resolved_sum = zs.Sum(
                [
                    zs.If(m, r["published_seq_len"], 0)
                    for m, r in zip(launched, self.reqs, strict=True)
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
            self.snapshot()
            self.check_state(i, "resolve_seq_lens_cpu")
        mirror_sum = zs.Sum(
            [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(launched, self.reqs, strict=True)]
        )
        backfill = zs.And(zs.Not(present), cpu, zs.BoolVal(not ctx.has("B2")))
        fb_present = zs.Or(present, backfill)
        fb_value = zs.If(present, total, mirror_sum)
        anything = zs.Or(*launched)
        self.violate(
            "SL1",
            i,
            "init_new",
            zs.And(anything, cpu, zs.Not(zs.And(fb_present, fb_value == mirror_sum))),
            zs.And(anything, cpu),
        )
        if not cfg.cell.overshoot:
            # RP4: no launch of a request its results in flight already finish by length
            # (prepare_for_extend folds the prefill's launch in: it is counted already).
            for b, r in enumerate(self.reqs):
                before = r["launched_steps"] - zs.If(prefill, 1, 0)
                self.violate(
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
        posts = []
        for b, r in enumerate(self.reqs):
            fires = zs.And(decode, launched[b])
            top = (
                self.select_by_rung(rung, lambda shape: zs.IntVal(shape.max_accept_len))
                if ctx.is_spec
                else zs.IntVal(1)
            )
            self.add(zs.And(1 <= accept[b], accept[b] <= top))
            step = launch(ctx, r, accept[b])
            self.check_point("launch", i, fires, b, r, step)
            if ctx.is_spec:
                d_tok = self.select_by_rung(rung, lambda shape: zs.IntVal(shape.draft_tokens))
                seq_len = r["seq_len"]
                forward = self.select_by_rung(
                    rung,
                    lambda shape, s=seq_len: lift(
                        tr.compute_draft_extend_seq_lens, (s,), shape.draft_tokens
                    )[0],
                )
                # B7 writes the +D_tok to the ScheduleBatch too (reference worker).
                schedule_after = forward if ctx.has("B7") else r["seq_len"]
                self.violate(
                    "SL10",
                    i,
                    f"draft_extend r{b}",
                    zs.And(
                        fires,
                        zs.Not(
                            zs.And(forward == r["seq_len"] + d_tok, schedule_after == r["seq_len"])
                        ),
                    ),
                    fires,
                )
            post = dict(step.post)
            run_accept = zs.If(fires, accept[b], 1)
            eos_at = zs.If(run_accept - 1 - offset >= 0, run_accept - 1 - offset, 0)
            second = r["launched_steps"] >= 1
            post.update(
                eos_oldest=zs.If(second, r["eos_oldest"], eos[b]),
                eos_index_oldest=zs.If(second, r["eos_index_oldest"], eos_at),
                eos_newest=zs.If(second, eos[b], r["eos_newest"]),
                eos_index_newest=zs.If(second, eos_at, r["eos_index_newest"]),
            )
            # The extend launch is folded into prepare_for_extend: only its EOS is stored.
            extend_post = dict(r)
            extend_post.update(eos_oldest=eos[b], eos_index_oldest=eos_at)
            posts.append(_ite(fires, post, _ite(zs.And(prefill, launched[b]), extend_post, r)))
        self.reqs = posts
        if ctx.is_spec and not ctx.overlap:
            # run_batch re-applies new_seq_lens; the host copy refreshes the sum.
            reapplied = zs.Sum(
                [zs.If(m, r["seq_len_cpu"], 0) for m, r in zip(launched, self.reqs, strict=True)]
            )
            g["running_sum_present"] = zs.If(decode, g["running_has_cpu"], g["running_sum_present"])
            g["running_seq_lens_sum"] = zs.If(decode, reapplied, g["running_seq_lens_sum"])
            g["extend_sum_present"] = zs.If(prefill, True, g["extend_sum_present"])
            g["extend_seq_lens_sum"] = zs.If(prefill, reapplied, g["extend_seq_lens_sum"])
        self.snapshot()
        self.check_state(i, "run_batch")


def prove_allocation_lemma(ctx: Context, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> zs.Outcome:
    """Is ALLOC (``_Builder.allocation_lemma``) valid in this context, for a symbolic
    request at any rung? Only then may the unrolling add its instances: a valid formula
    removes no run. Under a fault that changes the allocation (B12) it is not."""
    builder = _Builder(ctx, 0, 0)
    r = make_record("alloc")
    rung = zs.Int("alloc.rung")
    goal = builder.allocation_lemma(r, rung, builder.decode_step(r, rung))
    return zs.prove([builder.rung_domain(rung)], goal, timeout_ms)


def build_unrolling(
    ctx: Context,
    depth: int = DEFAULT_DEPTH,
    requests: int = DEFAULT_REQUESTS,
    use_lemma: bool = False,
) -> Unrolling:
    """The constraints of every K-iteration run of B requests, with its violations;
    ``use_lemma`` adds ALLOC's instances (the caller has proved it valid)."""
    builder = _Builder(ctx, depth, requests, use_lemma)
    for i in range(depth):
        builder.iteration(i)
        builder.out.frames.append(len(builder.out.constraints))
    return builder.out


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
    builder = _Builder(ctx, depth, requests, use_lemma, symbolic_start=True)
    now = zs.Int("step.n")
    builder.add(zs.And(1 <= now, now <= depth - 1))
    builder.check_state(0, "start")
    builder.check_loop(0, now - 1)
    assumed = [zs.Not(v.term) for v in builder.out.violations]
    builder.out.violations.clear()
    builder.iteration(1, now)
    return builder.out, assumed


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
    windowed = window and invariants is None
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
