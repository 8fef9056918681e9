"""The Hypothesis tier's report: the invariant x cell table for a terminal, its JSON
section, and its :class:`~overlap_spec.harness.verdict.TierReport`."""

from __future__ import annotations

import json
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import hypothesis

from overlap_spec.harness.drive.cells import CONFIG_WIDTH
from overlap_spec.harness.drive.mechanisms import MECHANISMS, render_mechanisms
from overlap_spec.harness.drive.stateful import CellResult, describe_failure
from overlap_spec.harness.drive.witness import group_reasons
from overlap_spec.harness.verdict import TierReport, Verdict
from overlap_spec.spec.invariants import INVARIANTS

PASS, FAIL, NOT_APPLICABLE, VACUOUS = (Verdict.PASS, Verdict.FAIL, Verdict.NOT_APPLICABLE,
                                       Verdict.VACUOUS)
SYMBOLS = {PASS: ".", FAIL: "X", NOT_APPLICABLE: "-", VACUOUS: "0"}


def get_verdicts(results: list[CellResult]) -> dict[str, dict[str, Verdict]]:
    """invariant ID -> cell name -> pass / fail / n/a / vacuous.

    Vacuous: the invariant applies to the cell but no observation of the run gave
    it anything to check (no witness), though the cell's deterministic witnesses claim
    it (or the run replayed none). That is a failure, never a pass. An invariant the
    witnesses give a reason for having no witness at these sizes (``na_reasons``), and
    the search did not reach either, is n/a.
    """
    verdicts: dict[str, dict[str, Verdict]] = {inv.id: {} for inv in INVARIANTS}
    for result in results:
        cell = result.config.name
        failed = set(result.failed_ids)
        for inv in INVARIANTS:
            if not inv.applies(result.config.cell):
                verdict = NOT_APPLICABLE
            elif inv.id in failed or result.error is not None:
                verdict = FAIL
            elif result.ok and result.exercised.get(inv.id, 0) == 0:
                verdict = NOT_APPLICABLE if inv.id in result.na_reasons else VACUOUS
            else:
                verdict = PASS
            verdicts[inv.id][cell] = verdict
    return verdicts


def get_cell_columns(results: list[CellResult]) -> dict[str, list[CellResult]]:
    """The table's columns: one per cell, holding its results at every size set it ran
    with (the default run's size variants), in run order."""
    columns: dict[str, list[CellResult]] = {}
    for result in results:
        columns.setdefault(result.config.cell.name, []).append(result)
    return columns


# A column's verdict over its size sets: the worst, a pass over an n/a.
_RANK = {FAIL: 3, VACUOUS: 2, PASS: 1, NOT_APPLICABLE: 0}


def render_table(results: list[CellResult]) -> str:
    verdicts = get_verdicts(results)
    width = max([CONFIG_WIDTH, *(len(r.config.name) for r in results)])
    columns = get_cell_columns(results)
    by_cell = len(columns) != len(results)
    lines = ["cells:" if not by_cell else
             "cells (each with the size sets it ran at; the table's column is the cell, its "
             "worst verdict over them):"]
    for k, members in enumerate(columns.values(), 1):
        for index, result in enumerate(members):
            status = "ok" if result.ok else "FAILED"
            label = f"c{k:02d}" if index == 0 else "   "
            lines.append(f"  {label} {result.config.name:<{width}} "
                         f"{result.seconds:6.2f}s  {status}")
    header = "ID    " + "".join(f"{k:>3d}" for k in range(1, len(columns) + 1))
    lines += ["", "invariant x cell ('.' pass, 'X' fail, '-' n/a, '0' vacuous: no witness):",
              header]
    for inv in INVARIANTS:
        worst = [max((verdicts[inv.id][r.config.name] for r in members),
                     key=_RANK.__getitem__) for members in columns.values()]
        row = "".join(f"{SYMBOLS[verdict]:>3}" for verdict in worst)
        lines.append(f"{inv.id:<6}{row}   {inv.claim}")
    nowhere = [inv.id for inv in INVARIANTS
               if not any(inv.applies(r.config.cell) for r in results)]
    if nowhere:  # said, not left to a row of '-'
        lines.append(f"n/a in every cell of this run: {', '.join(nowhere)}")
        if any(i.startswith("RX") for i in nowhere):
            lines.append("  RX applies to the radix cells only, none of which this run selected "
                         "(the default run holds them; 'overlap-spec cells --radix' lists them)")
    lines += ["", render_mechanisms(get_mechanism_counts(results))]
    failures = render_failures(results)
    na = render_na_reasons(results)
    return "\n".join(lines + ([""] + na.splitlines() if na else [])
                     + ([""] + failures.splitlines() if failures else []))


