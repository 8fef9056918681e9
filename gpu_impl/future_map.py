"""FutureMap in torch: the relay from the forward stream back to the schedule side.

Upstream: ``managers/overlap_utils.py`` of sglang 0.5.23 (PRs 25879, 26020, 26128, 26380,
26463, 35748; the digest's S1 snapshot is the closed PR 27979's branch,
docs/modelling-choices.md, "The FutureMap's source"). Buffers are device tensors indexed by
future index, which is the pool row (``req_pool_idx``); row 0 is the padding row.

- ``publish`` (on F): ``new_seq_lens_buf[rows] = new_seq_lens``, then record
  ``publish_ready`` (spec only; the non-spec publish is written and never read).
- ``stash`` (on F): ``output_tokens_buf[rows] = tokens``; only the next forward reads them,
  on the same stream, so no event.
- ``resolve_forward_inputs`` (on F): the next forward's input ids, gathered from the relay.
- ``resolve_seq_lens_cpu`` (on S, plus the private D2H stream D): S waits
  ``publish_ready`` and gathers ``seq_lens``; with ``needs_cpu_seq_lens`` D waits the same
  event, copies the whole buffer into the pinned host buffer and the host blocks on D;
  without it ``seq_lens_cpu`` stays None and ``seq_len_cpu_ub`` bounds it from
  ``kv_allocated_len`` (no D2H).
- ``resolve_mixed_spec_tails`` (on F after the RAW fence, plus D): a spec mixed batch's
  tails lag the in-flight verify, so F waits ``publish_ready`` and rebinds their seq_lens
  to the published length + 1; the host mirror follows through D as above.

::

    F : verify ─ publish(new_seq_lens_buf) ─ record publish_ready ─ draft_extend ─ stash
    S :                         wait publish_ready ─ gather seq_lens
    D :                         wait publish_ready ─ copy buf → pinned ─▶ host sync
"""

from __future__ import annotations

import torch

from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.gpu_impl.schedule_batch import ScheduleBatch
from overlap_spec.spec.happens_before import D2H, SCHEDULE

PUBLISH_READY = "publish_ready"


