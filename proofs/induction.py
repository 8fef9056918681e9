"""Inductive proofs: initiation and consecution of every transition x invariant.

Per-request claims are proved over one symbolic request: every per-request
transition is element-wise (entry j of the post-batch depends only on entry j of
the pre-batch), so this is the unbounded-batch proof with the index left symbolic.
The transitions that reshape the batch (``filter_batch``, ``merge_batch``) are
proved over arrays with a symbolic length. Sum claims (SL1, SL3, RP3) are proved
for every batch size 0..N.

The strengthening conjuncts ``IND1``..``IND7`` (``proofs/claims.py``) are proved
inductive alongside the spec IDs, each in its own matrix row.
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
    build_transition,
    get_request_transitions,
    is_fresh,
    make_array_record,
    make_record,
    select,
)
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr

DEFAULT_BATCH_BOUND: Final = 16


@dataclass
class Obligation:
    """One matrix entry: a transition and an invariant, with its verdict and time."""

    transition: str
    invariant: str
    verdict: str
    seconds: float
    detail: str = ""
    counterexample: dict[str, int | bool] = field(default_factory=dict)


def initial_record(prefix: str) -> tuple[Record, Term]:
    """A newly admitted, waiting request: nothing held, nothing in flight."""
    r = make_record(prefix)
    constraints = zs.And(
        is_fresh(r),
        1 <= r["prompt_len"],
        1 <= r["max_new_tokens"],
    )
    return r, constraints


def _record(matrix: list[Obligation], transition: str, invariant: str, outcome: zs.Outcome) -> None:
    detail = ""
    if outcome.verdict == zs.COUNTEREXAMPLE:
        shown = {k: v for k, v in sorted(outcome.model.items()) if "!" not in k}
        detail = ", ".join(f"{k}={v}" for k, v in list(shown.items())[:24])
    elif outcome.verdict == zs.UNKNOWN:
        detail = f"solver: {outcome.reason}"
    matrix.append(
        Obligation(
            transition,
            invariant,
            outcome.verdict,
            outcome.seconds,
            detail,
            outcome.model if outcome.verdict == zs.COUNTEREXAMPLE else {},
        )
    )


def prove_initiation(ctx: Context, matrix: list[Obligation], timeout_ms: int) -> None:
    r, init = initial_record("init")
    preset = ctx.config.preset
    domain = zs.And(
        r["prompt_len"] <= preset.max_prompt_len, r["max_new_tokens"] <= preset.max_new_tokens
    )
    for inv in get_state_invariants(ctx):
        _record(matrix, "init", inv.id, zs.prove([init, domain], inv.predicate(ctx, r), timeout_ms))


def prove_request_transitions(ctx: Context, matrix: list[Obligation], timeout_ms: int) -> None:
    for name in get_request_transitions(ctx):
        r = make_record(f"{name}.pre")
        steps = build_transition(name, ctx, r, f"{name}.choice")
        hypothesis = get_strengthened(ctx, r)
        for inv in get_state_invariants(ctx):
            goal = zs.And(*[zs.Implies(s.guard, inv.predicate(ctx, s.post)) for s in steps])
            _record(matrix, name, inv.id, zs.prove([hypothesis], goal, timeout_ms))
        for point in POINT_INVARIANTS:
            if point.transition != name or not point.applies(ctx):
                continue
            goal = zs.And(*[zs.Implies(s.guard, point.predicate(ctx, r, s)) for s in steps])
            _record(matrix, name, point.id, zs.prove([hypothesis], goal, timeout_ms))


def prove_reshaping(ctx: Context, matrix: list[Obligation], timeout_ms: int) -> None:
    """filter_batch and merge_batch over arrays with a symbolic length."""
    i, j = zs.Int("i"), zs.Int("j")
    # filter_batch: post[j] = pre[keep[j]] for j < n', with keep[j] in [0, n).
    pre = make_array_record("filter.pre")
    n, n_post, keep = zs.Int("filter.n"), zs.Int("filter.n_post"), zs.IntArray("filter.keep")
    everyone = zs.ForAll(
        [i], zs.Implies(zs.And(0 <= i, i < n), get_strengthened(ctx, select(pre, i)))
    )
    picked = select(pre, keep[j])
    in_range = zs.And(0 <= j, j < n_post, n_post <= n, 0 <= keep[j], keep[j] < n)
    for inv in get_state_invariants(ctx):
        goal = zs.Implies(in_range, inv.predicate(ctx, picked))
        _record(matrix, "filter_batch", inv.id, zs.prove([everyone], goal, timeout_ms))
    # merge_batch: post[j] = left[j] if j < n1 else right[j - n1]; mirror kept iff both.
    left, right = make_array_record("merge.left"), make_array_record("merge.right")
    n1, n2 = zs.Int("merge.n1"), zs.Int("merge.n2")
    cpu1, cpu2 = zs.Bool("merge.cpu1"), zs.Bool("merge.cpu2")
    hyps = [
        zs.ForAll([i], zs.Implies(zs.And(0 <= i, i < n1), get_strengthened(ctx, select(left, i)))),
        zs.ForAll([i], zs.Implies(zs.And(0 <= i, i < n2), get_strengthened(ctx, select(right, i)))),
    ]
    merged = {name: zs.If(j < n1, left[name][j], right[name][j - n1]) for name in left}
    in_merged = zs.And(0 <= j, j < n1 + n2, 0 <= n1, 0 <= n2)
    for inv in get_state_invariants(ctx):
        goal = zs.Implies(in_merged, inv.predicate(ctx, merged))
        if inv.id == "SL2":
            # The mirror survives a merge only when both sides keep it (schedule_batch.py).
            goal = zs.Implies(zs.And(cpu1, cpu2), goal)
        _record(matrix, "merge_batch", inv.id, zs.prove(hyps, goal, timeout_ms))


# ----------------------------------------------------------------------------- sums
@dataclass
class BatchSum:
    """A batch of n entries for the sum claims: seq_lens, mirror, relay rows, flags."""

    n: int
    s: list[Term]
    sc: list[Term]
    pub: list[Term]
    has_cpu: Term
    sum_present: Term
    total: Term


def make_batch(prefix: str, n: int) -> BatchSum:
    return BatchSum(
        n,
        [zs.Int(f"{prefix}.s{j}") for j in range(n)],
        [zs.Int(f"{prefix}.sc{j}") for j in range(n)],
        [zs.Int(f"{prefix}.pub{j}") for j in range(n)],
        zs.Bool(f"{prefix}.has_cpu"),
        zs.Bool(f"{prefix}.sum_present"),
        zs.Int(f"{prefix}.sum"),
    )


def sl3(b: BatchSum) -> Term:
    """SL3: seq_lens_sum is None or the sum of the mirror (which then exists)."""
    return zs.Implies(b.sum_present, zs.And(b.has_cpu, b.total == zs.Sum(b.sc)))


def _sum_transitions(ctx: Context, b: BatchSum) -> dict[str, tuple[BatchSum, Term]]:
    """Batch-level effects on (seq_lens, mirror, sum) with their guards."""
    d_tok = max(shape.draft_tokens for shape in ctx.shapes)
    out: dict[str, tuple[BatchSum, Term]] = {}
    fills = [zs.Int(f"fill{j}") for j in range(b.n)]
    out["prepare_for_extend"] = (
        BatchSum(b.n, fills, fills, fills, zs.BoolVal(True), zs.BoolVal(True), zs.Sum(fills)),
        zs.BoolVal(True),
    )
    if ctx.is_spec:
        out["prepare_for_decode"] = (b, zs.BoolVal(True))
    else:
        bumped = [lift(tr.compute_decode_seq_len_ns, v) for v in b.s]
        bumped_cpu = [lift(tr.compute_decode_seq_len_ns, v) for v in b.sc]
        out["prepare_for_decode"] = (
            BatchSum(b.n, bumped, bumped_cpu, b.pub, b.has_cpu, zs.BoolVal(False), b.total),
            zs.BoolVal(True),
        )
    keep = [zs.Bool(f"keep{j}") for j in range(b.n)]
    kept_sum_terms = [zs.If(k, v, 0) for k, v in zip(keep, b.sc, strict=True)]
    # Filtered entries as "kept or zero": sums over the kept entries only.
    filtered = BatchSum(
        b.n,
        [zs.If(k, v, 0) for k, v in zip(keep, b.s, strict=True)],
        kept_sum_terms,
        b.pub,
        b.has_cpu,
        b.sum_present if ctx.has("B1") else zs.BoolVal(False),
        b.total,
    )
    out["filter_batch"] = (filtered, zs.BoolVal(True))
    if ctx.relay:
        if ctx.config.cell.needs_cpu_seq_lens:
            resolved = BatchSum(
                b.n, b.pub, b.pub, b.pub, zs.BoolVal(True), zs.BoolVal(True), zs.Sum(b.pub)
            )
        else:
            resolved = BatchSum(
                b.n, b.pub, b.sc, b.pub, zs.BoolVal(False), zs.BoolVal(False), b.total
            )
        out["resolve_seq_lens_cpu"] = (resolved, zs.BoolVal(True))
    if ctx.is_spec:
        accepts = [zs.Int(f"accept{j}") for j in range(b.n)]
        published = [
            lift(tr.compute_verify_new_seq_len, s, a) for s, a in zip(b.s, accepts, strict=True)
        ]
        ok = zs.And(*[zs.And(1 <= a, a <= ctx.config.max_accept_len) for a in accepts])
        if ctx.overlap:
            out["launch"] = (
                BatchSum(b.n, b.s, b.sc, published, b.has_cpu, b.sum_present, b.total),
                ok,
            )
        else:  # run_batch re-applies new_seq_lens; the host copy refreshes sum too
            out["launch"] = (
                BatchSum(
                    b.n, published, published, published, b.has_cpu, b.has_cpu, zs.Sum(published)
                ),
                ok,
            )
        if ctx.has("B7"):
            plus = list(lift(tr.compute_draft_extend_seq_lens, tuple(b.sc), d_tok))
            out["draft_extend"] = (
                BatchSum(
                    b.n,
                    list(lift(tr.compute_draft_extend_seq_lens, tuple(b.s), d_tok)),
                    plus,
                    b.pub,
                    b.has_cpu,
                    b.sum_present,
                    b.total,
                ),
                zs.BoolVal(True),
            )
        else:
            out["draft_extend"] = (b, zs.BoolVal(True))
    return out


def init_new_sum(ctx: Context, b: BatchSum) -> tuple[Term, Term]:
    """ForwardBatch.init_new: (FB sum present, FB sum) with the lazy-sum backfill."""
    backfill = zs.And(zs.Not(b.sum_present), b.has_cpu, zs.BoolVal(not ctx.has("B2")))
    present = zs.Or(b.sum_present, backfill)
    return present, zs.If(b.sum_present, b.total, zs.Sum(b.sc))


def prove_sums(ctx: Context, matrix: list[Obligation], bound: int, timeout_ms: int) -> None:
    """SL3 through every batch-level transition and merge; SL1 at init_new; n = 0..bound."""
    names = list(_sum_transitions(ctx, make_batch("probe", 0)))
    totals: dict[str, list[float]] = {
        name: [0.0, 0.0] for name in [*names, "merge_batch", "init_new"]
    }
    verdicts: dict[tuple[str, str], zs.Outcome] = {}

    def keep_worst(key: tuple[str, str], outcome: zs.Outcome) -> None:
        previous = verdicts.get(key)
        rank = {zs.PROVED: 0, zs.UNKNOWN: 1, zs.COUNTEREXAMPLE: 2}
        total = outcome.seconds + (previous.seconds if previous else 0.0)
        if previous is None or rank[outcome.verdict] > rank[previous.verdict]:
            verdicts[key] = zs.Outcome(outcome.verdict, total, outcome.reason, outcome.raw_model)
        else:
            previous.seconds = total

    for n in range(bound + 1):
        b = make_batch(f"b{n}", n)
        for name, (post, guard) in _sum_transitions(ctx, b).items():
            keep_worst((name, "SL3"), zs.prove([sl3(b), guard], sl3(post), timeout_ms))
        present, value = init_new_sum(ctx, b)
        sl1 = zs.Implies(b.has_cpu, zs.And(present, value == zs.Sum(b.sc)))
        keep_worst(("init_new", "SL1"), zs.prove([sl3(b)], sl1, timeout_ms))
        stale = [zs.Bool(f"b{n}.stale{j}") for j in range(n)]
        accepts = [zs.Int(f"b{n}.accept{j}") for j in range(n)]
        counted = [zs.BoolVal(True) if ctx.has("B4") else zs.Not(x) for x in stale]
        correct = zs.Sum([zs.If(c, a - 1, 0) for c, a in zip(counted, accepts, strict=True)])
        size = zs.Sum([zs.If(c, 1, 0) for c in counted])
        live_correct = zs.Sum([zs.If(x, 0, a - 1) for x, a in zip(stale, accepts, strict=True)])
        live_size = zs.Sum([zs.If(x, 0, 1) for x in stale])
        accepts_ok = zs.And(*[zs.And(1 <= a, a <= ctx.config.max_accept_len) for a in accepts])
        if ctx.is_spec:
            keep_worst(
                ("process_result", "RP3"),
                zs.prove(
                    [accepts_ok], zs.And(correct == live_correct, size == live_size), timeout_ms
                ),
            )
        for n1 in range(n + 1):
            left, right = make_batch(f"m{n}l", n1), make_batch(f"m{n}r", n - n1)
            merged = BatchSum(
                n,
                left.s + right.s,
                left.sc + right.sc,
                left.pub + right.pub,
                zs.And(left.has_cpu, right.has_cpu),
                left.sum_present if ctx.has("B1") else zs.BoolVal(False),
                left.total,
            )
            keep_worst(
                ("merge_batch", "SL3"), zs.prove([sl3(left), sl3(right)], sl3(merged), timeout_ms)
            )
    del totals
    for (name, inv), outcome in verdicts.items():
        _record(matrix, name, f"{inv}", outcome)


def prove_draft_extend(ctx: Context, matrix: list[Obligation], timeout_ms: int) -> None:
    """SL10: the ForwardBatch gets seq_lens + D_tok; the ScheduleBatch keeps its own."""
    s, sc = zs.Int("de.s"), zs.Int("de.sc")
    for shape in ctx.shapes:
        d_tok = shape.draft_tokens
        (fb,) = lift(tr.compute_draft_extend_seq_lens, (s,), d_tok)
        sb_after = (fb, sc + d_tok) if ctx.has("B7") else (s, sc)
        goal = zs.And(fb == s + d_tok, sb_after[0] == s, sb_after[1] == sc)
        _record(matrix, "draft_extend", "SL10", zs.prove([], goal, timeout_ms))


def prove_cell(
    ctx: Context, bound: int = DEFAULT_BATCH_BOUND, timeout_ms: int = zs.DEFAULT_TIMEOUT_MS
) -> list[Obligation]:
    """Every proof of one cell: the matrix rows, in a stable order."""
    matrix: list[Obligation] = []
    started = time.perf_counter()
    prove_initiation(ctx, matrix, timeout_ms)
    prove_request_transitions(ctx, matrix, timeout_ms)
    prove_reshaping(ctx, matrix, timeout_ms)
    prove_sums(ctx, matrix, bound, timeout_ms)
    if ctx.is_spec:
        prove_draft_extend(ctx, matrix, timeout_ms)
    del started
    return matrix


# ----------------------------------------------------------------------------- witnesses
def find_witnesses(ctx: Context, timeout_ms: int = zs.DEFAULT_TIMEOUT_MS) -> dict[str, str]:
    """For each encoded invariant, whether some transition from a strengthened state
    reaches a state that exercises it (its antecedent true): "sat" is a witness; a proof
    whose antecedent is never true would be vacuous."""
    from overlap_spec.proofs.claims import POINT_INVARIANTS as points
    from overlap_spec.proofs.model import get_extend_pending, is_live

    found: dict[str, str] = {}
    for name in get_request_transitions(ctx):
        r = make_record(f"w.{name}.pre")
        hypothesis = get_strengthened(ctx, r)
        for step in build_transition(name, ctx, r, f"w.{name}.choice"):
            for inv in get_state_invariants(ctx):
                if found.get(inv.id) == zs.SATISFIABLE:
                    continue
                antecedent = get_antecedent(inv.id, step.post)
                outcome = zs.check_sat([hypothesis, step.guard, antecedent], timeout_ms)
                found[inv.id] = outcome.verdict
            for point in points:
                if point.transition != name or not point.applies(ctx):
                    continue
                key = f"{point.id}@{name}"
                if found.get(key) == zs.SATISFIABLE:
                    continue
                p = step.post
                if point.id in ("KV8", "KV9", "KV10"):
                    antecedent = zs.And(is_live(p), zs.Not(get_extend_pending(p)))
                elif point.id == "RP1" and name == "process_result":
                    antecedent = zs.And(zs.Not(is_live(r)), zs.Not(r["extend_inflight"]))
                else:
                    antecedent = zs.BoolVal(True)
                found[key] = zs.check_sat([hypothesis, step.guard, antecedent], timeout_ms).verdict
    return found
