"""The abstract scheduler state as Z3 terms, and the spec's transitions over it.

One request is a record of integer and Boolean terms under the spec's field names
(``spec.state.RequestView`` and ``GhostView``): ``prompt_len``, ``output_len``,
``max_new_tokens``, ``kv_committed_len``, ``kv_allocated_len``, ``finished``,
``is_retracted``, ``holds_kv``, and its place in the running batch (``seq_len``, the
``seq_lens`` entry; ``seq_len_cpu``, its mirror; ``published_seq_len``, the FutureMap
row; ``page_count``, the pages its row holds). A batch adds the flags ``has_cpu`` /
``sum_present`` and ``seq_lens_sum``. Every arithmetic rule is the spec's own
``compute_*`` function run over terms by :func:`proofs.symbolic.lift`; this module only
says *which* rule fires in which transition and what it leaves unchanged (the frame),
following ``reference/``.

Where the relation cannot run on terms, the model says why at the transition: the
ghost's launched steps are a map in ``spec.relation.Ghost`` (``steps``, one entry per
step with the KV length its forward reached, an epoch per retraction) and here a queue
of at most two accept lengths (``accept_oldest`` / ``accept_newest``) with no epoch (a
retracted request's late results are told apart by ``is_live``); the batch fields are
``spec.transitions`` rules. ``tests/test_model_refines_relation.py`` runs the model's
transitions on concrete values beside the relation and compares every field they share.

Ghost fields (never written by scheduler logic, as in ``spec/state.py``):
``kv_len_true`` true KV length, ``settled_len`` settled length, ``inflight_steps`` steps
prepared or launched and not processed, ``launched_steps`` launched unprocessed steps,
``accept_oldest`` / ``accept_newest`` their accept lengths (an extend slot has 0),
``extend_inflight`` (the oldest slot is the prefill), ``prepared`` (a prepared,
unlaunched decode step), ``resolved`` (its seq_lens came back through the relay),
``write_width`` (its write width), ``max_accept_len`` (its rung's largest accept length).

Modelling compromises, stated once:
- A tree on pages > 1 writes as far as its branch regions reach, which depends on
  ``seq_len % page``; the record keeps the widest over every residue, so KV3 is shown for
  each (``compute_forward_write_width`` without a ``seq_len``).
- The prefill of a request (``prepare_for_extend``) folds in the extend launch:
  nothing is claimed between the two but the batch mirror, which the sum model keeps.
- Event-loop order is a guard on each transition (prepare needs at most one pending
  result under overlap and none without, launch needs a prepared step, processing
  needs a launched one); any interleaving the guards allow is checked, which
  includes every order the loop makes.
- Memory pressure is not modelled in the per-request proofs (retraction is a free
  choice instead); page conservation is the sum model's ``KV7``.
- Prompt and budget sizes are bounded by the preset (``max_prompt_len``,
  ``max_new_tokens``), the admission domain of the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import relation
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import Cell, ModelConfig, SpecShape
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

INT_FIELDS: Final = (
    "prompt_len",
    "output_len",
    "max_new_tokens",
    "kv_committed_len",
    "kv_allocated_len",
    "kv_len_true",
    "settled_len",
    "inflight_steps",
    "launched_steps",
    "accept_oldest",
    "accept_newest",
    "seq_len",
    "seq_len_cpu",
    "published_seq_len",
    "page_count",
    "write_width",
    "max_accept_len",
)
BOOL_FIELDS: Final = (
    "finished",
    "is_retracted",
    "holds_kv",
    "extend_inflight",
    "prepared",
    "resolved",
)
FIELDS: Final = INT_FIELDS + BOOL_FIELDS

Record = dict[str, Term]

_fresh = count()


def fresh_name(prefix: str) -> str:
    return f"{prefix}!{next(_fresh)}"


def make_record(prefix: str) -> Record:
    record: Record = {name: zs.Int(f"{prefix}.{name}") for name in INT_FIELDS}
    record.update({name: zs.Bool(f"{prefix}.{name}") for name in BOOL_FIELDS})
    return record


def make_array_record(prefix: str) -> dict[str, Term]:
    """One array per field: the batch of unbounded length as arrays indexed by position."""
    arrays = {name: zs.IntArray(f"{prefix}.{name}") for name in INT_FIELDS}
    arrays.update({name: zs.BoolArray(f"{prefix}.{name}") for name in BOOL_FIELDS})
    return arrays


def select(arrays: dict[str, Term], index: Term) -> Record:
    return {name: array[index] for name, array in arrays.items()}


def is_live(r: Record) -> Term:
    return zs.And(r["holds_kv"], zs.Not(r["finished"]), zs.Not(r["is_retracted"]))


def is_fresh(r: Record) -> Term:
    """A request as admitted: nothing held, nothing in flight, no output."""
    return zs.And(
        zs.Not(r["holds_kv"]),
        zs.Not(r["finished"]),
        zs.Not(r["is_retracted"]),
        zs.Not(r["prepared"]),
        zs.Not(r["resolved"]),
        zs.Not(r["extend_inflight"]),
        r["launched_steps"] == 0,
        r["inflight_steps"] == 0,
        r["output_len"] == 0,
        r["kv_committed_len"] == 0,
        r["kv_allocated_len"] == 0,
        r["kv_len_true"] == 0,
        r["settled_len"] == 0,
        r["page_count"] == 0,
    )


def get_lag(r: Record) -> Term:
    """Accepts of launched, unprocessed steps: what kv_len_true is ahead of the settled length."""
    return zs.If(r["launched_steps"] >= 1, r["accept_oldest"], 0) + zs.If(
        r["launched_steps"] >= 2, r["accept_newest"], 0
    )


def get_extend_pending(r: Record) -> Term:
    return zs.And(r["launched_steps"] >= 1, r["extend_inflight"])


@dataclass
class Context:
    """A cell, its sizes and the faults switched on (bug IDs)."""

    config: ModelConfig
    faults: frozenset[str] = frozenset()
    shapes: tuple[SpecShape, ...] = ()

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.cell.spec_mode.value == "v2chain":
            self.shapes = tuple(cfg.get_shape(r) for r in range(1, cfg.preset.chain_steps + 1))
        else:
            self.shapes = (cfg.get_shape(),)

    def has(self, bug_id: str) -> bool:
        return bug_id in self.faults

    @property
    def is_spec(self) -> bool:
        return self.config.cell.is_spec

    @property
    def overlap(self) -> bool:
        return self.config.cell.overlap

    @property
    def relay(self) -> bool:
        """Spec under overlap: seq_lens come back through new_seq_lens_buf (resolve)."""
        return self.is_spec and self.overlap

    @property
    def max_pending(self) -> int:
        """Results pending at prepare time: one under overlap, none without (ST5)."""
        return 1 if self.overlap else 0

    def get_reserve(self, shape: SpecShape) -> int:
        return self.config.get_decode_reserve(shape, self.faults)

    def get_lead(self, claimed: Term) -> Term:
        return lift(tr.compute_committed_lead, self.config.cell, claimed)


@dataclass
class Step:
    """One transition instance: the guard, the post-state and the values a claim reads."""

    guard: Term
    post: Record
    notes: dict[str, Term] = field(default_factory=dict)


# ----------------------------------------------------------------------------- transitions
def prepare_for_extend(ctx: Context, r: Record) -> Step:
    """Admit a waiting request: row, KV for fill_len, committed = allocated = fill_len; the
    extend launch is folded in (kv_len_true = fill_len, extend publish of seq_len, one slot
    in flight)."""
    fill, _ = lift(relation.compute_extend_kv, r["prompt_len"], r["output_len"])
    page = ctx.config.page_size
    post = dict(r)
    post.update(
        kv_committed_len=fill,
        kv_allocated_len=fill,
        seq_len=fill,
        seq_len_cpu=fill,
        kv_len_true=lift(extend_forward_kv, r["prompt_len"], r["output_len"], fill),
        settled_len=fill,
        published_seq_len=fill,
        launched_steps=r["launched_steps"] + 1,
        inflight_steps=r["inflight_steps"] + 1,
        accept_oldest=zs.IntVal(0),
        extend_inflight=zs.BoolVal(True),
        holds_kv=zs.BoolVal(True),
        is_retracted=zs.BoolVal(False),
        prepared=zs.BoolVal(False),
        resolved=zs.BoolVal(False),
        page_count=lift(tr.compute_pages_for_len, fill, page),
    )
    guard = zs.And(zs.Not(r["holds_kv"]), zs.Not(r["finished"]), r["launched_steps"] == 0)
    return Step(guard, post)


# --- the relation's transitions run on a record whose integer fields are terms ---------------
# Each wrapper below builds the smallest RequestRecord or Ghost the transition accepts, with
# only the fields that enter it set, runs spec.relation on it and returns those fields; lift
# runs it over terms. A record's output is a token tuple, so the transitions that read the
# output length (the prefill's fill, a result's run and finish) expose an integer core in
# the relation (compute_extend_kv, compute_result_kv, compute_finished_reason,
# compute_release_cached) that is lifted instead.
def _holding(committed: int, allocated: int) -> relation.RequestRecord:
    return relation.RequestRecord(
        RequestId(0),
        TokenCount(1),
        TokenCount(1),
        kv_committed_len=committed,
        kv_allocated_len=allocated,
        req_pool_idx=PoolRow(0),
        waiting=False,
        holds_kv=True,
    )


def extend_forward_kv(prompt_len: int, output_len: int, end: int) -> int:
    """kv_len_true after the prefill forward writes up to ``end`` (``ghost_forward_extend``)."""
    ghost = relation.ghost_launch(relation.Ghost(output_len_true=output_len), StepId(0))
    return relation.ghost_forward_extend(ghost, StepId(0), prompt_len, end).kv_len_true


def decode_forward_kv(kv_len_true: int, advanced_by: int) -> int:
    """kv_len_true after a decode forward settles ``advanced_by`` (``ghost_forward_decode``)."""
    ghost = relation.ghost_launch(relation.Ghost(kv_len_true=kv_len_true), StepId(0))
    return relation.ghost_forward_decode(ghost, StepId(0), advanced_by).kv_len_true


def release_kv(cell: Cell, committed: int, allocated: int) -> tuple[int, int, bool]:
    """(kv_committed_len, kv_allocated_len, holds_kv) after ``release_kv_cache``; what the
    tree keeps at a finish is compute_release_cached."""
    post = relation.release_kv_cache(_holding(committed, allocated), cell, False)
    return post.kv_committed_len, post.kv_allocated_len, post.holds_kv


def retract_kv(cell: Cell, committed: int, allocated: int) -> tuple[int, int, bool, bool]:
    """``retract_decode``: release_req then reset_for_retract, as (kv_committed_len,
    kv_allocated_len, holds_kv, is_retracted)."""
    post = relation.reset_for_retract(
        relation.release_kv_cache(_holding(committed, allocated), cell, False))
    return post.kv_committed_len, post.kv_allocated_len, post.holds_kv, post.is_retracted


def finishes(eos_at: int | None, run_len: int, output_len: int, max_new_tokens: int) -> bool:
    """A live row's result finishes it (``update_finish_state``; the model has no aborts)."""
    return relation.compute_finished_reason(None, eos_at, run_len, output_len, max_new_tokens,
                                            None) is not None


