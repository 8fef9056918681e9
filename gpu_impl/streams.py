"""Streams and events for gpu_impl: real CUDA streams on a GPU, virtual streams on CPU.

Upstream keeps four streams in play (digest section 3): the schedule stream S that the
scheduler's host thread enqueues on, the forward stream F, the result copy stream C and
the private D2H stream D of ``resolve_seq_lens_cpu`` (#25465). Events are named as in
the reference (``publish_ready``, the read-done event of the WAR fence,
``copy_done:<step>``).

Every stream operation goes through :class:`Streams`, for two reasons:

- on CPU there are no streams, so the ordering is kept by a
  :class:`gpu_impl.race.RaceDetector` (vector clocks, the engine of
  ``torch.cuda._sanitizer``), which must be told about every record, wait and
  synchronize;
- the sync contract (docs/gpu-impl.md) counts host-blocking synchronisations and device-to-host
  copies per iteration, and only calls made here are counted. A raw ``.item()``,
  ``.tolist()`` or ``.cpu()`` on a device tensor elsewhere in gpu_impl is a defect
  (``tests/test_gpu_impl.py`` asserts there is none), and so is an ``int()`` or ``bool()``
  of one, which the race detector reports as a hidden host read.

On CUDA the same calls drive real ``torch.cuda.Stream`` / ``torch.cuda.Event`` objects,
and torch's own CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``) watches them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from overlap_spec.spec.happens_before import COPY, D2H, FORWARD, SCHEDULE

DEVICE_STREAMS = (SCHEDULE, FORWARD, COPY, D2H)


class StreamListener(Protocol):
    """What the race detector hears from :class:`Streams` (see gpu_impl/race.py)."""

    def set_current_stream(self, stream: str) -> None: ...
    def on_record(self, event: str, stream: str) -> None: ...
    def on_wait_event(self, stream: str, event: str) -> None: ...
    def on_wait_stream(self, waiter: str, waitee: str) -> None: ...
    def on_synchronize_event(self, event: str) -> None: ...
    def on_synchronize_stream(self, stream: str) -> None: ...
    def mark_host(self, tensor: torch.Tensor) -> None: ...
    def name(self, tensor: torch.Tensor, name: str) -> None: ...
    def enter_host(self) -> None: ...
    def exit_host(self) -> None: ...
    def on_host_access(self, tensor: torch.Tensor, operation: str, write: bool) -> None: ...


@dataclass
class Counters:
    """Host-blocking syncs and D2H copies (launches: the race detector or a launch counter)."""

    host_syncs: list[str] = field(default_factory=list)  # "event:<name>" | "stream:<name>"
    d2h_copies: list[str] = field(default_factory=list)  # the stream each copy ran on

    def reset(self) -> None:
        self.host_syncs.clear()
        self.d2h_copies.clear()


class Streams:
    """The stream set of one scheduler; see the module header."""

    def __init__(self, device: torch.device | None = None,
                 detector: StreamListener | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.detector = detector
        self.counters = Counters()
        self._current = SCHEDULE
        self._cuda_streams: dict[str, Any] = {}
        self._cuda_events: dict[str, Any] = {}
        if self.is_cuda:
            # S is the stream current when the scheduler is built: the release runs its
            # whole event loop inside ``StreamContext(self.schedule_stream)``
            # (scheduler.py, run_event_loop), so every kernel the scheduler enqueues
            # outside a ``use()`` (prepare_for_decode's ``seq_lens + 1``, say) is on S.
            # A fresh stream here would leave that work on whatever stream is current
            # (the default stream), which no fence orders: the CUDA sanitizer's race at
            # every cell's first decode (bench/results/cuda-20261129/).
            with torch.cuda.device(self.device):
                self._cuda_streams = {name: torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                                      for name in DEVICE_STREAMS if name != SCHEDULE}
                self._cuda_streams[SCHEDULE] = torch.cuda.current_stream(self.device)
        if detector is not None:
            detector.set_current_stream(SCHEDULE)

    # ------------------------------------------------------------------ streams
    def current(self) -> str:
        return self._current

    @contextmanager
    def use(self, stream: str) -> Iterator[None]:
        """Make ``stream`` current: torch work inside is enqueued on (attributed to) it."""
        if stream not in DEVICE_STREAMS:
            raise ValueError(f"unknown stream {stream!r}; streams: {DEVICE_STREAMS}")
        previous = self._current
        self._current = stream
        if self.detector is not None:
            self.detector.set_current_stream(stream)
        try:
            if self.is_cuda:
                with torch.cuda.stream(self._cuda_streams[stream]):
                    yield
            else:
                yield
        finally:
            self._current = previous
            if self.detector is not None:
                self.detector.set_current_stream(previous)

    def _event(self, name: str) -> Any:
        event = self._cuda_events.get(name)
        if event is None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._cuda_events[name] = event
        return event

    def record(self, event: str, stream: str) -> None:
        if self.is_cuda:
            self._event(event).record(self._cuda_streams[stream])
        if self.detector is not None:
            self.detector.on_record(event, stream)

    def wait_event(self, stream: str, event: str) -> None:
        if self.is_cuda:
            self._cuda_streams[stream].wait_event(self._event(event))
        if self.detector is not None:
            self.detector.on_wait_event(stream, event)

    def wait_stream(self, waiter: str, waitee: str) -> None:
        if waiter == waitee:
            return
        if self.is_cuda:
            self._cuda_streams[waiter].wait_stream(self._cuda_streams[waitee])
        if self.detector is not None:
            self.detector.on_wait_stream(waiter, waitee)

    def synchronize_event(self, event: str) -> None:
        """The host blocks until ``event`` has completed (one counted host sync)."""
        self.counters.host_syncs.append(f"event:{event.split(':')[0]}")
        if self.is_cuda:
            self._event(event).synchronize()
        if self.detector is not None:
            self.detector.on_synchronize_event(event)

    def synchronize_stream(self, stream: str) -> None:
        """The host blocks until ``stream`` has drained (one counted host sync)."""
        self.counters.host_syncs.append(f"stream:{stream}")
        if self.is_cuda:
            self._cuda_streams[stream].synchronize()
        if self.detector is not None:
            self.detector.on_synchronize_stream(stream)

    # ------------------------------------------------------------------ tensors
    def name(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Label a long-lived buffer so race reports say which one (no effect on CUDA)."""
        if self.detector is not None:
            self.detector.name(tensor, name)
        return tensor

    def host_tensor(self, values: Sequence[int] | int) -> torch.Tensor:
        """An int64 host tensor (pinned on CUDA), written by the host."""
        pin = self.is_cuda
        with self.on_host():
            if isinstance(values, int):
                tensor = torch.zeros(values, dtype=torch.int64, pin_memory=pin)
            else:
                tensor = torch.tensor(list(values), dtype=torch.int64, pin_memory=pin)
            if self.detector is not None:
                self.detector.mark_host(tensor)
        return tensor

    @contextmanager
    def on_host(self) -> Iterator[None]:
        """Torch work on host tensors done by the host thread itself (not enqueued)."""
        if self.detector is not None:
            self.detector.enter_host()
        try:
            yield
        finally:
            if self.detector is not None:
                self.detector.exit_host()

    def device_tensor(self, values: Sequence[int], stream: str = SCHEDULE) -> torch.Tensor:
        """An int64 device tensor filled by an H2D copy enqueued on ``stream``."""
        with self.use(stream):
            return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor, stream: str) -> None:
        """A non-blocking D2H copy into host ``dst`` on ``stream``; read it only after a sync."""
        self.counters.d2h_copies.append(stream)
        with self.use(stream):
            dst.copy_(src, non_blocking=True)

    def to_list(self, host: torch.Tensor, operation: str = "host read") -> list[int]:
        """The host reads a host tensor (after whatever synchronize made it valid)."""
        if host.device.type != "cpu":
            raise ValueError("to_list reads host tensors; use copy_to_host for device tensors")
        if self.detector is not None:
            self.detector.on_host_access(host, operation, write=False)
        return [int(v) for v in host.tolist()]

    def host_write(self, host: torch.Tensor, values: Sequence[int],
                   operation: str = "host write") -> None:
        """The host overwrites a host tensor in place (e.g. refreshing seq_lens_cpu)."""
        with self.on_host():
            host.copy_(torch.tensor(list(values), dtype=host.dtype))

    def read_for_observation(self, tensor: torch.Tensor) -> list[int]:
        """The driver's read of a tensor for ``get_observable_state``; not scheduler work.

        It waits for the whole device (on CUDA) and copies with torch dispatch modes
        disabled, so it adds no host sync or D2H to the counters and no access or ordering
        to the race detector: observing after every operation must not hide a race of the
        next one.
        """
        with _disable_current_modes():
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            host.copy_(tensor)
            return [int(value) for value in host.reshape(-1).tolist()]
