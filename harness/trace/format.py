"""The trace format (schema ``overlap-spec-trace`` version 2, ``docs/trace-format.md``):
its constants, the header, and the parser that turns newline-delimited JSON into
events and spec observations. A malformed trace is a :class:`TraceFormatError`
naming its line; nothing here judges a trace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from overlap_spec.harness.drive.cells import UsageError, check_sizes, make_preset
from overlap_spec.harness.drive.script import (
    Op,
    Script,
    ScriptError,
    check_op_ranges,
    op_from_json,
)
from overlap_spec.harness.trace.codec import CodecError, decode_dataclass, encode_value
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.happens_before import PARTICIPANTS
from overlap_spec.spec.state import (
    AllocatorView,
    BatchView,
    GhostView,
    Observation,
    ObservationPoint,
    RequestView,
    ResultView,
)
from overlap_spec.spec.units import TokenCount

SCHEMA = "overlap-spec-trace"
SCHEMA_VERSION = 2
EVENT_KINDS = ("header", "op", "stream", "observe", "call", "end")
# Invariants whose predicates read only the ScheduleBatch or the races: what a ``call``
# event of the live-process shim (harness/trace_shim.py) lets the spec check.
CALL_INVARIANTS = ("SL2", "SL3", "SL4", "SL5", "FM1", "FM3", "ST1", "ST2", "ST4")
# Invariants that read request views, the allocator or a result view: what a ``call``
# event carrying request views (the shim on a real sglang scheduler) lets the spec check
# besides CALL_INVARIANTS. A live process has no ghost truth; at a call where one of these
# needs it, that one is not judged (never passed, never failed; the verdict counts it).
STATE_CALL_INVARIANTS = ("KV1", "KV2", "KV4", "KV5", "KV6", "KV7", "KV9", "RP1", "RP2",
                         "RP3", "RP7", "ST5")
RACE_INVARIANTS = frozenset({"FM1", "FM3", "ST1", "ST2", "ST4", "ST5"})
OK, VIOLATION, INCONCLUSIVE = "ok", "violation", "inconclusive"



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
                                     TokenCount(0), False, None, 0, 0))
_CALL_POINTS = {"process_batch_result": ObservationPoint.PROCESS_RESULT}


@dataclass(frozen=True)
class TraceHeader:
    cell: str
    preset: str
    faults: tuple[str, ...] = ()
    seed: int | None = None
    implementation: str = "reference"
    snapshots: bool = True
    sizes: dict[str, int] = field(default_factory=dict)  # in place of the preset's

    def to_json(self) -> dict[str, Any]:
        return {"id": 0, "event": "header", "schema": SCHEMA, "version": SCHEMA_VERSION,
                "cell": self.cell, "preset": self.preset,
                **({"sizes": dict(sorted(self.sizes.items()))} if self.sizes else {}),
                "faults": list(self.faults), "seed": self.seed,
                "implementation": self.implementation, "snapshots": self.snapshots}


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
    sizes = raw.get("sizes", {})
    try:
        if not isinstance(sizes, dict):
            raise UsageError("expected an object such as {\"kv_tokens\": 16}")
        problem = check_sizes(ModelConfig(get_cell(cell), make_preset(preset, sizes)))
        if problem is not None:
            raise UsageError(problem)
    except UsageError as error:
        raise TraceFormatError(line, "sizes", str(error)) from None
    faults = _require(raw, "faults", list, line)
    if not all(isinstance(f, str) and f in SUPPORTED_FAULTS for f in faults):
        raise TraceFormatError(line, "faults", f"expected bug IDs such as \"B3\", got {faults}")
    seed = _require(raw, "seed", int, line, nullable=True)
    # Any name: a trace is checked by the spec, and re-executed (if at all) on the reference.
    implementation = _require(raw, "implementation", str, line)
    snapshots = _require(raw, "snapshots", bool, line)
    return TraceHeader(cell, preset, tuple(faults), seed, implementation, snapshots,
                       dict(sizes))


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
    op_lines: list[int] = []
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
                op_lines.append(number)
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
                    header.implementation, dict(header.sizes))
    _check_ranges(script, op_lines)
    return ParsedTrace(header, events, script, states, calls, end_line, state_calls)


def _check_ranges(script: Script, op_lines: list[int]) -> None:
    """Every op within the header's cell's limits (as a script file is), else a
    :class:`TraceFormatError` at that op's line naming the field, value and range."""
    try:
        check_op_ranges(script.get_config(), script.ops)
    except ScriptError as error:
        text = str(error)
        match = re.match(r"op (\d+) ", text)
        line = op_lines[int(match.group(1))] if match else None
        field = re.search(r"field '([a-z_]+)'", text)
        raise TraceFormatError(line, field.group(1) if field else "op", text) from None


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


def get_trace_path(script_path: Path) -> Path:
    """Where the trace of a saved script goes: ``x.json`` -> ``x.trace.ndjson``."""
    return script_path.with_suffix(".trace.ndjson")


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
