"""Recording: any implementation writes a trace once :func:`attach_recorder` swaps the
model's happens-before record (``model.rt.hb``) for a :class:`RecordingHappensBefore`;
:func:`record_script` runs an operation script on the reference and keeps its events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Op,
    Script,
    apply_op,
    get_factory,
    op_to_json,
)
from overlap_spec.harness.trace.codec import encode_value
from overlap_spec.harness.trace.format import TraceHeader
from overlap_spec.spec.happens_before import HappensBefore, Race
from overlap_spec.spec.interface import SchedulerModel
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.state import (
    Observation,
)
from overlap_spec.spec.units import RequestId


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
    violation exactly like :func:`overlap_spec.harness.drive.script.run_script`."""
    config = script.get_config()
    recorder = TraceRecorder(TraceHeader(script.cell, script.preset, tuple(script.faults),
                                         script.seed, script.implementation, snapshots,
                                         dict(script.sizes)))
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


def write_trace(run: RecordedRun, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.recorder.to_text())
    return path