def get_mechanism_counts(results: list[CellResult]) -> dict[str, int]:
    """Operations per mechanism over every cell and size set of the run."""
    total: Counter[str] = Counter()
    for result in results:
        total.update(result.mechanisms)
    return {m.id: total.get(m.id, 0) for m in MECHANISMS}


def _shape(head: str, text: str) -> str:
    text = re.sub(r"\s*\((op|step) \d+, cell [^)]*\)", "", text)
    return f"{head}: {re.sub(r'[0-9]+', 'N', text)}"


def get_failure_signature(result: CellResult) -> str:
    """What makes two cells' failures the same failure: the first invariant's message
    (or the crash's type and message) with its numbers blanked and the position (op,
    cell) left out; the other invariants the same state broke do not count here."""
    if result.violation is not None:
        head, text = result.violation.invariant_id, result.violation.message
    else:
        head, text = f"crash {type(result.error).__name__}", str(result.error)
    return _shape(head, (text.splitlines() or [""])[0])


def get_all_signatures(result: CellResult) -> set[str]:
    """The signature of every invariant the failing state broke, the first and each
    "also" line, in the same form as :func:`get_failure_signature`."""
    found = {get_failure_signature(result)}
    if result.violation is not None:
        for line in result.violation.message.splitlines()[1:]:
            also = re.match(r"\s*also (\w+) violated (.*)$", line)
            if also is not None:
                found.add(_shape(also.group(1), also.group(2)))
    return found


def group_failures(results: list[CellResult]) -> list[list[CellResult]]:
    """One group per distinct failure. A failure whose state also broke the first
    invariant of a larger group, in the same words, joins that group: one bug met
    first through different invariants in different cells reads as one block (the
    block names the other first invariants). Otherwise by :func:`get_failure_signature`."""
    by_head: dict[str, list[CellResult]] = {}
    for result in results:
        if not result.ok:
            by_head.setdefault(get_failure_signature(result), []).append(result)
    groups: dict[str, list[CellResult]] = {}
    for head, members in by_head.items():
        for result in members:
            shared = [h for h in by_head if h in get_all_signatures(result)]
            target = max(shared, key=lambda h: (len(by_head[h]), h == head))
            groups.setdefault(target, []).append(result)
    order = {id(result): index for index, result in enumerate(results)}
    return [sorted(members, key=lambda r: order[id(r)]) for members in groups.values()]


def render_failures(results: list[CellResult]) -> str:
    """One block per distinct failure (:func:`group_failures`), listing the cells it
    occurred in; the block shows the smallest counterexample among the cells whose
    first invariant is the group's (fewest requests, then ops)."""
    groups = group_failures(results)
    if not groups:
        return ""
    count = sum(len(g) for g in groups)
    lines = [f"failures: {len(groups)} distinct, in {count} cell{'s' * (count != 1)}"]
    for number, members in enumerate(groups, 1):
        head = max({get_failure_signature(r) for r in members},
                   key=lambda h: sum(get_failure_signature(r) == h for r in members))
        leading = [r for r in members if get_failure_signature(r) == head]
        shown = min(leading, key=lambda r: (r.script.count_requests(), len(r.script.ops))
                    if r.script is not None else (1 << 30, 1 << 30))
        names = [r.config.name for r in members]
        lines += textwrap.wrap(f"[{number}] in {len(names)} cell{'s' * (len(names) != 1)}: "
                               + ", ".join(names), width=100, subsequent_indent="    ",
                               break_on_hyphens=False)
        others = sorted({r.failed_ids[0] for r in members if r not in leading and r.failed_ids})
        if others:
            lines += textwrap.wrap(
                f"    (in {len(members) - len(leading)} of them the same state failed "
                f"{', '.join(others)} first: replay their scripts for those)", width=100,
                subsequent_indent="    ")
        lines += ["    " + line for line in describe_failure(shown).splitlines()]
    return "\n".join(lines)


def get_na_reasons(result: CellResult) -> dict[str, str]:
    """The applicable invariants left n/a in this cell for want of a witness at its sizes,
    with the reason (those the search reached after all are not among them)."""
    return {inv: reason for inv, reason in sorted(result.na_reasons.items())
            if not result.exercised.get(inv, 0)}


