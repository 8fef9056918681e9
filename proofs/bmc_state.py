"""The BMC's state record and plumbing: what the loop phases of :mod:`proofs.bmc_schedule`
and :mod:`proofs.bmc_run` read and write.

``BmcState`` is the unrolling being built: its constraints, violations and per-iteration
records (``Unrolling``), and the current frame's request records and loop globals (the
running / extend batch flags, sums, the waiting counter, the admission state). Each frame
gets fresh constants (``snapshot``), which keeps every term linear in K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.claims import get_strengthened
from overlap_spec.proofs.model import Context, Record, Step, is_fresh, make_record
from overlap_spec.proofs.model import prepare_for_decode as model_prepare_for_decode
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import Cell, SpecMode, SpecShape

MODEL_ID: Final = "MODEL"
LOOP_ID: Final = "LOOP"
# Order keys: a batch merged at iteration i sorts after everything merged before it.
ORDER_STRIDE: Final = 1000
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
    # A flush_cache ran after this iteration (radix cells; None: the cell has none).
    flushed: Term | None = None


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
class BmcState:
    """The unrolling under construction; ``reqs`` and ``glob`` are the current frame."""

    ctx: Context
    out: Unrolling
    use_lemma: bool  # add ALLOC instances (only once it is proved valid)
    ratio_init: int  # the new-token ratio at the start and after on_idle (scaled)
    reqs: list[Record]
    glob: dict[str, Term]
    frame: int = 0

    @property
    def kv_pages(self) -> int:
        return self.ctx.config.kv_pages

    @property
    def rows(self) -> int:
        return self.ctx.config.preset.max_running_requests


def new_state(
    ctx: Context,
    depth: int,
    requests: int,
    use_lemma: bool = False,
    symbolic_start: bool = False,
    ratio_init: int = RATIO_INIT,
) -> BmcState:
    """Frame 0: the initial state (or, with ``symbolic_start``, any state: the caller
    constrains it, as ``check_inductive_step`` does)."""
    reqs: list[Record] = []
    for b in range(requests):
        r = make_record(f"r{b}.f0")
        for name in EXTRA_INT:
            r[name] = zs.Int(f"r{b}.f0.{name}")
        for name in EXTRA_BOOL:
            r[name] = zs.Bool(f"r{b}.f0.{name}")
        reqs.append(r)
    glob: dict[str, Term] = {
        "last_was_extend": zs.BoolVal(False),
        "last_launched": zs.BoolVal(False),
        "running_has_cpu": zs.BoolVal(True),
        "running_sum_present": zs.BoolVal(False),
        "running_seq_lens_sum": zs.IntVal(0),
        "extend_sum_present": zs.BoolVal(False),
        "extend_seq_lens_sum": zs.IntVal(0),
        "waiting_counter": zs.IntVal(requests),
        "new_token_ratio": zs.IntVal(ratio_init),  # NewTokenRatioTracker, scaled
        "batch_is_full": zs.BoolVal(False),  # the running batch's admission latch
    }
    s = BmcState(ctx, Unrolling(ctx, depth, requests), use_lemma, ratio_init, reqs, glob)
    if ctx.config.cell.radix:
        add_radix_fields(s)
    if symbolic_start:
        s.glob = {
            name: (zs.Bool if zs.is_bool(term) else zs.Int)(f"g.f0.{name}")
            for name, term in glob.items()
        }
    else:
        add_initial_state(s)
    s.out.initial = len(s.out.constraints)
    return s


def add_initial_state(s: BmcState) -> None:
    """Every request fresh, not yet admitted; its admission iteration, prompt_len and
    max_new_tokens free within the preset's bounds (the admission domain)."""
    preset = s.ctx.config.preset
    depth = s.out.depth
    for b, r in enumerate(s.reqs):
        add(
            s,
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
            ),
        )
        if s.ctx.config.cell.radix:
            add(s, get_initial_radix(r))
        if b > 0:  # requests are admitted in rid order (symmetry breaking)
            add(s, s.reqs[b - 1]["admit_at"] <= r["admit_at"])
        s.out.admit_at.append(r["admit_at"])
        s.out.prompt_len.append(r["prompt_len"])
        s.out.max_new_tokens.append(r["max_new_tokens"])


# ---------------------------------------------------------------------- plumbing
def add(s: BmcState, term: Term) -> None:
    s.out.constraints.append(term)


def violate(
    s: BmcState, invariant: str, iteration: int, where: str, term: Term, exercised: Term = None
) -> None:
    s.out.violations.append(Violation(invariant, iteration, where, term, exercised))


def snapshot(s: BmcState) -> None:
    """Fresh constants for the current frame: keeps every term linear in K."""
    s.frame += 1
    fresh: list[Record] = []
    for b, r in enumerate(s.reqs):
        new: Record = {}
        for name, term in r.items():
            if zs.is_name(term) or zs.is_literal(term):
                new[name] = term  # unchanged since the last frame, or a literal
                continue
            var = (zs.Bool if zs.is_bool(term) else zs.Int)(f"r{b}.f{s.frame}.{name}")
            add(s, var == term)
            new[name] = var
        fresh.append(new)
    s.reqs = fresh
    for name, term in list(s.glob.items()):
        if zs.is_name(term) or zs.is_literal(term):
            continue
        var = (zs.Bool if zs.is_bool(term) else zs.Int)(f"g.f{s.frame}.{name}")
        add(s, var == term)
        s.glob[name] = var


