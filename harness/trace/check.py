"""Judging a trace with the spec alone where it can.

- stream events are replayed through a fresh
  :class:`~overlap_spec.spec.happens_before.HappensBefore`, so races are the spec's
  verdict, not the recording implementation's;
- recorded snapshots are checked with every applicable invariant;
- where snapshots are missing, the state is *inferred* by re-executing the ops on
  the reference; the re-execution must reproduce the recorded ops, stream events
  and observation points, else the verdict is *inconclusive* (never a pass).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import Script
from overlap_spec.harness.trace.codec import encode_value
from overlap_spec.harness.trace.format import (
    CALL_INVARIANTS,
    INCONCLUSIVE,
    OK,
    RACE_INVARIANTS,
    STATE_CALL_INVARIANTS,
    VIOLATION,
    NotRecorded,
    ParsedTrace,
    TraceEvent,
    read_trace,
)
from overlap_spec.harness.trace.record import apply_stream_event, record_script, write_trace
from overlap_spec.spec.happens_before import Access, HappensBefore, Race
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation, classify_race
from overlap_spec.spec.state import (
    Observation,
)


# ----------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class TraceViolation:
    event_id: int  # the observe (or op) event where the spec rejects the trace
    line: int
    step: int
    invariant_id: str
    all_ids: tuple[str, ...]
    request: str | None  # "r3", when the message names one
    point: str | None
    expected: str  # the invariant's claim
    actual: str  # what the spec saw, with both values
    access_event_id: int | None  # the stream access that completed a race, if any
    earlier_event_id: int | None  # the unordered earlier access of that race
    preceding: tuple[str, ...]

    def describe(self) -> str:
        lines = [f"event {self.event_id} (line {self.line}, op {self.step}"
                 + (f", {self.point}" if self.point else "") + f"): {self.invariant_id} violated"
                 + (f" for request {self.request}" if self.request else ""),
                 f"  expected: {self.expected}",
                 f"  actual:   {self.actual}"]
        if len(self.all_ids) > 1:
            lines.append(f"  also: {', '.join(self.all_ids[1:])}")
        if self.access_event_id is not None:
            lines.append(f"  violating access: event {self.access_event_id}, unordered after "
                         f"event {self.earlier_event_id}")
        if self.preceding:
            lines.append("  preceding events:")
            lines.extend(f"    {p}" for p in self.preceding)
        return "\n".join(lines)


@dataclass(frozen=True)
class TraceVerdict:
    status: str  # ok | violation | inconclusive
    violation: TraceViolation | None = None
    inferred: bool = False  # some state was inferred by re-executing the ops
    events: int = 0
    observations: int = 0
    notes: tuple[str, ...] = ()
    exercised: dict[str, int] = field(default_factory=dict)  # instances judged per ID

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def invariant_id(self) -> str | None:
        return self.violation.invariant_id if self.violation is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "inferred": self.inferred, "events": self.events,
                "observations": self.observations, "notes": list(self.notes),
                "exercised": dict(sorted(self.exercised.items())),
                "violation": None if self.violation is None else encode_value(self.violation)}

    def describe(self) -> str:
        head = {OK: "PASS", VIOLATION: "VIOLATION", INCONCLUSIVE: "INCONCLUSIVE"}[self.status]
        source = ("state inferred by re-executing the ops on the reference"
                  if self.inferred else "state from the recorded snapshots"
                  if self.observations else "stream events only")
        lines = [f"{head}: {self.events} events, {self.observations} observations checked "
                 f"({source})"]
        lines.extend(f"note: {n}" for n in self.notes)
        if self.violation is not None:
            lines.append(self.violation.describe())
        return "\n".join(lines)


# ----------------------------------------------------------------------------- checking
def describe_event(event: TraceEvent | dict[str, Any]) -> str:
    """One line per event, for diagnostics and pictures."""
    raw = event.raw if isinstance(event, TraceEvent) else event
    kind = raw.get("event")
    head = f"#{raw.get('id')} "
    if kind == "op":
        fields = {k: v for k, v in raw.items() if k not in ("id", "event", "step", "op")}
        return head + f"op {raw.get('step')} {raw.get('op')} " + json.dumps(fields)
    if kind == "observe":
        return head + f"observe {raw.get('point')}" + ("" if "state" in raw else " (no state)")
    if kind == "call":
        return head + f"call {raw.get('method')}"
    if kind == "stream":
        return head + describe_stream(raw)
    return head + str(kind)


def describe_stream(raw: dict[str, Any]) -> str:
    kind = raw.get("kind")
    if kind in ("read", "write"):
        return (f"{raw['stream']} {kind} {raw['buffer']}[{raw['index']}] "
                f"({raw['operation']})")
    if kind == "free":
        return f"host free {raw['buffer']}[{raw['index']}] ({raw['operation']})"
    if kind == "record":
        return f"{raw['stream']} record {raw['cuda_event']}"
    if kind == "wait_event":
        return f"{raw['stream']} wait_event {raw['cuda_event']}"
    if kind == "wait_stream":
        return f"{raw['stream']} wait_stream {raw['waited']}"
    if kind == "synchronize_event":
        return f"host synchronize {raw['cuda_event']}"
    if kind == "synchronize_stream":
        return f"host synchronize {raw['stream']}"
    return f"enqueue on {raw.get('stream')}"


def _comparable(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in ("id", "state")}


_BY_ID = {inv.id: inv for inv in INVARIANTS}


def get_claim(invariant_id: str) -> str:
    """The claim in full with its source (the ID itself for one the registry lacks)."""
    inv = _BY_ID.get(invariant_id)
    return invariant_id if inv is None else inv.describe().removeprefix(f"{invariant_id}: ")


def _infer(parsed: ParsedTrace) -> tuple[dict[int, Observation], list[str], str | None]:
    """Re-execute the ops on the reference and align the result with the recorded events.

    Returns the inferred observation per recorded event id, notes, and a divergence
    message when the re-execution does not reproduce the trace (inconclusive).
    """
    rerun = record_script(replace(parsed.script, implementation="reference"), snapshots=False)
    present = {e.event for e in parsed.events}
    if parsed.script.implementation == "gpu_impl":
        # Its stream events are gpu_impl's own (tensor granularity); only the ops must match.
        present = {"op"}
    inferred = [e for e in rerun.recorder.events[1:-1] if e["event"] in present]
    notes: list[str] = []
    if rerun.crash is not None:
        notes.append(f"the reference crashed re-executing op {rerun.failed_at}: {rerun.crash}")
    observations = dict(rerun.recorder.observations)
    mapped: dict[int, Observation] = {}
    last_op_id: dict[int, int] = {}
    compared = [e for e in parsed.events if e.event in present]
    for recorded, again in zip(compared, inferred, strict=False):
        if _comparable(recorded.raw) != _comparable(again):
            return {}, notes, (f"the reference does not reproduce event {recorded.id} (line "
                               f"{recorded.line}): recorded {describe_event(recorded)}, "
                               f"re-executed {describe_event(again)}")
        if recorded.event == "observe":
            mapped[recorded.id] = observations[again["id"]]
        if recorded.event == "op":
            last_op_id[recorded.step] = recorded.id
    if len(inferred) < len(compared):
        extra = compared[len(inferred)]
        return {}, notes, (f"the reference stops before event {extra.id} (line {extra.line}),"
                           f" {describe_event(extra)}")
    if len(inferred) > len(compared):
        notes.append(f"the trace stops {len(inferred) - len(compared)} events before "
                     "the re-execution does; only the recorded prefix is checked")
    if "observe" not in present:
        # No observe events: attribute each inferred observation to its op event.
        for _, obs in rerun.recorder.observations:
            if obs.step_index in last_op_id:
                mapped.setdefault(-len(mapped) - 1, obs)
    return mapped, notes, None


def check_trace(parsed: ParsedTrace, context: int = 8) -> TraceVerdict:
    """Replay a parsed trace through the spec and return the first violation."""
    hb = HappensBefore()
    race_event: dict[int, int] = {}  # id(Race) -> the stream event that completed it
    access_event: dict[int, int] = {}  # id(Access) -> the stream event that made it
    pending: list[Race] = []
    races_at: dict[int, tuple[Race, ...]] = {}
    checked_at: dict[int, tuple[Race, ...]] = {}  # the stream claims' witnesses
    checked_seen = 0
    has_streams = any(e.event == "stream" for e in parsed.events)
    for event in parsed.events:
        if event.event == "stream":
            for race in apply_stream_event(hb, event.raw):
                race_event[id(race)] = event.id
                race_event[id(race.later)] = event.id
                pending.append(race)
            made = _latest_access(hb, event.raw)
            if made is not None:
                access_event[id(made)] = event.id
        elif event.event in ("observe", "call"):
            races_at[event.id] = tuple(pending)
            pending = []
            checked_at[event.id] = tuple(hb.checked[checked_seen:])
            checked_seen = len(hb.checked)
    observe_ids = [e.id for e in parsed.events if e.event == "observe"]
    if pending and not observe_ids and not parsed.calls:
        # No observation to attach the races to (a gpu_impl trace): the first one decides.
        return _race_verdict(parsed, pending[0], race_event, access_event, context)
    tally = _CallTally()
    call_verdict = _check_calls(parsed, races_at, checked_at, race_event, access_event,
                                context, tally)
    if call_verdict is not None:
        return call_verdict
    notes = tally.describe()
    inferred = bool(parsed.script.ops) and (
        not observe_ids or any(i not in parsed.states for i in observe_ids))
    checked = len(parsed.calls)
    states: dict[int, Observation] = dict(parsed.states)
    if inferred:
        mapped, infer_notes, divergence = _infer(parsed)
        notes.extend(infer_notes)
        if divergence is not None:
            return TraceVerdict(INCONCLUSIVE, None, True, len(parsed.events), 0,
                                (*notes, divergence))
        for event_id, obs in mapped.items():
            if event_id in states and _strip_races(states[event_id]) != _strip_races(obs):
                line = next(e.line for e in parsed.events if e.id == event_id)
                return TraceVerdict(INCONCLUSIVE, None, True, len(parsed.events), 0, (
                    *notes, f"the snapshot at event {event_id} (line {line}) differs from "
                    "the state the reference infers from the ops"))
            states.setdefault(event_id, obs)
    config = parsed.script.get_config()
    checker = InvariantChecker(config)
    checker.exercised.update(tally.exercised)
    by_id = {e.id: e for e in parsed.events}
    order = sorted(states, key=lambda i: (i < 0, abs(i)))
    if any(i < 0 for i in order):
        notes.append("no observe events: state inferred for every observation point")
    for count, event_id in enumerate(order, 1):
        obs = states[event_id]
        if has_streams and event_id in races_at:
            obs = replace(obs, races=races_at[event_id], checked_pairs=checked_at[event_id])
        try:
            checker(obs)
        except InvariantViolation as violation:
            anchor = by_id.get(event_id) or _op_event(parsed, obs.step_index)
            return TraceVerdict(VIOLATION, _build_violation(parsed, anchor, obs, violation,
                                                            race_event, access_event, context),
                                inferred, len(parsed.events), count, tuple(notes),
                                dict(checker.exercised))
    return TraceVerdict(OK, None, inferred, len(parsed.events), len(order) + checked,
                        tuple(notes), dict(checker.exercised))


@dataclass
class _CallTally:
    """What the call checks judged: instances per ID, and checks not judged at a call
    because they needed a part it does not carry (the ghost truth, the allocator)."""

    exercised: Counter[str] = field(default_factory=Counter)
    unjudged: Counter[str] = field(default_factory=Counter)
    checked_ids: tuple[str, ...] = ()
    calls: int = 0
    state_calls: int = 0

    def describe(self) -> list[str]:
        if not self.calls:
            return []
        notes = [f"{self.calls} call events checked with the batch-only and race invariants"]
        if self.state_calls:
            notes.append(f"{self.state_calls} of them carry request views, also checked "
                         f"with {', '.join(self.checked_ids)}")
        if self.unjudged:
            notes.append("not judged where they needed the ghost truth or the allocator, "
                         "which the trace does not carry: " + ", ".join(
                             f"{i} at {n} calls" for i, n in sorted(self.unjudged.items())))
        return notes


def _check_calls(parsed: ParsedTrace, races_at: dict[int, tuple[Race, ...]],
                 checked_at: dict[int, tuple[Race, ...]],
                 race_event: dict[int, int], access_event: dict[int, int],
                 context: int, tally: _CallTally) -> TraceVerdict | None:
    """Check the shim's call events with the batch-only and race invariants of the cell,
    and those carrying request views also with :data:`STATE_CALL_INVARIANTS`."""
    if not parsed.calls:
        return None
    config = parsed.script.get_config()
    applicable = [inv for inv in INVARIANTS if inv.applies(config.cell)]
    batch_only = [inv for inv in applicable if inv.id in CALL_INVARIANTS]
    with_state = batch_only + [inv for inv in applicable if inv.id in STATE_CALL_INVARIANTS]
    tally.checked_ids = tuple(inv.id for inv in with_state[len(batch_only):])
    by_id = {e.id: e for e in parsed.events}
    for count, (event_id, obs) in enumerate(sorted(parsed.calls.items()), 1):
        obs = replace(obs, races=races_at.get(event_id, ()),
                      checked_pairs=checked_at.get(event_id, ()))
        failures: list[InvariantViolation] = []
        with_views = event_id in parsed.state_calls
        tally.calls += 1
        tally.state_calls += with_views
        for inv in with_state if with_views else batch_only:
            try:
                tally.exercised[inv.id] += inv.check(config, obs)
            except NotRecorded:
                tally.unjudged[inv.id] += 1
            except InvariantViolation as violation:
                failures.append(violation)
        if failures:
            first = InvariantViolation(failures[0].invariant_id, failures[0].message,
                                       all_ids=tuple(f.invariant_id for f in failures))
            return TraceVerdict(VIOLATION, _build_violation(
                parsed, by_id[event_id], obs, first, race_event, access_event, context),
                False, len(parsed.events), count, tuple(tally.describe()),
                dict(tally.exercised))
    return None


def _race_verdict(parsed: ParsedTrace, race: Race, race_event: dict[int, int],
                  access_event: dict[int, int], context: int) -> TraceVerdict:
    invariant_id = classify_race(race)
    event_id = race_event[id(race)]
    index = next(i for i, e in enumerate(parsed.events) if e.id == event_id)
    anchor = parsed.events[index]
    preceding = tuple(describe_event(e) for e in parsed.events[max(index - context, 0):index])
    violation = TraceViolation(
        event_id=event_id, line=anchor.line, step=anchor.step, invariant_id=invariant_id,
        all_ids=(invariant_id,), request=None, point=None, expected=get_claim(invariant_id),
        actual=race.describe(), access_event_id=event_id,
        earlier_event_id=access_event.get(id(race.earlier)), preceding=preceding)
    return TraceVerdict(VIOLATION, violation, False, len(parsed.events), 0,
                        ("races judged by the spec's happens-before rules on the recorded "
                         "stream events",))


def _latest_access(hb: HappensBefore, raw: dict[str, Any]) -> Access | None:
    key = (raw.get("buffer"), raw.get("index"))
    if raw["kind"] == "write":
        return hb.last_write.get(key)  # type: ignore[arg-type]
    if raw["kind"] == "read":
        reads = hb.reads_since_write.get(key, [])  # type: ignore[arg-type]
        return reads[-1] if reads else None
    if raw["kind"] == "free":
        return hb.freed.get(key)  # type: ignore[arg-type]
    return None


def _strip_races(obs: Observation) -> Observation:
    return replace(obs, races=(), checked_pairs=())


def _op_event(parsed: ParsedTrace, step: int) -> TraceEvent:
    return next(e for e in parsed.events if e.event == "op" and e.step == step)


def _build_violation(parsed: ParsedTrace, anchor: TraceEvent, obs: Observation,
                     violation: InvariantViolation, race_event: dict[int, int],
                     access_event: dict[int, int], context: int) -> TraceViolation:
    first_line = str(violation).split("\n", 1)[0]
    match = re.search(r"\brequest r(\d+)", first_line)
    access: int | None = None
    earlier: int | None = None
    if violation.invariant_id in RACE_INVARIANTS:
        for race in obs.races:
            if classify_race(race) == violation.invariant_id and id(race) in race_event:
                access = race_event[id(race)]
                earlier = access_event.get(id(race.earlier))
                break
    index = next(i for i, e in enumerate(parsed.events) if e.id == anchor.id)
    preceding = tuple(describe_event(e) for e in parsed.events[max(index - context, 0):index])
    return TraceViolation(
        event_id=anchor.id, line=anchor.line, step=anchor.step,
        invariant_id=violation.invariant_id, all_ids=violation.all_ids,
        request=f"r{match.group(1)}" if match else None, point=obs.point.value,
        expected=get_claim(violation.invariant_id), actual=first_line,
        access_event_id=access, earlier_event_id=earlier, preceding=preceding)


def check_trace_file(path: Path, context: int = 8) -> TraceVerdict:
    """Parse and check a trace file; raises :class:`TraceFormatError` on malformed input."""
    return check_trace(read_trace(path), context)


def record_script_trace(script: Script, path: Path, snapshots: bool = True) -> TraceVerdict:
    """Run ``script`` on its implementation, write the trace to ``path`` and check it.

    The verdict is the trace checker's (not the recording run's); a recording run that
    crashed is inconclusive.
    """
    if script.implementation == "gpu_impl":
        from overlap_spec.harness.trace.gpu import (
            record_gpu_script,  # gpu_impl traces: the race detector
        )

        run = record_gpu_script(script)
    else:
        run = record_script(script, snapshots)
    write_trace(run, path)
    verdict = check_trace_file(path)
    if run.crash is not None and verdict.status == OK:
        return replace(verdict, status=INCONCLUSIVE,
                       notes=(*verdict.notes, f"the implementation crashed: {run.crash}"))
    return verdict