def render_na_reasons(results: list[CellResult]) -> str:
    """One line per (invariant, reason) with its cells: what has no witness at these sizes
    and why (n/a, not a pass); then any witness that no longer exercised what it claims."""
    # An invariant another size set of the same cell reached is no gap of the cell (the
    # default run's variants): only what no size set of the cell reached is listed.
    reached: dict[str, set[str]] = {}
    for result in results:
        reached.setdefault(result.config.cell.name, set()).update(
            inv for inv, count in result.exercised.items() if count)
    grouped = group_reasons({r.config.name: {inv: reason for inv, reason in
                                             get_na_reasons(r).items()
                                             if inv not in reached[r.config.cell.name]}
                             for r in results})
    lines = ["n/a for want of a witness at these sizes (not a pass):"] if grouped else []
    for inv, reason, cells in grouped:
        where = cells[0] if len(cells) == 1 else f"{len(cells)} cells: {', '.join(cells)}"
        lines += textwrap.wrap(f"  {inv} in {where}: {reason}", width=100,
                               subsequent_indent="      ", break_on_hyphens=False)
    for result in results:
        for index, claims in sorted(result.witnesses_lost.items()):
            lines.append(f"witness {index} of {result.config.name} ({result.witness_source}) "
                         f"no longer exercises {', '.join(claims)} (vacuous unless the "
                         "search reached it: 'overlap-spec witnesses' says more)")
    return "\n".join(lines)


def is_clean(results: list[CellResult]) -> bool:
    """Every cell ran clean and every applicable invariant had a witness."""
    verdicts = get_verdicts(results)
    return all(r.ok for r in results) and not any(
        v in (FAIL, VACUOUS) for per_cell in verdicts.values() for v in per_cell.values())


def build_section(results: list[CellResult]) -> dict[str, Any]:
    """The tier's keys of the JSON report: cells, invariants (ID -> cell -> verdict), details."""
    verdicts = get_verdicts(results)
    details: dict[str, Any] = {}
    for result in results:
        entry: dict[str, Any] = {
            "seconds": round(result.seconds, 3),
            "seed": result.seed,
            "profile": result.profile,
            # a radix cell: its release cell with the radix prefix cache on
            "radix": result.config.cell.radix,
            "runs": result.runs,
            "observations": result.observations,
            "exercised": {inv.id: result.exercised.get(inv.id, 0) for inv in INVARIANTS
                          if inv.applies(result.config.cell)},
            "mechanisms": {m.id: result.mechanisms.get(m.id, 0) for m in MECHANISMS},
        }
        if result.witness_source is not None:
            entry["witnesses"] = {"source": result.witness_source,
                                  "ran": result.witnesses_ran,
                                  # witness index -> the claims it no longer exercised
                                  "lost": {str(k): v for k, v in
                                           result.witnesses_lost.items()},
                                  "not_applicable": get_na_reasons(result)}
        if result.violation is not None:
            entry["violation"] = str(result.violation)
            entry["failed"] = list(result.failed_ids)
            if result.script_path is not None:
                entry["replay"] = f"overlap-spec replay {result.script_path}"
            if result.trace_verdict is not None:
                entry["trace"] = result.trace_verdict.status
            if result.script is not None:
                entry["ops"] = len(result.script.ops)
                entry["requests"] = result.script.count_requests()
        if result.error is not None:
            entry["error"] = f"{type(result.error).__name__}: {result.error}"
            if result.script_path is not None:
                entry["replay"] = f"overlap-spec replay {result.script_path}"
        details[result.config.name] = entry
    return {
        "cells": [r.config.name for r in results],
        "invariants": {i: {c: v.value for c, v in per_cell.items()}
                       for i, per_cell in verdicts.items()},
        "details": details,
        # operations per mechanism over the whole run (harness.drive.mechanisms)
        "mechanisms": get_mechanism_counts(results),
        # A seed replays the same search only under the same Hypothesis version
        # (requirements.lock pins the one ./dev installs): the report says which searched.
        "hypothesis_version": hypothesis.__version__,
    }


def hypothesis_tier_report(results: list[CellResult]) -> TierReport:
    """FAIL on a violation, INCONCLUSIVE on a crash, VACUOUS on a missing witness."""
    clean = is_clean(results)
    if clean:
        verdict = Verdict.PASS
    elif any(r.violation is not None for r in results):
        verdict = Verdict.FAIL
    elif any(r.error is not None for r in results):
        verdict = Verdict.INCONCLUSIVE
    else:
        verdict = Verdict.VACUOUS
    vacuous = sum(v is VACUOUS for per_cell in get_verdicts(results).values()
                  for v in per_cell.values())
    columns = get_cell_columns(results)
    radix = sum(members[0].config.cell.radix for members in columns.values())
    notes = [f"{len(results)} cell x size set runs" if len(columns) != len(results) else "",
             f"{radix} of the {len(columns)} cells are radix cells" if radix else ""]
    said = "; ".join(note for note in notes if note)
    clean_cells = sum(all(r.ok for r in members) for members in columns.values())
    summary = (f"{clean_cells}/{len(columns)} cells clean" + (f" ({said})" if said else "")
               + (f" ({vacuous} invariant x cell vacuous: no witness)" if vacuous else ""))
    return TierReport("hypothesis", verdict, summary, build_section(results))


def write_json(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