def decode_kv(
    committed: int,
    allocated: int,
    seq_len: int,
    spec: bool,
    reserve: int,
    page_size: int,
    preclaim: bool,
    faults: frozenset[str],
) -> tuple[int, int]:
    """(kv_allocated_len, kv_committed_len) after ``prepare_for_decode``: the spec's own
    transition (``spec.relation``), run here on a live request holding KV and lifted into
    Z3 below, so the proofs do not restate it (B12 included). The other fields of the
    record do not enter this transition; the model's guard says when it fires."""
    request = _holding(committed, allocated)
    if spec:
        post = relation.prepare_for_decode_spec_v2(request, reserve, page_size, preclaim, faults)
    else:
        post = relation.prepare_for_decode(request, seq_len)
    return post.kv_allocated_len, post.kv_committed_len


def prepare_for_decode(ctx: Context, r: Record, shape: SpecShape) -> Step:
    """Non-spec: claim one slot, seq_lens + 1. Spec-v2: reserve max(cur, committed + R),
    page aligned; seq_lens untouched; the J2 pre-claim adds 1 to committed."""
    page = ctx.config.page_size
    post = dict(r)
    width = lift(tr.compute_forward_write_width, shape, "decode", page)
    allocated, committed = lift(
        decode_kv,
        r["kv_committed_len"],
        r["kv_allocated_len"],
        r["seq_len"],
        ctx.is_spec,
        ctx.get_reserve(shape) if ctx.is_spec else 0,
        page,
        ctx.config.cell.preclaim,
        ctx.faults,
    )
    post.update(kv_allocated_len=allocated, kv_committed_len=committed)
    if not ctx.is_spec:
        post.update(
            seq_len=lift(tr.compute_decode_seq_len_ns, r["seq_len"]),
            seq_len_cpu=lift(tr.compute_decode_seq_len_ns, r["seq_len_cpu"]),
        )
    needed = lift(tr.compute_pages_for_len, post["kv_allocated_len"], page)
    post.update(
        inflight_steps=r["inflight_steps"] + 1,
        prepared=zs.BoolVal(True),
        resolved=zs.BoolVal(False),
        write_width=width,
        max_accept_len=zs.IntVal(shape.max_accept_len),
        page_count=zs.If(needed > r["page_count"], needed, r["page_count"]),
    )
    guard = zs.And(is_live(r), zs.Not(r["prepared"]), r["launched_steps"] <= ctx.max_pending)
    return Step(guard, post)


