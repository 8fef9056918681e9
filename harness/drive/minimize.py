"""Shrinking a failing script to a smaller one that still trips the same invariant, so a
saved counterexample reads at a glance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    run_script,
)
from overlap_spec.spec.state import IterationChoices


def _still_fails(script: Script, invariant_id: str) -> bool:
    outcome = run_script(script)
    return outcome.violation is not None and invariant_id in outcome.violation.all_ids


def _simpler_ops(op: Op) -> list[Op]:
    """Candidate simplifications of one operation, simplest first."""
    if isinstance(op, Iterate):
        c = op.choices
        plain = IterationChoices(c.allow_prefill, 0, (1,), frozenset(), False, 0, 0)
        candidates = [
            replace(c, retract=0), replace(c, eos_positions=frozenset()),
            replace(c, accept_lens=(1,)), replace(c, disable_overlap=False),
            replace(c, spec_steps=0), replace(c, eos_offset=0),
            replace(c, allow_prefill=True), plain,
        ]
        return [Iterate(x) for x in candidates if x != c]
    if isinstance(op, Admit | AdmitPrebuilt):
        # Only real changes: a candidate equal to ``op`` "still fails" every time, which
        # would count as progress and rerun the passes until the budget is spent.
        admissions = [type(op)(1, op.max_new_tokens), type(op)(op.prompt_len, 2)]
        return [x for x in admissions if x != op]
    if isinstance(op, Abort):
        return [Abort(0)] if op.request else []
    return []


def minimize_script(script: Script, invariant_id: str, budget: int = 400,
                    still_fails: Callable[[Script], bool] | None = None) -> Script:
    """Delta debugging: drop runs of operations (halves first, then smaller runs down to
    single operations), then simplify the rest; same invariant (or whatever
    ``still_fails`` demands, for checkers other than the invariants).

    Dropping large runs first matters for the cost, not the result: each trial replays
    the whole script, and a trial that drops half of a 30-op script makes every later
    trial half as long (profiled: a gpu_impl kill took 187 one-op trials, 55 s).
    """
    if still_fails is None:
        def still_fails(trial: Script) -> bool:
            return _still_fails(trial, invariant_id)
    best = replace(script, ops=list(script.ops))
    runs = 0
    changed = True
    while changed and runs < budget:
        changed = False
        size = max(1, len(best.ops) // 2)
        while runs < budget:
            # From the end: late operations are the likeliest to be irrelevant.
            start = len(best.ops) - size
            while start >= 0 and runs < budget:
                trial = replace(best, ops=best.ops[:start] + best.ops[start + size:])
                runs += 1
                if trial.ops and still_fails(trial):
                    best, changed = trial, True
                start = min(start, len(best.ops) - size) - size
            if size == 1:
                break
            size = max(1, size // 2)
        for index, op in enumerate(list(best.ops)):
            for simpler in _simpler_ops(op):
                if runs >= budget:
                    break
                trial = replace(best, ops=best.ops[:index] + [simpler] + best.ops[index + 1:])
                runs += 1
                if still_fails(trial):
                    best, changed = trial, True
                    break
    return best
