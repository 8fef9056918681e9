"""Observation hooks on the release's classes: the real method runs, then the spec observes.

Installed once per process (:func:`install`). Each wrapper calls the real method unchanged
and tells :data:`HOST` (the active :class:`~upstream.adapter.UpstreamScheduler`, or a quiet
stand-in while a session drains between examples) what happened. Only the outermost
wrapped ``ScheduleBatch`` call observes: ``retract_decode`` calls ``filter_batch`` inside,
and that intermediate state is not an observation point upstream promises anything about.

Retraction is observed once the retracted requests are back in the waiting queue
(``update_running_batch`` re-queues them after ``retract_decode`` returns): just before the
``prepare_for_decode`` that follows, or when ``update_running_batch`` returns without one.
"""

from __future__ import annotations

import functools
from typing import Any

from overlap_spec.spec.state import IterationChoices, ObservationPoint


class _QuietHost:
    """Serves the stand-in worker while no adapter is attached (draining between examples)."""

    def __init__(self) -> None:
        self._steps = 0

    def __getattr__(self, item: str) -> Any:
        return lambda *args, **kwargs: None  # every observation is dropped

    def get_choices(self) -> IterationChoices:
        return IterationChoices(allow_prefill=False)

    def next_step_id(self) -> int:
        self._steps += 1
        return -self._steps

    def get_rid(self, req: Any) -> int:
        return -1

    def write_kv(self, *args: Any) -> list[Any]:
        return []

    def write_kv_at(self, *args: Any) -> list[Any]:
        return []


class _Host:
    """Forwards to the attached adapter, or to the quiet host."""

    def __init__(self) -> None:
        self.target: Any = None
        self.quiet = _QuietHost()
        self.depth = 0  # nesting of wrapped ScheduleBatch calls
        self.retract_pending: Any = None

    def attach(self, target: Any) -> None:
        self.target = target
        self.depth = 0
        self.retract_pending = None

    def detach(self) -> None:
        self.target = None
        self.quiet = _QuietHost()
        self.depth = 0
        self.retract_pending = None

    def __getattr__(self, item: str) -> Any:
        return getattr(self.target if self.target is not None else self.quiet, item)


HOST = _Host()
_INSTALLED = False


