"""Happens-before model of the host thread, the CUDA streams and the events.

What it models: which accesses to which buffer rows are ordered. Streams are
FIFO queues; the host enqueues work onto them; events capture a stream's
position; ``wait`` orders a stream after an event; ``synchronize`` blocks the
host until an event or stream has drained. This is the vector-clock rule of
``torch/cuda/_sanitizer.py`` restated over named streams and named buffer rows,
with the host as one more participant.

::

    host ──enqueue──▶ schedule (S) ──wait_stream──▶ forward (F) ──record──▶ publish_ready
      ▲                                                                     │
      └──────── synchronize(d2h) ◀── d2h (D) ◀──────── wait_event ──────────┘

Modelling compromise: the reference executes each enqueued operation at once,
in host program order. Concurrency is judged only by this relation: an access
that is not ordered after a conflicting earlier access is a race whether or not
a real GPU would have interleaved them badly. That is the sanitizer's rule too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from overlap_spec.spec.units import PoolRow

HOST: Final = "host"
SCHEDULE: Final = "schedule"
FORWARD: Final = "forward"
COPY: Final = "copy"
D2H: Final = "d2h"
PARTICIPANTS: Final = (HOST, SCHEDULE, FORWARD, COPY, D2H)

BufferKey = tuple[str, int]  # (buffer name, row or tensor id)
Clock = dict[str, int]


@dataclass(frozen=True)
class Access:
    """One read or write of one buffer row by one participant."""

    participant: str
    seq: int  # the participant's own counter at the access
    kind: str  # "read" | "write" | "free"
    key: BufferKey
    operation: str  # which upstream operation did it, for the report

    def describe(self) -> str:
        name, index = self.key
        return f"{self.kind} of {name}[{index}] by {self.operation} on {self.participant}"


@dataclass(frozen=True)
class Race:
    """Two conflicting accesses with no happens-before edge between them."""

    earlier: Access
    later: Access

    def describe(self) -> str:
        return (
            f"unsynchronised {self.later.describe()} after {self.earlier.describe()}"
            " (no event or stream wait orders them)"
        )


@dataclass(frozen=True)
class EventCapture:
    stream: str
    clock: tuple[tuple[str, int], ...]

    def as_clock(self) -> Clock:
        return dict(self.clock)


@dataclass
class HappensBefore:
    """Vector clocks for the participants, captured events and per-row access history."""

    clocks: dict[str, Clock] = field(
        default_factory=lambda: {p: {q: 0 for q in PARTICIPANTS} for p in PARTICIPANTS}
    )
    events: dict[str, EventCapture] = field(default_factory=dict)
    last_write: dict[BufferKey, Access] = field(default_factory=dict)
    reads_since_write: dict[BufferKey, list[Access]] = field(default_factory=dict)
    races: list[Race] = field(default_factory=list)
    # Every conflicting pair of accesses by two participants whose order was checked,
    # ordered or not: the witnesses of the stream claims (a race is a checked pair that
    # was not ordered). Same-participant pairs are ordered by FIFO and not counted.
    checked: list[Race] = field(default_factory=list)
    freed: dict[BufferKey, Access] = field(default_factory=dict)  # use after free is ST4
    host_syncs: list[str] = field(default_factory=list)  # what the host blocked on

    # -- clock helpers ------------------------------------------------------
    def _tick(self, participant: str) -> int:
        clock = self.clocks[participant]
        clock[participant] += 1
        return clock[participant]

    def _join(self, into: str, other: Clock) -> None:
        clock = self.clocks[into]
        for p, value in other.items():
            clock[p] = max(clock[p], value)

    def is_ordered_before(self, access: Access, participant: str) -> bool:
        """Whether ``access`` happens before the next action of ``participant``."""
        return (access.participant == participant
                or self.clocks[participant][access.participant] >= access.seq)

    def _join_event(self, into: str, event: str) -> bool:
        """Join the event's latest capture into ``into``'s clock; a never-recorded event
        orders nothing (False)."""
        capture = self.events.get(event)
        if capture is not None:
            self._join(into, capture.as_clock())
        return capture is not None

    # -- enqueue / fences ---------------------------------------------------
    def enqueue(self, stream: str) -> None:
        """The host enqueues work on ``stream``: everything the host did so far precedes it."""
        if stream != HOST:
            self._join(stream, self.clocks[HOST])

    def record(self, event: str, stream: str) -> None:
        """``event.record(stream)``: the event captures the stream's current position."""
        self.enqueue(stream)
        self._tick(stream)
        self.events[event] = EventCapture(stream, tuple(sorted(self.clocks[stream].items())))

    def wait_event(self, stream: str, event: str) -> bool:
        """``stream.wait_event(event)``; waiting on a never-recorded event orders nothing."""
        self.enqueue(stream)
        return self._join_event(stream, event)

    def wait_stream(self, waiter: str, waited: str) -> None:
        """``waiter.wait_stream(waited)``: waiter runs after all work enqueued on waited."""
        self.enqueue(waiter)
        self.enqueue(waited)
        self._join(waiter, self.clocks[waited])

    def synchronize_event(self, event: str) -> bool:
        """Host blocks on ``event.synchronize()``."""
        self.host_syncs.append(f"event:{event}")
        return self._join_event(HOST, event)

    def synchronize_stream(self, stream: str) -> None:
        """Host blocks on ``stream.synchronize()`` (also what a blocking ``.cpu()`` does)."""
        self.host_syncs.append(f"stream:{stream}")
        self._join(HOST, self.clocks[stream])

    def event_covers(self, event: str, access: Access) -> bool:
        """Whether the event's latest capture is ordered after ``access`` (FM2)."""
        capture = self.events.get(event)
        return capture is not None and capture.as_clock().get(access.participant, 0) >= access.seq

    # -- accesses -----------------------------------------------------------
    def access(self, participant: str, kind: str, key: BufferKey, operation: str) -> list[Race]:
        """Record an access and return the races it completes (also kept in ``races``)."""
        self.enqueue(participant)
        now = Access(participant, self._tick(participant), kind, key, operation)
        found: list[Race] = []
        if key in self.freed:
            found.append(Race(self.freed[key], now))  # the memory may hold something else
        previous = self.last_write.get(key)
        if previous is not None:
            self._check(previous, now, found)
        if kind == "write":
            for reader in self.reads_since_write.get(key, []):
                self._check(reader, now, found)
            self.last_write[key] = now
            self.reads_since_write[key] = []
        else:
            self.reads_since_write.setdefault(key, []).append(now)
        self.races.extend(found)
        return found

    def _check(self, earlier: Access, now: Access, found: list[Race]) -> None:
        """Judge one conflicting pair: counted when the participants differ, a race when
        ``earlier`` is not ordered before ``now``."""
        if earlier.participant != now.participant:
            self.checked.append(Race(earlier, now))
        if not self.is_ordered_before(earlier, now.participant):
            found.append(Race(earlier, now))

    def read(self, participant: str, key: BufferKey, operation: str) -> list[Race]:
        return self.access(participant, "read", key, operation)

    def write(self, participant: str, key: BufferKey, operation: str) -> list[Race]:
        return self.access(participant, "write", key, operation)

    def free(self, key: BufferKey, operation: str, owner: str = SCHEDULE) -> list[Race]:
        """The host drops the last reference; the caching allocator may reuse the memory.

        The allocator reuses memory on its ``owner`` stream in FIFO order, so only
        accesses by other streams must be ordered before the free (ST4).
        """
        self.enqueue(owner)
        now = Access(HOST, self._tick(HOST), "free", key, operation)
        earlier = list(self.reads_since_write.pop(key, []))
        previous = self.last_write.pop(key, None)
        if previous is not None:
            earlier.append(previous)
        watched = [a for a in earlier if a.participant != owner]
        self.checked.extend(Race(a, now) for a in watched)
        found = [Race(a, now) for a in watched if not self.is_ordered_before(a, HOST)]
        self.freed[key] = now
        self.races.extend(found)
        return found


