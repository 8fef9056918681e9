"""One trace format: record, replay and check scheduler event logs against the spec.

A trace is newline-delimited JSON (schema ``overlap-spec-trace`` version 1,
``docs/trace-format.md``): a ``header`` line, then ``op`` events (the script
operations with the environment's choices, so a trace re-executes like a
script), ``stream`` events (every happens-before call: record, wait_event,
wait_stream, synchronize, read, write, free), ``observe`` events (one per spec
:class:`~spec.state.ObservationPoint`, optionally with the state snapshot) and
an ``end`` line whose count makes truncation detectable. Ids count up by one.

``check_trace`` judges a trace with the spec alone where it can:

- stream events are replayed through a fresh :class:`~spec.happens_before.HappensBefore`,
  so races are the spec's verdict, not the recording implementation's;
- recorded snapshots are checked with every applicable invariant;
- where snapshots are missing, the state is *inferred* by re-executing the ops on
  the reference; the re-execution must reproduce the recorded ops, stream events
  and observation points, else the verdict is *inconclusive* (never a pass).

Any implementation can be recorded: :func:`attach_recorder` swaps the model's
happens-before record (``model.rt.hb``) for a :class:`RecordingHappensBefore`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from overlap_spec.harness.checker import InvariantChecker
from overlap_spec.harness.script import (
    Op,
    Script,
    ScriptError,
    apply_op,
    get_factory,
    load_script,
    op_from_json,
    op_to_json,
)
from overlap_spec.harness.trace_codec import CodecError, decode_dataclass, encode_value
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.config import PRESETS, get_cell
from overlap_spec.spec.happens_before import PARTICIPANTS, Access, HappensBefore, Race
from overlap_spec.spec.interface import SchedulerModel
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation, classify_race
from overlap_spec.spec.state import (
    AllocatorView,
    BatchView,
    GhostView,
    Observation,
    ObservationPoint,
    RequestView,
    ResultView,
)
from overlap_spec.spec.units import RequestId, TokenCount

SCHEMA = "overlap-spec-trace"
SCHEMA_VERSION = 1
EVENT_KINDS = ("header", "op", "stream", "observe", "call", "end")
# Invariants whose predicates read only the ScheduleBatch or the races: what a ``call``
# event of the live-process shim (harness/trace_shim.py) lets the spec check.
CALL_INVARIANTS = ("SL2", "SL3", "SL4", "SL5", "FM1", "FM3", "ST1", "ST2", "ST4")
# Invariants that read request views, the allocator or a result view: what a ``call``
# event carrying request views (the shim on a real sglang scheduler) lets the spec check
# besides CALL_INVARIANTS. A live process has no ghost truth; at a call where one of these
# needs it, that one is not judged (never passed, never failed; the verdict counts it).
STATE_CALL_INVARIANTS = ("KV1", "KV2", "KV4", "KV5", "KV6", "KV7", "KV9", "RP1", "RP2",
                         "RP3", "ST5")
# Stream event kind -> its fields besides id/event/step/kind: (name, JSON type).
STREAM_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "enqueue": (("stream", str),),
    "record": (("stream", str), ("cuda_event", str)),
    "wait_event": (("stream", str), ("cuda_event", str)),
    "wait_stream": (("stream", str), ("waited", str)),
    "synchronize_event": (("cuda_event", str),),
    "synchronize_stream": (("stream", str),),
    "read": (("stream", str), ("buffer", str), ("index", int), ("operation", str)),
    "write": (("stream", str), ("buffer", str), ("index", int), ("operation", str)),
    "free": (("owner", str), ("buffer", str), ("index", int), ("operation", str)),
}
RACE_INVARIANTS = frozenset({"FM1", "FM3", "ST1", "ST2", "ST4", "ST5"})
OK, VIOLATION, INCONCLUSIVE = "ok", "violation", "inconclusive"


class TraceFormatError(ValueError):
    """Malformed trace input: which line and which field, and why (CLI exit code 2)."""

    def __init__(self, line: int | None, field_name: str | None, message: str) -> None:
        where = f"line {line}" if line is not None else "trace"
        if field_name:
            where += f", field {field_name!r}"
        super().__init__(f"{where}: {message}")
        self.line = line
        self.field = field_name
        self.message = message


class NotRecorded(Exception):
    """A check read a part of the state the trace does not carry (the ghost truth of a live
    process, the allocator where a tree cache holds pages)."""


class _Unrecorded:
    """Stands in for a state part a call event does not carry: any read raises
    :class:`NotRecorded`, so a check that needs the part cannot pass or fail on a guess."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __getattr__(self, name: str) -> Any:
        raise NotRecorded(f"{self.part}.{name}")


