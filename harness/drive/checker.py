"""InvariantChecker: the observer that checks every applicable invariant at every observation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from overlap_spec.harness.drive.mechanisms import MechanismTracker
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import INVARIANTS, Invariant, InvariantViolation
from overlap_spec.spec.state import Observation


@dataclass
class InvariantChecker:
    config: ModelConfig
    exercised: Counter[str] = field(default_factory=Counter)
    observations: int = 0
    applicable: tuple[Invariant, ...] = ()
    # The mechanisms the observations showed, per operation (harness.drive.mechanisms);
    # off where nobody reads them (the exhaustive search, whose state copies would make a
    # count meaningless anyway).
    track_mechanisms: bool = True
    mechanisms: MechanismTracker | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.applicable = tuple(inv for inv in INVARIANTS if inv.applies(self.config.cell))
        if self.track_mechanisms:
            self.mechanisms = MechanismTracker(self.config)

    def __call__(self, obs: Observation) -> None:
        """Check every applicable invariant; report all that fail at this observation."""
        self.observations += 1
        if self.mechanisms is not None:
            self.mechanisms(obs)
        failures: list[InvariantViolation] = []
        for inv in self.applicable:
            try:
                self.exercised[inv.id] += inv.check(self.config, obs)
            except InvariantViolation as violation:
                failures.append(violation)
        if failures:
            first = failures[0]
            where = f" (op {obs.step_index}, cell {self.config.name})"
            others = "".join(f"\n  also {f}" for f in failures[1:])
            raise InvariantViolation(first.invariant_id, first.message + where + others,
                                     all_ids=tuple(f.invariant_id for f in failures))


def describe_id_ranges(ids: Iterable[str]) -> str:
    """``SL1-SL11, KV1-KV12, ...``: the IDs given (``INVARIANT_IDS``: the registry's), as runs
    of consecutive numbers of one family, in their order. Nothing restates the ranges by hand."""
    runs: list[tuple[str, int, int]] = []  # (family, first number, last number)
    for invariant_id in ids:
        family = invariant_id.rstrip("0123456789")
        number = int(invariant_id[len(family):])
        if runs and runs[-1][0] == family and runs[-1][2] == number - 1:
            runs[-1] = (family, runs[-1][1], number)
        else:
            runs.append((family, number, number))
    return ", ".join(f"{family}{first}" + (f"-{family}{last}" if last > first else "")
                     for family, first, last in runs)
