"""Typed wrappers around Z3: one place that sets timeouts and reads verdicts.

z3-solver ships no type stubs, so the module is imported untyped here and every
other proofs/ module goes through these helpers or treats terms as ``Term``.
A solver that answers ``unknown`` (a timeout included) is reported as
``unknown``, never as proved.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Final

import z3  # type: ignore[import-untyped]

Term = Any  # a z3 expression (ArithRef / BoolRef / ArrayRef); z3 has no stubs

PROVED: Final = "proved"
COUNTEREXAMPLE: Final = "counterexample"
UNKNOWN: Final = "unknown"
NOT_APPLICABLE: Final = "n/a"
SATISFIABLE: Final = "sat"
UNSATISFIABLE: Final = "unsat"

DEFAULT_TIMEOUT_MS: Final = 20_000


@dataclass
class Outcome:
    """A solver answer: ``verdict`` is proved / counterexample / unknown (validity) or
    sat / unsat / unknown (satisfiability); ``model`` maps names to values when one exists."""

    verdict: str
    seconds: float
    reason: str = ""
    raw_model: Any = None

    @functools.cached_property
    def model(self) -> dict[str, int | bool]:
        # Read on first use: most sat answers are only asked for their verdict or for a
        # few terms (``evaluate``), and reading every name of a BMC model took longer
        # than the check itself (profiled: 0.29 s against 0.12 s per query).
        return {} if self.raw_model is None else _read_model(self.raw_model)


def Int(name: str) -> Term:  # noqa: N802 - mirrors z3's constructor names
    return z3.Int(name)


def Bool(name: str) -> Term:  # noqa: N802
    return z3.Bool(name)


def IntVal(value: int) -> Term:  # noqa: N802
    return z3.IntVal(value)


def BoolVal(value: bool) -> Term:  # noqa: N802
    return z3.BoolVal(value)


def IntArray(name: str) -> Term:  # noqa: N802
    return z3.Array(name, z3.IntSort(), z3.IntSort())


def BoolArray(name: str) -> Term:  # noqa: N802
    return z3.Array(name, z3.IntSort(), z3.BoolSort())


# The connectives below build straight through z3's C API when every argument is
# already a term of the right sort; z3's Python front end otherwise re-derives contexts,
# sorts and coercions on every call, which was most of the time to build a BMC
# unrolling. The term built is the same (the same Z3_mk_* call on the same arguments);
# anything else (Python values to coerce, mixed sorts) goes through z3's own function.


def _ast_array(terms: tuple[Term, ...]) -> Any:
    array = (z3.Ast * len(terms))()
    for index, term in enumerate(terms):
        array[index] = term.as_ast()
    return array


def _are_bools(terms: tuple[Term, ...]) -> bool:
    """Boolean terms (not quantifiers, not Python bools) of one context."""
    ctx = terms[0].ctx if terms else None
    return all(type(t) is z3.BoolRef and t.ctx is ctx for t in terms)


def _connective(terms: tuple[Term, ...], empty: bool, make: Any, fallback: Any) -> Term:
    """An n-ary And/Or: ``make`` (Z3_mk_and / Z3_mk_or) on Boolean terms, else z3's own."""
    if not terms:
        return z3.BoolVal(empty)
    if _are_bools(terms):
        ctx = terms[0].ctx
        return z3.BoolRef(make(ctx.ref(), len(terms), _ast_array(terms)), ctx)
    return fallback(*terms)


def And(*terms: Term) -> Term:  # noqa: N802
    return _connective(terms, True, z3.Z3_mk_and, z3.And)


def Or(*terms: Term) -> Term:  # noqa: N802
    return _connective(terms, False, z3.Z3_mk_or, z3.Or)


def Not(term: Term) -> Term:  # noqa: N802
    if type(term) is z3.BoolRef:
        return z3.BoolRef(z3.Z3_mk_not(term.ctx.ref(), term.as_ast()), term.ctx)
    return z3.Not(term)


def Implies(a: Term, b: Term) -> Term:  # noqa: N802
    if _are_bools((a, b)):
        return z3.BoolRef(z3.Z3_mk_implies(a.ctx.ref(), a.as_ast(), b.as_ast()), a.ctx)
    return z3.Implies(a, b)


def If(c: Term, a: Term, b: Term) -> Term:  # noqa: N802
    if type(c) is z3.BoolRef:
        for kind in (z3.ArithRef, z3.BoolRef):
            if isinstance(a, kind) and isinstance(b, kind) and a.ctx is b.ctx is c.ctx:
                ref = c.ctx.ref()
                a_sort, b_sort = z3.Z3_get_sort(ref, a.as_ast()), z3.Z3_get_sort(ref, b.as_ast())
                if z3.Z3_is_eq_sort(ref, a_sort, b_sort):
                    return kind(z3.Z3_mk_ite(ref, c.as_ast(), a.as_ast(), b.as_ast()), c.ctx)
    return z3.If(c, a, b)


def ForAll(variables: list[Term], body: Term) -> Term:  # noqa: N802
    return z3.ForAll(variables, body)


def Sum(terms: list[Term]) -> Term:  # noqa: N802
    return z3.Sum(terms) if terms else z3.IntVal(0)