def resolve_seq_lens_cpu(ctx: Context, r: Record) -> Step:
    """Spec overlap: SB.seq_lens (and the mirror when kept) = new_seq_lens_buf[row]."""
    post = dict(r)
    post.update(
        seq_len=r["published_seq_len"],
        seq_len_cpu=r["published_seq_len"],
        resolved=zs.BoolVal(True),
    )
    return Step(zs.And(r["prepared"], is_live(r)), post)


def launch(ctx: Context, r: Record, accept: Term) -> Step:
    """The forward: draft + verify write [seq_len, seq_len + W); kv_len_true += accept;
    publish seq_len + accept; the step joins the in-flight queue. Non-spec writes position
    seq_len - 1: kv_len_true += 1."""
    post = dict(r)
    advance = accept if ctx.is_spec else zs.IntVal(1)
    published = lift(tr.compute_verify_new_seq_len, r["seq_len"], accept)
    slot_two = r["launched_steps"] >= 1
    post.update(
        kv_len_true=lift(decode_forward_kv, r["kv_len_true"], advance),
        launched_steps=r["launched_steps"] + 1,
        prepared=zs.BoolVal(False),
        resolved=zs.BoolVal(False),
        accept_oldest=zs.If(slot_two, r["accept_oldest"], advance),
        accept_newest=zs.If(slot_two, advance, r["accept_newest"]),
        extend_inflight=zs.And(slot_two, r["extend_inflight"]),
    )
    if ctx.is_spec:
        post["published_seq_len"] = published
        if not ctx.overlap:  # run_batch re-applies new_seq_lens to SB
            post.update(seq_len=published, seq_len_cpu=published)
    if ctx.overlap and ctx.has("B6"):
        # A -future_indices sentinel (rows are >= 1); a non-spec prepare_for_decode reads it.
        post.update(seq_len=zs.IntVal(-1))
    guards = [r["prepared"]]
    if not ctx.has("B14"):
        guards.append(r["holds_kv"])  # the re-filter after early result processing
    if ctx.relay:
        guards.append(r["resolved"])
    accept_ok = zs.And(accept >= 1, accept <= r["max_accept_len"]) if ctx.is_spec else accept == 1
    return Step(zs.And(*guards, accept_ok), post, {"accept": accept})


