"""One verdict vocabulary and one report object for every tier of ``overlap-spec check``.

Each tier keeps the words natural to it for its items (a mutant is *killed*, a proof
obligation *proved*, a trace *ok*), and says what each word means here through
:data:`ITEM_VERDICTS`; its overall result is a :class:`TierReport` with a :class:`Verdict`.
:class:`CheckReport` holds the tiers of one run and is the only place that decides
whether the run passed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

REPORT_VERSION = 1


class Verdict(enum.StrEnum):
    """What a check concluded. Only PASS counts as evidence; N/A and SKIPPED do not fail a
    run but are reported as what they are, never as a pass."""

    PASS = "pass"
    FAIL = "fail"
    VACUOUS = "vacuous"  # applicable, but nothing was checked: no witness
    INCONCLUSIVE = "inconclusive"  # a crash, a solver timeout or "unknown"
    NOT_APPLICABLE = "n/a"
    SKIPPED = "skipped"

    @property
    def fails_run(self) -> bool:
        return self in (Verdict.FAIL, Verdict.VACUOUS, Verdict.INCONCLUSIVE)


# The item-level words of each tier, in the one vocabulary.
ITEM_VERDICTS: dict[str, Verdict] = {
    "pass": Verdict.PASS, "ok": Verdict.PASS, "killed": Verdict.PASS, "proved": Verdict.PASS,
    "fail": Verdict.FAIL, "violation": Verdict.FAIL, "survived": Verdict.FAIL,
    "counterexample": Verdict.FAIL, "other-id": Verdict.FAIL, "vacuous": Verdict.VACUOUS,
    "inconclusive": Verdict.INCONCLUSIVE, "unknown": Verdict.INCONCLUSIVE,
    "error": Verdict.INCONCLUSIVE, "n/a": Verdict.NOT_APPLICABLE, "skipped": Verdict.SKIPPED,
}


def as_verdict(word: str) -> Verdict:
    """A tier's word as a :class:`Verdict`; an unknown word is an error, never a pass."""
    try:
        return ITEM_VERDICTS[word]
    except KeyError:
        raise ValueError(f"no verdict is called {word!r}") from None


def combine(verdicts: list[Verdict]) -> Verdict:
    """The verdict of several checks: the worst one; all n/a is n/a; nothing is skipped."""
    if not verdicts:
        return Verdict.SKIPPED
    for worst in (Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.VACUOUS):
        if worst in verdicts:
            return worst
    if all(v is Verdict.NOT_APPLICABLE for v in verdicts):
        return Verdict.NOT_APPLICABLE
    if all(v in (Verdict.SKIPPED, Verdict.NOT_APPLICABLE) for v in verdicts):
        return Verdict.SKIPPED
    return Verdict.PASS


@dataclass(frozen=True)
class TierReport:
    """One tier's result: its verdict, the phrase the closing line shows, why it was skipped
    or failed (if it was), and its section of the JSON report."""

    name: str
    verdict: Verdict
    summary: str
    section: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    seconds: float | None = None  # wall time of the tier, when it ran

    @classmethod
    def skipped(cls, name: str, reason: str) -> TierReport:
        return cls(name, Verdict.SKIPPED, f"{name} skipped",
                   {name: {"status": "skipped", "reason": reason}}, reason)


@dataclass
class CheckReport:
    """The tiers of one ``check`` run, in the order they ran."""

    seed: int
    profile: str
    tiers: list[TierReport] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: str | None = None  # the tier a Ctrl-C stopped; the report is incomplete

    def add(self, tier: TierReport) -> TierReport:
        self.tiers.append(tier)
        return tier

    def interrupt(self, tier: str) -> None:
        """Ctrl-C inside ``tier``: it is inconclusive, the tiers after it never ran."""
        self.interrupted = tier
        self.add(TierReport(tier, Verdict.INCONCLUSIVE, f"{tier} interrupted",
                            {tier: {"status": "interrupted"}}, "interrupted (Ctrl-C)"))

    @property
    def ok(self) -> bool:
        return self.interrupted is None and not any(t.verdict.fails_run for t in self.tiers)

    def closing_line(self) -> str:
        parts = ", ".join(t.summary for t in self.tiers)
        word = ("INTERRUPTED (report incomplete)" if self.interrupted
                else "OK" if self.ok else "FAILED")
        return (f"{word}: {parts}, seed {self.seed}, "
                f"profile {self.profile}, {self.elapsed_s:.1f}s")

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "version": REPORT_VERSION,
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 3),
            "seed": self.seed,
            "profile": self.profile,
            **({"incomplete": True, "interrupted": self.interrupted}
               if self.interrupted else {}),
            "tiers": {t.name: {"verdict": t.verdict.value, "summary": t.summary,
                               **({"reason": t.reason} if t.reason else {}),
                               **({"seconds": round(t.seconds, 3)}
                                  if t.seconds is not None else {})}
                      for t in self.tiers},
        }
        for tier in self.tiers:
            document.update(tier.section)
        return document
