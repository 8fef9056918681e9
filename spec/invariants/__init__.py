"""The invariants, one predicate per ID of digest section 4, one module per family: ``sl``
(sequence-length mirror), ``kv`` (KV accounting), ``fm`` (FutureMap relay), ``st`` (stream
ordering), ``rp`` (result processing), ``rx`` (the radix prefix cache); ``registry`` holds
what they share. ``st`` also says which stream claim a race breaks (``classify_race``), for
FM and ST alike.

Each ``check_*`` takes the model configuration and one :class:`Observation`, raises
:class:`InvariantViolation` naming the ID, the request and both values when the claim is
false, and otherwise returns how many instances it checked at this observation (0 means the
observation did not exercise it). Whether an ID applies to a cell at all is
``Invariant.applies``; where it does not, reports say "n/a".

An invariant is written once, in its family's module: ``@invariant(ID, **switches)`` on its
predicate names its ID and the cells it applies to (``Cell`` switches), and its docstring
gives its one-line claim, the claim in full and its upstream source (``registry``).
``INVARIANTS`` is a tuple of :class:`Invariant` in family order (``registry.FAMILIES``),
then by number: the order checkers run them and reports list them in. For
the claims by ID use ``INVARIANTS_BY_ID`` (a mapping from ID to :class:`Invariant`) or
``get_invariant(ID)``, which names the known IDs when given an unknown one.
"""

from collections.abc import Mapping
from typing import Final

from overlap_spec.spec.invariants import fm, kv, rp, rx, sl, st
from overlap_spec.spec.invariants.registry import REGISTERED, Invariant, InvariantViolation
from overlap_spec.spec.invariants.rp import check_rp4
from overlap_spec.spec.invariants.st import classify_race

__all__ = ["INVARIANTS", "INVARIANTS_BY_ID", "INVARIANT_IDS", "Invariant", "InvariantViolation",
           "check_rp4", "classify_race", "fm", "get_invariant", "kv", "rp", "rx", "sl", "st"]

# The claims in report order (a tuple: iterate it); INVARIANTS_BY_ID, the same by ID.
INVARIANTS: Final[tuple[Invariant, ...]] = tuple(REGISTERED)
INVARIANTS_BY_ID: Final[Mapping[str, Invariant]] = {inv.id: inv for inv in INVARIANTS}
INVARIANT_IDS: Final = tuple(INVARIANTS_BY_ID)


def get_invariant(invariant_id: str) -> Invariant:
    """The invariant of ``invariant_id`` (``INVARIANTS_BY_ID``); a :class:`KeyError` naming
    the known IDs when there is none."""
    if invariant_id not in INVARIANTS_BY_ID:
        raise KeyError(f"unknown invariant {invariant_id!r}; known: {', '.join(INVARIANT_IDS)}")
    return INVARIANTS_BY_ID[invariant_id]