@dataclass
class RelayConsumption:
    """What upstream's CI guards on the seq-lens relay keep (#30471, ``SGLANG_IS_IN_CI``):
    whether publish_ready was re-armed by a publish since the last resolve consumed it
    (``_publish_fresh``, FM6), and which new_seq_lens_buf rows a resolve gathered with no
    publish of them since (upstream poisons gathered rows with -1, FM7). The reference
    and the upstream adapter keep it from the publishes and resolves they see."""

    fresh: bool = False  # a publish recorded publish_ready since the last resolve
    recorded: bool = False  # publish_ready has been recorded at least once
    consumed: set[PoolRow] = field(default_factory=set)  # rows gathered, not re-published

    def publish(self, rows: list[PoolRow]) -> None:
        """A publish that recorded publish_ready for ``rows`` (speculative, non-empty)."""
        self.fresh = self.recorded = True
        self.consumed.difference_update(rows)

    def resolve(self, rows: tuple[PoolRow, ...]) -> tuple[bool | None, tuple[PoolRow, ...]]:
        """(consumed a fresh publish, or None before any; the rows gathered again)."""
        fresh = self.fresh if self.recorded else None
        self.fresh = False
        regathered = tuple(row for row in rows if row in self.consumed)
        self.consumed.update(rows)
        return fresh, regathered
