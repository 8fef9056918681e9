"""One verdict vocabulary and one report object for every tier of ``overlap-spec check``.

Each tier keeps the words natural to it for its items (a mutant is *killed*, a proof
obligation *proved*, a trace *ok*), and says what each word means here through
:data:`ITEM_VERDICTS`; its overall result is a :class:`TierReport` with a :class:`Verdict`.
:class:`CheckReport` holds the tiers of one run and is the only place that decides
whether the run passed, and the one place that turns that into an exit code
(:attr:`CheckReport.exit_code`).

Exit codes, for every command that reports a verdict: 0 clean; 1 a violation, a crash, a
vacuous check or an inconclusive one; 2 a usage error, found before any work (raised as
``UsageError``, never a report); 3 the upstream tier cannot drive the sglang it was given
(it does not import, or a name the tier relies on is missing or has another signature:
``upstream/compat.py``) and nothing else failed; 130 interrupted.
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
    # The upstream tier cannot drive the sglang given (upstream/compat.py): nothing was
    # checked, so never a pass; exit 3 when it is the only failure.
    CANNOT_DRIVE = "cannot-drive"

    @property
    def fails_run(self) -> bool:
        return self in (Verdict.FAIL, Verdict.VACUOUS, Verdict.INCONCLUSIVE,
                        Verdict.CANNOT_DRIVE)


# The item-level words of each tier, in the one vocabulary.
ITEM_VERDICTS: dict[str, Verdict] = {
    "pass": Verdict.PASS, "ok": Verdict.PASS, "killed": Verdict.PASS, "proved": Verdict.PASS,
    "fail": Verdict.FAIL, "violation": Verdict.FAIL, "survived": Verdict.FAIL,
    "counterexample": Verdict.FAIL, "other-id": Verdict.FAIL, "vacuous": Verdict.VACUOUS,
    "inconclusive": Verdict.INCONCLUSIVE, "unknown": Verdict.INCONCLUSIVE,
    "error": Verdict.INCONCLUSIVE, "n/a": Verdict.NOT_APPLICABLE, "skipped": Verdict.SKIPPED,
    "cannot-drive": Verdict.CANNOT_DRIVE,
}

EXIT_CLEAN = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANNOT_DRIVE = 3
EXIT_INTERRUPTED = 130


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
    for worst in (Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.VACUOUS, Verdict.CANNOT_DRIVE):
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

    @property
    def exit_code(self) -> int:
        """130 interrupted; 0 passed; 3 when the only failing tiers could not drive their
        sglang; 1 otherwise (a violation anywhere outranks an undrivable sglang)."""
        if self.interrupted is not None:
            return EXIT_INTERRUPTED
        failing = [t.verdict for t in self.tiers if t.verdict.fails_run]
        if not failing:
            return EXIT_CLEAN
        if all(v is Verdict.CANNOT_DRIVE for v in failing):
            return EXIT_CANNOT_DRIVE
        return EXIT_FAILED

    def closing_line(self) -> str:
        parts = ", ".join(t.summary for t in self.tiers)
        word = ("INTERRUPTED (report incomplete)" if self.interrupted
                else "OK" if self.ok
                else "CANNOT DRIVE SGLANG" if self.exit_code == EXIT_CANNOT_DRIVE
                else "FAILED")
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
