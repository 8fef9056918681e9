"""Scheduler: the event loop, run_batch with isolation, retraction and result processing.

Upstream: ``managers/scheduler.py`` (event_loop_overlap / event_loop_normal,
get_next_batch_to_run, update_running_batch, run_batch, _forward_isolation,
record_batch_in_overlap, _apply_war_barrier), ``schedule_batch.py``
(retract_decode, release_req), ``batch_result_processor.py``
(process_batch_result_prefill / _decode, _resolve_spec_v2_tokens).

One call of :meth:`Scheduler.run_iteration` is one pass of the event loop::

    overlap:     prepare(B_i) → run_batch(B_i) → WAR fence → process(R_{i-1})
    no overlap:  prepare(B_i) → run_batch(B_i) → process(R_i)

``faults`` switches on historical bugs (digest section 5) by ID; with none the
reference is the intended design.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from overlap_spec.reference.future_map import FutureMap
from overlap_spec.reference.mem_cache import (
    checkpoint_kv_cache,
    evict_after_retract,
    get_available_pages,
    get_decode_pages_needed,
    get_radix,
    match_prefix,
    release_kv_cache,
)
from overlap_spec.reference.memory import RadixCache
from overlap_spec.reference.refinement import Refinement
from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import Runtime
from overlap_spec.reference.schedule_batch import ScheduleBatch
from overlap_spec.reference.worker import ForwardResult, ModelWorker
from overlap_spec.spec import relation
from overlap_spec.spec.bugs import BUG_IDS, LAST_REQUEST_OOM
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.happens_before import COPY, FORWARD, HOST, SCHEDULE
from overlap_spec.spec.interface import BatchState, ObservableState, Observer, RequestState
from overlap_spec.spec.state import (
    AdmissionView,
    BatchView,
    IsolationView,
    IterationChoices,
    LaunchMember,
    LaunchView,
    ObservationPoint,
    PlacementView,
    ProcessedEntry,
    PublishRecord,
    RelayGather,
    ResultView,
    compute_env_token,
)
from overlap_spec.spec.transitions import (
    INIT_NEW_TOKEN_RATIO,
    compute_admission,
    compute_chunk_continuation_end,
    compute_chunk_first_end,
    compute_decayed_ratio,
    compute_fill_len,
    compute_forward_write_width,
    compute_page_align_up,
    compute_pages_for_len,
    compute_prefill_check_tokens,
    compute_prefill_reserved_tokens,
    compute_ratio_after_retract,
    compute_retraction_order,
    compute_running_token_offset,
    is_next_output_finishing_by_length,
)
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

# Historical bugs (digest section 5) this reference can re-introduce, by ID.
SUPPORTED_FAULTS = frozenset(BUG_IDS)


@dataclass
class QueuedResult:
    batch: ScheduleBatch
    result: ForwardResult


class Scheduler:
    """The reference implementation of :class:`reference.interface.SchedulerModel`."""

    def __init__(self, config: ModelConfig, faults: frozenset[str] = frozenset(),
                 observer: Observer | None = None) -> None:
        unknown = set(faults) - SUPPORTED_FAULTS
        if unknown:
            raise ValueError(f"unknown fault IDs {sorted(unknown)}; this reference supports "
                             f"{sorted(SUPPORTED_FAULTS)}")
        self.config = config
        self.rt = Runtime(config, frozenset(faults))
        self.refinement = Refinement(self.rt, observer)
        self.future_map = FutureMap(self.rt)
        self.worker = ModelWorker(self.rt, self._emit_forward)
        self.requests: dict[RequestId, Req] = {}
        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.result_queue: deque[QueuedResult] = deque()
        self.batch_record_buf: list[set[int]] = [set(), set()]
        self.batch_record_ct = 0
        self.next_rid = 0
        self.next_step = 0
        self.last_processed_step: StepId | None = None
        self.step_index = 0
        self.isolation_entry: BatchView | None = None
        self.kv_write_fault_count = 0
        self.accept_counters = (0, 0)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # NewTokenRatioTracker.current
        # Chunked prefill (preset chunked_prefill_size > 0): the one request whose prompt is
        # being prefilled in chunks, out of the running batch until its last chunk, and an
        # abort of it, applied at the top of the next step (process_pending_chunked_abort).
        self.chunked_req: Req | None = None
        self.pending_chunked_abort: Req | None = None
        self.paused = False  # pause_generation's _engine_paused
        # B38: the finished requests this step's filter dropped, still counted as running
        # load by the admission that follows (empty without the fault).
        self.stale_load: list[Req] = []

    # ------------------------------------------------------------------ interface
    def admit(self, prompt_len: int, max_new_tokens: int, prebuilt: bool = False,
              family: int | None = None) -> RequestId:
        rid = RequestId(self.next_rid)
        self.next_rid += 1
        cfg = self.config
        capped, refused = compute_admission(prompt_len, max_new_tokens,
                                            cfg.preset.max_context_len, cfg.kv_tokens,
                                            cfg.page_size)
        refused = refused and not self.rt.has_fault("B24")  # B24: no validate_input_length
        req = Req(rid, TokenCount(prompt_len), TokenCount(capped), prebuilt, refused, family)
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
        if req.waiting:
            self.waiting_queue.remove(req)
        if req is self.chunked_req:
            # abort_request only marks it; the teardown waits for the next step's top.
            self.pending_chunked_abort = req
        req.apply(relation.abort)
        self.refinement.observe(ObservationPoint.ABORT, self)

    def run_iteration(self, choices: IterationChoices) -> None:
        hb = self.rt.hb
        if self.paused:  # the loop ingests, then continues before get_next_batch_to_run
            self.refinement.observe(ObservationPoint.ITERATION_END, self, host_syncs=(),
                                    launched_this_iteration=False,
                                    placement=self.get_placement_view())
            return
        syncs_before = len(hb.host_syncs)
        self.rt.shape = self.config.get_shape(choices.spec_steps)
        batch = self.get_next_batch_to_run(choices)
        self.cur_batch = batch  # the loop's local variable keeps its tensors alive
        if self.config.cell.overlap:
            early = choices.disable_overlap and self.last_batch is not None and bool(
                self.result_queue)
            if early:
                # is_disable_overlap_for_batch: the pending result is processed before launch.
                self.pop_and_process()
                if batch is not None and not self.rt.has_fault("B14"):
                    before = len(batch.reqs)
                    batch.filter_batch()  # drop what that result finished and released
                    if len(batch.reqs) < before:  # as the release's next filter would
                        batch.batch_is_full = False
                    self._observe_batch(ObservationPoint.FILTER_BATCH, batch)
                    if batch.is_empty():
                        batch = None
            if batch is not None:
                result = self.run_batch(batch, choices)
                self.apply_war_barrier()
                self.result_queue.append(QueuedResult(batch.copy(), result))
            if self.last_batch is not None and self.result_queue and not early:
                self.pop_and_process()
            elif self.last_batch is None and batch is None:
                self.on_idle()
        elif batch is not None:
            result = self.run_batch(batch, choices)
            self.result_queue.append(QueuedResult(batch.copy(), result))
            self.pop_and_process()
        else:
            self.on_idle()
        launched = batch is not None
        self.last_batch = batch
        self.cur_batch = None
        # "event:copy_done:7" -> "event:copy_done": the step number is not part of the kind.
        syncs = tuple(":".join(s.split(":")[:2]) for s in hb.host_syncs[syncs_before:])
        self.refinement.observe(ObservationPoint.ITERATION_END, self, host_syncs=syncs,
                                launched_this_iteration=launched,
                                placement=self.get_placement_view())

    def on_idle(self) -> None:
        """``Scheduler.on_idle``: once nothing runs, waits, is in flight or is being chunked
        (``is_fully_idle``), the new-token ratio starts over."""
        if self.is_fully_idle():
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def is_fully_idle(self, sees_in_flight: bool = True) -> bool:
        """``Scheduler.is_fully_idle``: nothing runs, waits or is being chunked, and (unless
        ``sees_in_flight`` is off: B35's check) no batch is in flight or has its result
        queued. While paused ``flush_cache`` ignores the waiting queue (``ignore_waiting``,
        scheduler.py:5520): no waiting request holds KV here."""
        idle = ((self.running_batch is None or self.running_batch.is_empty())
                and (self.paused or not self.waiting_queue) and self.chunked_req is None)
        return idle and (not sees_in_flight or (
            (self.last_batch is None or self.last_batch.is_empty()) and not self.result_queue))

    def flush_cache(self) -> bool:
        """``Scheduler.flush_cache``: when fully idle, the tree reset and the row and page
        pools back to their first state; refused otherwise, nothing changed. B35: the idle
        check before #12107, blind to the batch in flight."""
        if not self.is_fully_idle(sees_in_flight=not self.rt.has_fault("B35")):
            return False
        self.last_batch = None
        self.rt.tree.reset()
        self.rt.req_to_token.clear()
        self.rt.allocator.clear()
        self.refinement.observe(ObservationPoint.FLUSH_CACHE, self)
        return True

    def pause_generation(self) -> None:
        """``Scheduler.pause_generation(mode="retract")`` (scheduler.py:5817-5932): paused;
        under overlap the queued result is processed at once; then the running batch's
        unfinished requests, the last batch's when it is an extend batch not yet merged,
        and the chunked request, in that order, are released without caching
        (``retract_all``: ``release_req`` with the count left) and re-queued; the running
        batch emptied, its latch cleared, no chunked request. The pending chunked abort
        marker stays (the release keeps it; its next check drops it, the request holding
        no KV). The new-token ratio is untouched."""
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
        self.refinement.observe(ObservationPoint.PAUSE_GENERATION, self)

    def continue_generation(self) -> None:
        """``Scheduler.continue_generation``: ``_engine_paused`` cleared."""
        self.paused = False

    def set_step_index(self, index: int) -> None:
        self.step_index = index

    def get_observable_state(self) -> ObservableState:
        """The state a differential run compares (spec.interface.ObservableState)."""
        rt = self.rt
        requests = []
        for req in self.requests.values():
            status = "finished" if req.finished() else "waiting" if req.waiting else "running"
            row: tuple[int, ...] = ()
            if req.holds_kv and req.req_pool_idx is not None:
                width = min(req.kv_allocated_len, rt.req_to_token.width)
                row = tuple(rt.req_to_token.rows[req.req_pool_idx][:width])
            contents = tuple(rt.kv_cache.get(slot) for slot in row)
            requests.append(RequestState(req.rid, status, tuple(req.output_ids),
                                         req.kv_committed_len, req.kv_allocated_len, row,
                                         req.cached_len, req.finished_reason,
                                         req.spec_verify_ct, req.spec_num_correct_drafts,
                                         req.get_protected_len(), contents))
        return ObservableState(
            requests=tuple(requests),
            running=self._get_batch_state(self.running_batch),
            last_batch=self._get_batch_state(self.last_batch),
            free_pages=get_available_pages(rt),
            kv_write_faults=self.kv_write_fault_count,
            accept_counters=self.accept_counters,
            new_token_ratio=self.new_token_ratio,
            batch_is_full=bool(self.running_batch and self.running_batch.reqs
                               and self.running_batch.batch_is_full),
            tree_pages=len(rt.tree.get_pages()),
            tree=rt.tree.tree.view() if isinstance(rt.tree, RadixCache) else None,
        )

    def get_placement_view(self) -> PlacementView:
        """Where the requests are (RP10): the queue, the two batches, the results queued."""
        last = self.last_batch
        return PlacementView(
            waiting=tuple(req.rid for req in self.waiting_queue),
            running=() if self.running_batch is None else tuple(
                req.rid for req in self.running_batch.reqs),
            last=() if last is None else tuple(req.rid for req in last.reqs),
            last_mode=None if last is None else last.forward_mode,
            last_is_running=last is not None and last is self.running_batch,
            in_flight=tuple(tuple(req.rid for req in queued.batch.reqs)
                            for queued in self.result_queue))

    @staticmethod
    def _get_batch_state(batch: ScheduleBatch | None) -> BatchState | None:
        if batch is None or batch.is_empty():
            return None
        return BatchState(tuple(req.rid for req in batch.reqs), tuple(batch.seq_lens.values),
                          None if batch.seq_lens_cpu is None else tuple(batch.seq_lens_cpu),
                          batch.seq_lens_sum)

    # ------------------------------------------------------------------ scheduling
    def get_next_batch_to_run(self, choices: IterationChoices) -> ScheduleBatch | None:
        self.process_pending_chunked_abort()  # the release's first step (scheduler.py:3897)
        self.process_prebuilt()
        if self.chunked_req is not None and (
                self.chunked_req.extend_end > self.chunked_req.prefix_len):
            # The chunk scheduled last becomes the next one's prefix (checkpoint_kv_cache).
            self.chunked_req.apply(relation.stash_chunked_request)
            if get_radix(self.rt) is not None:
                checkpoint_kv_cache(self.rt, self.chunked_req, self.chunked_req.extend_end)
        last = self.last_batch
        if last is not None and last.forward_mode in ("extend", "mixed"):
            excluded = self.get_merge_exclusions(last)
            before = len(last.reqs)
            last.filter_batch([j for j, req in enumerate(last.reqs)
                               if not req.finished() and id(req) not in excluded])
            last.chunked_req = None  # what is left of it joins the running batch
            self._observe_batch(ObservationPoint.FILTER_BATCH, last)
            if len(last.reqs) < before and self.running_batch is not None:
                self.running_batch.batch_is_full = False
            if not last.is_empty():
                if self.running_batch is None or self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
                    self._observe_batch(ObservationPoint.MERGE_BATCH, self.running_batch)
        running = self.running_batch
        self.stale_load = []
        if not self.config.cell.overshoot and running is not None and running.reqs:
            # The release filters at every step, before admission counts the batch.
            before = len(running.reqs)
            if self.rt.has_fault("B38"):
                self.stale_load = [req for req in running.reqs if req.finished()]
            running.filter_batch()
            if len(running.reqs) != before:
                running.batch_is_full = False
                self._observe_batch(ObservationPoint.FILTER_BATCH, running)
        if choices.allow_prefill:
            new_batch = self.get_new_batch_prefill()
            if new_batch is not None:
                return new_batch
        if running is not None and not running.is_empty() and not running.is_prefill_only:
            decodes = self.update_running_batch(running, choices.retract)
            if decodes and not running.is_empty():
                return running
        return None

    def _choose_prebuilt(self) -> list[Req]:
        """PD-decode requests, in order, while a row and their pages are free (the release's
        prealloc queue is not modelled; this is the model's own rule for them)."""
        rt = self.rt
        running = 0 if self.running_batch is None else len(self.running_batch.reqs)
        chosen: list[Req] = []
        pages = 0
        for req in self.waiting_queue:
            if not req.prebuilt:
                continue
            if running + len(chosen) >= self.config.preset.max_running_requests:
                break
            if len(rt.req_to_token.free_slots) <= len(chosen):
                break
            need = compute_pages_for_len(
                compute_fill_len(req.prompt_len, len(req.output_ids)), self.config.page_size)
            if pages + need > get_available_pages(rt):
                break
            chosen.append(req)
            pages += need
        for req in chosen:
            self.waiting_queue.remove(req)
        return chosen

    def process_prebuilt(self) -> None:
        """PD decode: seed the relay on S for requests whose prefill ran elsewhere.

        There is no forward, so ``publish`` runs on the schedule stream and records
        ``publish_ready`` there. The caller fence ``S.wait_stream(F)`` (#35748) keeps that
        capture after the in-flight forward's publishes; B9 drops it.
        """
        rt = self.rt
        chosen = self._choose_prebuilt()
        if not chosen:
            return
        if not rt.has_fault("B9"):
            rt.hb.wait_stream(SCHEDULE, rt.forward_stream)
        batch = ScheduleBatch.prepare_for_extend(rt, chosen)
        rows = list(batch.req_pool_indices_cpu)
        tokens = []
        for req in chosen:
            self.future_map.on_row_acquired(req)
            tokens.append(compute_env_token(req.rid, req.prompt_len, req.last_prompt_token))
            req.apply(relation.process_prebuilt, tokens[-1])
        if self.config.cell.is_spec:
            self.future_map.publish(chosen, rows, list(batch.seq_lens.values), stream=SCHEDULE)
        self.future_map.stash(chosen, rows, tokens, stream=SCHEDULE)
        if self.config.cell.is_spec and self.config.cell.overlap:
            batch.future_indices = rows
        self._observe_batch(ObservationPoint.PREPARE_FOR_EXTEND, batch)
        if self.running_batch is None or self.running_batch.is_empty():
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)
            self._observe_batch(ObservationPoint.MERGE_BATCH, self.running_batch)

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
        req.apply(relation.finish_chunked_abort)
        release_kv_cache(self.rt, req, is_insert=False)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        chosen, ends, view = self.admit_by_budget()
        if not chosen:
            return None
        rt = self.rt
        continued = self.chunked_req
        # The (one) request whose chunk stops short of its fill is the chunked request.
        self.chunked_req = next((req for req, end in zip(chosen, ends, strict=True) if end
                                 < compute_fill_len(req.prompt_len, len(req.output_ids))), None)
        batch = ScheduleBatch.prepare_for_extend(rt, chosen, ends)
        for req in chosen:
            if req is not continued:
                self.future_map.on_row_acquired(req)
        batch.chunked_req = self.chunked_req
        self._observe_batch(ObservationPoint.PREPARE_FOR_EXTEND, batch, admission=view)
        if self.config.preset.mixed_chunk:
            self.mix_running_decodes(batch)
        return batch

    def mix_running_decodes(self, batch: ScheduleBatch) -> None:
        """Mixed chunks (``is_mixed_chunk``): the running decodes (spec ones as tails), less
        those their queued result finishes by length, ride in the prefill's batch when their
        decode fits the KV left after it (``check_decode_mem``; else they sit out this step,
        not retracted); the running batch is then an empty one that keeps the latch. No
        new-token-ratio decay: ``update_running_batch`` does not run."""
        running = self.running_batch
        if running is None or running.is_empty():
            return
        finishing = self._reqs_finishing_inflight(running)
        before = len(running.reqs)
        # filter_batch(reqs_to_exclude=finishing): the finished leave too.
        running.filter_batch([j for j, req in enumerate(running.reqs)
                              if not req.finished() and j not in finishing])
        if finishing:
            running.batch_is_full = False
        if len(running.reqs) != before:
            self._observe_batch(ObservationPoint.FILTER_BATCH, running)
        if running.is_empty() or not self._fits(running, set(range(len(running.reqs)))):
            return
        running.prepare_for_decode()
        self._observe_batch(ObservationPoint.PREPARE_FOR_DECODE, running)
        batch.mix_with_running(running)
        self.running_batch = ScheduleBatch.empty(self.rt, running.batch_is_full)

    def admit_by_budget(self) -> tuple[list[Req], list[int], AdmissionView | None]:
        """``get_new_batch_prefill`` with the release's ``PrefillAdder``: the chunked request
        continues first (``add_chunked_req``), then waiting requests in order, no skipping,
        while a row is left and each one asks for less than the budget has left
        (``spec.transitions``: the free KV, less each running request's remaining
        ``max_new_tokens`` x ``new_token_ratio`` and what the admitted ones reserved). The
        first that does not fit, or no row or no budget left after one, stops admission and,
        with anything running or admitted, latches ``batch_is_full`` until a request leaves.

        With ``chunked_prefill_size``, each admission also spends the step's chunk budget
        (page-ceiled); a prompt that does not fit what is left is cut to its page-floored
        rest and reserves no ``max_new_tokens`` (``_select_prefill_admission``); a spent
        budget stops admission without the latch. In a radix cell each waiting request is
        matched as it comes and asks only for its extend past the prefix, from the free KV
        with its own prefix pinned and the earlier admissions' locked (section 1.6 of
        ``docs/upstream-radix-sharing.md``); the admitted keep the lock. Returns the
        requests, each one's extend end and the view KV11 checks."""
        rt, cfg = self.rt, self.config
        running = self.running_batch
        members = [] if running is None else running.reqs
        if running is not None and not members:
            running.batch_is_full = False
        load = members + self.stale_load  # the running requests PrefillAdder sums (B38: more)
        waiting = [req for req in self.waiting_queue if not req.prebuilt]
        continued = self.chunked_req
        latched = running is not None and running.batch_is_full
        if continued is None and (latched or not waiting):
            return [], [], None
        rows = min(cfg.preset.max_running_requests - len(members),
                   len(rt.req_to_token.free_slots) + (continued is not None))
        if (radix := get_radix(rt)) is not None and (rows > 0 or continued is not None):
            # calc_priority, past the release's early returns (scheduler.py:4099-4133).
            radix.refresh_waiting([radix.make_key(req.get_fill_tokens()) for req in waiting])
        page = cfg.page_size
        available = get_available_pages(rt) * page
        # As PrefillBudget adds them: a mixed step's one token per running decode
        # (num_mixed_decode_tokens, else 0), then the running offsets' sum, then each
        # reservation.
        mixed = len(members) if cfg.preset.mixed_chunk else 0
        total: float = mixed
        current = mixed
        total += sum([compute_running_token_offset(req.max_new_tokens, len(req.output_ids),
                                                   self.new_token_ratio) for req in load])
        chunk = cfg.preset.chunked_prefill_size - mixed if cfg.preset.chunked_prefill_size \
            else None  # rem_chunk_tokens
        chosen: list[Req] = []
        ends: list[int] = []
        continuation, limit = None, None
        if continued is not None and chunk is not None and chunk <= 0:
            # The running decodes set aside the whole chunk budget: the release would prefill
            # an empty chunk (KV11). Only PD-prebuilt arrivals, which join the running batch
            # outside the budget, get here; the model's own rule: the chunk waits a step.
            return [], [], None
        if continued is not None:
            fill = compute_fill_len(continued.prompt_len, len(continued.output_ids))
            assert chunk is not None
            limit = (len(continued.pages) + get_available_pages(rt)) * page
            end = compute_chunk_continuation_end(
                continued.prefix_len, fill, chunk, int(available - total), limit)
            if end <= continued.prefix_len:
                return [], [], None  # the pool is held by the running decodes: it waits
            paged = compute_page_align_up(end - continued.prefix_len, page)
            total += compute_prefill_reserved_tokens(
                end - continued.prefix_len, continued.max_new_tokens if end == fill else 0, page)
            current += paged + page
            chunk -= paged
            chosen.append(continued)
            ends.append(end)
            continuation = (continued.rid, continued.prefix_len, fill, continued.max_new_tokens,
                            end)
        latch = rows <= 0 and continued is None
        # A radix cell matches each candidate as it comes (init_next_round_input) and pins
        # its matched path for its check (add_one_req's _lock_node, schedule_policy.py:
        # 1429-1431); an admitted one keeps that lock (_commit_prefill_admission, :1690), so
        # the free KV, read live by the release, moves within the pass.
        free = available
        prefixes: list[int] = []
        frees: list[int] = []
        for req in waiting if rows > 0 and not latched else []:
            if chunk is not None and chunk <= 0 and free - total > 0 and free - current > 0:
                break  # OTHER: the step's chunk budget is spent
            if len(chosen) >= rows:
                latch = True
                break
            fill = compute_fill_len(req.prompt_len, len(req.output_ids))
            prefix, node = 0, None
            if radix is not None:
                prefix, node = match_prefix(rt, req)
                req.matched_len = prefix  # the release's cpl from the match on (:1742)
                radix.lock(node)
                free = get_available_pages(rt) * page
                prefixes.append(prefix)
                frees.append(free)
            asked = compute_prefill_check_tokens(fill, req.max_new_tokens, len(req.output_ids),
                                                 page, prefix)
            end = compute_chunk_first_end(fill, chunk, page, prefix)
            if not asked < free - total or end <= prefix:
                if radix is not None and node is not None:
                    radix.unlock(node)
                # NO_TOKEN latches; OTHER (no whole page of the chunk budget left) does not.
                latch = latch or (not asked < free - total and (bool(chosen) or bool(members)))
                break
            assert req.lock is None, f"r{req.rid} admitted holding a tree lock"
            req.lock = node
            chosen.append(req)
            ends.append(end)
            total += compute_prefill_reserved_tokens(end - prefix, req.max_new_tokens
                                                     if end == fill else 0, page)
            current += compute_page_align_up(end - prefix, page) + page
            if chunk is not None:
                chunk -= compute_page_align_up(end - prefix, page)
            if not (free - total > 0 and free - current > 0):
                latch = True
                break
            if chunk is not None and chunk <= 0:
                break
        if running is not None and latch:
            running.batch_is_full = True
        for req in chosen:
            if req is not continued:
                self.waiting_queue.remove(req)
        view = AdmissionView(
            self.new_token_ratio, available, rows,
            tuple((req.max_new_tokens, len(req.output_ids)) for req in load),
            tuple((req.rid, compute_fill_len(req.prompt_len, len(req.output_ids)),
                   req.max_new_tokens, len(req.output_ids)) for req in waiting),
            len(chosen) - (continued is not None),
            chunk_size=cfg.preset.chunked_prefill_size, continued=continuation,
            continued_limit=limit,
            ends=tuple(ends[1:] if continued is not None else ends), latched=latched,
            mixed_decode_tokens=mixed, prefixes=tuple(prefixes), frees=tuple(frees))
        return chosen, ends, view

    def update_running_batch(self, batch: ScheduleBatch, forced_retracts: int) -> bool:
        """Filter, retract (or decay the new-token ratio), prepare the decode; False: no
        decode this step (the release returns None when only the requests left out below
        are short of KV). A batch that shrinks clears its admission latch."""
        initial = len(batch.reqs)
        finishing = self._reqs_finishing_inflight(batch)
        batch.filter_batch([j for j, req in enumerate(batch.reqs)
                            if not req.finished() and j not in finishing])
        self._observe_batch(ObservationPoint.FILTER_BATCH, batch)
        if batch.is_empty():
            batch.batch_is_full = False
            return False
        if finishing and not self._fits(batch, set(range(len(batch.reqs)))):
            batch.batch_is_full = False
            return False  # their queued result frees KV at the end of this step
        # In a radix cell check_decode_mem runs first, forced or not (scheduler.py:4469): it
        # evicts the shortfall, which a forced retraction's release then finds evicted.
        if forced_retracts and get_radix(self.rt) is not None:
            self._fits(batch, set(range(len(batch.reqs))))
        if forced_retracts or not self._fits(batch, set(range(len(batch.reqs)))):
            self.retract_decode(batch, forced_retracts)
        else:
            self.new_token_ratio = compute_decayed_ratio(self.new_token_ratio)
        if len(batch.reqs) < initial:
            batch.batch_is_full = False
        if batch.is_empty():
            return False
        batch.prepare_for_decode()
        self._observe_batch(ObservationPoint.PREPARE_FOR_DECODE, batch)
        return True

    def _reqs_finishing_inflight(self, batch: ScheduleBatch) -> set[int]:
        """Positions of the requests the queued result finishes by length (overlap only:
        ``next_output_finishes_by_length`` of a member of the last launched batch)."""
        if not self.config.cell.skips_finishing_decode or not self.result_queue:
            return set()
        queued = {id(req) for req in self.result_queue[0].batch.reqs}
        return {j for j, req in enumerate(batch.reqs)
                if id(req) in queued and not req.finished()
                and is_next_output_finishing_by_length(len(req.output_ids), req.max_new_tokens)}

    def _fits(self, batch: ScheduleBatch, keep: set[int]) -> bool:
        """``check_decode_mem``; in a radix cell it evicts the shortfall first, as the
        release's ``check_decode_capacity`` does (allocator/base.py:171-185)."""
        needed = self._pages_needed_for(batch, keep)
        if isinstance(self.rt.tree, RadixCache):
            self.rt.tree.evict(needed, self.rt.allocator)
        return needed <= get_available_pages(self.rt)

    def retract_decode(self, batch: ScheduleBatch, forced: int) -> None:
        """Retract until the next decode fits, plus ``forced`` more; keep at least one, and
        abort that one when it alone does not fit (the release's out-of-memory abort). The
        new-token ratio is then re-estimated over the requests kept, whatever was retracted.

        Victims in ``transitions.compute_retraction_order``: the release's policy sort
        (#32023), or from the back of the batch in the pre-claim era's spec cells.
        """
        retracted: list[Req] = []
        order = compute_retraction_order(self.config.cell,
                                         [len(req.output_ids) for req in batch.reqs],
                                         [req.prompt_len for req in batch.reqs])
        keep = set(order)
        while len(keep) > 1 and (
            forced > len(retracted)
            or not self._fits(batch, keep)
        ):
            victim = order.pop()
            keep.discard(victim)
            req = batch.reqs[victim]
            self.release_req(req, len(order))
            retracted.append(req)
        aborted = not self._fits(batch, keep)
        if aborted and self.rt.has_fault("B25"):  # before #19881: the scheduler dies
            raise ValueError(LAST_REQUEST_OOM)
        if aborted:
            # Even the last request does not fit: the release aborts it instead of crashing
            # (retract_decode: "Out of memory even after retracting all other requests");
            # its KV is released as at a retraction and it leaves as a waiting abort does,
            # finished "abort", in no queue. A result still in flight for it is stale.
            req = batch.reqs[order.pop()]
            self.release_req(req, 0)
            req.apply(relation.abort)
        kept = [batch.reqs[j] for j in order]
        self.new_token_ratio = compute_ratio_after_retract(
            [len(req.output_ids) for req in kept], [req.max_new_tokens for req in kept])
        if not retracted and not aborted:
            return
        batch.filter_batch(keep_indices=order)  # the policy's order, as the release keeps it
        if not self.rt.has_fault("B37"):  # B37: the retracted leave every queue
            self.waiting_queue.extend(retracted)
        self._observe_batch(ObservationPoint.RETRACT_DECODE, batch)

    def _pages_needed_for(self, batch: ScheduleBatch, keep: set[int]) -> int:
        return sum(get_decode_pages_needed(self.rt, batch.reqs[j], batch.seq_lens.values[j])
                   for j in keep)

    def release_req(self, req: Req, remaining: int) -> None:
        """``release_req``: the KV released without caching (checkpoint=False), then in a
        radix cell the tree evicts for the ``remaining`` requests at once."""
        release_kv_cache(self.rt, req, is_insert=False)
        evict_after_retract(self.rt, remaining)
        req.apply(relation.reset_for_retract, self.rt.faults)
        req.matched_len = 0

    # ------------------------------------------------------------------ run_batch
    def run_batch(self, batch: ScheduleBatch, choices: IterationChoices) -> ForwardResult:
        """Launch ``batch``: relay resolve, the RAW fence, the forward inside the
        isolation of the batch's fields, the token relay, the result copy; then the
        LAUNCH and RUN_BATCH observations."""
        cfg = self.config
        step = StepId(self.next_step)
        self.next_step += 1
        for req in batch.reqs:
            req.apply(relation.launch, step)
        unseeded = self._resolve_relay(batch)
        if cfg.cell.overlap:
            self.rt.hb.wait_stream(FORWARD, SCHEDULE)  # RAW fence at launch (ST1)
        rows = list(batch.req_pool_indices_cpu)
        decoding = [j for j in range(len(batch.reqs)) if batch.is_decode_row(j)]
        if cfg.cell.is_spec and cfg.cell.overlap and batch.forward_mode == "mixed":
            # resolve_mixed_spec_tails, outside the isolation: the tails' lengths from the
            # relay, behind publish_ready, on the device and (D2H) the host.
            tails = [batch.reqs[j] for j in decoding]
            tail_rows = [rows[j] for j in decoding]
            unseeded = self.future_map.get_unseeded_rows(tails, tail_rows)
            self.future_map.resolve_mixed_spec_tails(batch, len(decoding), tail_rows)
        gathers: list[RelayGather] = []
        # A prefill row's last input token (the prompt's, or the last output's); a decode
        # row's (a mixed batch's too) is the relay's under overlap, else the last output.
        inputs = [req.output_ids[-1] if req.output_ids else req.last_prompt_token
                  for req in batch.reqs]
        if cfg.cell.overlap and decoding:
            gathers, relayed = self.future_map.resolve_forward_inputs(
                [batch.reqs[j] for j in decoding], [rows[j] for j in decoding])
            for j, token in zip(decoding, relayed, strict=True):
                inputs[j] = token
        batch.input_ids = inputs
        members = self._launch_members(batch, rows)
        entry = self.refinement.get_batch_view(batch)
        self.isolation_entry = entry
        snapshot = self._isolation_snapshot(batch)
        if cfg.cell.overlap:
            self.record_batch_in_overlap(batch)
        result, publishes = self._forward(batch, step, choices, rows)
        self._relay_tokens(batch, rows, result)
        self._copy_result(result, step)
        reapplied = self._exit_isolation(batch, snapshot, rows, result)
        launch = LaunchView(
            step=step,
            forward_mode=batch.forward_mode,
            members=members,
            kv_write_faults=tuple(result.kv_write_faults),
            relay_gathers=tuple(gathers),
            unseeded_spec_rows=tuple(unseeded),
            publishes=tuple(publishes),
        )
        self.refinement.observe(ObservationPoint.LAUNCH, self, batch=batch, launch=launch)
        isolation = None
        if cfg.cell.is_spec:
            isolation = IsolationView(entry, self.refinement.get_batch_view(batch), reapplied)
        self.refinement.observe(ObservationPoint.RUN_BATCH, self, batch=batch, launch=launch,
                                isolation=isolation)
        return result

    def _resolve_relay(self, batch: ScheduleBatch) -> list[tuple[RequestId, PoolRow]]:
        """Spec overlap decode: ``resolve_seq_lens_cpu`` brings the published seq_lens back
        (observed); returns the rows nothing has published to yet."""
        cfg = self.config
        if not (cfg.cell.is_spec and cfg.cell.overlap and batch.forward_mode == "decode"):
            return []
        assert batch.future_indices is not None
        unseeded = self.future_map.get_unseeded_rows(batch.reqs, batch.future_indices)
        resolve = self.future_map.resolve_seq_lens_cpu(batch)
        self._observe_batch(ObservationPoint.RESOLVE_SEQ_LENS_CPU, batch, resolve=resolve)
        return unseeded

    def _launch_members(self, batch: ScheduleBatch, rows: list[PoolRow]
                        ) -> tuple[LaunchMember, ...]:
        """What the LAUNCH observation says of each member, read before the forward."""
        cfg = self.config
        relayed = cfg.cell.is_spec and cfg.cell.overlap
        return tuple(
            LaunchMember(
                rid=req.rid,
                holds_kv=req.holds_kv,
                seq_len=s,
                published_seq_len=self.future_map.new_seq_lens_buf[row] if relayed else None,
                kv_allocated_len=req.kv_allocated_len,
                ghost_kv_len=TokenCount(req.ghost.kv_len_true),
                # A mixed batch's decode row writes its one token (a spec tail too).
                write_width=TokenCount(1) if batch.forward_mode == "mixed"
                and batch.is_decode_row(j) else compute_forward_write_width(
                    self.rt.shape, batch.forward_mode, cfg.page_size, s),
            )
            for j, (req, s, row) in enumerate(zip(batch.reqs, batch.seq_lens.values, rows,
                                                  strict=True))
        )

    def _forward(self, batch: ScheduleBatch, step: StepId, choices: IterationChoices,
                 rows: list[PoolRow]) -> tuple[ForwardResult, list[PublishRecord]]:
        """The worker's forward; every publish it makes is recorded for the observation."""
        accept_lens = [choices.get_accept_len(j, self.rt.shape.max_accept_len)
                       for j in range(len(batch.reqs))]
        future_indices = list(rows)
        publishes: list[PublishRecord] = []

        def on_publish(values: list[int]) -> None:
            seq_in = batch.seq_lens.values
            for j, (req, value) in enumerate(zip(batch.reqs, values, strict=True)):
                accept = None if batch.forward_mode != "decode" else accept_lens[j]
                publishes.append(
                    PublishRecord(req.rid, future_indices[j], seq_in[j], accept, value))
            self.future_map.publish(batch.reqs, future_indices, values)

        result = self.worker.forward_batch_generation(batch, step, choices, on_publish)
        self.kv_write_fault_count += len(result.kv_write_faults)
        result.publishes = publishes
        return result, publishes

    def _relay_tokens(self, batch: ScheduleBatch, rows: list[PoolRow],
                      result: ForwardResult) -> None:
        """The forward stream's relay for the next launch: the non-spec seq_lens publish,
        the sampled / bonus token stash, and B13's forward-written accept state."""
        rt, cfg = self.rt, self.config
        if not cfg.cell.is_spec and cfg.cell.overlap:
            # Non-spec publish of seq_lens + 1: written, never read by the schedule side.
            self.future_map.publish(batch.reqs, list(rows), result.new_seq_lens)
        last_tokens = [
            result.next_token_ids[j * result.stride + result.accept_lens[j] - 1]
            for j in range(len(batch.reqs))
        ]
        self.future_map.stash(batch.reqs, list(rows), last_tokens, middle=batch.chunked_req)
        if rt.has_fault("B13") and cfg.cell.is_spec and cfg.cell.overlap:
            # ngram kept forward-written accept state on spec_info for filter_batch.
            batch.extra["accept_lens"] = rt.new_tensor(result.accept_lens, "verify accept_lens",
                                                       stream=rt.forward_stream)

    def _copy_result(self, result: ForwardResult, step: StepId) -> None:
        """Result D2H on the copy stream, then ``copy_done``."""
        hb = self.rt.hb
        result.copy_done = f"copy_done:{step}"
        hb.wait_stream(COPY, self.rt.forward_stream)
        hb.write(COPY, ("result", step), "copy_to_cpu")
        hb.record(result.copy_done, COPY)

    def _exit_isolation(self, batch: ScheduleBatch, snapshot: dict[str, Any],
                        rows: list[PoolRow], result: ForwardResult) -> tuple[int, ...] | None:
        """Isolation exit: spec restores every field (then, without overlap, re-applies a
        verify's new_seq_lens); non-spec keeps its own. Returns the re-applied seq_lens, if
        any."""
        rt, cfg, hb = self.rt, self.config, self.rt.hb
        if cfg.cell.is_spec:
            self._isolation_restore(batch, snapshot)
        batch.input_ids = None
        if not cfg.cell.is_spec:
            if cfg.cell.overlap and rt.has_fault("B6"):
                # #25944: the sentinel in non-spec overlap too; the next prepare_for_decode
                # reads it on S (alloc_for_decode, one of the readers #26020 lists).
                batch.seq_lens = rt.new_tensor([-row for row in rows], "run_batch sentinel")
            return None
        batch.future_indices = list(rows) if cfg.cell.overlap else None
        if not cfg.cell.overlap and batch.forward_mode != "decode":
            # An extend returns batch.seq_lens itself: nothing to re-apply, no host sync
            # (scheduler.py:4843, "copying it back would block the scheduler").
            return None
        if not cfg.cell.overlap:
            batch.seq_lens = rt.new_tensor(result.new_seq_lens, "run_batch re-apply")
            if batch.seq_lens_cpu is not None:
                hb.synchronize_stream(SCHEDULE)  # new_seq_lens.to("cpu")
                batch.seq_lens_cpu = list(result.new_seq_lens)
                batch.seq_lens_sum = sum(batch.seq_lens_cpu)
            return tuple(result.new_seq_lens)
        if rt.has_fault("B6"):
            # #25879: a negative sentinel until the next resolve replaces it.
            batch.seq_lens = rt.new_tensor([-row for row in rows], "run_batch sentinel")
        return None

    def _isolation_snapshot(self, batch: ScheduleBatch) -> dict[str, Any]:
        fields = ("forward_mode", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "input_ids",
                  "future_indices", "seq_len_cpu_ub")
        return {name: getattr(batch, name) for name in fields}

    def _isolation_restore(self, batch: ScheduleBatch, snapshot: dict[str, Any]) -> None:
        for name, value in snapshot.items():
            setattr(batch, name, value)

    def record_batch_in_overlap(self, batch: ScheduleBatch) -> None:
        """Keep the launched batch's tensors alive for two launches (batch_record_buf)."""
        size = 1 if self.rt.has_fault("B15") else 2
        self.batch_record_ct = (self.batch_record_ct + 1) % size
        self.batch_record_buf[self.batch_record_ct] = batch.get_referenced_tensors()
        if size == 1:
            self.batch_record_buf[1] = set()
        self._collect_tensors("record_batch_in_overlap")

    def _collect_tensors(self, operation: str) -> None:
        referenced: set[int] = set().union(*self.batch_record_buf)
        for batch in (self.running_batch, self.last_batch, self.cur_batch):
            if batch is not None:
                referenced |= batch.get_referenced_tensors()
        for queued in self.result_queue:
            referenced.add(queued.batch.req_pool_indices.tensor_id)
        self.rt.release_tensors(referenced, operation)

    def apply_war_barrier(self) -> None:
        """Right after launch (PR 31687): S waits for F_i's reads before writing again.

        The fine fence (read-done event, #28363) where the forward published one: after
        its last req_to_token read, which in a spec-v2 decode is the draft-extend's, so
        it also orders that forward's publish (not its stash). A forward that published
        none (a spec prefill) gets the coarse ``S.wait_stream(F)``, as in the release.
        """
        event, self.worker.shared_read_done_event = self.worker.shared_read_done_event, None
        if self.rt.has_fault("B8"):
            return
        if event is not None:
            self.rt.hb.wait_event(SCHEDULE, event)
        else:
            self.rt.hb.wait_stream(SCHEDULE, self.rt.forward_stream)

    # ------------------------------------------------------------------ results
    def pop_and_process(self) -> None:
        queued = self.result_queue.popleft()
        self.process_batch_result(queued.batch, queued.result)
        if self.config.cell.overlap:
            self._collect_tensors("process_batch_result")

    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        rt = self.rt
        cfg = self.config
        hb = rt.hb
        hb.synchronize_event(result.copy_done)
        hb.read(HOST, ("result", result.step), "process_batch_result")
        entries: list[ProcessedEntry] = []
        live_correct = 0
        live_count = 0
        all_correct = 0
        for j, req in enumerate(result.reqs):
            accept = result.accept_lens[j]
            eos_at = result.eos_at[j]
            stale = relation.is_stale(req.state)
            finished_before = req.finished()
            out_before, committed_before = len(req.output_ids), req.kv_committed_len
            start = j * result.stride
            tokens = tuple(result.next_token_ids[start:start + result.stride])
            mode = result.get_row_mode(j)
            middle = mode == "extend" and req.inflight_middle_chunks > 0
            req.apply(relation.process_result, cfg.cell, result.step, mode,
                      accept, eos_at, tokens, rt.faults)
            all_correct += accept - 1
            if not stale:
                live_correct += accept - 1
                live_count += 1
                req.hidden_ids = tokens[len(req.output_ids) - out_before:accept]
                if req.finished() and req.holds_kv:
                    release_kv_cache(rt, req, is_insert=True)
                elif (mode == "extend" and not middle and not req.finished() and req.holds_kv
                      and get_radix(rt) is not None):
                    # A prefill that did not finish publishes its KV (checkpoint_kv_cache,
                    # batch_result_processor.py:393-394); a decode row never does.
                    checkpoint_kv_cache(rt, req, req.extend_end)
            entries.append(ProcessedEntry(
                rid=req.rid, stale=stale, finished_before=finished_before,
                accept_len=accept, stride=result.stride,
                run_len=len(req.output_ids) - out_before if not stale else 0,  # the kept run
                output_before=out_before, output_after=len(req.output_ids),
                committed_before=committed_before, committed_after=req.kv_committed_len))
        # Upstream feeds update_spec_metrics from spec decode results only.
        metered = cfg.cell.is_spec and result.forward_mode == "decode"
        counted = all_correct if rt.has_fault("B4") else live_correct
        batch_size = len(result.reqs) if rt.has_fault("B4") else live_count
        if not metered:
            counted = batch_size = 0
        view = ResultView(
            step=result.step,
            entries=tuple(entries),
            num_correct_drafts=counted,
            metrics_batch_size=batch_size,
            previous_step=self.last_processed_step,
            pending_after=len(self.result_queue),
            metered=metered,
        )
        self.last_processed_step = result.step
        self.accept_counters = (counted, batch_size)
        self.refinement.observe(ObservationPoint.PROCESS_RESULT, self, result=view)

    # ------------------------------------------------------------------ observation
    def _observe_batch(self, point: ObservationPoint, batch: ScheduleBatch, **parts: Any) -> None:
        self.refinement.observe(point, self, batch=batch, **parts)

    def _emit_forward(self, kind: str, **parts: Any) -> None:
        point = ObservationPoint.INIT_NEW if kind == "init_new" else ObservationPoint.DRAFT_EXTEND
        batch = parts["batch"]
        fb = parts["forward"]
        forward = self.refinement.get_forward_view(fb, batch)
        isolation = None
        if point is ObservationPoint.DRAFT_EXTEND and self.isolation_entry is not None:
            isolation = IsolationView(self.isolation_entry, forward.schedule_batch, None)
        self.refinement.observe(point, self, batch=batch, forward=forward, isolation=isolation)

