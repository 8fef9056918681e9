"""FutureMap: the relay from the forward stream back to the schedule side (overlap_utils.py).

- ``publish`` (F): new_seq_lens_buf[rows] = new_seq_lens, then record publish_ready
  (spec only). The schedule side reads these rows.
- ``stash`` (F): output_tokens_buf[rows] = sampled / bonus tokens; only the next
  forward reads them, on the same stream (FIFO, no event).
- ``resolve_seq_lens_cpu`` (S, plus the private D stream): gate on publish_ready,
  gather seq_lens, and either copy the whole buffer to pinned memory and block on
  D, or (needs_cpu_seq_lens=False) leave seq_lens_cpu None with an upper bound.
- ``resolve_forward_inputs`` (F): gather the relay rows the forward consumes.

Rows are req_pool_idx; row 0 is the padding row. Each row remembers which owner
(request id, ghost epoch) last wrote it and how many stashes it took since its
last gather, which is what FM4 and FM5 are stated over. The map also keeps what
upstream's CI guards keep (#30471, ``SGLANG_IS_IN_CI``): whether publish_ready was
re-armed by a publish since the last resolve consumed it (``_publish_fresh``, FM6) and
which new_seq_lens_buf rows a resolve gathered with no publish since (upstream poisons
them with -1; FM7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import Runtime
from overlap_spec.reference.schedule_batch import ScheduleBatch
from overlap_spec.spec.happens_before import D2H, HOST, SCHEDULE, RelayConsumption
from overlap_spec.spec.state import RelayGather, ResolveView
from overlap_spec.spec.units import PoolRow, RequestId

PUBLISH_READY = "publish_ready"
Owner = tuple[RequestId, int]


def get_owner(req: Req) -> Owner:
    return (req.rid, req.ghost.epoch)


@dataclass
class FutureMap:
    rt: Runtime
    new_seq_lens_buf: list[int] = field(default_factory=list)
    new_seq_lens_cpu_pinned: list[int] = field(default_factory=list)
    output_tokens_buf: list[int] = field(default_factory=list)
    publisher: dict[PoolRow, Owner] = field(default_factory=dict)
    stasher: dict[PoolRow, Owner] = field(default_factory=dict)
    row_owner: dict[PoolRow, Owner] = field(default_factory=dict)
    stashes_since_gather: dict[PoolRow, int] = field(default_factory=dict)
    consumption: RelayConsumption = field(default_factory=RelayConsumption)  # FM6, FM7

    def __post_init__(self) -> None:
        rows = self.rt.config.preset.max_running_requests + 1
        self.new_seq_lens_buf = [-1] * rows
        self.new_seq_lens_cpu_pinned = [-1] * rows
        self.output_tokens_buf = [-1] * rows

    def on_row_acquired(self, req: Req) -> None:
        """A prefill hands the row to a new owner: its relay history starts over."""
        assert req.req_pool_idx is not None
        self.row_owner[req.req_pool_idx] = get_owner(req)
        self.stashes_since_gather[req.req_pool_idx] = 0

    # -- forward side ---------------------------------------------------------------
    def publish(self, reqs: list[Req], rows: list[PoolRow], values: list[int],
                stream: str | None = None) -> None:
        """On the current stream (normally F); records publish_ready there (spec only)."""
        rt = self.rt
        stream = stream or rt.forward_stream
        for req, row, value in zip(reqs, rows, values, strict=True):
            self.new_seq_lens_buf[row] = value
            self.publisher[row] = get_owner(req)
            rt.hb.write(stream, ("new_seq_lens_buf", row), "FutureMap.publish")
        if rt.config.cell.is_spec and rows:
            rt.hb.record(PUBLISH_READY, stream)
            self.consumption.publish(rows)

    def stash(self, reqs: list[Req], rows: list[PoolRow], tokens: list[int],
              stream: str | None = None, middle: Req | None = None) -> None:
        """``middle``: the request whose middle chunk this was; its token is written (the
        release stashes every extend row) but is no token to consume: the next chunk's
        stash overwrites it, so it is not counted for FM4."""
        rt = self.rt
        stream = stream or rt.forward_stream
        for req, row, token in zip(reqs, rows, tokens, strict=True):
            self.output_tokens_buf[row] = token
            self.stasher[row] = get_owner(req)
            if req is not middle:
                self.stashes_since_gather[row] = self.stashes_since_gather.get(row, 0) + 1
            rt.hb.write(stream, ("output_tokens_buf", row), "FutureMap.stash")

    def resolve_forward_inputs(self, reqs: list[Req], rows: list[PoolRow]
                               ) -> tuple[list[RelayGather], list[int]]:
        """Decode: gather output_tokens_buf[rows] on F (tokens or spec bonus), the forward's
        input_ids; consume once."""
        rt = self.rt
        gathers: list[RelayGather] = []
        tokens: list[int] = []
        for req, row in zip(reqs, rows, strict=True):
            tokens.append(self.output_tokens_buf[row])
            rt.hb.read(rt.forward_stream, ("output_tokens_buf", row), "resolve_forward_inputs")
            gathers.append(RelayGather(
                row=row,
                rid=req.rid,
                stashes_since_last_gather=self.stashes_since_gather.get(row, 0),
                written_by_current_owner=self.stasher.get(row) == get_owner(req),
            ))
            self.stashes_since_gather[row] = 0
        return gathers, tokens

    # -- schedule side ----------------------------------------------------------------
    def resolve_seq_lens_cpu(self, batch: ScheduleBatch) -> ResolveView | None:
        """Make SB.seq_lens (and the mirror) exact before the next spec forward (d1)."""
        rt = self.rt
        rows = batch.future_indices
        if rows is None:
            return None
        hb = rt.hb
        fresh, regathered = self.consumption.resolve(tuple(rows))
        if not rt.has_fault("B5"):
            hb.wait_event(SCHEDULE, PUBLISH_READY)
        uncovered: list[PoolRow] = []
        values: list[int] = []
        for row in rows:
            last = hb.last_write.get(("new_seq_lens_buf", row))
            if last is not None and not hb.event_covers(PUBLISH_READY, last):
                uncovered.append(row)
            hb.read(SCHEDULE, ("new_seq_lens_buf", row), "resolve_seq_lens_cpu")
            values.append(self.new_seq_lens_buf[row])
        batch.seq_lens = rt.new_tensor(values, "resolve_seq_lens_cpu")
        if not rt.config.cell.needs_cpu_seq_lens:
            batch.seq_lens_cpu = None
            batch.seq_lens_sum = None
            batch.seq_len_cpu_ub = (max((r.kv_allocated_len for r in batch.reqs), default=0)
                                    if rt.config.cell.cpu_ub else None)  # #27979 only
            return ResolveView(tuple(rows), tuple(uncovered), fresh, regathered)
        if not rt.has_fault("B5"):
            hb.wait_event(D2H, PUBLISH_READY)
        for index in range(len(self.new_seq_lens_buf)):  # the whole buffer, as upstream
            hb.read(D2H, ("new_seq_lens_buf", index), "resolve_seq_lens_cpu D2H copy")
            self.new_seq_lens_cpu_pinned[index] = self.new_seq_lens_buf[index]
            hb.write(D2H, ("new_seq_lens_cpu_pinned", index), "resolve_seq_lens_cpu D2H copy")
        hb.synchronize_stream(D2H)
        cpu: list[int] = []
        for row in batch.req_pool_indices_cpu:
            hb.read(HOST, ("new_seq_lens_cpu_pinned", row), "resolve_seq_lens_cpu host read")
            cpu.append(self.new_seq_lens_cpu_pinned[row])
        batch.seq_lens_cpu = cpu
        batch.seq_lens_sum = sum(cpu)
        batch.seq_len_cpu_ub = None
        return ResolveView(tuple(rows), tuple(uncovered), fresh, regathered)

    def resolve_mixed_spec_tails(self, batch: ScheduleBatch, tails: int,
                                 rows: list[PoolRow]) -> None:
        """``resolve_mixed_spec_tails`` (spec overlap, at the forward's input resolve): the
        last ``tails`` members' lengths lag the in-flight verify, so F waits publish_ready
        and rebinds them to the published length + 1; the host mirror follows through the
        private D2H copy (a host sync); the relay is not consumed (no poisoning)."""
        rt, hb = self.rt, self.rt.hb
        forward = rt.forward_stream
        if not tails:  # upstream returns at once (only the model's early filter empties it)
            return
        if not rt.has_fault("B5"):
            hb.wait_event(forward, PUBLISH_READY)
        fresh = []
        for row in rows:
            hb.read(forward, ("new_seq_lens_buf", row), "resolve_mixed_spec_tails")
            fresh.append(self.new_seq_lens_buf[row] + 1)
        keep = len(batch.reqs) - tails
        values = rt.read_tensor(forward, batch.seq_lens, "resolve_mixed_spec_tails")
        # The release drops the tensor F just cloned; the WAR barrier orders its reuse on S
        # after that read. The model keeps it referenced for the launch instead.
        batch.extra["replaced_seq_lens"] = batch.seq_lens
        batch.seq_lens = rt.new_tensor(values[:keep] + fresh, "resolve_mixed_spec_tails",
                                       stream=forward)
        if batch.seq_lens_cpu is None:
            return
        if not rt.has_fault("B5"):
            hb.wait_event(D2H, PUBLISH_READY)
        for index in range(len(self.new_seq_lens_buf)):  # the whole buffer, as upstream
            hb.read(D2H, ("new_seq_lens_buf", index), "resolve_mixed_spec_tails D2H copy")
            self.new_seq_lens_cpu_pinned[index] = self.new_seq_lens_buf[index]
            hb.write(D2H, ("new_seq_lens_cpu_pinned", index),
                     "resolve_mixed_spec_tails D2H copy")
        hb.synchronize_stream(D2H)
        for row in rows:
            hb.read(HOST, ("new_seq_lens_cpu_pinned", row), "resolve_mixed_spec_tails host read")
        batch.seq_lens_cpu = batch.seq_lens_cpu[:keep] + [
            self.new_seq_lens_cpu_pinned[row] + 1 for row in rows]
        batch.seq_lens_sum = sum(batch.seq_lens_cpu)

    def get_unseeded_rows(
        self, reqs: list[Req], rows: list[PoolRow]
    ) -> list[tuple[RequestId, PoolRow]]:
        """Rows a spec resolve read that their current owner never published (FM5)."""
        return [
            (req.rid, row)
            for req, row in zip(reqs, rows, strict=True)
            if self.publisher.get(row) != get_owner(req)
        ]