def ite(condition: Term, then: Record, other: Record) -> Record:
    return {name: zs.If(condition, then[name], other[name]) for name in other}


def count(terms: list[Term]) -> Term:
    return zs.Sum([zs.If(t, 1, 0) for t in terms])


# ---------------------------------------------------------------------- helpers
def available_pages(s: BmcState) -> Term:
    """``get_available_pages``: free + evictable (a radix cell's tree: its counters; else
    the sink, always evictable: the pool less what holders own)."""
    if s.ctx.config.cell.radix:
        return s.glob["free"] + s.glob["evictable"]
    owned = zs.Sum([zs.If(r["holds_kv"], r["page_count"], 0) for r in s.reqs])
    return s.kv_pages - owned


def rung_shapes(ctx: Context, rung: Term) -> list[tuple[Term, SpecShape]]:
    """(selector, shape) per rung the chain may run this iteration."""
    if ctx.config.cell.spec_mode is not SpecMode.V2_CHAIN:
        return [(zs.BoolVal(True), ctx.shapes[0])]
    return [(rung == shape.steps, shape) for shape in ctx.shapes]


def select_by_rung(ctx: Context, rung: Term, build: Callable[[SpecShape], Term]) -> Term:
    """An If chain over the rungs of ``build(shape)`` (a term)."""
    options = rung_shapes(ctx, rung)
    value = build(options[-1][1])
    for selector, shape in reversed(options[:-1]):
        value = zs.If(selector, build(shape), value)
    return value


def decode_step(ctx: Context, r: Record, rung: Term) -> Step:
    """prepare_for_decode at this iteration's rung: an If chain over the rungs."""
    options = [
        (sel, model_prepare_for_decode(ctx, r, shape)) for sel, shape in rung_shapes(ctx, rung)
    ]
    post, guard = options[-1][1].post, options[-1][1].guard
    for sel, step in reversed(options[:-1]):
        post = ite(sel, step.post, post)
        guard = zs.If(sel, step.guard, guard)
    return Step(guard, post)


def allocation_lemma(ctx: Context, r: Record, rung: Term, step: Step) -> Term:
    """ALLOC: from a state meeting the state claims and the transition's guard (a
    live request), prepare_for_decode adds exactly
    the pages retract_decode counted for the request (its fit check). Proved valid
    per context by ``bmc.prove_allocation_lemma`` before it is added; it restates
    what KV4's page count gives, which the solver otherwise re-derives through the
    page rounding of every rung in each deep KV7 query."""
    return zs.Implies(
        zs.And(step.guard, get_strengthened(ctx, r)),
        step.post["page_count"] == r["page_count"] + decode_pages_needed(ctx, r, rung),
    )


def rung_domain(ctx: Context, rung: Term) -> Term:
    if ctx.config.cell.spec_mode is SpecMode.V2_CHAIN:
        return zs.And(1 <= rung, rung <= ctx.config.preset.chain_steps)
    return rung == 0


def decode_pages_needed(ctx: Context, r: Record, rung: Term) -> Term:
    page = ctx.config.page_size
    if not ctx.is_spec:
        return lift(tr.compute_ns_decode_pages_needed, r["seq_len"], page)
    return select_by_rung(
        ctx,
        rung,
        lambda shape: lift(
            tr.compute_v2_decode_pages_needed,
            r["kv_committed_len"],
            r["kv_allocated_len"],
            ctx.get_reserve(shape),
            page,
        ),
    )


# ---------------------------------------------------------------------- radix state
# The bounded radix tree's fields (proofs/bmc_radix.py, which makes its transitions).
RADIX_INT = ("cpl_pages", "matched_pages", "lock_trunk", "lock_branch", "branch", "branch_ref",
             "branch_locked", "row_path", "extend_end")
RADIX_BOOL = ("has_lock",)


def compute_shared_pages(cell: Cell, prompt_len: int) -> int:
    """Pages of a prompt's key that every longer prompt of its family shares: the key over
    the prompt (``compute_inserted_len``), as the prefill's checkpoint inserts it."""
    return tr.compute_inserted_len(cell, prompt_len) // cell.page_size


def get_trunk_bound(ctx: Context) -> int:
    return compute_shared_pages(ctx.config.cell, ctx.config.preset.max_prompt_len)


def add_radix_fields(s: BmcState) -> None:
    """The radix fields of frame 0's records and globals (named, left free: the initial
    state or the inductive step constrains them)."""
    for b, r in enumerate(s.reqs):
        for name in RADIX_INT:
            r[name] = zs.Int(f"r{b}.f0.{name}")
        for name in RADIX_BOOL:
            r[name] = zs.Bool(f"r{b}.f0.{name}")
    s.glob["free"] = zs.IntVal(s.kv_pages)
    for name in ("trunk", "evictable", "protected", *get_lock_names(s.ctx)):
        s.glob[name] = zs.IntVal(0)


def get_lock_names(ctx: Context) -> list[str]:
    return [f"lock{j}" for j in range(get_trunk_bound(ctx))]


def get_initial_radix(r: Record) -> Term:
    return zs.And(*[r[name] == 0 for name in RADIX_INT], zs.Not(r["has_lock"]))
