"""Scheduler in torch: the event loop, run_batch with isolation, retraction, results.

Upstream: ``managers/scheduler.py`` (event_loop_overlap / event_loop_normal,
get_next_batch_to_run, update_running_batch, run_batch, _forward_isolation,
record_batch_in_overlap, _apply_war_barrier; S2 snapshot, PR 31687),
``schedule_batch.py`` (retract_decode, release_req),
``scheduler_components/batch_result_processor.py`` (process_batch_result; J1 / S3).

This is the second implementation of :class:`spec.interface.SchedulerModel`: the same
operations as ``reference/``, with the state in torch tensors on ``streams.device`` and
the real stream structure (``gpu_impl/streams.py``)::

    overlap:    prepare(B_i) ─ run_batch(B_i) ─ WAR fence ─ process(R_{i-1})
    no overlap: prepare(B_i) ─ run_batch(B_i) ─ process(R_i)

    run_batch:  [S wait publish_ready, gather seq_lens; D copy → pinned; host sync D]
                F.wait_stream(S) ─ F: inputs, forward, publish → publish_ready,
                draft-extend, read_done, stash ─ C.wait_stream(F), result D2H,
                record copy_done:<step>
                (non-spec and early_fence: read_done before the publish; a spec
                prefill records none and the WAR fence is S.wait_stream(F))

Its checkers are the differential run against the reference (``get_observable_state``
after every operation) and the race detector (``gpu_impl/race.py``) listening to the
streams; it reports no spec Observations, so the ``observer`` argument is accepted for
the shared factory signature and ignored. ``faults`` re-introduces the historical bugs
of the catalogue (``spec/bugs.py``'s IDs) as the mistake upstream made, in torch code.

A radix cell (``Cell.radix``) keeps the release's prefix tree on the host and does what
the reference does with it (``docs/upstream-radix-sharing.md`` sections 1 and 2): each
admission candidate matched and pinned, the prefix's slots in the row, checkpoints at the
chunk stash and at a prefill's completion, the release by section 1.4's table, retraction's
immediate eviction, and the release's eviction demands (``gpu_impl/mem_cache.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from overlap_spec.gpu_impl.future_map import FutureMap
from overlap_spec.gpu_impl.mem_cache import (
    checkpoint_kv_cache,
    evict_after_retract,
    get_available_pages,
    get_decode_pages_needed,
    get_radix,
    match_prefix,
    release_kv_cache,
)
from overlap_spec.gpu_impl.memory import RadixCache, decode_kv
from overlap_spec.gpu_impl.req import Req
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.gpu_impl.schedule_batch import ResultBatch, ScheduleBatch
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.gpu_impl.worker import ForwardResult, ModelWorker
from overlap_spec.spec.bugs import BUG_IDS, LAST_REQUEST_OOM
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.happens_before import COPY, FORWARD, SCHEDULE
from overlap_spec.spec.interface import BatchState, ObservableState, Observer, RequestState
from overlap_spec.spec.state import IterationChoices, compute_env_token, get_last_prompt_token
from overlap_spec.spec.transitions import (
    INIT_NEW_TOKEN_RATIO,
    compute_admission,
    compute_chunk_continuation_end,
    compute_chunk_first_end,
    compute_committed_after_result,
    compute_committed_run,
    compute_decayed_ratio,
    compute_fill_len,
    compute_output_budget,
    compute_page_align_up,
    compute_pages_for_len,
    compute_prefill_check_tokens,
    compute_prefill_reserved_tokens,
    compute_ratio_after_retract,
    compute_retraction_order,
    compute_run_len,
    compute_running_token_offset,
    is_next_output_finishing_by_length,
)
from overlap_spec.spec.units import RequestId, StepId, TokenCount

# Historical bugs (spec/bugs.py's IDs) gpu_impl can re-introduce.
SUPPORTED_FAULTS = frozenset(BUG_IDS)

# The isolation snapshot of _forward_isolation: spec restores these fields after launch.
ISOLATED_FIELDS = ("forward_mode", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "input_ids",
                   "future_indices", "seq_len_cpu_ub")


@dataclass
class QueuedResult:
    batch: ResultBatch
    result: ForwardResult


@dataclass
class PrefillBudget:
    """``PrefillBudget``: offsets against the free tokens (the allocator's and the tree's
    evictable; a radix cell re-reads them per candidate, its prefix pinned), the running
    requests' estimate first (a float), then each admission's."""

    available: int
    total_offset: float = 0
    current_offset: int = 0

    def admits(self, asked: int) -> bool:
        return asked < self.available - self.total_offset

    def reserve(self, reserved: int, immediate: int) -> None:
        self.total_offset += reserved
        self.current_offset += immediate

    def has_capacity(self) -> bool:
        return (self.available - self.total_offset > 0
                and self.available - self.current_offset > 0)


class Scheduler:
    """The torch implementation of :class:`spec.interface.SchedulerModel`."""

    def __init__(self, config: ModelConfig, faults: frozenset[str] = frozenset(),
                 observer: Observer | None = None, streams: Streams | None = None,
                 device: torch.device | None = None, era: str = "B") -> None:
        unknown = set(faults) - SUPPORTED_FAULTS
        if unknown:
            raise ValueError(f"unknown fault IDs {sorted(unknown)}; gpu_impl supports "
                             f"{sorted(SUPPORTED_FAULTS)}")
        del observer  # see the module header: gpu_impl emits no spec Observations
        self.config = config
        self.streams = streams if streams is not None else Streams(
            device if device is not None else torch.device("cpu"))
        if era not in ("A", "B"):
            raise ValueError(f"era must be 'A' (the benchmark baseline) or 'B', not {era!r}")
        self.rt = Runtime(config, frozenset(faults), self.streams)
        self.rt.era = era
        self.future_map = FutureMap(self.rt)
        self.worker = ModelWorker(self.rt)
        self.requests: dict[RequestId, Req] = {}
        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.result_queue: deque[QueuedResult] = deque()
        # Real references: a tensor the forward reads stays alive for two launches.
        self.batch_record_buf: list[tuple[torch.Tensor, ...]] = [(), ()]
        self.batch_record_ct = 0
        self.next_rid = 0
        self.next_step = 0
        self.step_index = 0
        with self.streams.use(SCHEDULE):
            self.kv_write_faults = torch.zeros((), dtype=torch.int64, device=self.streams.device)
        # The global accept counters of the last processed result (RP3; B4 counts stale rows).
        self.num_correct_drafts = 0
        self.metrics_batch_size = 0
        self.ratio = INIT_NEW_TOKEN_RATIO  # NewTokenRatioTracker.current
        # Chunked prefill (preset chunked_prefill_size > 0): the one request whose prompt is
        # being prefilled in chunks, out of the running batch until its last chunk, and an
        # abort of it, applied at the top of the next step (process_pending_chunked_abort).
        self.chunked_req: Req | None = None
        self.pending_chunked_abort: Req | None = None
        self.paused = False  # pause_generation's _engine_paused
        # B38: the finished requests this step's filter dropped, still summed as running
        # load by the admission after it (empty without the fault).
        self.stale_load: list[Req] = []

    # ------------------------------------------------------------------ interface
    def admit(self, prompt_len: int, max_new_tokens: int, prebuilt: bool = False,
              family: int | None = None) -> RequestId:
        """Capped as ``init_req_max_new_tokens`` caps it; a prompt ``validate_input_length``
        refuses is queued as one token with an abort its first result promotes."""
        rid = RequestId(self.next_rid)
        self.next_rid += 1
        cfg = self.config
        capped, refused = compute_admission(prompt_len, max_new_tokens,
                                            cfg.preset.max_context_len, cfg.kv_tokens,
                                            cfg.page_size)
        refused = refused and not self.rt.has_fault("B24")  # B24: no validate_input_length
        if prebuilt:  # a PD-decode request needs room for one token past its first
            capped = max(capped, 2)
        req = Req(rid, TokenCount(1 if refused else prompt_len), TokenCount(capped),
                  get_last_prompt_token(rid if family is None else family, prompt_len, refused),
                  prebuilt=prebuilt,
                  to_finish="abort" if refused else None,
                  family=rid if family is None else family, refused=refused)
        self.requests[rid] = req
        self.waiting_queue.append(req)
        return rid

    def admit_prebuilt(self, prompt_len: int, max_new_tokens: int) -> RequestId:
        """A PD-decode request whose prefill ran elsewhere: KV and first token arrive ready."""
        return self.admit(prompt_len, max_new_tokens, prebuilt=True)

    def abort(self, rid: RequestId) -> None:
        """Waiting: leave the queue finished. Running: deferred until its next result."""
        req = self.requests.get(rid)
        if req is None or req.finished():
            return
        if req is self.chunked_req:
            # abort_request only marks it; the teardown waits for the next step's top.
            self.pending_chunked_abort = req
        if not req.waiting:
            req.to_finish = "abort"
            return
        self.waiting_queue.remove(req)
        req.waiting = False
        req.is_retracted = False
        req.finished_reason = "abort"

    def run_iteration(self, choices: IterationChoices) -> None:
        if self.paused:  # the loop ingests, then continues before get_next_batch_to_run
            return
        self.rt.shape = self.config.get_shape(choices.spec_steps)
        batch = self.get_next_batch_to_run(choices)
        self.cur_batch = batch
        if not self.config.cell.overlap:
            if batch is not None:
                result = self.run_batch(batch, choices)
                self.result_queue.append(QueuedResult(batch.copy(), result))
                self.pop_and_process()
        else:
            early = (choices.disable_overlap and self.last_batch is not None
                     and bool(self.result_queue))
            if early:
                # is_disable_overlap_for_batch: the pending result goes first.
                self.pop_and_process()
                if batch is not None and not self.rt.has_fault("B14"):
                    size = len(batch.reqs)
                    batch.filter_batch()  # drop what that result finished and released
                    batch.batch_is_full = batch.batch_is_full and len(batch.reqs) == size
                    if batch.is_empty():
                        batch = None
            if batch is not None:
                result = self.run_batch(batch, choices)
                self.apply_war_barrier()
                self.result_queue.append(QueuedResult(batch.copy(), result))
            if not early and self.last_batch is not None and self.result_queue:
                self.pop_and_process()
        if batch is None and (self.last_batch is None or not self.config.cell.overlap):
            self._reset_ratio_if_idle()
        self.last_batch = batch
        self.cur_batch = None

    def _reset_ratio_if_idle(self) -> None:
        """``on_idle`` past its fully-idle gate (nothing chunked either) resets the
        new-token ratio."""
        if self._is_fully_idle(sees_in_flight=True):
            self.ratio = INIT_NEW_TOKEN_RATIO

    def _is_fully_idle(self, sees_in_flight: bool) -> bool:
        """``is_fully_idle``; without ``sees_in_flight``, B35's check (before #12107): the
        batch in flight and the queued result unseen."""
        batches = (self.running_batch, self.last_batch) if sees_in_flight else (
            self.running_batch,)
        busy = [b for b in batches if b is not None and b.reqs]
        return (not busy and not (sees_in_flight and self.result_queue)
                and (self.paused or not self.waiting_queue) and self.chunked_req is None)

    def flush_cache(self) -> bool:
        """``Scheduler.flush_cache``: at full idle the tree reset, the pools back to their
        first state (the pages' owners cleared on S); refused otherwise."""
        if not self._is_fully_idle(sees_in_flight=not self.rt.has_fault("B35")):
            return False
        self.last_batch = None
        rt = self.rt
        rt.tree.reset()
        rt.req_to_token_pool.clear()
        rt.allocator.clear()
        pages = list(range(rt.allocator.total_pages))
        rt.kv.set_owner(pages, [-1] * len(pages))
        return True

    def pause_generation(self) -> None:
        """``pause_generation(mode="retract")`` (the reference's: the queued result first,
        then the running batch's, the unmerged extend batch's and the chunked request's
        unfinished requests released without caching and re-queued)."""
        self.paused = True
        if self.config.cell.overlap and self.last_batch is not None and self.result_queue:
            self.pop_and_process()
        running, last = self.running_batch, self.last_batch
        retract = [req for req in (running.reqs if running is not None else [])
                   if not req.finished()]
        if (last is not None and last.forward_mode in ("extend", "mixed")
                and last is not running and not self.rt.has_fault("B39")):
            retract += [req for req in last.reqs if not req.finished()]
        chunked = self.chunked_req
        if chunked is not None and not chunked.finished() and chunked not in retract:
            retract.append(chunked)
        self.last_batch = None
        for k, req in enumerate(retract):
            self.release_req(req, len(retract) - k)
        self.running_batch = None
        self.waiting_queue.extend(retract)
        self.chunked_req = None

    def continue_generation(self) -> None:
        self.paused = False

    def set_step_index(self, index: int) -> None:
        self.step_index = index

    def get_observable_state(self) -> ObservableState:
        """What the differential run compares; read without touching the stream record."""
        streams = self.streams
        table = self.rt.req_to_token_pool.req_to_token
        width = table.shape[1]
        cells = streams.read_for_observation(table)
        kv = streams.read_for_observation(self.rt.kv.kv_cache)
        requests = []
        for req in self.requests.values():
            status = "finished" if req.finished() else "waiting" if req.waiting else "running"
            row: tuple[int, ...] = ()
            if req.holds_kv and req.req_pool_idx is not None:
                start = req.req_pool_idx * width
                row = tuple(cells[start:start + min(req.kv_allocated_len, width)])
            contents = tuple(None if slot < 0 else decode_kv(kv[slot]) for slot in row)
            requests.append(RequestState(req.rid, status, tuple(req.output_ids),
                                         req.kv_committed_len, req.kv_allocated_len, row,
                                         req.cached_len, req.finished_reason,
                                         req.spec_verify_ct, req.spec_num_correct_drafts,
                                         req.get_protected_len(), contents))
        tree = self.rt.tree
        return ObservableState(
            requests=tuple(requests),
            running=self._get_batch_state(self.running_batch),
            last_batch=self._get_batch_state(self.last_batch),
            free_pages=get_available_pages(self.rt),
            kv_write_faults=streams.read_for_observation(self.kv_write_faults)[0],
            accept_counters=(self.num_correct_drafts, self.metrics_batch_size),
            new_token_ratio=self.ratio,
            batch_is_full=bool(self.running_batch is not None and self.running_batch.reqs
                               and self.running_batch.batch_is_full),
            tree_pages=(len(tree.get_pages()) if isinstance(tree, RadixCache)
                        else tree.evictable_size()),
            tree=tree.tree.view() if isinstance(tree, RadixCache) else None,
        )

    def _get_batch_state(self, batch: ScheduleBatch | None) -> BatchState | None:
        if batch is None or batch.is_empty():
            return None
        read = self.streams.read_for_observation
        cpu = batch.seq_lens_cpu
        return BatchState(tuple(req.rid for req in batch.reqs), tuple(read(batch.seq_lens)),
                          None if cpu is None else tuple(read(cpu)), batch.seq_lens_sum)

    # ------------------------------------------------------------------ scheduling
    def get_next_batch_to_run(self, choices: IterationChoices) -> ScheduleBatch | None:
        self.process_pending_chunked_abort()  # the release's first step (scheduler.py:3897)
        self.process_prebuilt()
        chunked = self.chunked_req
        if chunked is not None and chunked.extend_end > chunked.prefix_len:
            # stash_chunked_request: the chunk scheduled last is the next one's prefix,
            # which a radix cell checkpoints into its tree (checkpoint_kv_cache).
            chunked.prefix_len = chunked.extend_end
            if get_radix(self.rt) is not None:
                checkpoint_kv_cache(self.rt, chunked, chunked.extend_end)
        last = self.last_batch
        if last is not None and last.forward_mode in ("extend", "mixed"):
            size = len(last.reqs)
            excluded = self.get_merge_exclusions(last)
            last.filter_batch([j for j, req in enumerate(last.reqs)
                               if not req.finished() and id(req) not in excluded])
            last.chunked_req = None  # what is left of it joins the running batch
            if self.running_batch is not None and len(last.reqs) != size:
                self.running_batch.batch_is_full = False  # a request left
            if not last.is_empty():
                self._merge_into_running(last)
        running = self.running_batch
        self.stale_load = []
        if not self.config.cell.overshoot and running is not None:
            size = len(running.reqs)
            if self.rt.has_fault("B38"):
                self.stale_load = [req for req in running.reqs if req.finished()]
            running.filter_batch()  # the release: at every step, before admission
            running.batch_is_full = running.batch_is_full and len(running.reqs) == size
        if choices.allow_prefill:
            new_batch = self.get_new_batch_prefill()
            if new_batch is not None:
                return new_batch
        if running is None or running.is_empty() or running.is_prefill_only:
            return None  # a prefill-only batch is never decoded (the release)
        decodes = self.update_running_batch(running, choices.retract)
        return running if decodes and not running.is_empty() else None

    def _merge_into_running(self, batch: ScheduleBatch) -> None:
        if self.running_batch is None or self.running_batch.is_empty():
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)

    def _choose_prebuilt(self) -> list[Req]:
        """PD-decode requests in queue order while a pool row and their pages are free (the
        model's own rule: the release's prealloc queue is not modelled)."""
        limit = self.config.preset.max_running_requests
        running = 0 if self.running_batch is None else len(self.running_batch.reqs)
        free_rows = len(self.rt.req_to_token_pool.free_slots)
        budget = get_available_pages(self.rt)
        chosen: list[Req] = []
        for req in (r for r in self.waiting_queue if r.prebuilt):
            if running + len(chosen) >= limit or free_rows <= len(chosen):
                break
            fill_len = compute_fill_len(req.prompt_len, len(req.output_ids))
            need = compute_pages_for_len(fill_len, self.config.page_size)
            if need > budget:
                break
            budget -= need
            chosen.append(req)
        for req in chosen:
            self.waiting_queue.remove(req)
        return chosen

    def process_prebuilt(self) -> None:
        """PD decode: seed the relay on S for requests whose prefill ran elsewhere.

        No forward runs, so ``publish`` and ``stash`` run on the schedule stream and
        ``publish_ready`` is recorded there; the caller fence ``S.wait_stream(F)``
        (#35748) orders them after the in-flight forward's relay writes. B9 drops it.
        """
        chosen = self._choose_prebuilt()
        if not chosen:
            return
        streams = self.streams
        cell = self.config.cell
        if not self.rt.has_fault("B9"):
            streams.wait_stream(SCHEDULE, self.rt.forward_stream)
        batch = ScheduleBatch.prepare_for_extend(self.rt, chosen)
        first_tokens = [compute_env_token(req.rid, req.prompt_len, req.last_prompt_token)
                        for req in chosen]
        for req, token in zip(chosen, first_tokens, strict=True):
            req.output_ids.append(token)
        rows = batch.req_pool_indices
        if cell.is_spec:
            self.future_map.publish(rows, batch.seq_lens, SCHEDULE)
        self.future_map.stash(rows, streams.device_tensor(first_tokens), SCHEDULE)
        if cell.is_spec and cell.overlap:
            batch.future_indices = rows
        self._merge_into_running(batch)

    def get_merge_exclusions(self, last: ScheduleBatch) -> set[int]:
        """``reqs_to_exclude``: the chunked request, and the one the last prefill carried a
        middle chunk of, stay out of the running batch (ids of their ``Req``)."""
        return {id(req) for req in (self.chunked_req, last.chunked_req) if req is not None}

    def process_pending_chunked_abort(self) -> None:
        """``process_pending_chunked_abort``: the chunked request an abort marked finishes
        "abort" now and its KV is released without caching it (``checkpoint=False``); a
        chunk still in flight drains through the result's chunked branch."""
        req, self.pending_chunked_abort = self.pending_chunked_abort, None
        if req is None or req is not self.chunked_req:
            return
        self.chunked_req = None
        assert req.to_finish == "abort" and not req.finished(), f"r{req.rid}: no abort marked"
        req.finished_reason, req.to_finish = "abort", None
        release_kv_cache(self.rt, req, is_insert=False)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """``PrefillAdder``: the chunked request's next chunk first, then the waiting queue
        (FCFS, no skipping): the batch of what it admitted, or None; ``batch_is_full``
        latched when it ran out of rows or budget. The one request whose chunk stops short
        of its fill becomes the chunked request (and the batch's ``chunked_req``)."""
        running = self.running_batch
        if running is not None and running.is_empty():
            running.batch_is_full = False
        full = running is not None and running.batch_is_full
        queue = [r for r in self.waiting_queue if not r.prebuilt]
        continued = self.chunked_req
        if continued is None and (full or not queue):
            return None
        members = running.reqs if running is not None else []
        slots = min(self.config.preset.max_running_requests - len(members),
                    len(self.rt.req_to_token_pool.free_slots) + (continued is not None))
        if (radix := get_radix(self.rt)) is not None and (slots > 0 or continued is not None):
            # calc_priority, past the release's early returns (scheduler.py:4099-4133).
            radix.refresh_waiting([radix.make_key(req.get_fill_tokens()) for req in queue])
        chosen, ends, latch = self._add_requests([] if full else queue, members, slots,
                                                 continued)
        if running is not None and latch:
            running.batch_is_full = True
        for req in chosen:
            if req is not continued:
                self.waiting_queue.remove(req)
        if not chosen:
            return None
        self.chunked_req = next((req for req, end in zip(chosen, ends, strict=True) if end
                                 < compute_fill_len(req.prompt_len, len(req.output_ids))), None)
        batch = ScheduleBatch.prepare_for_extend(self.rt, chosen, ends)
        batch.chunked_req = self.chunked_req
        if self.config.preset.mixed_chunk:
            self.mix_running_decodes(batch)
        return batch

    def mix_running_decodes(self, batch: ScheduleBatch) -> None:
        """``is_mixed_chunk``: the running decodes, less the finished and those the queued
        result finishes by length, are prepared (a spec cell's by the v2 reserve) and ride
        in ``batch`` (``mix_with_running``) when their decode fits the KV the prefill left
        (``check_decode_mem``; else they sit out this step, not retracted). The running
        batch is then an empty one keeping the latch. The new-token ratio is not decayed:
        ``update_running_batch`` does not run."""
        running = self.running_batch
        if running is None or running.is_empty():
            return
        finishing = self._reqs_finishing_inflight(running)
        left_out = {id(req) for req in finishing}
        running.filter_batch([j for j, req in enumerate(running.reqs)
                              if not req.finished() and id(req) not in left_out])
        if finishing:
            running.batch_is_full = False
        if running.is_empty():
            return
        if not self._fits(sum(self._decode_pages_needed(running))):
            return
        running.prepare_for_decode()
        batch.mix_with_running(running)
        self.running_batch = ScheduleBatch.empty(self.rt, running.batch_is_full)

    def _add_requests(self, queue: list[Req], members: list[Req], slots: int,
                      continued: Req | None) -> tuple[list[Req], list[int], bool]:
        """(admitted, each one's extend end, latch): ``add_chunked_req`` for the chunked
        request, then ``add_one_req`` until one does not fit or nothing is left.

        With ``chunked_prefill_size`` each admission also spends the step's chunk budget
        (page-ceiled); a prompt that does not fit what is left is cut to its page-floored
        rest and reserves no ``max_new_tokens``; a spent budget stops without the latch."""
        page = self.config.page_size
        preset = self.config.preset
        # A mixed step sets one token per running decode aside (num_mixed_decode_tokens)
        # from both offsets and the chunk budget, before the running estimate.
        mixed = len(members) if preset.mixed_chunk else 0
        budget = PrefillBudget(get_available_pages(self.rt) * page, mixed, mixed)
        budget.total_offset += sum([
            compute_running_token_offset(r.max_new_tokens, len(r.output_ids), self.ratio)
            for r in [*members, *self.stale_load]])
        # rem_chunk_tokens
        chunk = preset.chunked_prefill_size - mixed if preset.chunked_prefill_size else None
        admitted: list[Req] = []
        ends: list[int] = []
        if continued is not None:
            assert chunk is not None
            if chunk <= 0:
                # The decodes set aside took the whole chunk budget: the chunked request
                # waits, and nothing is admitted this step.
                return [], [], False
            fill = compute_fill_len(continued.prompt_len, len(continued.output_ids))
            end = compute_chunk_continuation_end(
                continued.prefix_len, fill, chunk, int(budget.available - budget.total_offset),
                (len(continued.pages) + get_available_pages(self.rt)) * page)
            if end <= continued.prefix_len:
                return [], [], False  # the pool is held by the running decodes: it waits
            paged = compute_page_align_up(end - continued.prefix_len, page)
            budget.reserve(compute_prefill_reserved_tokens(
                end - continued.prefix_len, continued.max_new_tokens if end == fill else 0, page),
                paged + page)
            chunk -= paged
            admitted.append(continued)
            ends.append(end)
        if slots <= 0:
            return admitted, ends, continued is None
        # A radix cell matches each candidate as it comes (init_next_round_input) and pins
        # its matched path for its check (add_one_req's _lock_node); an admitted one keeps
        # that lock (_commit_prefill_admission), so the free KV moves within the pass.
        radix = get_radix(self.rt)
        for req in queue:
            if chunk is not None and chunk <= 0 and budget.has_capacity():
                return admitted, ends, False  # OTHER: the step's chunk budget is spent
            if len(admitted) >= slots:
                return admitted, ends, True
            out = len(req.output_ids)
            fill = compute_fill_len(req.prompt_len, out)
            prefix, node = 0, None
            if radix is not None:
                prefix, node = match_prefix(self.rt, req)
                req.matched_len = prefix  # the release's cpl from the match on (:1742)
                radix.lock(node)
                budget.available = get_available_pages(self.rt) * page
            if not budget.admits(compute_prefill_check_tokens(fill, req.max_new_tokens, out,
                                                              page, prefix)):
                if radix is not None and node is not None:
                    radix.unlock(node)
                return admitted, ends, bool(admitted or members)  # NO_TOKEN
            end = compute_chunk_first_end(fill, chunk, page, prefix)
            if end <= prefix:
                if radix is not None and node is not None:
                    radix.unlock(node)
                return admitted, ends, False  # OTHER: no whole page of the chunk budget
            assert req.lock is None, f"r{req.rid} admitted holding a tree lock"
            req.lock = node
            admitted.append(req)
            ends.append(end)
            budget.reserve(compute_prefill_reserved_tokens(
                end - prefix, req.max_new_tokens if end == fill else 0, page),
                compute_page_align_up(end - prefix, page) + page)
            if chunk is not None:
                chunk -= compute_page_align_up(end - prefix, page)
            if not budget.has_capacity():
                return admitted, ends, True
            if chunk is not None and chunk <= 0:
                return admitted, ends, False
        return admitted, ends, False

    def update_running_batch(self, batch: ScheduleBatch, forced_retracts: int) -> bool:
        """False: no decode this step (only requests the queued result finishes by
        length are short of KV, and that result frees theirs). A retraction re-estimates
        the new-token ratio, a decode without one decays it."""
        size = len(batch.reqs)
        finishing = self._reqs_finishing_inflight(batch)
        left_out = {id(req) for req in finishing}
        batch.filter_batch([j for j, req in enumerate(batch.reqs)
                            if not req.finished() and id(req) not in left_out])
        needed = sum(self._decode_pages_needed(batch))
        # The reference's order of the checks: in a radix cell each one evicts first.
        if batch.is_empty() or (finishing and not self._fits(needed)):
            batch.batch_is_full = False
            return False
        # In a radix cell check_decode_mem runs first, forced or not (scheduler.py:4469): it
        # evicts the shortfall, which a forced retraction's release then finds evicted.
        if forced_retracts > 0 and get_radix(self.rt) is not None:
            self._fits(needed)
        if forced_retracts > 0 or not self._fits(needed):
            self.retract_decode(batch, forced_retracts)
        else:
            self.ratio = compute_decayed_ratio(self.ratio)
        if len(batch.reqs) != size:
            batch.batch_is_full = False
        if batch.is_empty():
            return False
        batch.prepare_for_decode()
        return True

    def _reqs_finishing_inflight(self, batch: ScheduleBatch) -> list[Req]:
        """``Scheduler._reqs_finishing_inflight``: members of the queued result's batch
        that one more output token finishes by length (overlap only)."""
        if not self.config.cell.skips_finishing_decode or not self.result_queue:
            return []
        queued = {id(req) for req in self.result_queue[0].batch.reqs}
        return [req for req in batch.reqs
                if id(req) in queued and not req.finished()
                and is_next_output_finishing_by_length(len(req.output_ids),
                                                       req.max_new_tokens)]

    def retract_decode(self, batch: ScheduleBatch, forced: int) -> None:
        """Retract until the next decode fits, plus ``forced`` more; keep at least one, and
        abort that one when it alone does not fit (the release's out-of-memory abort).

        Victims in ``transitions.compute_retraction_order``: the release's policy sort
        (#32023), or from the back of the batch in the pre-claim era's spec cells.
        """
        needs = self._decode_pages_needed(batch)
        order = compute_retraction_order(self.config.cell,
                                         [len(req.output_ids) for req in batch.reqs],
                                         [req.prompt_len for req in batch.reqs])
        retracted: list[Req] = []

        def short_of_pages() -> bool:
            return not self._fits(sum(needs[j] for j in order))

        while len(order) > 1 and (forced > len(retracted) or short_of_pages()):
            req = batch.reqs[order.pop()]
            self.release_req(req, len(order))
            retracted.append(req)
        aborted = short_of_pages()
        if aborted and self.rt.has_fault("B25"):  # before #19881: the scheduler dies
            raise ValueError(LAST_REQUEST_OOM)
        if aborted:  # the last one alone does not fit: aborted, not a crash (reference)
            req = batch.reqs[order.pop()]
            self.release_req(req, 0)
            req.waiting = False
            req.is_retracted = False
            req.finished_reason = "abort"
        self.ratio = compute_ratio_after_retract([len(batch.reqs[j].output_ids) for j in order],
                                                 [batch.reqs[j].max_new_tokens for j in order])
        if retracted or aborted:
            batch.filter_batch(keep_indices=order)  # in the policy's order
            if not self.rt.has_fault("B37"):
                self.waiting_queue.extend(retracted)
            for req in retracted if self.rt.has_fault("B37") else ():
                req.waiting = False  # B37: dropped, not re-queued (the flag is membership)

    def _decode_pages_needed(self, batch: ScheduleBatch) -> list[int]:
        seq_lens: list[int | None] = [None] * len(batch.reqs)
        if not self.config.cell.is_spec:
            seq_lens = list(batch.get_seq_lens_host())
        return [get_decode_pages_needed(self.rt, req, s)
                for req, s in zip(batch.reqs, seq_lens, strict=True)]

    def _fits(self, pages_needed: int) -> bool:
        """``check_decode_mem``; in a radix cell it evicts the shortfall first, as the
        release's ``check_decode_capacity`` does (allocator/base.py:171-185)."""
        if get_radix(self.rt) is not None:
            self.rt.tree.evict(pages_needed, self.rt.allocator)
        return pages_needed <= get_available_pages(self.rt)

    def release_req(self, req: Req, remaining: int) -> None:
        """``release_req``: the KV released without caching (checkpoint=False); a radix
        cell's tree then evicts for the ``remaining`` requests at once."""
        release_kv_cache(self.rt, req, is_insert=False)
        evict_after_retract(self.rt, remaining)
        req.reset_for_retract(keep_prefix=self.rt.has_fault("B36"))
        req.matched_len = 0

    # ------------------------------------------------------------------ run_batch
    def run_batch(self, batch: ScheduleBatch, choices: IterationChoices) -> ForwardResult:
        rt = self.rt
        cell = self.config.cell
        streams = self.streams
        forward = rt.forward_stream
        step = StepId(self.next_step)
        self.next_step += 1
        if cell.is_spec and cell.overlap and batch.forward_mode == "decode":
            assert batch.future_indices is not None
            self.future_map.resolve_seq_lens_cpu(batch)
        if cell.overlap:
            streams.wait_stream(FORWARD, SCHEDULE)  # RAW fence at launch (ST1)
        decode_rows = batch.get_decode_rows() if batch.forward_mode == "mixed" else []
        if cell.is_spec and cell.overlap and batch.forward_mode == "mixed":
            # resolve_mixed_spec_tails, outside the isolation: the tails' lengths from the
            # relay, behind publish_ready, on the device and (D2H) the host.
            self.future_map.resolve_mixed_spec_tails(batch, len(decode_rows))
        if cell.overlap and batch.forward_mode == "decode":
            batch.input_ids = self.future_map.resolve_forward_inputs(batch.req_pool_indices)
        else:  # the last result's tokens, or a prefill's last input token (H2D)
            batch.input_ids = streams.device_tensor(
                [req.output_ids[-1] if req.output_ids else req.last_prompt_token
                 for req in batch.reqs], forward)
            if cell.overlap and decode_rows:
                # A mixed batch's decode rows take the relay's tokens (their last result
                # may still be queued); only their rows are gathered.
                positions = streams.device_tensor(decode_rows, forward)
                with streams.use(forward):
                    relayed = self.future_map.resolve_forward_inputs(
                        batch.req_pool_indices[positions])
                    batch.input_ids = batch.input_ids.index_put((positions,), relayed)
        snapshot = {name: getattr(batch, name) for name in ISOLATED_FIELDS}
        if cell.overlap:
            self.record_batch_in_overlap(batch)
        rows = batch.req_pool_indices

        def on_publish(new_seq_lens: torch.Tensor) -> None:
            self.future_map.publish(rows, new_seq_lens, forward)

        result = self.worker.forward_batch_generation(batch, step, choices, on_publish)
        with streams.use(forward):
            self.kv_write_faults.add_(result.kv_write_faults)
            if not cell.is_spec and cell.overlap:
                # Non-spec publish of seq_lens + 1: written, never read by the schedule side.
                self.future_map.publish(rows, result.new_seq_lens, forward)
            # Relay the sampled / bonus token (the last of the accepted run) for the next forward.
            starts = torch.arange(len(batch.reqs), dtype=torch.int64,
                                  device=streams.device) * result.stride
            last_tokens = result.next_token_ids[starts + result.accept_lens - 1]
        self.future_map.stash(rows, last_tokens, forward)
        if rt.has_fault("B13") and cell.is_spec and cell.overlap:
            # ngram kept forward-written accept state on spec_info for filter_batch: the
            # accept lengths as the forward leaves them after its last step (the reference
            # writes them there too), past the read-done point that orders S.
            with streams.use(forward):
                batch.spec_extra["accept_lens"] = result.accept_lens.clone()
        self._copy_result_to_host(result, forward)
        if cell.is_spec:  # isolation exit: spec restores every field
            for name, value in snapshot.items():
                setattr(batch, name, value)
        batch.input_ids = None
        if cell.overlap and rt.has_fault("B6"):
            # #25879 (#25944: non-spec too): a negative sentinel until the next resolve;
            # a non-spec prepare_for_decode reads it on S (#26020's alloc_for_decode).
            batch.seq_lens = -rows
        if cell.is_spec and cell.overlap:
            batch.future_indices = rows
        elif cell.is_spec:
            batch.future_indices = None
            if batch.forward_mode == "decode":  # an extend returns batch.seq_lens itself
                self._reapply_new_seq_lens(batch, result.new_seq_lens)
        return result

    def _copy_result_to_host(self, result: ForwardResult, forward: str) -> None:
        """Result D2H on the copy stream after the forward, then record copy_done:<step>."""
        streams = self.streams
        # Named "result": a read before copy_done is an ST5 race (spec classify_race).
        result.next_token_ids_cpu = streams.name(
            streams.host_tensor(result.next_token_ids.numel()), "result")
        result.accept_lens_cpu = streams.name(
            streams.host_tensor(result.accept_lens.numel()), "result")
        result.copy_done = f"copy_done:{result.step}"
        streams.wait_stream(COPY, forward)
        streams.copy_to_host(result.next_token_ids, result.next_token_ids_cpu, COPY)
        streams.copy_to_host(result.accept_lens, result.accept_lens_cpu, COPY)
        streams.record(result.copy_done, COPY)

    def _reapply_new_seq_lens(self, batch: ScheduleBatch, new_seq_lens: torch.Tensor) -> None:
        """Non-overlap spec: the batch takes the verified lengths at once (one host sync)."""
        streams = self.streams
        batch.seq_lens = new_seq_lens
        if batch.seq_lens_cpu is not None:
            host = streams.host_tensor(new_seq_lens.numel())
            streams.copy_to_host(new_seq_lens, host, SCHEDULE)
            streams.synchronize_stream(SCHEDULE)  # new_seq_lens.to("cpu")
            batch.seq_lens_cpu = host
            batch.seq_lens_sum = sum(streams.to_list(host, "run_batch seq_lens_sum"))

    def record_batch_in_overlap(self, batch: ScheduleBatch) -> None:
        """Keep the launched batch's tensors alive for two launches (B15: one)."""
        size = 1 if self.rt.has_fault("B15") else 2
        self.batch_record_ct = (self.batch_record_ct + 1) % size
        self.batch_record_buf[self.batch_record_ct] = batch.get_referenced_tensors()
        if size == 1:
            self.batch_record_buf[1] = ()

    def apply_war_barrier(self) -> None:
        """Right after launch (PR 31687): S waits for F_i's reads before writing again.

        The fine fence (read-done event, #28363) where the forward published one, else
        the coarse ``S.wait_stream(F)`` (a spec prefill), as in the reference.
        """
        event, self.worker.shared_read_done_event = self.worker.shared_read_done_event, None
        if self.rt.has_fault("B8"):
            return
        if event is not None:
            self.streams.wait_event(SCHEDULE, event)
        else:
            self.streams.wait_stream(SCHEDULE, self.rt.forward_stream)

    # ------------------------------------------------------------------ results
    def pop_and_process(self) -> None:
        queued = self.result_queue.popleft()
        self.process_batch_result(queued.batch, queued.result)

    def process_batch_result(self, batch: ResultBatch, result: ForwardResult) -> None:
        """Commit each live request's accepted run, cut at EOS and max_new_tokens.

        Stale rows (finished or retracted before this result) are skipped (#23456; B3,
        in the pre-claim era, still commits their run). The accept counters count live
        rows only (B4: all).
        """
        rt = self.rt
        cell = self.config.cell
        streams = self.streams
        streams.synchronize_event(result.copy_done)
        assert result.next_token_ids_cpu is not None and result.accept_lens_cpu is not None
        tokens = streams.to_list(result.next_token_ids_cpu, "process_batch_result tokens")
        accept_lens = streams.to_list(result.accept_lens_cpu, "process_batch_result accept")
        counted = [0, 0]  # correct drafts, batch size
        for j, req in enumerate(batch.reqs):
            accept, eos_at = accept_lens[j], result.eos_at[j]
            mode = result.get_row_mode(j)  # a mixed batch has both; a spec one, tails
            is_decode = mode == "decode"
            if mode == "extend" and req.inflight_middle_chunks > 0 and not req.is_retracted:
                # A middle chunk (process_batch_result_prefill's chunked branch): one off
                # the counter; no token, no finish check, no commit.
                req.inflight_middle_chunks -= 1
                if not (req.finished() or req.is_retracted):
                    req.hidden_ids = tuple(tokens[j * result.stride:j * result.stride + accept])
                if rt.has_fault("B4") or not (req.finished() or req.is_retracted):
                    counted[0] += accept - 1
                    counted[1] += 1
                continue
            was_finished = req.finished()
            stale = was_finished or req.is_retracted
            run_len = compute_run_len(accept, compute_output_budget(
                req.max_new_tokens, len(req.output_ids), req.to_finish is not None), eos_at)
            if rt.has_fault("B17") and cell.is_spec and is_decode and req.to_finish:
                run_len = accept  # the release: no finished_len once an abort is pending
            if rt.has_fault("B4") or not stale:
                counted[0] += accept - 1
                counted[1] += 1
            if stale:
                if is_decode and rt.has_fault("B3") and cell.is_spec and cell.preclaim:
                    # the commit loop before #23456: accept_len - 1 on every row
                    req.kv_committed_len = compute_committed_after_result(
                        cell, req.kv_committed_len, accept, False, False)
                elif is_decode:
                    req.kv_committed_len = compute_committed_after_result(
                        cell, req.kv_committed_len, run_len, True, was_finished)
                continue
            if is_decode:
                settled = (accept if rt.has_fault("B11")
                           else compute_committed_run(cell, accept, run_len))
                req.kv_committed_len = compute_committed_after_result(
                    cell, req.kv_committed_len, settled, False, False)
            start = j * result.stride
            req.output_ids += tokens[start:start + run_len]
            # Accepted past the visible output (an abort's run past the cap or EOS): KV a
            # radix cell's finish release keys.
            req.hidden_ids = tuple(tokens[start + run_len:start + accept])
            if cell.is_spec and is_decode:
                req.spec_verify_ct += 1
                req.spec_num_correct_drafts += accept - 1
            req.update_finish_state(eos_at is not None and eos_at < run_len)
            if mode == "tail" and not req.finished() and not rt.has_fault("B20"):
                # The second commit site (process_batch_result_prefill): a spec mixed tail
                # commits its pending bonus token's slot; a finishing one commits nothing.
                # B20 (#27971) dropped it.
                req.kv_committed_len += 1
            if req.finished() and req.holds_kv:
                release_kv_cache(rt, req, is_insert=True)
            elif (mode == "extend" and not req.finished() and req.holds_kv
                  and get_radix(rt) is not None):
                # A prefill that did not finish publishes its KV (checkpoint_kv_cache,
                # batch_result_processor.py:393-394); a decode row never does.
                checkpoint_kv_cache(rt, req, req.extend_end)
        # Only spec decode results feed the metrics (update_spec_metrics).
        metered = cell.is_spec and result.forward_mode == "decode"
        self.num_correct_drafts, self.metrics_batch_size = counted if metered else (0, 0)
