"""ScheduleBatch in torch: device seq_lens, host mirror, lazy sum (upstream schedule_batch.py).

Three homes of a sequence length, as upstream after PR 26020 (digest 1.2):

- ``seq_lens``: a device int64 tensor, a faithful mirror of the host copy;
- ``seq_lens_cpu``: a host int64 tensor (pinned on CUDA), or None on the no-D2H path of
  ``resolve_seq_lens_cpu`` (PR 26128);
- ``seq_lens_sum``: a Python int, or None meaning "recompute lazily" (``prepare_for_decode``,
  ``filter_batch`` and ``merge_batch`` reset it; ``ForwardBatch.init_new`` backfills it).

``req_pool_indices`` is a device tensor with a host twin ``req_pool_indices_cpu``;
``future_indices`` (``spec_info.future_indices`` under spec overlap) is the device tensor
the relay is keyed by, equal in value to ``req_pool_indices`` (upstream FIXME "unify
future_indices and req_pool_indices"). Filter and merge are gathers and concatenations on
the schedule stream; they always build new tensors, because the in-flight forward may
still read the old ones (kept alive by ``Scheduler.record_batch_in_overlap``).

A mixed batch (``enable_mixed_chunk``) is a prefill whose ``mix_with_running`` appended
the prepared running decodes as one-token extends; ``decoding_reqs`` names those rows (by
identity, the way upstream's ``decoding_reqs`` does), a suffix of ``reqs``. In a spec cell
they are the mixed tails: each sits at its committed base with its bonus token pending.

``spec_extra`` is where the B13 mutant keeps the forward-produced ``accept_lens`` that
ngram's ``spec_info.filter_batch`` used to gather on S (PR 35198); it is empty otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overlap_spec.gpu_impl.mem_cache import (
    alloc_for_decode,
    alloc_for_extend,
    evict_for_batch,
    get_radix,
    grow_to,
)
from overlap_spec.gpu_impl.req import Req
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.spec.transitions import (
    compute_decode_seq_len_ns,
    compute_fill_len,
    compute_v2_alloc_target,
    is_prefill_only,
)

# compute_decode_seq_len_ns, applied to whole tensors: seq_lens' = seq_lens + 1.
NS_DECODE_STEP = compute_decode_seq_len_ns(0)


@dataclass
class ScheduleBatch:
    rt: Runtime
    reqs: list[Req]
    forward_mode: str  # "extend" | "decode" | "mixed" | "idle"
    seq_lens: torch.Tensor  # device
    seq_lens_cpu: torch.Tensor | None  # host
    seq_lens_sum: int | None
    req_pool_indices: torch.Tensor  # device
    req_pool_indices_cpu: torch.Tensor  # host
    future_indices: torch.Tensor | None = None  # device; spec overlap only
    seq_len_cpu_ub: int | None = None
    input_ids: torch.Tensor | None = None  # set at forward entry, None between iterations
    spec_extra: dict[str, torch.Tensor] = field(default_factory=dict)
    is_prefill_only: bool = False  # never decoded (reference/schedule_batch.py)
    batch_is_full: bool = False  # admission's latch, while this is the running batch
    # The chunked request whose middle chunk this prefill carries (init_new's chunked_req).
    chunked_req: Req | None = None
    # A mixed batch's decode rows, after its prefill rows (None unless mixed).
    decoding_reqs: list[Req] | None = None
    # The seq_lens a spec mixed launch rebound on F after reading it there
    # (``FutureMap.resolve_mixed_spec_tails``): kept alive past the WAR barrier.
    replaced_seq_lens: torch.Tensor | None = None

    @classmethod
    def prepare_for_extend(cls, rt: Runtime, reqs: list[Req],
                           ends: list[int] | None = None) -> ScheduleBatch:
        """Prefill: a row and positions up to each extend's end (fill_len, or a chunk's
        end in ``ends``); every mirror exact, the sum eager.

        Changes per request: req_pool_idx (kept by a continuing chunk), pages,
        kv_committed_len = kv_allocated_len = extend_end = the end, inflight_middle_chunks
        (+1 for a chunk short of fill_len), is_retracted = waiting = False. Leaves output_ids.
        """
        streams = rt.streams
        fill_lens: list[int] = [compute_fill_len(req.prompt_len, len(req.output_ids))
                                for req in reqs]
        lens = list(fill_lens) if ends is None else list(ends)
        radix = get_radix(rt)
        if radix is not None:  # the batch's new tokens: each extend past its prefix
            p = rt.config.page_size
            starts = [req.prefix_len if req.holds_kv else 0 if req.lock is None
                      else len(radix.get_path_pages(req.lock)) * p for req in reqs]
            evict_for_batch(rt, sum(lens) - sum(starts), len(reqs))
        alloc_for_extend(rt, reqs, lens, fill_lens)
        for req in reqs:
            req.is_retracted = False
            req.waiting = False
        rows = [req.req_pool_idx or 0 for req in reqs]
        seq_lens_cpu = streams.host_tensor(lens)
        return cls(
            rt=rt,
            reqs=list(reqs),
            forward_mode="extend",
            seq_lens=streams.device_tensor(lens),  # the pinned H2D upstream does
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=sum(lens),
            req_pool_indices=streams.device_tensor(rows),
            req_pool_indices_cpu=streams.host_tensor(rows),
            is_prefill_only=is_prefill_only(rt.config.cell.is_spec,
                                            [req.max_new_tokens for req in reqs]),
        )

    @classmethod
    def empty(cls, rt: Runtime, batch_is_full: bool) -> ScheduleBatch:
        """``ScheduleBatch(reqs=[], batch_is_full=...)``: the running batch a mixed step
        leaves behind, holding only the admission latch."""
        streams = rt.streams
        return cls(rt=rt, reqs=[], forward_mode="idle", seq_lens=streams.device_tensor([]),
                   seq_lens_cpu=streams.host_tensor([]), seq_lens_sum=0,
                   req_pool_indices=streams.device_tensor([]),
                   req_pool_indices_cpu=streams.host_tensor([]), batch_is_full=batch_is_full)

    def is_empty(self) -> bool:
        return not self.reqs

    def is_decode_row(self, j: int) -> bool:
        """Whether row ``j`` decodes: every row of a decode batch, a mixed batch's
        ``decoding_reqs``, no row of a prefill."""
        if self.forward_mode != "mixed":
            return self.forward_mode == "decode"
        assert self.decoding_reqs is not None, "a mixed batch without decoding_reqs"
        member = self.reqs[j]
        return any(req is member for req in self.decoding_reqs)

    def get_decode_rows(self) -> list[int]:
        """The positions of the rows that decode (see :meth:`is_decode_row`)."""
        return [j for j in range(len(self.reqs)) if self.is_decode_row(j)]

    def get_seq_lens_host(self) -> list[int]:
        """The host mirror as ints (non-spec cells always keep it)."""
        assert self.seq_lens_cpu is not None, "seq_lens_cpu is None on a path that needs it"
        return self.rt.streams.to_list(self.seq_lens_cpu, "read seq_lens_cpu")

    # -- decode -----------------------------------------------------------------
    def prepare_for_decode(self) -> None:
        """Non-spec: claim column seq_lens, seq_lens + 1 as a new tensor (#30669), sum None.
        Spec-v2: reserve up to max(cur, committed + reserve), page aligned; seq_lens untouched."""
        self.forward_mode = "decode"
        if self.rt.config.cell.is_spec:
            self._prepare_for_decode_spec_v2()
            return
        evict_for_batch(self.rt, 0, len(self.reqs))  # a radix cell's paged decode demand
        alloc_for_decode(self.rt, self.reqs, self.get_seq_lens_host())
        # A new tensor with and without overlap (#30669): under overlap the in-flight
        # forward still reads the old one.
        self.seq_lens = self.seq_lens + NS_DECODE_STEP
        if self.seq_lens_cpu is not None:
            with self.rt.streams.on_host():
                self.seq_lens_cpu = self.seq_lens_cpu + NS_DECODE_STEP
        self.seq_lens_sum = None

    def _prepare_for_decode_spec_v2(self) -> None:
        """Frame: kv_allocated_len (and kv_committed_len + 1 with the pre-claim) only."""
        rt = self.rt
        page_size = rt.config.page_size
        reserve = rt.get_decode_reserve()
        # B12 (no max(cur, ...) clamp) and B22 (no page rounding) are the target's faults.
        targets = [compute_v2_alloc_target(req.kv_committed_len, req.kv_allocated_len,
                                           reserve, page_size, rt.faults) for req in self.reqs]
        # ``alloc_for_spec_decode``'s num_needed_tokens: a radix cell evicts for it first.
        demand = sum(t - req.kv_allocated_len for t, req in zip(targets, self.reqs, strict=True))
        if demand > 0:
            evict_for_batch(rt, demand, len(self.reqs))
        grow_to(rt, self.reqs, targets)
        if rt.config.cell.preclaim:
            for req in self.reqs:
                req.kv_committed_len += 1

    # -- mixed chunks -------------------------------------------------------------
    def mix_with_running(self, running: ScheduleBatch) -> None:
        """``ScheduleBatch.mix_with_running``: the prepared decodes of ``running`` ride after
        this prefill's rows as one-token extends ending at their decode seq_len
        (``spec.relation.mix_with_running``: extend_end := seq_len; prefix_len kept), merged
        as ``merge_batch`` merges. The batch becomes "mixed" and is never prefill-only.

        A spec row (a tail) has no prepared seq_len: its length is the request's own,
        prompt + output (``Req.seqlen``; behind an in-flight verify under overlap, where the
        launch rebinds it from the relay), on the device (a new tensor) and the host alike;
        the host mirror is the prefill's plus those lengths, whatever ``running`` kept.

        Changes: extend_end of the running requests; this batch's rows, tensors,
        forward_mode, decoding_reqs, is_prefill_only (B19 keeps the prefill's). Leaves
        ``running`` as it was.
        """
        prefill_only = self.is_prefill_only
        spec = self.rt.config.cell.is_spec
        lens = ([req.prompt_len + len(req.output_ids) for req in running.reqs] if spec
                else running.get_seq_lens_host())
        for req, seq_len in zip(running.reqs, lens, strict=True):
            req.extend_end = seq_len
        prefill_cpu = self.seq_lens_cpu
        self.merge_batch(running)
        if spec:
            streams = self.rt.streams
            keep = len(self.reqs) - len(lens)
            self.seq_lens = torch.cat((self.seq_lens[:keep], streams.device_tensor(lens)))
            with streams.on_host():
                self.seq_lens_cpu = (None if prefill_cpu is None
                                     else torch.cat((prefill_cpu, streams.host_tensor(lens))))
        self.forward_mode = "mixed"
        self.decoding_reqs = list(running.reqs)
        # B19 (before #10889): the flag stayed the prefill's, as if the merge kept it.
        self.is_prefill_only = prefill_only if self.rt.has_fault("B19") else False

    # -- filter / merge -----------------------------------------------------------
    def filter_batch(self, keep_indices: list[int] | None = None) -> None:
        """Keep the unfinished requests (or ``keep_indices``): gathers on S, sum None."""
        if keep_indices is None:
            keep_indices = [j for j, req in enumerate(self.reqs) if not req.finished()]
        if keep_indices == list(range(len(self.reqs))):
            return
        streams = self.rt.streams
        keep = streams.device_tensor(keep_indices)
        keep_cpu = streams.host_tensor(keep_indices)
        self.reqs = [self.reqs[j] for j in keep_indices]
        if self.decoding_reqs is not None:  # a mixed batch's decode rows that are kept
            kept = {id(req) for req in self.reqs}
            self.decoding_reqs = [req for req in self.decoding_reqs if id(req) in kept]
        self.seq_lens = self.seq_lens[keep]
        self.req_pool_indices = self.req_pool_indices[keep]
        with streams.on_host():
            self.req_pool_indices_cpu = self.req_pool_indices_cpu[keep_cpu]
            if self.seq_lens_cpu is not None:
                self.seq_lens_cpu = self.seq_lens_cpu[keep_cpu]
        if self.future_indices is not None:
            self.future_indices = self.future_indices[keep]
        forward_state = self.spec_extra.get("accept_lens")
        if forward_state is not None:  # B13: slices forward-produced state on S
            self.spec_extra["accept_lens"] = forward_state[keep]
        if not self.rt.has_fault("B1"):
            self.seq_lens_sum = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Concatenate; seq_lens_cpu / future_indices None if either side's is; sum None."""
        self.is_prefill_only = self.is_prefill_only and other.is_prefill_only
        self.seq_lens = torch.cat((self.seq_lens, other.seq_lens))
        self.req_pool_indices = torch.cat((self.req_pool_indices, other.req_pool_indices))
        with self.rt.streams.on_host():
            self.req_pool_indices_cpu = torch.cat((self.req_pool_indices_cpu,
                                                   other.req_pool_indices_cpu))
            if self.seq_lens_cpu is None or other.seq_lens_cpu is None:
                self.seq_lens_cpu = None
            else:
                self.seq_lens_cpu = torch.cat((self.seq_lens_cpu, other.seq_lens_cpu))
        if self.future_indices is None or other.future_indices is None:
            self.future_indices = None
        else:
            self.future_indices = torch.cat((self.future_indices, other.future_indices))
        if not self.rt.has_fault("B1"):
            self.seq_lens_sum = None
        mine, theirs = self.spec_extra.get("accept_lens"), other.spec_extra.get("accept_lens")
        if mine is not None or theirs is not None:
            # B13: spec_info.merge_batch concatenates the forward-produced state on S.
            parts = [t if t is not None else torch.zeros(len(b.reqs), dtype=torch.int64,
                                                          device=b.seq_lens.device)
                     for t, b in ((mine, self), (theirs, other))]
            self.spec_extra["accept_lens"] = torch.cat(parts)
        self.reqs = self.reqs + other.reqs

    # -- what outlives the iteration ------------------------------------------------
    def copy(self) -> ResultBatch:
        """``SB.copy()`` for the result queue: the same Req objects and the pool rows."""
        return ResultBatch(list(self.reqs), self.forward_mode, self.req_pool_indices,
                           None if self.decoding_reqs is None else list(self.decoding_reqs))

    def get_referenced_tensors(self) -> tuple[torch.Tensor, ...]:
        """What the forward reads from this batch (the batch_record_buf keep-alive set)."""
        replaced = () if self.replaced_seq_lens is None else (self.replaced_seq_lens,)
        return (self.seq_lens, self.req_pool_indices, *replaced, *self.spec_extra.values())


@dataclass(frozen=True)
class ResultBatch:
    """The queued copy of a launched batch: its requests and the rows the forward used."""

    reqs: list[Req]
    forward_mode: str
    req_pool_indices: torch.Tensor
    decoding_reqs: list[Req] | None = None  # a mixed batch's decode rows