def is_term(value: object) -> bool:
    return isinstance(value, z3.ExprRef)


def is_bool(term: Term) -> bool:
    return bool(z3.is_bool(term))


def simplify(term: Term) -> Term:
    return z3.simplify(term)


def substitute(term: Term, pairs: list[tuple[Term, Term]]) -> Term:
    return z3.substitute(term, *pairs) if pairs else term


def is_name(term: Term) -> bool:
    """An uninterpreted constant (a named variable), not a compound term or a literal."""
    return bool(z3.is_const(term) and term.decl().kind() == z3.Z3_OP_UNINTERPRETED)


def is_literal(term: Term) -> bool:
    """A numeral or true / false as built (no simplification: cheap)."""
    return bool(z3.is_int_value(term) or z3.is_true(term) or z3.is_false(term))


def as_python(term: Term) -> int | bool | None:
    """A ground term's value, or None when it is not a literal after simplification."""
    value = z3.simplify(term)
    if z3.is_int_value(value):
        return int(value.as_long())
    if z3.is_true(value):
        return True
    if z3.is_false(value):
        return False
    return None


def _read_model(model: Any) -> dict[str, int | bool]:
    values: dict[str, int | bool] = {}
    for decl in model.decls():
        if decl.arity() != 0:
            continue
        value = model[decl]
        if z3.is_int_value(value):
            values[decl.name()] = int(value.as_long())
        elif z3.is_true(value) or z3.is_false(value):
            values[decl.name()] = bool(z3.is_true(value))
    return values


def evaluate(raw_model: Any, term: Term) -> int | bool | None:
    """The value of ``term`` in a model (completing unconstrained names)."""
    return as_python(raw_model.eval(term, model_completion=True))


def check_sat(constraints: list[Term], timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Outcome:
    """Satisfiability of the conjunction: sat (with a model), unsat, or unknown.

    For the small queries of the inductive proofs (hundreds per cell, a transition and a
    claim each), on z3's plain SMT solver: ``z3.Solver()`` puts a tactic front end before
    it whose set-up and tear-down per query cost about a quarter of the proofs tier, with
    the same verdicts (measured on every cell). A query the size of a BMC unrolling wants
    that preprocessing: :class:`Preprocessed`."""
    solver = z3.SimpleSolver()
    solver.set("timeout", int(timeout_ms))
    solver.add(*constraints)
    return _run(solver)


def _run(solver: Any) -> Outcome:
    """Check ``solver`` once and read its answer; anything but sat / unsat is unknown."""
    started = time.perf_counter()
    answer = solver.check()
    seconds = time.perf_counter() - started
    if answer == z3.sat:
        return Outcome(SATISFIABLE, seconds, raw_model=solver.model())
    if answer == z3.unsat:
        return Outcome(UNSATISFIABLE, seconds)
    return Outcome(UNKNOWN, seconds, reason=str(solver.reason_unknown()))


def prove(hypotheses: list[Term], goal: Term, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Outcome:
    """Validity of ``hypotheses -> goal``: proved, counterexample (with a model) or unknown."""
    answer = check_sat([*hypotheses, z3.Not(goal)], timeout_ms)
    if answer.verdict == UNSATISFIABLE:
        return Outcome(PROVED, answer.seconds)
    if answer.verdict == SATISFIABLE:
        return Outcome(COUNTEREXAMPLE, answer.seconds, raw_model=answer.raw_model)
    return Outcome(UNKNOWN, answer.seconds, reason=answer.reason)


# Preprocessing before the SMT core: the BMC's frames are chained by equalities
# (fresh constant == term), which solve-eqs eliminates; z3's incremental core skips
# that preprocessing after a push, which made deep BMC queries about 8x slower.
PREPROCESS: Final = ("simplify", "propagate-values", "solve-eqs", "elim-uncnstr", "simplify")
# The SMT core's arithmetic after that preprocessing: z3's older simplex (arith.solver
# 2) answered the deepest K=6, B=3 BMC queries about twice as fast as the default
# (docs/proofs.md has the measurement).
CORE_PARAMS: Final = (("arith.solver", 2),)


class Preprocessed:
    """A solver grown frame by frame (BMC) whose ``check`` runs a fresh solver over
    everything added so far (plus ``extra``) through :data:`PREPROCESS` and then the
    SMT core with :data:`CORE_PARAMS`, under the timeout (unknown when it hits).
    z3's incremental (push / pop) core skips that preprocessing."""

    def __init__(self, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.terms: list[Term] = []
        self.timeout_ms = int(timeout_ms)

    def add(self, *terms: Term) -> None:
        self.terms.extend(terms)

    def check(self, extra: list[Term], timeout_ms: int | None = None) -> Outcome:
        limit = max(self.timeout_ms if timeout_ms is None else int(timeout_ms), 1)
        params = z3.ParamsRef()
        for key, value in CORE_PARAMS:
            params.set(key, value)
        tactic = z3.Then(*PREPROCESS, z3.WithParams(z3.Tactic("smt"), params))
        solver = z3.TryFor(tactic, limit).solver()
        solver.set("timeout", limit)
        solver.add(*self.terms, *extra)
        return _run(solver)
