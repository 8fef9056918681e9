"""ScheduleBatch: the running batch as the schedule side holds it (upstream schedule_batch.py).

Three homes of a sequence length live here: the device ``seq_lens`` (a
:class:`DeviceTensor`), the host mirror ``seq_lens_cpu`` (or None on the
no-D2H path) and the lazy ``seq_lens_sum`` (None means "recompute").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from overlap_spec.reference.mem_cache import (
    alloc_for_decode,
    alloc_for_decode_spec_v2,
    alloc_for_extend,
    evict_for_batch,
    get_radix,
    get_spec_decode_demand,
)
from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import DeviceTensor, Runtime
from overlap_spec.spec import relation
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.transitions import (
    compute_decode_seq_len_ns,
    compute_fill_len,
    is_prefill_only,
)
from overlap_spec.spec.units import PoolRow


@dataclass
class ScheduleBatch:
    rt: Runtime
    reqs: list[Req]
    forward_mode: str  # "extend" | "decode" | "mixed" | "idle"
    seq_lens: DeviceTensor
    seq_lens_cpu: list[int] | None
    seq_lens_sum: int | None
    req_pool_indices: DeviceTensor
    req_pool_indices_cpu: list[PoolRow]
    future_indices: list[PoolRow] | None = None  # spec_info.future_indices (spec overlap)
    seq_len_cpu_ub: int | None = None
    input_ids: list[int] | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # Every member has max_new_tokens == 0 and the cell does not speculate
    # (Req.is_prefill_only): the release never decodes such a batch. Set at prepare time,
    # AND-ed at a merge, kept through a filter, as the release keeps it.
    is_prefill_only: bool = False
    # The release's admission latch on the running batch: set when a prefill found no row or
    # no budget left, cleared when a request leaves; while set, no admission is tried.
    batch_is_full: bool = False
    # The chunked request whose middle chunk this prefill carries (init_new's chunked_req).
    chunked_req: Req | None = None
    # A mixed batch's decode rows (``decoding_reqs``), after its prefill rows.
    decoding_reqs: list[Req] | None = None

    # -- construction ---------------------------------------------------------
    @classmethod
    def prepare_for_extend(cls, rt: Runtime, reqs: list[Req],
                           ends: list[int] | None = None) -> ScheduleBatch:
        """Prefill: a pool row and KV up to each extend's end (fill_len, or a chunk's end
        in ``ends``); every mirror exact.

        Per request: spec.relation.prepare_for_extend (or prepare_next_chunk), then its
        pages. Batch: seq_lens (pinned H2D), seq_lens_cpu, seq_lens_sum (eager).
        """
        lens: list[int] = []
        radix = get_radix(rt)
        if radix is not None:  # the batch's new tokens: each extend past its prefix
            p = rt.config.page_size
            starts = [req.prefix_len if req.holds_kv else 0 if req.lock is None
                      else len(radix.get_path_pages(req.lock)) * p for req in reqs]
            tails = [compute_fill_len(req.prompt_len, len(req.output_ids)) if ends is None
                     else ends[j]
                     for j, req in enumerate(reqs)]
            evict_for_batch(rt, sum(tails) - sum(starts), len(reqs))
        for j, req in enumerate(reqs):
            alloc_for_extend(rt, req, None if ends is None else ends[j])
            lens.append(req.kv_allocated_len)
        rows = [req.req_pool_idx for req in reqs]
        assert all(row is not None for row in rows)
        pool_rows = [PoolRow(row) for row in rows if row is not None]
        return cls(
            rt=rt,
            reqs=list(reqs),
            forward_mode="extend",
            seq_lens=rt.new_tensor(lens, "prepare_for_extend"),
            seq_lens_cpu=list(lens),
            seq_lens_sum=sum(lens),
            req_pool_indices=rt.new_tensor(pool_rows, "prepare_for_extend"),
            req_pool_indices_cpu=pool_rows,
            is_prefill_only=is_prefill_only(rt.config.cell.is_spec,
                                            [req.max_new_tokens for req in reqs]),
        )

    @classmethod
    def empty(cls, rt: Runtime, batch_is_full: bool) -> ScheduleBatch:
        """``ScheduleBatch(reqs=[], batch_is_full=...)``: what a mixed step leaves running."""
        return cls(rt=rt, reqs=[], forward_mode="idle", seq_lens=rt.new_tensor([], "init"),
                   seq_lens_cpu=[], seq_lens_sum=0, req_pool_indices=rt.new_tensor([], "init"),
                   req_pool_indices_cpu=[], batch_is_full=batch_is_full)

    def is_empty(self) -> bool:
        return not self.reqs

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """``mix_with_running``: the prepared decode rows ride after the prefill rows as
        one-token extends (spec.relation.mix_with_running), merged as ``merge_batch``
        merges; the batch is "mixed" and never prefill-only. A spec row (a tail) sits at its
        committed base with its bonus token pending: its length is the request's own,
        prompt + output (``Req.seqlen``, behind an in-flight verify under overlap, where the
        launch rebinds it from the relay), on the device and the host alike."""
        flag = self.is_prefill_only
        spec = self.rt.config.cell.is_spec
        tails = [req.prompt_len + len(req.output_ids) for req in running.reqs]
        lens = tails if spec else running.seq_lens.values
        for req, seq_len in zip(running.reqs, lens, strict=True):
            req.apply(relation.mix_with_running, seq_len)
        prefill_cpu = self.seq_lens_cpu
        self.merge_batch(running)
        if spec:
            values = self.seq_lens.values[:len(self.reqs) - len(tails)] + tails
            self.seq_lens = self.rt.new_tensor(values, "mix_with_running")
            self.seq_lens_cpu = None if prefill_cpu is None else prefill_cpu + tails
        self.forward_mode = "mixed"
        self.decoding_reqs = list(running.reqs)
        # B19 (before #10889): the flag stayed the prefill's (merge_batch did not AND it).
        self.is_prefill_only = flag if self.rt.has_fault("B19") else False

    def is_decode_row(self, j: int) -> bool:
        """Whether member ``j`` decodes: a decode batch's rows, a mixed batch's last ones."""
        if self.forward_mode == "mixed":
            assert self.decoding_reqs is not None
            return any(req is self.reqs[j] for req in self.decoding_reqs)
        return self.forward_mode == "decode"

    # -- decode -----------------------------------------------------------------
    def prepare_for_decode(self) -> None:
        """Non-spec: claim one slot, seq_lens + 1 as a new tensor (#30669), sum = None.
        Spec-v2: reserve up to max(cur, committed + 2A), page aligned; seq_lens untouched."""
        rt = self.rt
        self.forward_mode = "decode"
        if rt.config.cell.is_spec:
            demand = get_spec_decode_demand(rt, self.reqs)
            if demand > 0:
                evict_for_batch(rt, demand, len(self.reqs))
            for req in self.reqs:
                alloc_for_decode_spec_v2(rt, req)
            return
        evict_for_batch(rt, 0, len(self.reqs))
        old = self.seq_lens.values
        for req, seq_len in zip(self.reqs, old, strict=True):
            alloc_for_decode(rt, req, seq_len)
        # A new tensor with and without overlap, as the release does since #30669: under
        # overlap the in-flight forward still reads the old one.
        self.seq_lens = rt.new_tensor([compute_decode_seq_len_ns(s) for s in old],
                                      "prepare_for_decode")
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = [compute_decode_seq_len_ns(s) for s in self.seq_lens_cpu]
        self.seq_lens_sum = None

    # -- filter / merge -----------------------------------------------------------
    def filter_batch(self, keep_indices: list[int] | None = None) -> None:
        """Keep unfinished requests (or ``keep_indices``): gathers on S, sum = None."""
        if keep_indices is None:
            keep_indices = [j for j, req in enumerate(self.reqs) if not req.finished()]
        if keep_indices == list(range(len(self.reqs))):
            return
        rt = self.rt
        lens = rt.read_tensor(SCHEDULE, self.seq_lens, "filter_batch")
        rows = rt.read_tensor(SCHEDULE, self.req_pool_indices, "filter_batch")
        self.reqs = [self.reqs[j] for j in keep_indices]
        if self.decoding_reqs is not None:
            self.decoding_reqs = [req for req in self.decoding_reqs
                                  if any(req is kept for kept in self.reqs)]
        self.seq_lens = rt.new_tensor([lens[j] for j in keep_indices], "filter_batch")
        self.req_pool_indices = rt.new_tensor([rows[j] for j in keep_indices], "filter_batch")
        self.req_pool_indices_cpu = [self.req_pool_indices_cpu[j] for j in keep_indices]
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = [self.seq_lens_cpu[j] for j in keep_indices]
        if self.future_indices is not None:
            self.future_indices = [self.future_indices[j] for j in keep_indices]
        forward_state = self.extra.get("accept_lens")
        if isinstance(forward_state, DeviceTensor):  # B13: forward-produced spec state
            values = rt.read_tensor(SCHEDULE, forward_state, "spec_info.filter_batch")
            self.extra["accept_lens"] = rt.new_tensor([values[j] for j in keep_indices],
                                                      "spec_info.filter_batch")
        if not rt.has_fault("B1"):
            self.seq_lens_sum = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Concatenate; seq_lens_cpu is None if either side's is; sum = None."""
        rt = self.rt
        self.is_prefill_only = self.is_prefill_only and other.is_prefill_only
        lens = rt.read_tensor(SCHEDULE, self.seq_lens, "merge_batch")
        lens += rt.read_tensor(SCHEDULE, other.seq_lens, "merge_batch")
        rows = rt.read_tensor(SCHEDULE, self.req_pool_indices, "merge_batch")
        rows += rt.read_tensor(SCHEDULE, other.req_pool_indices, "merge_batch")
        self.seq_lens = rt.new_tensor(lens, "merge_batch")
        self.req_pool_indices = rt.new_tensor(rows, "merge_batch")
        self.req_pool_indices_cpu = self.req_pool_indices_cpu + other.req_pool_indices_cpu
        if self.seq_lens_cpu is None or other.seq_lens_cpu is None:
            self.seq_lens_cpu = None
        else:
            self.seq_lens_cpu = self.seq_lens_cpu + other.seq_lens_cpu
        if self.future_indices is not None and other.future_indices is not None:
            self.future_indices = self.future_indices + other.future_indices
        else:
            self.future_indices = None
        if not rt.has_fault("B1"):
            self.seq_lens_sum = None
        mine, theirs = self.extra.get("accept_lens"), other.extra.get("accept_lens")
        if isinstance(mine, DeviceTensor) or isinstance(theirs, DeviceTensor):
            # B13: spec_info.merge_batch concatenates the forward-produced state on S.
            values = [rt.read_tensor(SCHEDULE, t, "spec_info.merge_batch") if
                      isinstance(t, DeviceTensor) else [0] * len(b.reqs)
                      for t, b in ((mine, self), (theirs, other))]
            self.extra["accept_lens"] = rt.new_tensor(values[0] + values[1],
                                                      "spec_info.merge_batch")
        self.reqs = self.reqs + other.reqs

    # -- snapshot -----------------------------------------------------------------
    def copy(self) -> ScheduleBatch:
        """``SB.copy()`` for the result queue: a shallow list of the same Req objects."""
        decoding = None if self.decoding_reqs is None else list(self.decoding_reqs)
        return replace(self, reqs=list(self.reqs), extra={}, decoding_reqs=decoding)

    def get_referenced_tensors(self) -> set[int]:
        held = {self.seq_lens.tensor_id, self.req_pool_indices.tensor_id}
        held |= {t.tensor_id for t in self.extra.values() if isinstance(t, DeviceTensor)}
        return held
