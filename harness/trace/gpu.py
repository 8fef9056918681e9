"""Traces of gpu_impl runs: the same ndjson schema, written from the race detector's view.

gpu_impl has no spec ``HappensBefore`` record to wrap (its streams are torch streams, or
virtual ones on CPU), so its trace comes from :class:`RecordingRaceDetector`: every
record / wait / synchronize that :class:`gpu_impl.streams.Streams` issues, and every
tensor access the dispatch mode attributes to a stream, become ``stream`` events. A
tensor is a buffer at whole-tensor granularity: ``buffer`` is the spec's name for the
long-lived ones (``new_seq_lens_buf``, ``req_to_token``, ...; ``tensor`` otherwise) and
``index`` the tensor's allocation number. gpu_impl reports no observation points, so a
gpu_impl trace has no ``observe`` events; ``trace check`` judges its stream events with
the spec's happens-before rules and infers the state by re-executing its ops on the
reference with the header's faults (docs/trace-format.md, "gpu_impl traces").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from overlap_spec.gpu_impl.race import FREE_OPERATION, RaceDetector
from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.harness.drive.script import Script, apply_op
from overlap_spec.harness.trace.format import TraceHeader
from overlap_spec.harness.trace.record import RecordedRun, TraceRecorder
from overlap_spec.spec.happens_before import HOST
from overlap_spec.spec.units import RequestId

Listener = Callable[[dict[str, Any]], None]


class RecordingRaceDetector(RaceDetector):  # type: ignore[no-untyped-call]
    """A race detector that also reports each stream event in the trace schema."""

    def __init__(self, listener: Listener) -> None:
        super().__init__()
        self.listener = listener
        self._untracked: dict[int, int] = {}

    def on_record(self, event: str, stream: str) -> None:
        self.listener({"kind": "record", "stream": stream, "cuda_event": event})
        super().on_record(event, stream)

    def on_wait_event(self, stream: str, event: str) -> None:
        self.listener({"kind": "wait_event", "stream": stream, "cuda_event": event})
        super().on_wait_event(stream, event)

    def on_wait_stream(self, waiter: str, waitee: str) -> None:
        self.listener({"kind": "wait_stream", "stream": waiter, "waited": waitee})
        super().on_wait_stream(waiter, waitee)

    def on_synchronize_event(self, event: str) -> None:
        self.listener({"kind": "synchronize_event", "cuda_event": event})
        super().on_synchronize_event(event)

    def on_synchronize_stream(self, stream: str) -> None:
        self.listener({"kind": "synchronize_stream", "stream": stream})
        super().on_synchronize_stream(stream)

    def _key(self, pointer: int) -> tuple[str, int]:
        info = self.tensors.get(pointer) or self._freeing
        if info is not None:
            return info.buffer, info.serial
        # A view at an offset or an untracked block: a stable number of its own.
        return "tensor", -self._untracked.setdefault(pointer, len(self._untracked) + 1)

    def _launch(self, stream: str, reads: set[int], writes: set[int], operation: str,
                outputs: set[int], tensor_name: str | None = None) -> None:
        if stream != HOST:
            self.listener({"kind": "enqueue", "stream": stream})
        for pointer in sorted(reads - writes):
            buffer, index = self._key(pointer)
            self.listener({"kind": "read", "stream": stream, "buffer": buffer, "index": index,
                           "operation": operation})
        for pointer in sorted(writes):
            buffer, index = self._key(pointer)
            if operation == FREE_OPERATION:
                self.listener({"kind": "free", "owner": stream, "buffer": buffer,
                               "index": index, "operation": operation})
            else:
                self.listener({"kind": "write", "stream": stream, "buffer": buffer,
                               "index": index, "operation": operation})
        super()._launch(stream, reads, writes, operation, outputs, tensor_name)


def _ignore(fields: dict[str, Any]) -> None:
    del fields


def record_gpu_script(script: Script) -> RecordedRun:
    """Run ``script`` on gpu_impl (CPU, virtual streams) with its faults; record the trace."""
    config = script.get_config()
    recorder = TraceRecorder(TraceHeader(script.cell, script.preset, tuple(script.faults),
                                         script.seed, "gpu_impl", snapshots=False,
                                         sizes=dict(script.sizes)))
    detector = RecordingRaceDetector(recorder.on_stream)
    streams = Streams(torch.device("cpu"), detector)
    run = RecordedRun(recorder, None, None)
    with detector:
        model = GpuScheduler(config, frozenset(script.faults), None, streams=streams)
    admitted: list[RequestId] = []
    for index, op in enumerate(script.ops):
        model.set_step_index(index)
        recorder.on_op(op)
        try:
            with detector:
                apply_op(model, op, admitted)
        except Exception as error:  # recorded as inconclusive, never a pass
            run.crash, run.failed_at = f"{type(error).__name__}: {error}", index
            break
    # Frees after the run (teardown) are not part of it; nothing may follow the end event.
    detector.listener = _ignore
    recorder.finish()
    return run


def write_gpu_trace(script: Script, path: Path) -> Path:
    run = record_gpu_script(script)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.recorder.to_text())
    return path