NO_GHOST = cast(GhostView, _Unrecorded("ghost"))
NO_ALLOCATOR = cast(AllocatorView, _Unrecorded("allocator"))
# Stands in while a ghost-less request view is decoded; replaced by NO_GHOST.
_ZERO_GHOST = encode_value(GhostView(0, TokenCount(0), TokenCount(0), 0, False,
                                     TokenCount(0), False))
_CALL_POINTS = {"process_batch_result": ObservationPoint.PROCESS_RESULT}


# ----------------------------------------------------------------------------- recording
@dataclass
class RecordingHappensBefore(HappensBefore):
    """A happens-before record that also reports each outermost call to ``listener``.

    Nested calls (``record`` enqueues, ``read`` is an ``access``) are not reported twice,
    so replaying the reported calls in order rebuilds the same clocks and races.
    """

    listener: Callable[[dict[str, Any]], None] | None = None
    depth: int = 0

    def _report(self, fields: dict[str, Any]) -> bool:
        if self.depth == 0 and self.listener is not None:
            self.listener(fields)
        self.depth += 1
        return True

    def enqueue(self, stream: str) -> None:
        self._report({"kind": "enqueue", "stream": stream})
        try:
            super().enqueue(stream)
        finally:
            self.depth -= 1

    def record(self, event: str, stream: str) -> None:
        self._report({"kind": "record", "stream": stream, "cuda_event": event})
        try:
            super().record(event, stream)
        finally:
            self.depth -= 1

    def wait_event(self, stream: str, event: str) -> bool:
        self._report({"kind": "wait_event", "stream": stream, "cuda_event": event})
        try:
            return super().wait_event(stream, event)
        finally:
            self.depth -= 1

    def wait_stream(self, waiter: str, waited: str) -> None:
        self._report({"kind": "wait_stream", "stream": waiter, "waited": waited})
        try:
            super().wait_stream(waiter, waited)
        finally:
            self.depth -= 1

    def synchronize_event(self, event: str) -> bool:
        self._report({"kind": "synchronize_event", "cuda_event": event})
        try:
            return super().synchronize_event(event)
        finally:
            self.depth -= 1

    def synchronize_stream(self, stream: str) -> None:
        self._report({"kind": "synchronize_stream", "stream": stream})
        try:
            super().synchronize_stream(stream)
        finally:
            self.depth -= 1

    def access(self, participant: str, kind: str, key: tuple[str, int],
               operation: str) -> list[Race]:
        self._report({"kind": kind, "stream": participant, "buffer": key[0], "index": key[1],
                      "operation": operation})
        try:
            return super().access(participant, kind, key, operation)
        finally:
            self.depth -= 1

    def free(self, key: tuple[str, int], operation: str, owner: str = "schedule") -> list[Race]:
        self._report({"kind": "free", "owner": owner, "buffer": key[0], "index": key[1],
                      "operation": operation})
        try:
            return super().free(key, operation, owner)
        finally:
            self.depth -= 1