def process_result(ctx: Context, r: Record, eos: Term, eos_at: Term) -> Step:
    """Pop the oldest in-flight step. Live: keep the run cut at EOS / max_new_tokens,
    settle committed once (spec) and release at finish; stale: only the pre-claim refund.
    The record's fields are the relation's (the run, compute_result_kv per forward mode,
    the finish with or without an EOS); the ghost's queue and the batch's re-filter are
    the model's."""
    cell = ctx.config.cell
    post = dict(r)
    extend = r["extend_inflight"]
    accept = zs.If(extend, 1, r["accept_oldest"])
    stale = zs.Not(is_live(r))
    budget = lift(tr.compute_output_budget, r["max_new_tokens"], r["output_len"], False)
    run = zs.If(eos, lift(tr.compute_run_len, accept, budget, eos_at),
                lift(tr.compute_run_len, accept, budget, None))
    committed = zs.If(extend, *(
        lift(relation.compute_result_kv, cell, mode, r["kv_committed_len"], r["accept_oldest"],
             run, stale, r["finished"], ctx.faults) for mode in ("extend", "decode")))
    output = zs.If(stale, r["output_len"], r["output_len"] + run)
    finishing = zs.And(zs.Not(stale), zs.If(
        eos, lift(finishes, eos_at, run, output, r["max_new_tokens"]),
        lift(finishes, None, run, output, r["max_new_tokens"])))
    with_kv = r["prompt_len"] + output - 1
    # B14: without the re-filter the finished request's prepared step stays in the batch.
    dropped = zs.BoolVal(False) if ctx.has("B14") else finishing
    cached = lift(relation.compute_release_cached, cell, committed, r["prompt_len"], output,
                  False, ctx.faults)
    _, released, released_holds = lift(release_kv, cell, committed, r["kv_allocated_len"])
    post.update(
        # A finished request's prepared, unlaunched step is dropped with it (the re-filter).
        kv_committed_len=committed,
        output_len=output,
        launched_steps=r["launched_steps"] - 1,
        accept_oldest=r["accept_newest"],
        extend_inflight=zs.BoolVal(False),
        inflight_steps=r["inflight_steps"] - 1 - zs.If(zs.And(dropped, r["prepared"]), 1, 0),
        prepared=zs.And(r["prepared"], zs.Not(dropped)),
        resolved=zs.And(r["resolved"], zs.Not(dropped)),
        settled_len=zs.If(
            zs.Or(stale, extend), r["settled_len"], r["settled_len"] + r["accept_oldest"]
        ),
        finished=zs.Or(r["finished"], finishing),
        holds_kv=zs.If(finishing, released_holds, r["holds_kv"]),
        # The finish release ends with ReqKvInfo.mark_kv_released.
        kv_allocated_len=zs.If(finishing, released, r["kv_allocated_len"]),
    )
    notes = {
        "run_len": run,
        "accept": accept,
        "stale": stale,
        "finishing": finishing,
        "cached": cached,
        "with_kv": with_kv,
        "extend": extend,
        "claimed": r["inflight_steps"] - 1,
    }
    guard = zs.And(r["launched_steps"] >= 1, eos_at >= 0, zs.Implies(eos, eos_at < accept))
    return Step(guard, post, notes)