def _batch_call(point: ObservationPoint | None, before: Any = None, after: Any = None
                ) -> Any:
    """Wrap a ScheduleBatch method: observe ``point`` after it when outermost."""

    def decorate(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            outermost = HOST.depth == 0
            if outermost and before is not None:
                before(self)
            HOST.depth += 1
            try:
                value = original(self, *args, **kwargs)
            finally:
                HOST.depth -= 1
            if outermost:
                if after is not None:
                    after(self, value)
                if point is not None:
                    HOST.observe(point, batch=self)
            return value

        wrapper.__wrapped_by_overlap_spec__ = True  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _flush_retract(batch: Any) -> None:
    if HOST.retract_pending is not None:
        pending, HOST.retract_pending = HOST.retract_pending, None
        HOST.observe(ObservationPoint.RETRACT_DECODE, batch=pending)


def _after_retract(batch: Any, value: Any) -> None:
    retracted, _ratio, to_abort = value
    HOST.on_retract(list(retracted), list(to_abort))
    HOST.retract_pending = batch


def _after_prepare_decode(batch: Any, value: Any) -> None:
    HOST.on_prepare_decode(batch)


def _before_prepare_extend(batch: Any) -> None:
    HOST.on_before_prepare_extend(batch)


def _after_prepare_extend(batch: Any, value: Any) -> None:
    HOST.on_prepare_extend(batch)


def _get_gathered_rows(batch: Any, future_map: Any) -> list[int]:
    """The output_tokens_buf rows resolve_forward_inputs is about to gather (0.5.23
    overlap_utils.py:113): a decode's req_pool_indices without speculation, the draft
    input's future_indices with it, a mixed batch's decode rows (``mix_running_indices``;
    with speculation their pending bonus tokens, resolved by ``resolve_mixed_spec_tails``
    under overlap)."""
    if batch.prefill_input_ids_cpu is not None:
        mixed = batch.mix_running_indices
        return [] if mixed is None else [int(r) for r in mixed.tolist()]
    if batch.input_ids is None and future_map.spec_algo.is_none():
        return [int(r) for r in batch.req_pool_indices.tolist()]
    spec_info = batch.spec_info
    if batch.enable_overlap and spec_info is not None:
        indices = getattr(spec_info, "future_indices", None)
        if indices is not None:
            return [int(r) for r in indices.tolist()]
    return []


def install(scheduler_module: Any) -> None:
    """Wrap the release's classes once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from sglang.srt.managers import overlap_utils
    from sglang.srt.managers.schedule_batch import NextBatchPlan, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import (
        SchedulerMetricsReporter,
    )
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    # A radix cell's admission (KV11): each candidate's matched prefix and the free KV its
    # own budget check saw, inside add_one_req's pin of its matched path.
    add_one = PrefillAdder.add_one_req

    @functools.wraps(add_one)
    def add_one_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        HOST.on_candidate_free(None)
        try:
            return add_one(self, req, *args, **kwargs)
        finally:
            HOST.on_candidate_end(req)

    PrefillAdder.add_one_req = add_one_req
    check_prefill = PrefillBudget.check_prefill

    @functools.wraps(check_prefill)
    def check_prefill_wrapper(self: Any, **kwargs: Any) -> Any:
        HOST.on_candidate_free(int(self._available_and_evictable()))
        return check_prefill(self, **kwargs)

    PrefillBudget.check_prefill = check_prefill_wrapper

    sb = ScheduleBatch
    sb.prepare_for_extend = _batch_call(ObservationPoint.PREPARE_FOR_EXTEND,
                                        before=_before_prepare_extend,
                                        after=_after_prepare_extend)(sb.prepare_for_extend)
    sb.prepare_for_decode = _batch_call(ObservationPoint.PREPARE_FOR_DECODE,
                                        before=_flush_retract,
                                        after=_after_prepare_decode)(sb.prepare_for_decode)
    sb.filter_batch = _batch_call(ObservationPoint.FILTER_BATCH)(sb.filter_batch)
    sb.merge_batch = _batch_call(ObservationPoint.MERGE_BATCH)(sb.merge_batch)
    # A mixed step's merge of the prepared decodes into the prefill is no running-batch
    # merge (the reference observes none): its inner merge_batch is not the outermost call.
    sb.mix_with_running = _batch_call(None)(sb.mix_with_running)
    sb.retract_decode = _batch_call(None, after=_after_retract)(sb.retract_decode)

    resolve = overlap_utils.FutureMap.resolve_seq_lens_cpu

    @functools.wraps(resolve)
    def resolve_seq_lens_cpu(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        value = resolve(self, batch, *args, **kwargs)
        indices = (None if batch.spec_info is None
                   else getattr(batch.spec_info, "future_indices", None))
        if indices is not None:
            HOST.observe(ObservationPoint.RESOLVE_SEQ_LENS_CPU, batch=batch,
                         resolve=HOST.on_resolve(indices))
        return value

    overlap_utils.FutureMap.resolve_seq_lens_cpu = resolve_seq_lens_cpu

    stash = overlap_utils.FutureMap.stash

    @functools.wraps(stash)
    def stash_wrapper(self: Any, future_indices: Any, payload: Any) -> Any:
        value = stash(self, future_indices, payload)
        HOST.on_stash(future_indices)
        return value

    overlap_utils.FutureMap.stash = stash_wrapper

    publish = overlap_utils.FutureMap.publish

    @functools.wraps(publish)
    def publish_wrapper(self: Any, future_indices: Any, *args: Any, **kwargs: Any) -> Any:
        value = publish(self, future_indices, *args, **kwargs)
        HOST.on_future_publish(future_indices)
        return value

    overlap_utils.FutureMap.publish = publish_wrapper

    # A module function the scheduler calls through the name it imported: wrap that name.
    resolve_inputs = scheduler_module.resolve_forward_inputs

    @functools.wraps(resolve_inputs)
    def resolve_forward_inputs(batch: Any, future_map: Any) -> Any:
        rows = _get_gathered_rows(batch, future_map)
        # A mixed batch gathers for its decode rows, its last ones.
        reqs = list(batch.reqs)[len(batch.reqs) - len(rows):] if rows else []
        value = resolve_inputs(batch, future_map)
        if rows:
            HOST.on_relay_gather(batch, rows, reqs)
        return value

    scheduler_module.resolve_forward_inputs = resolve_forward_inputs

    cls = scheduler_module.Scheduler
    update = cls.update_running_batch

    @functools.wraps(update)
    def update_running_batch(self: Any, batch: Any) -> Any:
        value = update(self, batch)
        _flush_retract(batch)
        return value

    cls.update_running_batch = update_running_batch

    prefill = cls.get_new_batch_prefill

    @functools.wraps(prefill)
    def get_new_batch_prefill(self: Any, running_batch: Any) -> Any:
        if not HOST.get_choices().allow_prefill:
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        HOST.on_admission_start(self, running_batch)
        try:
            return prefill(self, running_batch)
        finally:
            HOST.on_admission_start(None, None)

    cls.get_new_batch_prefill = get_new_batch_prefill

    chunked_abort = cls.process_pending_chunked_abort

    @functools.wraps(chunked_abort)
    def process_pending_chunked_abort(self: Any) -> Any:
        # The teardown happens only while the marked request is still the chunked one
        # (scheduler.py process_pending_chunked_abort); otherwise the marker is dropped.
        req = self._pending_chunked_abort_req
        if req is not None and req is self.chunked_req:
            HOST.on_chunked_abort(req)
        return chunked_abort(self)

    cls.process_pending_chunked_abort = process_pending_chunked_abort

    decide = cls.is_disable_overlap_for_batch

    @functools.wraps(decide)
    def is_disable_overlap_for_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        value = decide(self, *args, **kwargs)
        HOST.on_overlap_decision(bool(value))
        return value

    cls.is_disable_overlap_for_batch = is_disable_overlap_for_batch

    run_batch = cls.run_batch

    @functools.wraps(run_batch)
    def run_batch_wrapper(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        value = run_batch(self, batch, *args, **kwargs)
        HOST.on_run_batch_exit(batch, value)
        return value

    cls.run_batch = run_batch_wrapper

    process = cls.process_batch_result

    @functools.wraps(process)
    def process_batch_result(self: Any, batch: Any, result: Any, *args: Any,
                             **kwargs: Any) -> Any:
        token = HOST.before_result(batch, result)
        value = process(self, batch, result, *args, **kwargs)
        HOST.after_result(batch, result, token)
        return value

    cls.process_batch_result = process_batch_result

    update_spec = SchedulerMetricsReporter.update_spec_metrics

    @functools.wraps(update_spec)
    def update_spec_metrics(self: Any, bs: int, num_correct_drafts: int, *args: Any,
                            **kwargs: Any) -> Any:
        HOST.on_spec_metrics(int(bs), int(num_correct_drafts))
        return update_spec(self, bs, num_correct_drafts, *args, **kwargs)

    SchedulerMetricsReporter.update_spec_metrics = update_spec_metrics

    # The release's idle-time checks (on_idle, scheduler.py:5241-5300): with nothing running
    # or waiting, every pool page must be free or the tree's (available + evictable +
    # protected == total), every req_to_token row free, and the allocator's byte accounting
    # clean. Strict (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1) they raise ValueError
    # inside the loop; the attached adapter takes that as the check's verdict (UC at idle),
    # and the loop goes on. With no adapter attached (a drain between examples) it raises.
    on_idle = cls.on_idle

    @functools.wraps(on_idle)
    def on_idle_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        checks = bool(self.is_fully_idle())  # on_idle's own gate: the checks run only then
        try:
            value = on_idle(self, *args, **kwargs)
        except ValueError as error:
            if not HOST.on_idle_check(checks, str(error) or "ValueError in on_idle"):
                raise
            return None
        HOST.on_idle_check(checks, None)
        return value

    cls.on_idle = on_idle_wrapper
    _INSTALLED = True


def watch_tree_cache(tree_cache: Any) -> None:
    """Every ``release_kv_cache`` calls ``tree_cache.on_release(req, checkpointed=...)``. On
    the Rust tree core, every ``insert`` (the checkpoints' and the releases') also tells
    :func:`upstream.fields.record_inserted_keys` which key element each slot carries: the
    core keeps the tokens where they cannot be read back."""
    from overlap_spec.upstream.fields import is_rust_core, record_inserted_keys

    original = tree_cache.on_release

    def on_release(req: Any, *args: Any, **kwargs: Any) -> Any:
        HOST.on_release(req, bool(kwargs.get("checkpointed", args[0] if args else False)))
        return original(req, *args, **kwargs)

    tree_cache.on_release = on_release
    if not is_rust_core(tree_cache):
        return
    insert = tree_cache.insert

    def insert_wrapper(params: Any, *args: Any, **kwargs: Any) -> Any:
        record_inserted_keys(tree_cache, params.key, params.value)
        return insert(params, *args, **kwargs)

    tree_cache.insert = insert_wrapper