def apply_stream_event(hb: HappensBefore, fields: dict[str, Any]) -> list[Race]:
    """Replay one recorded stream event on ``hb``; return the races it completed."""
    kind = fields["kind"]
    before = len(hb.races)
    if kind == "enqueue":
        hb.enqueue(fields["stream"])
    elif kind == "record":
        hb.record(fields["cuda_event"], fields["stream"])
    elif kind == "wait_event":
        hb.wait_event(fields["stream"], fields["cuda_event"])
    elif kind == "wait_stream":
        hb.wait_stream(fields["stream"], fields["waited"])
    elif kind == "synchronize_event":
        hb.synchronize_event(fields["cuda_event"])
    elif kind == "synchronize_stream":
        hb.synchronize_stream(fields["stream"])
    elif kind in ("read", "write"):
        hb.access(fields["stream"], kind, (fields["buffer"], fields["index"]),
                  fields["operation"])
    else:
        hb.free((fields["buffer"], fields["index"]), fields["operation"], fields["owner"])
    return hb.races[before:]


def attach_recorder(model: SchedulerModel, listener: Callable[[dict[str, Any]], None]) -> None:
    """Record ``model``'s stream events: replace its (still empty) happens-before record.

    An implementation plugs in by keeping its record at ``model.rt.hb`` (reference,
    gpu_impl) or ``model.hb``, and by reading it through that attribute, never a copy.
    """
    owner: Any = getattr(model, "rt", model)
    current = getattr(owner, "hb", None)
    if not isinstance(current, HappensBefore):
        raise TypeError(f"{type(model).__name__} exposes no happens-before record (rt.hb)")
    if current.races or current.events or current.last_write:
        raise ValueError("attach_recorder must run before the first operation")
    owner.hb = RecordingHappensBefore(listener=listener)


@dataclass(frozen=True)
class TraceHeader:
    cell: str
    preset: str
    faults: tuple[str, ...] = ()
    seed: int | None = None
    implementation: str = "reference"
    snapshots: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"id": 0, "event": "header", "schema": SCHEMA, "version": SCHEMA_VERSION,
                "cell": self.cell, "preset": self.preset, "faults": list(self.faults),
                "seed": self.seed, "implementation": self.implementation,
                "snapshots": self.snapshots}