def retract(ctx: Context, r: Record) -> Step:
    """release_req + reset_for_retract: committed = allocated = 0, row and pages freed;
    the ghost truth restarts (a late result of this request is stale). The relation's
    ghost starts a new epoch with nothing in flight; the model keeps the launched steps
    (their results still arrive, stale) and drops only the prepared one."""
    post = dict(r)
    committed, allocated, holds, retracted = lift(
        retract_kv, ctx.config.cell, r["kv_committed_len"], r["kv_allocated_len"])
    post.update(
        kv_committed_len=committed,
        kv_allocated_len=allocated,
        is_retracted=retracted,
        holds_kv=holds,
        page_count=zs.IntVal(0),
        kv_len_true=zs.IntVal(0),
        settled_len=zs.IntVal(0),
        inflight_steps=r["inflight_steps"] - zs.If(r["prepared"], 1, 0),
        prepared=zs.BoolVal(False),
        resolved=zs.BoolVal(False),
    )
    return Step(zs.And(is_live(r), zs.Not(r["prepared"])), post)


def readmit(ctx: Context, r: Record) -> Step:
    """A retracted request returns to the waiting queue's prefill (is_retracted cleared
    by prepare_for_extend)."""
    step = prepare_for_extend(ctx, r)
    return Step(
        zs.And(r["is_retracted"], zs.Not(r["holds_kv"]), r["launched_steps"] == 0), step.post
    )


TransitionBuilder = Callable[[Context, Record, str], Step]


def build_transition(name: str, ctx: Context, r: Record, prefix: str) -> list[Step]:
    """Every instance of a named per-request transition (one per adaptive rung)."""
    if name == "prepare_for_extend":
        return [prepare_for_extend(ctx, r)]
    if name == "prepare_for_decode":
        return [prepare_for_decode(ctx, r, shape) for shape in ctx.shapes]
    if name == "resolve_seq_lens_cpu":
        return [resolve_seq_lens_cpu(ctx, r)]
    if name == "launch":
        return [launch(ctx, r, zs.Int(f"{prefix}.accept"))]
    if name == "process_result":
        return [process_result(ctx, r, zs.Bool(f"{prefix}.eos"), zs.Int(f"{prefix}.eos_at"))]
    if name == "retract_decode":
        return [retract(ctx, r)]
    if name == "readmit":
        return [readmit(ctx, r)]
    raise KeyError(name)


def get_request_transitions(ctx: Context) -> tuple[str, ...]:
    names = ["prepare_for_extend", "prepare_for_decode"]
    if ctx.relay:
        names.append("resolve_seq_lens_cpu")
    names += ["launch", "process_result", "retract_decode", "readmit"]
    return tuple(names)
