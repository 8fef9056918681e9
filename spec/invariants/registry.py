"""What every invariant family shares: the registry, the failure and the cells a claim
applies to.

An invariant is written once, as its predicate in its family's module. ``@invariant(ID,
**switches)`` names it and the cells it is checked in (``is_spec=True, overlap=True``: the
cells whose ``Cell.is_spec`` and ``Cell.overlap`` are true; elsewhere it is n/a); its
docstring gives the rest: a one-line claim, a blank line, the claim in full, a blank line
and ``Source:`` with the upstream files and PRs. Nothing else restates them: the package's
``INVARIANTS``, ``overlap-spec invariants``, the reports, the proofs' claims and the ID
ranges read this registry, and a docstring without its parts fails at import.
"""

import sys
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from overlap_spec.spec.config import Cell, ModelConfig, enumerate_cells
from overlap_spec.spec.state import Observation

# The families, in report order: SL (sequence-length mirror), KV (KV accounting), FM
# (FutureMap relay), ST (stream ordering), RP (result processing), RX (the radix prefix
# cache). An ID is a family and a number; INVARIANTS is in that order, whichever family
# module registers first.
FAMILIES: Final = ("SL", "KV", "FM", "ST", "RP", "RX")


class InvariantViolation(AssertionError):
    """A checked claim is false. ``str()`` reads like the report line."""

    def __init__(self, invariant_id: str, message: str, all_ids: tuple[str, ...] = ()) -> None:
        super().__init__(f"{invariant_id} violated {message}")
        self.invariant_id = invariant_id
        self.message = message
        self.all_ids = all_ids or (invariant_id,)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, so a violation crosses a process boundary intact.
        return (type(self), (self.invariant_id, self.message, self.all_ids), self.__dict__)


def fail(invariant_id: str, obs: Observation, message: str) -> InvariantViolation:
    return InvariantViolation(invariant_id, f"{message} at {obs.point.value}")


Check = Callable[[ModelConfig, Observation], int]


@dataclass(frozen=True)
class Invariant:
    """One claim: ``check`` returns how many instances it judged at an observation (0: the
    observation did not exercise it) and raises :class:`InvariantViolation` when the claim
    is false; ``applies`` says in which cells it is checked at all (elsewhere: n/a)."""

    id: str
    claim: str  # one line, the tables' column
    statement: str  # the claim in full
    source: str  # the upstream files, functions and PRs
    cells: str  # where it applies: "every cell", "cells with is_spec and not overlap", ...
    applies: Callable[[Cell], bool]
    check: Check

    def describe(self) -> str:
        """``ID: the claim in full (its source).``: what a report prints as its claim."""
        return f"{self.id}: {self.statement.rstrip('.')} ({self.source})."


def get_id_key(invariant_id: str) -> tuple[int, int]:
    """The report order of an ID: its family's place in :data:`FAMILIES`, then its number;
    a :class:`ValueError` for an ID that is not a family and a number."""
    family = invariant_id.rstrip("0123456789")
    if family not in FAMILIES or not invariant_id[len(family):].isdigit():
        raise ValueError(f"invariant ID {invariant_id!r}: not one of {FAMILIES} and a number")
    return FAMILIES.index(family), int(invariant_id[len(family):])


REGISTERED: Final[list[Invariant]] = []  # in report order: get_id_key


def invariant(invariant_id: str, **switches: bool) -> Callable[[Check], Check]:
    """Registers the predicate it decorates as ``invariant_id``, with the claim, statement and
    source of its docstring (:func:`get_docstring_parts`), checked in the cells whose ``Cell``
    attributes have the values ``switches`` gives (none: every cell; elsewhere it is n/a)."""
    def applies(cell: Cell) -> bool:
        return all(getattr(cell, name) == value for name, value in switches.items())
    applies(enumerate_cells()[0])  # an attribute Cell lacks fails here, at import
    cells = " and ".join(name if value else f"not {name}" for name, value in switches.items())
    cells = f"cells with {cells}" if cells else "every cell"

    def register(check: Check) -> Check:
        parts = get_docstring_parts(invariant_id, check.__doc__)
        insort(REGISTERED, Invariant(invariant_id, *parts, cells, applies, check),
               key=lambda inv: get_id_key(inv.id))
        return check
    return register


def get_docstring_parts(invariant_id: str, doc: str | None) -> tuple[str, str, str]:
    """(claim, statement, source) of a predicate's docstring; a :class:`ValueError` naming the
    ID when a part is missing. ``python -OO`` strips docstrings: placeholders then."""
    text = "(stripped by python -OO)\n\n-\n\nSource: -" if sys.flags.optimize > 1 else doc
    parts = [" ".join(part.split()) for part in (text or "").split("\n\n")]
    if len(parts) < 3 or not parts[-1].startswith("Source: "):
        raise ValueError(f"{invariant_id}'s docstring is not a one-line claim, the claim in full "
                         "and 'Source: ...', as paragraphs")
    return parts[0], " ".join(parts[1:-1]), parts[-1].removeprefix("Source: ").rstrip(".")