class TraceRecorder:
    """Builds a trace's events in memory as the implementation runs."""

    def __init__(self, header: TraceHeader) -> None:
        self.header = header
        self.events: list[dict[str, Any]] = [header.to_json()]
        self.observations: list[tuple[int, Observation]] = []
        self.step = -1

    def _emit(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        record = {"id": len(self.events), "event": event, "step": self.step, **fields}
        self.events.append(record)
        return record

    def on_op(self, op: Op) -> None:
        self.step += 1
        self._emit("op", op_to_json(op))

    def on_stream(self, fields: dict[str, Any]) -> None:
        self._emit("stream", fields)

    def on_observation(self, obs: Observation) -> None:
        fields: dict[str, Any] = {"point": obs.point.value}
        if self.header.snapshots:
            fields["state"] = encode_value(obs)
        record = self._emit("observe", fields)
        self.observations.append((record["id"], obs))

    def finish(self) -> None:
        self.events.append({"id": len(self.events), "event": "end",
                            "events": len(self.events) + 1})

    def to_text(self) -> str:
        return "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in self.events)


@dataclass
class RecordedRun:
    recorder: TraceRecorder
    violation: InvariantViolation | None
    failed_at: int | None
    crash: str | None = None


def record_script(script: Script, snapshots: bool = True) -> RecordedRun:
    """Run ``script`` on its implementation, recording every event; stop at the first
    violation exactly like :func:`harness.script.run_script`."""
    config = script.get_config()
    recorder = TraceRecorder(TraceHeader(script.cell, script.preset, tuple(script.faults),
                                         script.seed, script.implementation, snapshots))
    checker = InvariantChecker(config)

    def observe(obs: Observation) -> None:
        recorder.on_observation(obs)
        checker(obs)

    model = get_factory(script.implementation)(config, frozenset(script.faults), observe)
    attach_recorder(model, recorder.on_stream)
    admitted: list[RequestId] = []
    run = RecordedRun(recorder, None, None)
    for index, op in enumerate(script.ops):
        model.set_step_index(index)
        recorder.on_op(op)
        try:
            apply_op(model, op, admitted)
        except InvariantViolation as violation:
            run.violation, run.failed_at = violation, index
            break
        except Exception as error:  # a crash is recorded as inconclusive, never a pass
            run.crash, run.failed_at = f"{type(error).__name__}: {error}", index
            break
    recorder.finish()
    return run


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


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class TraceEvent:
    line: int
    id: int
    event: str
    step: int
    raw: dict[str, Any]


@dataclass
class ParsedTrace:
    header: TraceHeader
    events: list[TraceEvent]  # op, stream and observe events, in order
    script: Script
    states: dict[int, Observation] = field(default_factory=dict)  # observe id -> snapshot
    calls: dict[int, Observation] = field(default_factory=dict)  # call id -> its view
    end_line: int = 0
    state_calls: set[int] = field(default_factory=set)  # calls carrying request views


def _require(raw: dict[str, Any], name: str, kind: type, line: int,
             nullable: bool = False) -> Any:
    if name not in raw:
        raise TraceFormatError(line, name, "missing field")
    value = raw[name]
    if value is None and nullable:
        return None
    wrong = (isinstance(value, bool) or not isinstance(value, int)) if kind is int \
        else not isinstance(value, kind)
    if wrong:
        names = {int: "an integer", str: "a string", bool: "true or false", list: "a list"}
        raise TraceFormatError(line, name, f"expected {names.get(kind, kind.__name__)}, "
                               f"got {json.dumps(value)[:40]}")
    return value


def _parse_header(raw: dict[str, Any], line: int) -> TraceHeader:
    if raw.get("event") != "header":
        raise TraceFormatError(line, "event", f"the first line must be the header, got "
                               f"{json.dumps(raw.get('event'))}")
    if _require(raw, "schema", str, line) != SCHEMA:
        raise TraceFormatError(line, "schema", f"expected {SCHEMA!r}, got {raw['schema']!r}")
    version = _require(raw, "version", int, line)
    if version != SCHEMA_VERSION:
        raise TraceFormatError(line, "version", f"unsupported schema version {version} "
                               f"(this checker reads version {SCHEMA_VERSION})")
    cell = _require(raw, "cell", str, line)
    try:
        get_cell(cell)
    except KeyError:
        raise TraceFormatError(line, "cell", f"unknown cell {cell!r} "
                               "(see 'overlap-spec cells')") from None
    preset = _require(raw, "preset", str, line)
    if preset not in PRESETS:
        raise TraceFormatError(line, "preset", f"unknown preset {preset!r}; known: "
                               f"{', '.join(PRESETS)}")
    faults = _require(raw, "faults", list, line)
    if not all(isinstance(f, str) and f in SUPPORTED_FAULTS for f in faults):
        raise TraceFormatError(line, "faults", f"expected bug IDs such as \"B3\", got {faults}")
    seed = _require(raw, "seed", int, line, nullable=True)
    # Any name: a trace is checked by the spec, and re-executed (if at all) on the reference.
    implementation = _require(raw, "implementation", str, line)
    snapshots = _require(raw, "snapshots", bool, line)
    return TraceHeader(cell, preset, tuple(faults), seed, implementation, snapshots)


def _iter_lines(text: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield number, line


def parse_trace(text: str) -> ParsedTrace:
    """Validate a whole trace; raise :class:`TraceFormatError` at the first problem."""
    if not text.strip():
        raise TraceFormatError(None, None, "empty file: no header line")
    ends_complete = text.endswith("\n")
    lines = list(_iter_lines(text))
    last_number = lines[-1][0]
    header: TraceHeader | None = None
    events: list[TraceEvent] = []
    ops: list[Op] = []
    states: dict[int, Observation] = {}
    calls: dict[int, Observation] = {}
    state_calls: set[int] = set()
    expected_id = 0
    end_line: int | None = None
    for number, line in lines:
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            if number == last_number and not ends_complete:
                raise TraceFormatError(number, None, "truncated: the last line is incomplete "
                                       f"JSON ({error.msg} at column {error.colno})") from None
            raise TraceFormatError(number, None, f"not JSON: {error.msg} at column "
                                   f"{error.colno}") from None
        if not isinstance(raw, dict):
            raise TraceFormatError(number, None, "expected a JSON object per line")
        if end_line is not None:
            raise TraceFormatError(number, "event", f"event after the end line {end_line}")
        if header is None and raw.get("event") != "header":
            raise TraceFormatError(number, "event", "the first line must be the header, got "
                                   f"{json.dumps(raw.get('event'))}")
        event_id = _require(raw, "id", int, number)
        if event_id != expected_id:
            raise TraceFormatError(number, "id", f"expected {expected_id}, got {event_id} "
                                   "(ids count up by one from 0; out of order or missing)")
        expected_id += 1
        kind = _require(raw, "event", str, number)
        if kind not in EVENT_KINDS:
            raise TraceFormatError(number, "event", f"unknown event {kind!r} (expected one "
                                   f"of {', '.join(EVENT_KINDS)})")
        if header is None:
            header = _parse_header(raw, number)
            continue
        if kind == "header":
            raise TraceFormatError(number, "event", "a second header")
        if kind == "end":
            count = _require(raw, "events", int, number)
            if count != event_id + 1:
                raise TraceFormatError(number, "events", f"the end line counts {count} events"
                                       f", the file has {event_id + 1}")
            end_line = number
            continue
        step = _require(raw, "step", int, number)
        if kind == "op":
            if step != len(ops):
                raise TraceFormatError(number, "step", f"expected op step {len(ops)}, got "
                                       f"{step} (op steps count up by one from 0)")
            try:
                ops.append(op_from_json(raw, step))
            except ScriptError as error:
                text_error = str(error).split(": ", 1)[-1]
                match = re.search(r"field '([a-z_]+)'", text_error)
                raise TraceFormatError(number, match.group(1) if match else "op",
                                       text_error) from None
        elif step != len(ops) - 1:
            raise TraceFormatError(number, "step", f"expected {len(ops) - 1} (the step of the "
                                   f"latest op event), got {step}")
        if kind == "stream":
            _validate_stream(raw, number)
        elif kind == "observe":
            point = _require(raw, "point", str, number)
            try:
                ObservationPoint(point)
            except ValueError:
                raise TraceFormatError(number, "point", f"unknown observation point "
                                       f"{point!r}") from None
            if raw.get("state") is not None:
                states[event_id] = _decode_state(raw["state"], point, step, number)
        elif kind == "call":
            method = _require(raw, "method", str, number)
            calls[event_id] = _decode_call(raw, method, step, number)
            if "requests" in raw:
                state_calls.add(event_id)
        events.append(TraceEvent(number, event_id, kind, step, raw))
    assert header is not None
    if end_line is None:
        raise TraceFormatError(last_number, None, "truncated: the trace stops without an "
                               "'end' line")
    script = Script(header.cell, header.preset, ops, header.faults, header.seed,
                    header.implementation)
    return ParsedTrace(header, events, script, states, calls, end_line, state_calls)


def _validate_stream(raw: dict[str, Any], line: int) -> None:
    kind = _require(raw, "kind", str, line)
    if kind not in STREAM_FIELDS:
        raise TraceFormatError(line, "kind", f"unknown stream event {kind!r} (expected one "
                               f"of {', '.join(STREAM_FIELDS)})")
    for name, json_type in STREAM_FIELDS[kind]:
        value = _require(raw, name, json_type, line)
        if name in ("stream", "waited", "owner") and value not in PARTICIPANTS:
            raise TraceFormatError(line, name, f"unknown stream {value!r} (expected one of "
                                   f"{', '.join(PARTICIPANTS)})")


def _decode_state(raw: Any, point: str, step: int, line: int) -> Observation:
    try:
        obs = decode_dataclass(Observation, raw, "state")
    except CodecError as error:
        raise TraceFormatError(line, error.path, error.message) from None
    if obs.point.value != point:
        raise TraceFormatError(line, "state.point", f"{obs.point.value!r} differs from the "
                               f"event's point {point!r}")
    if obs.step_index != step:
        raise TraceFormatError(line, "state.step_index", f"{obs.step_index} differs from "
                               f"the event's step {step}")
    return obs


def _decode_call(raw: dict[str, Any], method: str, step: int, line: int) -> Observation:
    """A shim call as an observation: its batch and, where recorded, request views (ghost
    null), the allocator and the result; parts not recorded read as :data:`NO_GHOST` /
    :data:`NO_ALLOCATOR`. ``running_batch`` is validated, not checked: the running batch is
    checked where it is prepared, filtered or merged."""
    try:
        batch = _decode_optional(BatchView, raw, "batch")
        _decode_optional(BatchView, raw, "running_batch")
        result = _decode_optional(ResultView, raw, "result")
        allocator = _decode_optional(AllocatorView, raw, "allocator")
        requests = _decode_requests(raw)
    except CodecError as error:
        raise TraceFormatError(line, error.path, error.message) from None
    if requests is None:  # a batch-only call: the batch-only invariants never read these
        requests, allocator = (), AllocatorView(0, 1, (), (), (), 0)
    name = method.rsplit(".", 1)[-1]
    points = {p.value: p for p in ObservationPoint}
    point = _CALL_POINTS.get(name) or points.get(name, ObservationPoint.ITERATION_END)
    return Observation(point, step, requests, batch, allocator or NO_ALLOCATOR, (),
                       result=result)


def _decode_optional(cls: type[Any], raw: dict[str, Any], name: str) -> Any:
    return None if raw.get(name) is None else decode_dataclass(cls, raw[name], name)


def _decode_requests(raw: dict[str, Any]) -> tuple[RequestView, ...] | None:
    """A call's request views: RequestView objects whose ``ghost`` is null (a live process
    has no truth), or None when the call carries none."""
    if "requests" not in raw:
        return None
    if not isinstance(raw["requests"], list):
        raise CodecError("requests", f"expected a list, got {json.dumps(raw['requests'])[:40]}")
    views = []
    for index, item in enumerate(raw["requests"]):
        path = f"requests[{index}]"
        if not isinstance(item, dict):
            raise CodecError(path, "expected an object")
        if item.get("ghost", 0) is not None:
            raise CodecError(f"{path}.ghost", "expected null: a call's request views carry "
                             "no ghost truth")
        view = decode_dataclass(RequestView, {**item, "ghost": _ZERO_GHOST}, path)
        views.append(replace(view, ghost=NO_GHOST))
    return tuple(views)


def read_trace(path: Path) -> ParsedTrace:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceFormatError(None, None, f"no such file {path}") from None
    except (UnicodeDecodeError, IsADirectoryError) as error:
        raise TraceFormatError(None, None, f"cannot read {path}: {error}") from None
    return parse_trace(text)


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


_CLAIMS = {inv.id: " ".join((inv.check.__doc__ or "").split()) for inv in INVARIANTS}


def get_claim(invariant_id: str) -> str:
    claim = _CLAIMS.get(invariant_id, invariant_id)
    return claim.split(": ", 1)[-1] if claim.startswith(invariant_id) else claim


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
    observe_ids = [e.id for e in parsed.events if e.event == "observe"]
    if pending and not observe_ids and not parsed.calls:
        # No observation to attach the races to (a gpu_impl trace): the first one decides.
        return _race_verdict(parsed, pending[0], race_event, access_event, context)
    tally = _CallTally()
    call_verdict = _check_calls(parsed, races_at, race_event, access_event, context, tally)
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
            obs = replace(obs, races=races_at[event_id])
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
        obs = replace(obs, races=races_at.get(event_id, ()))
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
    return replace(obs, races=())


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


def get_trace_path(script_path: Path) -> Path:
    """Where the trace of a saved script goes: ``x.json`` -> ``x.trace.ndjson``."""
    return script_path.with_suffix(".trace.ndjson")


def write_trace(run: RecordedRun, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.recorder.to_text())
    return path


def record_script_trace(script: Script, path: Path, snapshots: bool = True) -> TraceVerdict:
    """Run ``script`` on its implementation, write the trace to ``path`` and check it.

    The verdict is the trace checker's (not the recording run's); a recording run that
    crashed is inconclusive.
    """
    if script.implementation == "gpu_impl":
        from overlap_spec.harness.trace_gpu import (
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


def strip_snapshots(text: str) -> str:
    """The same trace without state snapshots (the checker must infer the state)."""
    out: list[str] = []
    for line in text.splitlines():
        raw = json.loads(line)
        raw.pop("state", None)
        if raw.get("event") == "header":
            raw["snapshots"] = False
        out.append(json.dumps(raw, separators=(",", ":")))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- CLI
def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trace`` subcommand group: check, render, record, strip."""
    sub = parser.add_subparsers(dest="trace_command", required=True)
    check = sub.add_parser("check", help="replay a trace through the spec; first violation")
    check.add_argument("file")
    check.add_argument("--json", metavar="PATH", help="write the verdict as JSON")
    check.add_argument("--context", type=int, default=8, help="preceding events to show")
    render = sub.add_parser("render", help="draw the timeline as Mermaid and SVG")
    render.add_argument("file")
    render.add_argument("--out", metavar="DIR", default=None,
                        help="where to write FILE.mmd and FILE.svg (default: beside FILE)")
    render.add_argument("--window", type=int, default=80,
                        help="events drawn before the violation (0: all)")
    record = sub.add_parser("record", help="run an operation script and write its trace")
    record.add_argument("script")
    record.add_argument("-o", "--output", required=True)
    record.add_argument("--no-snapshots", action="store_true", help="omit state snapshots")
    strip = sub.add_parser("strip", help="drop the state snapshots from a trace")
    strip.add_argument("file")
    strip.add_argument("-o", "--output", required=True)
    parser.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    """Exit codes: 0 pass, 1 violation or inconclusive, 2 malformed input or usage."""
    try:
        if args.trace_command == "check":
            verdict = check_trace_file(Path(args.file), args.context)
            print(verdict.describe())
            if args.json:
                Path(args.json).write_text(json.dumps(verdict.to_json(), indent=1) + "\n")
            return 0 if verdict.ok else 1
        if args.trace_command == "render":
            from overlap_spec.harness.trace_render import render_trace_file

            written = render_trace_file(Path(args.file),
                                        Path(args.out) if args.out else None, args.window)
            for path in written:
                print(f"wrote {path}")
            return 0
        if args.trace_command == "record":
            script = load_script(Path(args.script))
            verdict = record_script_trace(script, Path(args.output), not args.no_snapshots)
            print(f"wrote {args.output}")
            print(verdict.describe())
            return 0 if verdict.ok else 1
        text = Path(args.file).read_text()
        parse_trace(text)
        Path(args.output).write_text(strip_snapshots(text))
        print(f"wrote {args.output}")
        return 0
    except TraceFormatError as error:
        print(f"overlap-spec: {args.file if 'file' in args else args.script}: {error}",
              file=sys.stderr)
        return 2
    except ScriptError as error:
        print(f"overlap-spec: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError as error:
        print(f"overlap-spec: no such file {error.filename}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.trace ...`` until the lead wires ``trace`` into harness/cli.py."""
    parser = argparse.ArgumentParser(prog="overlap-spec trace")
    add_trace_arguments(parser)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
