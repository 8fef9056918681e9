"""``UpstreamScheduler``: sglang's own scheduler behind :class:`spec.interface.SchedulerModel`.

The third implementation of the interface, after ``reference/`` and ``gpu_impl/``. Nothing
here decides anything the scheduler decides: operations go to the release's code
(``Scheduler._add_request_to_queue``, ``Scheduler.abort_request``, one pass of
``run_event_loop``), and this class only maps upstream state to the spec's observations
(the refinement function) at upstream's observation points.

Refinement (upstream → spec). What a request, a batch and the allocator are read from is
:mod:`upstream.fields` (``REQUEST_FIELDS``, ``BATCH_FIELDS``, ``read_allocator``), the one
map this tier and the trace shim share. What this class adds, a reviewer checks here:

============================  ============================================================
spec                          upstream 0.5.23
============================  ============================================================
RequestView.rid               ``Req.rid`` = ``"r<n>"``, n the spec's id
finished                      ``req.finished()``, or aborted while waiting (no reason)
Observation.chunked_rid       ``Scheduler.chunked_req``
Observation.placement         at ITERATION_END: ``waiting_queue``, ``running_batch.reqs``,
                              ``last_batch`` (its reqs, mode, identity with the running
                              batch), ``result_queue``'s batch copies (overlap only)
release_count, cached_len,    counted by the ``tree_cache.on_release`` hook inside
committed_at_release          ``release_kv_cache``; cached = ``owned_kv_len()`` when
                              checkpointed (finish)
ForwardView                   the release's ``ForwardBatch`` (``init_new``; at
                              DRAFT_EXTEND after ``prepare_for_draft_extend``'s +D_tok):
                              ``batch_size``, ``seq_lens``, ``seq_lens_cpu``,
                              ``seq_lens_sum``; purpose from its ``forward_mode`` and
                              runner; draft_tokens the cell's D_tok; schedule_batch the
                              batch inside the forward (``TARGET_VERIFY``,
                              ``DRAFT_EXTEND_V2``: a decode's relabelling)
LaunchMember.write_width      the stand-in worker's: a decode's
                              ``compute_forward_write_width`` at its ``seq_lens`` (a tree
                              on pages > 1 depends on ``seq_len % page``), a mixed batch's
                              decode row 1, a prefill row 0
ghost                         :class:`~spec.relation.Ghost`, written only by the spec's
                              ghost transitions (stand-in worker, hooks)
============================  ============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.happens_before import RelayConsumption
from overlap_spec.spec.interface import (
    BatchState,
    ObservableState,
    Observer,
    RequestState,
)
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.relation import (
    Ghost,
    count_middle_chunks,
    ghost_abort,
    ghost_launch,
    ghost_prepare_decode,
    ghost_prepare_extend,
    ghost_release,
    ghost_result,
    ghost_retract,
)
from overlap_spec.spec.state import (
    AdmissionView,
    AllocatorView,
    BatchView,
    ForwardView,
    GhostView,
    IsolationView,
    IterationChoices,
    KvWrite,
    LaunchMember,
    LaunchView,
    Observation,
    ObservationPoint,
    PlacementView,
    ProcessedEntry,
    PublishRecord,
    RelayGather,
    RequestView,
    ResolveView,
    ResultView,
    compute_prompt_token,
)
from overlap_spec.spec.transitions import compute_admission
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount
from overlap_spec.upstream import hooks
from overlap_spec.upstream.fields import (
    read_allocator,
    read_batch,
    read_forward_mode,
    read_free_pages,
    read_placement,
    read_prefix,
    read_request,
    read_row_slots,
    read_tree,
    to_ints,
)
from overlap_spec.upstream.finish import get_finish_reason_name
from overlap_spec.upstream.session import (
    Session,
    UpstreamCrash,
    describe_upstream_frame,
    get_session,
)
from overlap_spec.upstream.worker import EOS_TOKEN, StepRecord


class _Track:
    """Per request: the upstream ``Req``, the ghost and what the release hook recorded."""

    def __init__(self, rid: RequestId, req: Any, family: int | None = None) -> None:
        self.rid = rid
        self.req = req
        self.family = int(rid) if family is None else family  # the prompt's tokens
        self.ghost = Ghost()
        self.release_count = 0
        self.cached_len: int | None = None
        self.inserted_len: int | None = None
        self.committed_at_release: int | None = None
        # Aborted while waiting: Scheduler.abort_request pops it and sends the abort to the
        # client (send_abort_output) without setting finished_reason; it has left.
        self.left = False

    def is_finished(self) -> bool:
        return bool(self.req.finished()) or self.left


class UpstreamScheduler:
    """The release's scheduler, one cell per process (see :mod:`upstream.session`)."""

    def __init__(self, config: ModelConfig, faults: frozenset[str] = frozenset(),
                 observer: Observer | None = None) -> None:
        if faults:
            raise ValueError(
                f"the upstream adapter has no fault switches (asked for {sorted(faults)}); "
                "to check a broken sglang, pass its tree with --sglang-src")
        self.config = config
        self.observer = observer
        self.session: Session = get_session(config)
        self.session.reset()
        self.scheduler = self.session.scheduler
        self.tracks: dict[RequestId, _Track] = {}
        self.by_req: dict[int, _Track] = {}
        self.step_index = 0
        self.next_step = 0
        self.last_processed_step: StepId | None = None
        self.result_steps: dict[int, StepRecord] = {}
        self.launch: LaunchView | None = None
        self.launch_entry: BatchView | None = None
        self.members: tuple[LaunchMember, ...] = ()
        self.publishes: list[PublishRecord] = []
        self.kv_write_fault_count = 0
        self.accept_counters = (0, 0)
        self.spec_metrics: tuple[int, int] | None = None
        self.launched = False
        self.pending: InvariantViolation | None = None
        # Requests the release retracted during the latest operation (for the differential).
        self.retracted_in_operation: frozenset[RequestId] = frozenset()
        # Whether the overlap loop processed the last result before launching in the latest
        # iteration (is_disable_overlap_for_batch said so): the differential gives the
        # reference the same choice.
        self.processed_early = False
        # PrefillAdder's inputs, read when get_new_batch_prefill starts (KV11), and the
        # chunked request it continues first (its Req and prefix_len then), if any.
        self.admission: AdmissionView | None = None
        self.candidate_free: int | None = None  # the radix cell's current candidate's
        self.continued: tuple[Any, int] | None = None
        # The requests of the prefill being prepared that already held KV: a continuing
        # chunk (prepare_next_chunk in the spec, which leaves the ghost alone).
        self.holding_before_extend: set[int] = set()
        # The relay rows: stashes since the last gather, who stashed and who published last
        # (request, epoch), and what the next launch gathered (FM4, FM5).
        self.stashes: dict[int, int] = {}
        self.stashed_by: dict[int, tuple[RequestId, int]] = {}
        self.published_by: dict[int, tuple[RequestId, int]] = {}
        self.gathers: list[RelayGather] = []
        self.unseeded: list[tuple[RequestId, PoolRow]] = []
        # The request whose middle chunk the launched batch carries (batch.chunked_req):
        # its stash is overwritten by its next chunk's, no token to consume (FM4).
        self.middle_chunk: Any = None
        # FM6, FM7 (spec/happens_before.RelayConsumption), kept from the calls sglang
        # makes, because the release resets its own _publish_fresh only in CI.
        self.relay = RelayConsumption()
        # The release's idle-time checks that ran in the latest iteration (on_idle, when the
        # scheduler was fully idle): None for a pass, else what they raised; and how many
        # ran in this example (the tier's idle point iterates until one has).
        self.idle_results: list[str | None] = []
        self.idle_checks_ran = 0
        hooks.HOST.attach(self)

    # ------------------------------------------------------------------ interface
    def admit(self, prompt_len: int, max_new_tokens: int, *,
              family: int | None = None) -> RequestId:
        from array import array

        self.retracted_in_operation = frozenset()
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.utils import validate_input_length
        from sglang.srt.sampling.sampling_params import SamplingParams

        rid = RequestId(len(self.tracks))
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        params.normalize(None)
        family = int(rid) if family is None else family
        prompt = array("q", [compute_prompt_token(family, k) for k in range(prompt_len)])
        # abort_request matches rids by prefix ("r1" would also abort "r10"): end with ":".
        req = Req(f"r{rid}:", "", prompt, params, vocab_size=1000, eos_token_ids={EOS_TOKEN})
        # The release's admission (handle_generate_request, scheduler.py:3242-3251): the
        # max_new_tokens cap, then the length check, which queues a refused prompt finished
        # by a deferred abort.
        self.scheduler.init_req_max_new_tokens(req)
        error = validate_input_length(req, self.scheduler.max_req_input_len, False)
        if error:
            req.set_finish_with_abort(error)
        track = _Track(rid, req, family)
        # The ghost's abort comes from the spec's rule, not from what the release decided.
        preset = self.config.preset
        _, refused = compute_admission(prompt_len, max_new_tokens, preset.max_context_len,
                                       self.config.kv_tokens, self.config.page_size)
        track.ghost = Ghost(abort_requested=refused)
        self.tracks[rid] = track
        self.by_req[id(req)] = track
        self.scheduler._add_request_to_queue(req)
        return rid

    def admit_prebuilt(self, prompt_len: int, max_new_tokens: int) -> RequestId:
        raise NotImplementedError(
            "PD prebuilt admission is not driven by the upstream adapter (it needs the "
            "disaggregation decode queues)")

    def abort(self, rid: RequestId) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        self.retracted_in_operation = frozenset()
        track = self.tracks.get(rid)
        if track is None or track.is_finished():
            return
        waiting = self._is_waiting(track.req)
        track.ghost = ghost_abort(track.ghost, waiting)
        self.scheduler.abort_request(AbortReq(rid=track.req.rid))
        if waiting and not self._is_waiting(track.req):
            track.left = True
        self.observe(ObservationPoint.ABORT)
        self._raise_pending()

    def flush_cache(self) -> bool:
        """The release's own ``Scheduler.flush_cache`` between two iterations (where its loop
        would take a ``FlushCacheReqInput``): it checks ``is_fully_idle`` itself."""
        self.retracted_in_operation = frozenset()
        flushed = bool(self.scheduler.flush_cache())
        if flushed:
            self.observe(ObservationPoint.FLUSH_CACHE)
        self._raise_pending()
        return flushed

    def pause_generation(self) -> None:
        """The release's own ``Scheduler.pause_generation(mode="retract")`` between two
        iterations (where its loop would take a ``PauseGenerationReqInput``); the requests
        it retracted (``Req.retraction_count`` moved) start a new ghost epoch."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self.retracted_in_operation = frozenset()
        counts = {id(t.req): t.req.retraction_count for t in self.tracks.values()}
        self.scheduler.pause_generation(PauseGenerationReqInput(mode="retract"))
        retracted = [t.req for t in self.tracks.values()
                     if t.req.retraction_count != counts[id(t.req)]]
        self.on_retract(retracted, [])
        self.observe(ObservationPoint.PAUSE_GENERATION)
        self._raise_pending()

    def continue_generation(self) -> None:
        """The release's own ``Scheduler.continue_generation`` (no cache emptying: CPU)."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self.retracted_in_operation = frozenset()
        self.scheduler.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
        self._raise_pending()

    def run_iteration(self, choices: IterationChoices) -> None:
        self.launched = False
        self.retracted_in_operation = frozenset()
        self.processed_early = False
        try:
            self.session.step(choices)
        finally:
            hooks.HOST.retract_pending = None
        self.report_idle_checks()
        self.observe(ObservationPoint.ITERATION_END, launched_this_iteration=self.launched,
                     placement=self.get_placement_view())
        self._raise_pending()
        self.run_upstream_checker()

    def on_idle_check(self, checked: bool, message: str | None) -> bool:
        """The loop's ``on_idle`` returned (``message`` None) or its idle-time checks
        raised (``message``); ``checked``: the scheduler was fully idle, so they ran. Called on
        the loop thread; reported after the iteration (:meth:`report_idle_checks`)."""
        if checked or message is not None:
            self.idle_results.append(message)
        return True

    def report_idle_checks(self) -> None:
        """The release's idle-time checks that ran in this iteration, to the observer (UC at
        idle), before the iteration's own observation: they ran inside it."""
        results, self.idle_results = self.idle_results, []
        self.idle_checks_ran += len(results)
        hook = getattr(self.observer, "on_upstream_idle_check", None)
        for message in results:
            if hook is not None:
                hook(message, self.step_index)

    def run_upstream_checker(self) -> None:
        """Upstream's own runtime checker, when the observer asks for it (``UC``)."""
        hook = getattr(self.observer, "on_upstream_check", None)
        if hook is None or self.scheduler.last_batch is None:
            return
        try:
            self.scheduler.invariant_checker.self_check_during_busy()
            message = None
        except (AssertionError, ValueError) as error:
            # A bare assert says nothing: name it by the release's line that raised it.
            message = (str(error)[:400] or f"{type(error).__name__} at "
                       f"{describe_upstream_frame(error.__traceback__)}")
        hook(message, self.step_index)

    def set_step_index(self, index: int) -> None:
        self.step_index = index

    def get_observable_state(self) -> ObservableState:
        requests = []
        for track in self.tracks.values():
            req = track.req
            status = ("finished" if track.is_finished() else "waiting" if self._is_waiting(req)
                      else "running")
            row = tuple(int(s) for s in self._row_slots(req))
            requests.append(RequestState(track.rid, status,
                                         tuple(int(t) for t in req.output_ids_through_stop),
                                         int(req.kv.kv_committed_len),
                                         int(req.kv.kv_allocated_len), row, track.cached_len,
                                         self._get_finish_reason(track),
                                         int(req.spec_verify_ct),
                                         int(req.spec_num_correct_drafts),
                                         int(req.kv.cache_protected_len)
                                         if self.config.cell.radix else 0,
                                         # Not reported: the stand-in keeps no KV buffer
                                         # (harness/conformance/tier.py, NOT_REPORTED_UPSTREAM).
                                         kv_contents=None))
        sched = self.scheduler
        return ObservableState(
            requests=tuple(requests),
            running=self._batch_state(sched.running_batch),
            last_batch=self._batch_state(sched.last_batch),
            free_pages=int(sched.token_to_kv_pool_allocator.available_size()
                           + sched.tree_cache.evictable_size()) // self.config.page_size,
            kv_write_faults=self.kv_write_fault_count,
            accept_counters=self.accept_counters,
            new_token_ratio=float(sched.new_token_ratio_tracker.current),
            batch_is_full=bool(sched.running_batch.batch_is_full
                               and not sched.running_batch.is_empty()),
            tree_pages=int(sched.tree_cache.evictable_size()) // self.config.page_size,
            tree=(read_tree(sched.tree_cache, self.config.page_size)
                  if self.config.cell.radix else None),
        )

    # ------------------------------------------------------------------ host: the worker
    def get_choices(self) -> IterationChoices:
        return self.session.choices

    def next_step_id(self) -> StepId:
        step = StepId(self.next_step)
        self.next_step += 1
        return step

    def get_rid(self, req: Any) -> RequestId:
        return self.by_req[id(req)].rid

    def get_ghost(self, req: Any) -> Ghost:
        return self.by_req[id(req)].ghost

    def update_ghost(self, req: Any, transition: Callable[..., Ghost], *args: Any) -> None:
        """Apply one of the spec's ghost transitions (spec/relation.py) to req's ghost."""
        track = self.by_req[id(req)]
        track.ghost = transition(track.ghost, *args)

    def on_launch(self, step: StepId, batch: Any, reqs: Sequence[Any], seq_lens: list[int],
                  widths: list[int], is_extend: bool) -> None:
        self.launched = True
        self.publishes = []
        self.middle_chunk = batch.chunked_req if is_extend else None
        self.launch_entry = self.get_batch_view(batch)
        spec_overlap = self.config.cell.is_spec and self.config.cell.overlap
        buf = self.scheduler.future_map.new_seq_lens_buf if spec_overlap else None
        members = []
        for req, seq_len, width in zip(reqs, seq_lens, widths, strict=True):
            ghost = self.get_ghost(req)
            row = req.kv.req_pool_idx
            published = int(buf[row]) if buf is not None and row is not None else None
            members.append(LaunchMember(
                rid=self.get_rid(req), holds_kv=bool(req.kv.holds_kv), seq_len=seq_len,
                published_seq_len=published, kv_allocated_len=int(req.kv.kv_allocated_len),
                ghost_kv_len=TokenCount(ghost.kv_len_true), write_width=TokenCount(width)))
            self.update_ghost(req, ghost_launch, step)
        self.members = tuple(members)

    def write_kv(self, req: Any, rid: RequestId, start: int, end: int) -> list[KvWrite]:
        """The forward writes positions [start, end) through the request's row."""
        return self.write_kv_at(req, rid, range(start, end))

    def gather_row(self, req: Any, positions: Sequence[int]) -> None:
        """``torch.gather`` of ``positions`` from the request's row, as the release's
        page-tree draft addresses it: past the row it raises, as the release's does on CPU
        (a crash of the loop, reported as such)."""
        import torch

        row = req.kv.req_pool_idx
        if row is None or not positions:
            return
        table = self.scheduler.req_to_token_pool.req_to_token
        index = torch.tensor([list(positions)], dtype=torch.int64)
        torch.gather(table[int(row)].unsqueeze(0), 1, index)

    def write_kv_at(self, req: Any, rid: RequestId, positions: Iterable[int]) -> list[KvWrite]:
        """The forward writes ``positions`` through the request's row."""
        faults: list[KvWrite] = []
        row = req.kv.req_pool_idx
        allocated = int(req.kv.kv_allocated_len)
        table = self.scheduler.req_to_token_pool.req_to_token
        page = self.config.page_size
        mine = {int(s) // page for s in self._row_slots(req)}
        for position in positions:
            if row is None or position < 0 or position >= table.shape[1]:
                faults.append(KvWrite(rid, position, None, "outside the req_to_token row"))
                continue
            slot = int(table[row, position])
            if position >= allocated:
                faults.append(KvWrite(rid, position, slot, "beyond kv_allocated_len"))
            elif slot <= 0 or slot // page not in mine or self._is_free(slot // page):
                faults.append(KvWrite(rid, position, slot, "slot not owned by the request"))
        return faults

    def on_forward_batch(self, point: ObservationPoint, batch: Any, forward_batch: Any,
                         purpose: str, draft_tokens: int) -> None:
        """The release built ``forward_batch`` from ``batch`` (``ForwardBatch.init_new``;
        at ``DRAFT_EXTEND``, ``prepare_for_draft_extend`` after its +D_tok): the spec's
        observation of it, with the ``ScheduleBatch`` as it stands inside the forward (a
        draft-extend's isolation entry is the batch at launch, as in the reference)."""
        schedule_batch = self.get_batch_view(batch, in_forward=True)
        cpu = forward_batch.seq_lens_cpu
        total = forward_batch.seq_lens_sum
        forward = ForwardView(
            purpose=purpose, draft_tokens=draft_tokens,
            batch_size=int(forward_batch.batch_size), seq_lens=_ints(forward_batch.seq_lens),
            seq_lens_cpu=None if cpu is None else _ints(cpu),
            seq_lens_sum=None if total is None else int(total),
            schedule_batch=schedule_batch)
        isolation = None
        if point is ObservationPoint.DRAFT_EXTEND and self.launch_entry is not None:
            isolation = IsolationView(self.launch_entry, schedule_batch, None)
        self.observe(point, batch_view=schedule_batch, forward=forward, isolation=isolation)

    def record_step(self, record: StepRecord, faults: list[KvWrite]) -> None:
        self.result_steps[record.step] = record
        self.kv_write_fault_count += len(faults)
        self.launch = LaunchView(step=record.step, forward_mode=record.forward_mode,
                                 members=self.members, kv_write_faults=tuple(faults),
                                 relay_gathers=tuple(self.gathers),
                                 unseeded_spec_rows=tuple(self.unseeded),
                                 publishes=tuple(self.publishes))
        self.gathers, self.unseeded = [], []
        self.observe(ObservationPoint.LAUNCH, launch=self.launch)

    def on_publish(self, step: StepId, reqs: Sequence[Any], seq_lens: list[int],
                   accept_lens: list[int] | None, values: list[int]) -> None:
        rows = [int(req.kv.req_pool_idx) for req in reqs]
        for j, req in enumerate(reqs):
            self.publishes.append(PublishRecord(
                self.get_rid(req), PoolRow(rows[j]), seq_lens[j],
                None if accept_lens is None else accept_lens[j], values[j]))

    # ------------------------------------------------------------------ host: hooks
    def _get_row_owner(self, row: int) -> tuple[RequestId, int] | None:
        for track in self.tracks.values():
            if track.req.kv.req_pool_idx == row:
                return track.rid, track.ghost.epoch
        return None

    def on_stash(self, indices: Any) -> None:
        for row in (int(r) for r in indices.tolist()):
            owner = self._get_row_owner(row)
            if owner != self.stashed_by.get(row):
                # A new owner's first stash: what a previous owner left is overwritten.
                self.stashes[row] = 0
            middle = self.middle_chunk
            if middle is None or middle.kv.req_pool_idx != row:
                self.stashes[row] = self.stashes.get(row, 0) + 1
            if owner is not None:
                self.stashed_by[row] = owner

    def on_future_publish(self, indices: Any) -> None:
        rows = [int(r) for r in indices.tolist()]
        for row in rows:
            owner = self._get_row_owner(row)
            if owner is not None:
                self.published_by[row] = owner
        # FutureMap.publish returns before recording publish_ready on no rows (DP idle),
        # and records it for speculative decoding only.
        if rows and self.config.cell.is_spec:
            self.relay.publish([PoolRow(row) for row in rows])

    def on_resolve(self, indices: Any) -> ResolveView:
        """resolve_seq_lens_cpu gathered these rows: what it consumed (FM6, FM7). The
        publish_ready coverage (FM2) needs CUDA events: none are listed."""
        rows = tuple(PoolRow(int(r)) for r in indices.tolist())
        fresh, regathered = self.relay.resolve(rows)
        return ResolveView(rows, (), fresh, regathered)

    def on_relay_gather(self, batch: Any, rows: list[int], reqs: list[Any]) -> None:
        """resolve_forward_inputs gathered these rows for ``reqs`` of the batch about to
        launch (all of a decode's, a mixed batch's decode rows)."""
        self.gathers = []
        for req, row in zip(reqs, rows, strict=False):
            track = self.by_req.get(id(req))
            if track is None:
                continue
            owner = (track.rid, track.ghost.epoch)
            self.gathers.append(RelayGather(
                row=PoolRow(row), rid=track.rid,
                stashes_since_last_gather=self.stashes.get(row, 0),
                written_by_current_owner=self.stashed_by.get(row) == owner))
            self.stashes[row] = 0
        spec_overlap = self.config.cell.is_spec and self.config.cell.overlap
        if spec_overlap and (batch.forward_mode.is_decode() or batch.forward_mode.is_mixed()):
            # resolve_seq_lens_cpu (resolve_mixed_spec_tails) read new_seq_lens_buf at these
            # rows: each must have been published by its current owner.
            self.unseeded = [(self.by_req[id(req)].rid, PoolRow(row))
                             for req, row in zip(reqs, rows, strict=False)
                             if id(req) in self.by_req
                             and self.published_by.get(row) != (self.by_req[id(req)].rid,
                                                                self.by_req[id(req)].ghost.epoch)]

    def on_admission_start(self, sched: Any, running_batch: Any) -> None:
        """What the release's PrefillAdder decides from, read before it runs (KV11): the
        admitted count, the extends' ends and the continued chunk's end are filled in at
        the prefill's prepare_for_extend. The chunked request (``Scheduler.chunked_req``)
        goes first (``add_chunked_req``) and keeps its row (``num_held_rows``)."""
        if sched is None:
            self.admission = None
            self.continued = None
            return
        running = list(running_batch.reqs)
        chunked = sched.chunked_req
        self.continued = None if chunked is None else (chunked, int(chunked.prefix_len))
        self.admission = AdmissionView(
            new_token_ratio=float(sched.new_token_ratio_tracker.current),
            available_tokens=int(sched.token_to_kv_pool_allocator.available_size()
                                 + sched.tree_cache.evictable_size()),
            rows=int(sched.get_num_allocatable_reqs(len(running), running_batch=running_batch,
                                                    num_held_rows=int(chunked is not None))),
            running=tuple((int(r.sampling_params.max_new_tokens), len(r.output_ids))
                          for r in running),
            waiting=tuple((self.get_rid(r), len(r.origin_input_ids) + len(r.output_ids),
                           int(r.sampling_params.max_new_tokens), len(r.output_ids))
                          for r in sched.waiting_queue),
            admitted=0,
            chunk_size=int(sched.chunked_prefill_size or 0),
            mixed_decode_tokens=len(running) if sched.is_mixed_chunk else 0,
            # _get_new_batch_prefill_raw clears a stale latch on an empty running batch.
            latched=bool(running_batch.batch_is_full) and not running_batch.is_empty())

    def on_candidate_free(self, free: int | None) -> None:
        self.candidate_free = free

    def on_candidate_end(self, req: Any) -> None:
        """A radix cell's candidate: its matched prefix and the free KV its check saw (the
        last one's where its check did not run)."""
        view = self.admission
        if view is None or not self.config.cell.radix:
            return
        free = self.candidate_free
        if free is None:
            free = view.frees[-1] if view.frees else view.available_tokens
        self.admission = replace(view, prefixes=(*view.prefixes, int(req.prefix_len)),
                                 frees=(*view.frees, free))

    def _complete_admission(self, admission: AdmissionView, batch: Any) -> AdmissionView:
        """The admission as the prepared prefill shows it: the continued chunk first."""
        reqs = list(batch.reqs)
        continued = None
        if self.continued is not None and reqs and reqs[0] is self.continued[0]:
            req, prefix = self.continued
            continued = (self.get_rid(req), prefix,
                         len(req.origin_input_ids) + len(req.output_ids),
                         int(req.sampling_params.max_new_tokens), int(req.extend_end))
            reqs = reqs[1:]
        return replace(admission, admitted=len(reqs), continued=continued,
                       ends=tuple(int(r.extend_end) for r in reqs))

    def on_before_prepare_extend(self, batch: Any) -> None:
        self.holding_before_extend = {id(req) for req in batch.reqs if req.kv.holds_kv}

    def on_prepare_extend(self, batch: Any) -> None:
        """A prefill claims its fill length at prepare time, at its first chunk only (a
        continuing chunk keeps the claim: spec.relation.prepare_next_chunk); nothing is
        settled yet."""
        for req in batch.reqs:
            if id(req) not in self.holding_before_extend:
                self.update_ghost(req, ghost_prepare_extend)
        self.holding_before_extend = set()

    def on_chunked_abort(self, req: Any) -> None:
        """``process_pending_chunked_abort`` is about to finish the chunked request "abort"
        and release its KV uncached: the ghost finishes first, as in
        spec.relation.finish_chunked_abort."""
        if id(req) in self.by_req:
            self.update_ghost(req, ghost_abort, True)

    def on_prepare_decode(self, batch: Any) -> None:
        for req in batch.reqs:
            self.update_ghost(req, ghost_prepare_decode)

    def on_overlap_decision(self, early: bool) -> None:
        self.processed_early = early

    def on_retract(self, retracted: list[Any], aborted: list[Any]) -> None:
        self.retracted_in_operation |= {self.get_rid(req) for req in retracted}
        for req in retracted:
            self.update_ghost(req, ghost_retract)
            self.by_req[id(req)].release_count = 0  # a new holding starts at re-admission
        for req in aborted:
            # retract_decode's out-of-memory abort (or a retraction that cannot resume):
            # released like a retraction (release_req, reset_for_retract), then told to
            # the client with send_abort_output; it leaves with no finished_reason.
            self.update_ghost(req, ghost_retract)
            self.update_ghost(req, ghost_abort, True)
            self.by_req[id(req)].release_count = 0
            self.by_req[id(req)].left = True

    def on_release(self, req: Any, checkpointed: bool) -> None:
        track = self.by_req.get(id(req))
        if track is None:
            return
        track.release_count += 1
        if req.finished():
            track.committed_at_release = int(req.kv.kv_committed_len)
            track.cached_len = int(req.owned_kv_len()) if checkpointed else 0
            # The checkpoint just set cache_protected_len to the keyed length, K
            # (unified_radix_cache.py:1317); a disabled tree keys nothing and says nothing.
            tree_on = not getattr(self.scheduler.tree_cache, "disable", True)
            track.inserted_len = (int(req.kv.cache_protected_len) if checkpointed and tree_on
                                  else None)
            track.ghost = ghost_release(track.ghost)

    def on_run_batch_exit(self, batch: Any, result: Any) -> None:
        if self.launch is None:
            return
        self.result_steps[StepId(-1 - id(result))] = self.result_steps[self.launch.step]
        isolation = None
        if self.config.cell.is_spec and self.launch_entry is not None:
            # Without overlap the release re-applies the worker's new_seq_lens after the
            # isolation restore (scheduler.py:4842), unless it is batch.seq_lens itself,
            # which an extend returns: then SL9 holds the batch to its entry lengths.
            reapplied = None
            new = getattr(result, "new_seq_lens", None)
            if (not self.config.cell.overlap and new is not None
                    and not batch.forward_mode.is_extend()):
                reapplied = tuple(int(v) for v in new.tolist())
            isolation = IsolationView(self.launch_entry, self.get_batch_view(batch), reapplied)
        self.observe(ObservationPoint.RUN_BATCH, batch=batch, launch=self.launch,
                     isolation=isolation)

    def before_result(self, batch: Any, result: Any) -> Any:
        record = self.result_steps.pop(StepId(-1 - id(result)), None)
        self.spec_metrics = None
        mode = batch.forward_mode
        verified = self.config.cell.is_spec and mode is not None and mode.is_decode()
        # A spec decode mixed into a prefill (a tail): its finish commits nothing.
        tails = ({id(r) for r in batch.decoding_reqs or ()}
                 if self.config.cell.is_spec and mode is not None and mode.is_mixed() else set())
        before = []
        for j, req in enumerate(batch.reqs):
            track = self.by_req[id(req)]
            before.append((req.finished() or bool(req.is_retracted), req.finished(),
                           len(req.output_ids), int(req.kv.kv_committed_len)))
            if record is not None:
                eos = record.eos_at[j]
                track.ghost = ghost_result(track.ghost, record.step,
                                           int(req.sampling_params.max_new_tokens),
                                           record.accept_lens[j], eos, verified,
                                           id(req) in tails)
        return record, before

    def after_result(self, batch: Any, result: Any, token: Any) -> None:
        record, before = token
        if record is None:
            return
        entries = []
        for j, req in enumerate(batch.reqs):
            stale, finished_before, out_before, committed_before = before[j]
            out_after = len(req.output_ids)
            entries.append(ProcessedEntry(
                rid=self.get_rid(req), stale=stale, finished_before=finished_before,
                accept_len=record.accept_lens[j], run_len=out_after - out_before,
                stride=record.stride, output_before=out_before, output_after=out_after,
                committed_before=committed_before,
                committed_after=int(req.kv.kv_committed_len)))
        if self.spec_metrics is not None:
            batch_size, correct = self.spec_metrics
        else:
            batch_size, correct = 0, 0
        self.accept_counters = (correct, batch_size)
        view = ResultView(step=record.step, entries=tuple(entries), num_correct_drafts=correct,
                          metrics_batch_size=batch_size,
                          previous_step=self.last_processed_step,
                          pending_after=len(getattr(self.scheduler, "result_queue", ())),
                          # Upstream feeds its spec metrics from decode results only.
                          metered=self.spec_metrics is not None)
        self.last_processed_step = record.step
        self.observe(ObservationPoint.PROCESS_RESULT, result=view)

    def on_spec_metrics(self, batch_size: int, num_correct_drafts: int) -> None:
        self.spec_metrics = (batch_size, num_correct_drafts)

    # ------------------------------------------------------------------ refinement
    def observe(self, point: ObservationPoint, batch: Any = None,
                batch_view: BatchView | None = None, **parts: Any) -> None:
        if self.observer is None:
            return
        if batch is not None:
            batch_view = self.get_batch_view(batch)
        if point is ObservationPoint.PREPARE_FOR_EXTEND and self.admission is not None:
            parts["admission"] = self._complete_admission(self.admission, batch)
            self.admission = None
            self.continued = None
        chunked = self.scheduler.chunked_req
        chunked_track = None if chunked is None else self.by_req.get(id(chunked))
        obs = Observation(
            point=point,
            step_index=self.step_index,
            requests=tuple(self.get_request_view(t) for t in self.tracks.values()),
            batch=batch_view,
            allocator=self.get_allocator_view(),
            races=(),
            chunked_rid=None if chunked_track is None else chunked_track.rid,
            tree=(read_tree(self.scheduler.tree_cache, self.config.page_size)
                  if self.config.cell.radix else None),
            paused=bool(self.scheduler._engine_paused),
            **parts,
        )
        try:
            self.observer(obs)
        except InvariantViolation as violation:
            # Never raise inside sglang's loop: the violation ends the operation when the
            # loop is parked again (run_iteration / abort).
            if self.pending is None:
                violation.upstream_location = _get_upstream_caller()  # type: ignore[attr-defined]
                self.pending = violation

    def _raise_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            raise pending

    @staticmethod
    def _get_finish_reason(track: _Track) -> str | None:
        # Aborted while waiting, it left with no finished_reason (abort_request).
        return "abort" if track.left else get_finish_reason_name(track.req.finished_reason)

    def get_request_view(self, track: _Track) -> RequestView:
        req, g = track.req, track.ghost
        fields = read_request(req, tokens=True)
        fields["is_retracted"] = fields["is_retracted"] and not track.left
        if self.config.cell.radix:
            fields |= read_prefix(self.scheduler.tree_cache, req)
        own_from = fields.get("cache_protected_len", 0)
        return RequestView(
            rid=track.rid, **fields, **read_placement(self.scheduler, req,
                                                      self.config.page_size, own_from),
            prompt_family=track.family,
            finished=track.is_finished(),
            release_count=track.release_count,
            cached_len=track.cached_len,
            inserted_len=track.inserted_len,
            committed_at_release=track.committed_at_release,
            inflight_at_release=g.inflight_at_release,
            claimed_at_release=g.claimed_at_release,
            finish_reason=self._get_finish_reason(track),
            ghost=GhostView(
                epoch=g.epoch, kv_len_true=TokenCount(g.kv_len_true),
                settled_len=TokenCount(g.settled_len),
                inflight_steps=g.inflight_steps + g.prepared_steps,
                extend_inflight=g.extend_inflight,
                output_len_true=TokenCount(g.output_len_true), finished=g.finished,
                finish_reason=g.finish_reason, verify_ct=g.verify_ct,
                correct_drafts=g.correct_drafts, middle_chunks=count_middle_chunks(g),
                finished_at_tail=g.finished_at_tail),
        )

    def get_batch_view(self, batch: Any, in_forward: bool = False) -> BatchView:
        """``in_forward``: the batch as a spec decode's forward has relabelled it
        (``eagle_prepare_for_verify``: ``TARGET_VERIFY``; ``prepare_for_draft_extend``:
        ``DRAFT_EXTEND_V2``), a decode to the spec; elsewhere those modes are what they
        are, so an isolation that fails to restore ``DECODE`` shows at ``run_batch``
        (SL9)."""
        return BatchView(
            forward_mode=read_forward_mode(batch, in_forward),
            rids=tuple(self.by_req[id(r)].rid for r in batch.reqs if id(r) in self.by_req),
            **read_batch(batch))

    def get_placement_view(self) -> PlacementView:
        """Where the release keeps its requests, between two iterations (RP10): the waiting
        queue, ``running_batch`` (never None), ``last_batch`` and the overlap loop's
        ``result_queue`` (absent without overlap)."""
        sched = self.scheduler

        def rids(reqs: Iterable[Any]) -> tuple[RequestId, ...]:
            return tuple(self.by_req[id(r)].rid for r in reqs if id(r) in self.by_req)

        last = sched.last_batch
        return PlacementView(
            waiting=rids(sched.waiting_queue), running=rids(sched.running_batch.reqs),
            last=() if last is None else rids(last.reqs),
            last_mode=None if last is None else read_forward_mode(last),
            last_is_running=last is not None and last is sched.running_batch,
            in_flight=tuple(rids(batch.reqs)
                            for batch, _ in getattr(sched, "result_queue", ())))

    def get_allocator_view(self) -> AllocatorView:
        view = read_allocator(self.scheduler, self.config.cell.radix)
        if view is None:  # session.py builds the tree disabled, or walkable (force-miss)
            raise RuntimeError("the tier's tree cache holds pages it cannot enumerate")
        return view

    # ------------------------------------------------------------------ helpers
    def _free_pages(self) -> list[int]:
        alloc = self.scheduler.token_to_kv_pool_allocator
        return read_free_pages(alloc, self.config.page_size)

    def _is_free(self, page: int) -> bool:
        return page in set(self._free_pages())

    def _row_slots(self, req: Any) -> list[int]:
        return read_row_slots(self.scheduler, req)

    def _is_waiting(self, req: Any) -> bool:
        return any(r is req for r in self.scheduler.waiting_queue)

    def _batch_state(self, batch: Any) -> BatchState | None:
        if batch is None or batch.is_empty():
            return None
        view = self.get_batch_view(batch)
        return BatchState(view.rids, view.seq_lens, view.seq_lens_cpu, view.seq_lens_sum)


def _get_upstream_caller() -> str:
    """``file:line in function`` of the innermost sglang frame on the stack: where the
    release was when the spec observed the violation (the caller of the wrapped method)."""
    import traceback

    frames = [f for f in traceback.extract_stack() if "/sglang/" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename.split('/sglang/', 1)[-1]}:{frame.lineno} in {frame.name}"


def _ints(tensor: Any) -> tuple[int, ...]:
    return tuple(to_ints(tensor) or ())


def make_upstream(config: ModelConfig, faults: frozenset[str],
                  observer: Observer | None) -> UpstreamScheduler:
    """The :data:`spec.interface.SchedulerFactory` of the upstream tier."""
    return UpstreamScheduler(config, faults, observer)


__all__ = ["UpstreamCrash", "UpstreamScheduler", "make_upstream"]
