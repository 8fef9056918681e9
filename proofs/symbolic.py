"""Run a spec ``compute_*`` function on Z3 terms: one definition, two interpretations.

The spec's transitions are plain Python over ints (``spec/transitions.py``). To
build the Z3 transition relation from the *same* definitions, :func:`lift` runs
the function with :class:`Sym` arguments: arithmetic builds Z3 terms, and every
branch on a symbolic comparison (an ``if``, ``min``, ``max``) forks the run. All
paths are explored depth first (each re-runs the function with a fixed prefix
of decisions) and the results are joined into one ``If`` chain guarded by the
path conditions. Concrete arguments (a cell, a page size) stay Python values,
so control that depends on them is decided as in the ordinary run; a Boolean term
argument (a request's ``finished`` flag) is a :class:`SymBool`, so branching on it forks.

Division follows Python (floor) for any non-zero divisor. ``tests/test_proofs.py``
evaluates every lifted function against the plain function on thousands of
concrete arguments, including those recorded from reference runs (the drift test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.solver import Term

MAX_PATHS = 256


class PathLimitError(RuntimeError):
    """The function branched on symbolic values more than :data:`MAX_PATHS` ways."""


class _Explorer:
    """Decides symbolic branches from a prefix, then records fresh decisions as True."""

    def __init__(self, prefix: list[bool]) -> None:
        self.prefix = prefix
        self.position = 0
        self.conditions: list[Term] = []

    def decide(self, condition: Term) -> bool:
        literal = zs.as_python(condition)
        if isinstance(literal, bool):
            return literal
        if self.position < len(self.prefix):
            choice = self.prefix[self.position]
        else:
            choice = True
            self.prefix.append(True)
        self.position += 1
        self.conditions.append(condition if choice else zs.Not(condition))
        return choice


def _term(value: object) -> Term:
    if isinstance(value, Sym):
        return value.term
    if isinstance(value, SymBool):
        return value.term
    if isinstance(value, bool):
        return zs.BoolVal(value)
    if isinstance(value, int):
        return zs.IntVal(value)
    if zs.is_term(value):
        return value
    raise TypeError(f"cannot lift {value!r} into a Z3 term")


class SymBool:
    """A symbolic truth value; ``bool()`` of it forks the run."""

    def __init__(self, explorer: _Explorer, term: Term) -> None:
        self.explorer = explorer
        self.term = term

    def __bool__(self) -> bool:
        return self.explorer.decide(self.term)


class Sym:
    """A symbolic integer: arithmetic builds terms, comparisons give :class:`SymBool`."""

    __hash__ = None  # type: ignore[assignment]  # compares symbolically

    def __init__(self, explorer: _Explorer, term: Term) -> None:
        self.explorer = explorer
        self.term = term

    def _wrap(self, term: Term) -> Sym:
        return Sym(self.explorer, term)

    def _bool(self, term: Term) -> SymBool:
        return SymBool(self.explorer, term)

    def __add__(self, other: object) -> Sym:
        return self._wrap(self.term + _term(other))

    def __radd__(self, other: object) -> Sym:
        return self._wrap(_term(other) + self.term)

    def __sub__(self, other: object) -> Sym:
        return self._wrap(self.term - _term(other))

    def __rsub__(self, other: object) -> Sym:
        return self._wrap(_term(other) - self.term)

    def __mul__(self, other: object) -> Sym:
        return self._wrap(self.term * _term(other))

    def __rmul__(self, other: object) -> Sym:
        return self._wrap(_term(other) * self.term)

    def __neg__(self) -> Sym:
        return self._wrap(-self.term)

    def __pos__(self) -> Sym:
        return self

    def __floordiv__(self, other: object) -> Sym:
        return self._wrap(_floor_div(self.term, _term(other)))

    def __rfloordiv__(self, other: object) -> Sym:
        return self._wrap(_floor_div(_term(other), self.term))

    def __mod__(self, other: object) -> Sym:
        divisor = _term(other)
        return self._wrap(self.term - divisor * _floor_div(self.term, divisor))

    def __lt__(self, other: object) -> SymBool:
        return self._bool(self.term < _term(other))

    def __le__(self, other: object) -> SymBool:
        return self._bool(self.term <= _term(other))

    def __gt__(self, other: object) -> SymBool:
        return self._bool(self.term > _term(other))

    def __ge__(self, other: object) -> SymBool:
        return self._bool(self.term >= _term(other))

    def __eq__(self, other: object) -> SymBool:  # type: ignore[override]
        return self._bool(self.term == _term(other))

    def __ne__(self, other: object) -> SymBool:  # type: ignore[override]
        return self._bool(self.term != _term(other))

    def __index__(self) -> int:
        raise TypeError("a symbolic integer cannot index a Python sequence")


def _floor_div(a: Term, b: Term) -> Term:
    """Python's ``a // b``: SMT ``div`` rounds so the remainder is >= 0, which is floor
    division for b > 0; for b < 0, a // b == (-a) // (-b)."""
    literal = zs.as_python(b)
    if isinstance(literal, int) and not isinstance(literal, bool):
        return a / b if literal > 0 else (-a) / (-b)
    return zs.If(b > 0, a / b, (-a) / (-b))


def _wrap_argument(explorer: _Explorer, value: object) -> object:
    if zs.is_term(value):
        literal = zs.as_python(value)
        if isinstance(literal, bool):
            return literal
        return SymBool(explorer, value) if zs.is_bool(value) else Sym(explorer, value)
    if isinstance(value, tuple):
        return tuple(_wrap_argument(explorer, v) for v in value)
    return value


def _result_term(value: object) -> Term | tuple[Any, ...]:
    if isinstance(value, tuple):
        return tuple(_result_term(v) for v in value)
    return _term(value)


def _join(paths: list[tuple[Term, Any]]) -> Any:
    """An ``If`` chain over the paths (the last path is the default: paths partition)."""
    guard, result = paths[-1]
    joined = result
    for guard, result in reversed(paths[:-1]):
        if isinstance(result, tuple):
            joined = tuple(_join_pair(guard, r, j) for r, j in zip(result, joined, strict=True))
        else:
            joined = zs.If(guard, result, joined)
    return joined


def _join_pair(guard: Term, a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return tuple(_join_pair(guard, x, y) for x, y in zip(a, b, strict=True))
    return zs.If(guard, a, b)


def lift(function: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """``function`` interpreted over Z3 terms: Z3 arguments become symbolic, the result
    is a term (or a tuple of terms) equal to the function's value on every input."""
    paths: list[tuple[Term, Any]] = []
    prefix: list[bool] = []
    while True:
        explorer = _Explorer(prefix)
        wrapped = [_wrap_argument(explorer, a) for a in args]
        named = {k: _wrap_argument(explorer, v) for k, v in kwargs.items()}
        result = function(*wrapped, **named)
        paths.append((zs.And(*explorer.conditions), _result_term(result)))
        if len(paths) > MAX_PATHS:
            raise PathLimitError(f"{function.__name__}: more than {MAX_PATHS} paths")
        # Depth first: flip the deepest True decision, drop what follows it.
        while prefix and not prefix[-1]:
            prefix.pop()
        if not prefix:
            break
        prefix[-1] = False
    return _join(paths)
