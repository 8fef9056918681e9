"""Every invariant each saved counterexample trips, and every witness its clean run counts.

The kill matrix asks only whether each catalogue bug is caught by some invariant it
lists. Mutation testing of the reference (``bench/results/mutation-20261125.json``)
showed that a mutation of the reference's own instrumentation (the owner check FM5
reads, the uncovered rows FM2 reads, a witness count) leaves every bug caught by another
invariant, so the matrix cannot see it. This pins, for each script of the corpus
(``tests/data/mutant_scripts``):

- the faulted run, checked at every observation without stopping at the first
  violation: every (operation, invariant) that fails, or the crash that ends it;
- the clean run (the same operations, no fault): the witness count of every invariant.

A change of the model's behaviour or instrumentation shows as a changed fingerprint. If
the change is meant, regenerate and review the diff::

    .venv/bin/python tests/test_corpus_fingerprints.py
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from overlap_spec.harness.drive.script import apply_op, get_factory, load_script
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation
from overlap_spec.spec.state import Observation
from overlap_spec.spec.units import RequestId

CORPUS = Path(__file__).parent / "data" / "mutant_scripts"
PINNED = Path(__file__).parent / "data" / "corpus_fingerprints.json"


class _Collector:
    """Checks every applicable invariant at every observation and never raises."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.applicable = [inv for inv in INVARIANTS if inv.applies(config.cell)]
        self.step = 0
        self.violations: set[tuple[int, str]] = set()
        self.witnesses: Counter[str] = Counter()

    def __call__(self, obs: Observation) -> None:
        for inv in self.applicable:
            try:
                self.witnesses[inv.id] += inv.check(self.config, obs)
            except InvariantViolation:
                self.violations.add((self.step, inv.id))


def _run(path: Path, faulted: bool) -> _Collector:
    script = load_script(path)
    if not faulted:
        script = replace(script, faults=())
    config = script.get_config()
    collector = _Collector(config)
    model = get_factory(script.implementation)(config, frozenset(script.faults), collector)
    admitted: list[RequestId] = []
    for index, op in enumerate(script.ops):
        collector.step = index
        model.set_step_index(index)
        try:
            apply_op(model, op, admitted)
        except Exception as error:  # a crash ends the run; it is part of the fingerprint
            collector.violations.add((index, f"crash {type(error).__name__}"))
            break
    return collector


def compute_fingerprint(path: Path) -> dict[str, Any]:
    faulted, clean = _run(path, True), _run(path, False)
    return {"violations": [f"op {step}: {what}" for step, what in sorted(faulted.violations)],
            "clean_violations": [f"op {s}: {w}" for s, w in sorted(clean.violations)],
            "clean_witnesses": dict(sorted((k, v) for k, v in clean.witnesses.items() if v))}


SCRIPTS = sorted(p.name for p in CORPUS.glob("*.json"))


def test_every_saved_counterexample_is_pinned() -> None:
    assert sorted(json.loads(PINNED.read_text())) == SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_counterexample_trips_and_witnesses_what_is_pinned(name: str) -> None:
    pinned = json.loads(PINNED.read_text())[name]
    found = compute_fingerprint(CORPUS / name)
    assert found["violations"], f"{name}: the bug no longer trips anything"
    assert found["clean_violations"] == [], f"{name}: the clean model fails"
    assert found == pinned, (
        f"{name}: the fingerprint changed; if meant, regenerate with "
        f"'python tests/test_corpus_fingerprints.py' and review the diff")


if __name__ == "__main__":
    PINNED.write_text(json.dumps({n: compute_fingerprint(CORPUS / n) for n in SCRIPTS},
                                 indent=1) + "\n")
    print(f"written: {PINNED}", file=sys.stderr)