class FutureMap:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        streams = rt.streams
        rows = rt.config.preset.max_running_requests + 1
        with streams.use(SCHEDULE):
            self.new_seq_lens_buf = torch.full((rows,), -1, dtype=torch.int64,
                                               device=streams.device)
            self.output_tokens_buf = torch.full((rows,), -1, dtype=torch.int64,
                                                device=streams.device)
        self.new_seq_lens_cpu_pinned = streams.host_tensor(rows)
        streams.name(self.new_seq_lens_buf, "new_seq_lens_buf")
        streams.name(self.output_tokens_buf, "output_tokens_buf")
        streams.name(self.new_seq_lens_cpu_pinned, "new_seq_lens_cpu_pinned")

    # -- forward side ---------------------------------------------------------------
    def publish(self, rows: torch.Tensor, new_seq_lens: torch.Tensor, stream: str) -> None:
        """On ``stream`` (F, or S for PD prebuilt requests); records publish_ready (spec)."""
        streams = self.rt.streams
        with streams.use(stream):
            self.new_seq_lens_buf.index_put_((rows,), new_seq_lens)
        if self.rt.config.cell.is_spec and rows.numel() > 0:
            streams.record(PUBLISH_READY, stream)

    def stash(self, rows: torch.Tensor, tokens: torch.Tensor, stream: str) -> None:
        with self.rt.streams.use(stream):
            self.output_tokens_buf.index_put_((rows,), tokens)

    def resolve_forward_inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """Decode input ids: the sampled / bonus token each row stashed (on F)."""
        with self.rt.streams.use(self.rt.forward_stream):
            return self.output_tokens_buf[rows]

    # -- schedule side ----------------------------------------------------------------
    def resolve_seq_lens_cpu(self, batch: ScheduleBatch) -> None:
        """Make SB.seq_lens (and the mirror) exact before the next spec forward.

        B5 drops both publish_ready waits: S and D read the buffer while F may still
        be writing it (values are the same here; the race detector sees it).
        """
        rows = batch.future_indices
        if rows is None:
            return
        rt = self.rt
        streams = rt.streams
        if rt.era == "A":
            self._resolve_era_a(batch, rows)
            return
        if not rt.has_fault("B5"):
            streams.wait_event(SCHEDULE, PUBLISH_READY)
        with streams.use(SCHEDULE):
            batch.seq_lens = self.new_seq_lens_buf[rows]
        if not rt.config.cell.needs_cpu_seq_lens:
            batch.seq_lens_cpu = None
            batch.seq_lens_sum = None
            batch.seq_len_cpu_ub = (max((req.kv_allocated_len for req in batch.reqs), default=0)
                                    if rt.config.cell.cpu_ub else None)  # #27979 only
            return
        self._copy_relay_to_host()
        with streams.on_host():
            seq_lens_cpu = self.new_seq_lens_cpu_pinned[batch.req_pool_indices_cpu]
        batch.seq_lens_cpu = seq_lens_cpu
        batch.seq_lens_sum = sum(streams.to_list(seq_lens_cpu, "resolve_seq_lens_cpu sum"))
        batch.seq_len_cpu_ub = None

    def resolve_mixed_spec_tails(self, batch: ScheduleBatch, tails: int) -> None:
        """``resolve_mixed_spec_tails`` (spec overlap, at the forward's input resolve, outside
        the isolation): the last ``tails`` rows' lengths lag the in-flight verify, so F waits
        publish_ready, gathers their published lengths and rebinds ``seq_lens`` to a new
        tensor holding them + 1 (the old one, read on F, is kept alive on the batch until
        the WAR barrier has ordered that read). The host mirror, where kept, follows through
        the private D2H copy and a host sync, with the sum. The relay is not consumed.

        B5 drops both publish_ready waits, as in ``resolve_seq_lens_cpu``.
        """
        rt = self.rt
        streams = rt.streams
        forward = rt.forward_stream
        if not tails:  # upstream returns at once (only the model's early filter empties it)
            return
        keep = len(batch.reqs) - tails
        if not rt.has_fault("B5"):
            streams.wait_event(forward, PUBLISH_READY)
        with streams.use(forward):
            fresh = self.new_seq_lens_buf[batch.req_pool_indices[keep:]]
            seq_lens = torch.cat((batch.seq_lens[:keep], fresh + 1))
        batch.replaced_seq_lens = batch.seq_lens
        batch.seq_lens = seq_lens
        if batch.seq_lens_cpu is None:
            return
        self._copy_relay_to_host()
        with streams.on_host():
            fresh_cpu = self.new_seq_lens_cpu_pinned[batch.req_pool_indices_cpu[keep:]]
            batch.seq_lens_cpu = torch.cat((batch.seq_lens_cpu[:keep], fresh_cpu + 1))
        batch.seq_lens_sum = sum(streams.to_list(batch.seq_lens_cpu,
                                                 "resolve_mixed_spec_tails sum"))

    def _copy_relay_to_host(self) -> None:
        """The private D2H copy behind publish_ready (B5 drops the wait): the whole buffer, as
        upstream, one copy, then a host sync; the caller picks rows on the host."""
        streams = self.rt.streams
        if not self.rt.has_fault("B5"):
            streams.wait_event(D2H, PUBLISH_READY)
        streams.copy_to_host(self.new_seq_lens_buf, self.new_seq_lens_cpu_pinned, D2H)
        streams.synchronize_stream(D2H)

    def _resolve_era_a(self, batch: ScheduleBatch, rows: torch.Tensor) -> None:
        """The era-A baseline (digest 3.4, before #25465), for ``bench gpu`` only.

        The host blocks on the verify (``verify_done``; here the publish_ready event,
        recorded at the same point) and the mirror is a blocking ``.cpu()`` on S: two
        host syncs before the next batch can be prepared, one of them on the schedule
        stream, where today's design has a private-stream sync.
        """
        streams = self.rt.streams
        streams.synchronize_event(PUBLISH_READY)
        with streams.use(SCHEDULE):
            batch.seq_lens = self.new_seq_lens_buf[rows]
        if not self.rt.config.cell.needs_cpu_seq_lens:
            batch.seq_lens_cpu = None
            batch.seq_lens_sum = None
            batch.seq_len_cpu_ub = (max((req.kv_allocated_len for req in batch.reqs), default=0)
                                    if self.rt.config.cell.cpu_ub else None)  # #27979 only
            return
        host = streams.host_tensor(len(batch.reqs))
        streams.copy_to_host(batch.seq_lens, host, SCHEDULE)
        streams.synchronize_stream(SCHEDULE)
        batch.seq_lens_cpu = host
        batch.seq_lens_sum = sum(streams.to_list(host, "resolve_seq_lens_cpu sum"))
        batch.seq_len_cpu_ub = None
