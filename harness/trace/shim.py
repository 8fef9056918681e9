"""Recording shim for a live scheduler: wrap upstream-named methods, write the trace format.

For a running SGLang scheduler process (or ``gpu_impl``/``reference``, whose
method names mirror upstream), :class:`TraceShim` wraps

- ``ScheduleBatch.prepare_for_extend / prepare_for_decode / filter_batch / merge_batch /
  retract_decode`` (on the class: batches are created on the fly),
- ``FutureMap.publish / stash / resolve_seq_lens_cpu / resolve_forward_inputs``, and
  ``resolve_forward_inputs`` where it is a module function (sglang 0.5.23:
  ``overlap_utils.resolve_forward_inputs``, called through the name the scheduler's module
  imported, so that binding is the one wrapped),
- ``Scheduler.get_next_batch_to_run / run_batch / process_batch_result``,

and writes one ``call`` event after each returns, with the batch's upstream fields
(``seq_lens``, ``seq_lens_cpu``, ``seq_lens_sum``, ``req_pool_indices``,
``spec_info.future_indices``, ``seq_len_cpu_ub``, ``forward_mode``, ``reqs[].rid``).
When the object keeps a spec happens-before record (``rt.hb``), stream events are
recorded too.

Request views. On a scheduler that exposes upstream's pools (``req_to_token_pool``,
``token_to_kv_pool_allocator``, ``waiting_queue``: sglang itself), the Scheduler calls and
the outermost ScheduleBatch calls also carry every request the shim has seen
(``Req.kv.*``, ``output_ids_through_stop``, the ``req_to_token`` row), the allocator's free
lists and, at ``process_batch_result``, the result (stale rows, accept lengths, the spec
counters the processor fed). What upstream does not count per request, the shim counts
from the calls it wraps: releases (``tree_cache.on_release``) and steps launched but not
yet processed (``run_batch`` / ``process_batch_result``). A live process has no ghost
truth, so the views carry ``ghost: null`` and ``trace check`` judges the KV and RP
checks that can be judged without it (``harness.trace.format.STATE_CALL_INVARIANTS``).

Reading request views copies ``req_to_token`` rows and free lists to the host: on CUDA
these are host syncs, made only while a shim is recording.

Usage in a live process (sketch)::

    with TraceShim(Path("live.ndjson"), "ov-p1-v2chain-cpu-honest", "realistic",
                   batch_class=ScheduleBatch, scheduler=scheduler,
                   future_map=scheduler.future_map, implementation="sglang"):
        scheduler.event_loop_overlap()

or, for an operation script: ``python -m harness.trace_shim SCRIPT -o TRACE``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, cast

from overlap_spec.harness.drive.script import Script, apply_op, get_factory, load_script
from overlap_spec.harness.trace.codec import encode_value
from overlap_spec.harness.trace.format import TraceHeader
from overlap_spec.harness.trace.record import attach_recorder
from overlap_spec.spec.config import get_cell
from overlap_spec.spec.state import (
    AllocatorView,
    BatchView,
    GhostView,
    ProcessedEntry,
    RequestView,
    ResultView,
)
from overlap_spec.spec.units import RequestId, StepId
from overlap_spec.upstream.fields import (
    get_kv,
    read_allocator,
    read_batch,
    read_forward_mode,
    read_placement,
    read_request,
    to_ints,
)
from overlap_spec.upstream.finish import get_finish_reason_name

BATCH_METHODS = ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch",
                 "retract_decode")
FUTURE_MAP_METHODS = ("publish", "stash", "resolve_seq_lens_cpu", "resolve_forward_inputs")
SCHEDULER_METHODS = ("get_next_batch_to_run", "run_batch", "process_batch_result")
MODULE_FUNCTIONS = ("resolve_forward_inputs",)
# retract_decode returns before its caller re-queues the retracted requests
# (update_running_batch): request views there would show them nowhere.
NO_REQUEST_VIEWS = frozenset({"retract_decode"})
# A live process has no ghost truth: request views are written with ``ghost: null``.
_NO_GHOST = cast(GhostView, None)
_ABSENT = object()

Hook = Callable[[tuple[Any, ...], dict[str, Any]], Any]
Recorder = Callable[[tuple[Any, ...], dict[str, Any], Any, Any], None]


def _get_plan_batches(value: Any) -> tuple[Any, Any]:
    """(batch to run, running batch) of ``get_next_batch_to_run``'s return: sglang 0.5.23
    returns a ``NextBatchPlan``, the reference and gpu_impl the batch (or None)."""
    if hasattr(value, "batch_to_run"):
        return value.batch_to_run, getattr(value, "running_batch", None)
    return value, None


def _get_arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
             default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _is_stale(req: Any) -> bool:
    return bool(req.finished()) or bool(getattr(req, "is_retracted", False))


@dataclass
class _Track:
    """What the shim learns about one request from the calls it wraps: upstream keeps no
    per-request count of releases or of launched, unprocessed steps."""

    req: Any
    rid: RequestId
    release_count: int = 0  # releases since the request was last prefilled
    cached_len: int | None = None
    committed_at_release: int | None = None
    inflight_at_release: int = 0
    claimed_at_release: int = 0
    inflight: set[int] = field(default_factory=set)  # launches whose result is unprocessed
    prepared: bool = False  # a decode prepared and not yet launched
    was_waiting: bool = False  # seen in the waiting queue since it last held KV
    left: bool = False  # aborted while waiting: out of the queue with no finish reason


@dataclass
class _Launch:
    step: int
    result: Any  # kept alive so its id names this launch until it is processed
    tracks: list[_Track]


class TraceShim:
    """A context manager that wraps the upstream-named methods and writes a trace."""

    def __init__(self, path: Path, cell: str, preset: str, *, batch_class: type,
                 scheduler: Any = None, future_map: Any = None,
                 implementation: str = "live", faults: tuple[str, ...] = (),
                 requests: bool | None = None, env_tokens: bool = False,
                 sizes: dict[str, int] | None = None) -> None:
        """``requests``: record request views (None: when ``scheduler`` exposes upstream's
        pools and waiting queue, i.e. a real sglang scheduler). ``env_tokens``: the forward
        is the project's stand-in, whose tokens are the environment's, so the views carry
        the output token values and the prompt's last token and RP7 is judged (a real
        model's tokens are not the stand-in's: off by default). ``sizes``: the run's sizes
        in place of the preset's (the trace header's ``sizes``)."""
        self.path = path
        self.header = TraceHeader(cell, preset, faults, None, implementation, False,
                                  dict(sizes or {}))
        self.env_tokens = env_tokens
        self.is_spec = get_cell(cell).is_spec
        self.batch_class = batch_class
        self.scheduler = scheduler
        self.future_map = future_map
        self.events: list[dict[str, Any]] = [self.header.to_json()]
        self.restore: list[Callable[[], None]] = []
        self.rids: dict[Any, int] = {}
        self.with_requests = self._has_request_state() if requests is None else requests
        self.tracks: dict[int, _Track] = {}  # id(Req) -> track, in first-seen order
        self.launches: dict[int, _Launch] = {}  # id(result) -> its launch
        self.next_step = 0
        self.last_processed: int | None = None
        self.spec_metrics: tuple[int, int] | None = None
        self.depth = 0  # nesting of wrapped ScheduleBatch calls

    def _has_request_state(self) -> bool:
        return self.scheduler is not None and all(
            hasattr(self.scheduler, name)
            for name in ("req_to_token_pool", "token_to_kv_pool_allocator", "waiting_queue"))

    # -- events --------------------------------------------------------------------
    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append({"id": len(self.events), "event": event, "step": -1, **fields})

    def on_stream(self, fields: dict[str, Any]) -> None:
        self._emit("stream", fields)

    def get_rid(self, req: Any) -> RequestId:
        """Request ids numbered by the shim in first-seen order: upstream rids are strings."""
        return RequestId(self.rids.setdefault(req.rid, len(self.rids)))

    def get_batch_view(self, batch: Any) -> BatchView:
        """Upstream ScheduleBatch fields -> spec BatchView (:mod:`upstream.fields`)."""
        return BatchView(forward_mode=read_forward_mode(batch),
                         rids=tuple(self.get_rid(req) for req in batch.reqs),
                         **read_batch(batch))

    def on_call(self, method: str, batch: Any, *, requests: bool = False,
                result: ResultView | None = None, running_batch: Any = None) -> None:
        fields: dict[str, Any] = {"method": method}
        fields["batch"] = None if batch is None else encode_value(self.get_batch_view(batch))
        if running_batch is not None:
            fields["running_batch"] = encode_value(self.get_batch_view(running_batch))
        if requests and self.with_requests:
            self._see(batch)
            fields["requests"] = [self._encode_request(t) for t in self.tracks.values()]
            allocator = self.get_allocator_view()
            if allocator is not None:
                fields["allocator"] = encode_value(allocator)
        if result is not None:
            fields["result"] = encode_value(result)
        self._emit("call", fields)

    # -- request views -------------------------------------------------------------
    def _track(self, req: Any) -> _Track:
        track = self.tracks.get(id(req))
        if track is None:
            track = self.tracks[id(req)] = _Track(req, self.get_rid(req))
        return track

    def _see(self, batch: Any) -> None:
        """Track every request the scheduler holds (finished ones stay tracked): a shim
        installed mid-run must see the KV holders it has not met in a call yet, or their
        pages would look leaked."""
        sched = self.scheduler
        queued = [item[0] if isinstance(item, tuple) else getattr(item, "batch", None)
                  for item in getattr(sched, "result_queue", None) or ()]
        for holder in (batch, getattr(sched, "running_batch", None),
                       getattr(sched, "last_batch", None), *queued):
            for req in getattr(holder, "reqs", None) or ():
                self._track(req)
        chunked = getattr(sched, "chunked_req", None)
        for req in [*sched.waiting_queue, *([chunked] if chunked is not None else [])]:
            self._track(req)

    def get_request_view(self, track: _Track) -> RequestView:
        req = track.req
        fields = read_request(req, tokens=self.env_tokens)
        page_size = int(getattr(self.scheduler.token_to_kv_pool_allocator, "page_size", 1))
        placement = read_placement(self.scheduler, req, page_size)
        waiting, holds_kv = placement["waiting"], fields["holds_kv"]
        finished = bool(req.finished())
        # Aborted while waiting: abort_request takes it out of the queue without a
        # finish reason; it has left the scheduler.
        if track.was_waiting and not (finished or waiting or holds_kv):
            track.left = True
        track.was_waiting = waiting or (track.was_waiting and not holds_kv)
        left = track.left
        fields["is_retracted"] = fields["is_retracted"] and not left
        return RequestView(
            rid=track.rid, **fields, **placement, finished=finished or left,
            release_count=track.release_count, cached_len=track.cached_len,
            committed_at_release=track.committed_at_release,
            inflight_at_release=track.inflight_at_release,
            claimed_at_release=track.claimed_at_release,
            finish_reason="abort" if left else get_finish_reason_name(req.finished_reason),
            ghost=_NO_GHOST)

    def _encode_request(self, track: _Track) -> dict[str, Any]:
        encoded: dict[str, Any] = encode_value(self.get_request_view(track))
        return encoded

    def get_allocator_view(self) -> AllocatorView | None:
        """Free pages and pool rows; None when a tree cache holds pages the shim cannot
        enumerate (radix cache enabled): KV4 and KV7 are then not judged."""
        return read_allocator(self.scheduler)

    # -- what upstream does not count: releases, launched and prepared steps ----------
    def on_prepare_extend(self, batch: Any) -> None:
        for req in batch.reqs:  # a (re)admission starts a new holding
            track = self._track(req)
            track.release_count, track.prepared = 0, False

    def on_prepare_decode(self, batch: Any) -> None:
        for req in batch.reqs:
            self._track(req).prepared = True

    def on_launch(self, batch: Any, result: Any) -> None:
        tracks = [self._track(req) for req in batch.reqs]
        for track in tracks:
            track.inflight.add(self.next_step)
            track.prepared = False
        self.launches[id(result)] = _Launch(self.next_step, result, tracks)
        self.next_step += 1

    def on_release(self, req: Any, checkpointed: bool) -> None:
        track = self._track(req)
        kv = get_kv(req)
        track.release_count += 1
        track.inflight_at_release = len(track.inflight)
        track.claimed_at_release = len(track.inflight) + int(track.prepared)
        if req.finished():
            track.committed_at_release = int(kv.kv_committed_len)
            owned = getattr(req, "owned_kv_len", None)
            cached = int(owned()) if owned is not None else int(kv.kv_committed_len)
            track.cached_len = cached if checkpointed else 0
        else:  # a retraction: results of steps launched before it settle nothing now
            track.inflight.clear()
            track.prepared = False

    def on_spec_metrics(self, batch_size: int, num_correct_drafts: int) -> None:
        self.spec_metrics = (batch_size, num_correct_drafts)

    def before_result(self, batch: Any, result: Any) -> Any:
        """Settle the launch (so a release inside processing sees it processed, as the
        ghost does) and remember each row's state before processing."""
        launch = self.launches.pop(id(result), None)
        if launch is not None:
            for track in launch.tracks:
                track.inflight.discard(launch.step)
        self.spec_metrics = None
        before = [(_is_stale(req), bool(req.finished()), len(req.output_ids),
                   int(get_kv(req).kv_committed_len)) for req in batch.reqs]
        return launch, before

    def get_result_view(self, batch: Any, result: Any, token: Any) -> ResultView | None:
        """None when the shim did not see the launch, or when a spec result fed no spec
        counters (a prefill): RP3's claim is about those counters."""
        launch, before = token
        if launch is None or (self.is_spec and self.spec_metrics is None):
            return None
        # A prefill or non-spec result has no accept lengths: one token per row.
        accept_lens = to_ints(getattr(result, "accept_lens", None)) or []
        stride = int(getattr(result, "speculative_num_draft_tokens", None) or 1)
        entries = []
        for j, (req, (stale, finished, output, committed)) in enumerate(
                zip(batch.reqs, before, strict=True)):
            after = len(req.output_ids)
            entries.append(ProcessedEntry(
                rid=self.get_rid(req), stale=stale, finished_before=finished,
                accept_len=accept_lens[j] if j < len(accept_lens) else 1,
                run_len=after - output, stride=stride,
                output_before=output, output_after=after, committed_before=committed,
                committed_after=int(get_kv(req).kv_committed_len)))
        batch_size, correct = self.spec_metrics or (0, 0)
        previous, self.last_processed = self.last_processed, launch.step
        return ResultView(
            step=StepId(launch.step), entries=tuple(entries), num_correct_drafts=correct,
            metrics_batch_size=batch_size,
            previous_step=None if previous is None else StepId(previous),
            pending_after=len(getattr(self.scheduler, "result_queue", ()) or ()),
            metered=self.spec_metrics is not None)

    # -- wrapping ------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str, record: Recorder, before: Hook | None = None,
              nests: bool = False) -> None:
        """Replace ``owner.name`` (a class, an instance or a module) by a wrapper that runs
        ``before``, the original, then ``record(args, kwargs, result, before's token)``.
        ``nests``: the call counts in ``self.depth`` while it runs."""
        original: Any = owner.__dict__.get(name, _ABSENT)
        bound = getattr(owner, name)
        is_class = isinstance(owner, type)
        # A plain function on a class is called with self among the arguments.
        call = original if is_class and not isinstance(
            original, classmethod | staticmethod) else bound

        @functools.wraps(bound)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = before(args, kwargs) if before is not None else None
            self.depth += nests
            try:
                result = call(*args, **kwargs)
            finally:
                self.depth -= nests
            record(args, kwargs, result, token)
            return result

        replacement: Any = wrapper
        if is_class and isinstance(original, classmethod):
            replacement = classmethod(lambda cls, *a, **k: wrapper(*a, **k))
        elif is_class and isinstance(original, staticmethod):
            replacement = staticmethod(wrapper)
        setattr(owner, name, replacement)
        if original is _ABSENT:  # an instance attribute over its class's method
            self.restore.append(lambda: delattr(owner, name))
        else:
            self.restore.append(lambda: setattr(owner, name, original))

    def _wrap_batch_method(self, name: str) -> None:
        label = f"ScheduleBatch.{name}"

        def enter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            return self.depth == 0

        def record(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                   outermost: bool) -> None:
            # 0.5.23: prepare_for_extend is an instance method returning None; the
            # reference's is a classmethod returning the new batch.
            batch = result if name == "prepare_for_extend" and result is not None \
                else args[0] if args else None
            if outermost and name == "prepare_for_extend":
                self.on_prepare_extend(batch)
            elif outermost and name == "prepare_for_decode":
                self.on_prepare_decode(batch)
            # Nested calls (filter_batch inside retract_decode) see an intermediate state.
            self.on_call(label, batch,
                         requests=outermost and name not in NO_REQUEST_VIEWS)

        self._wrap(self.batch_class, name, record, enter, nests=True)

    def _wrap_future_map(self) -> None:
        for name in FUTURE_MAP_METHODS:
            if not hasattr(self.future_map, name):
                continue
            label = f"FutureMap.{name}"
            takes_batch = name == "resolve_seq_lens_cpu"

            def record(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                       token: Any, label: str = label, takes_batch: bool = takes_batch
                       ) -> None:
                self.on_call(label, args[0] if takes_batch else None)

            self._wrap(self.future_map, name, record)

    def _get_function_modules(self) -> list[ModuleType]:
        """The modules whose global names the scheduler and the FutureMap call through."""
        modules: list[ModuleType] = []
        for owner in (self.scheduler, self.future_map):
            module = sys.modules.get(type(owner).__module__) if owner is not None else None
            if module is not None and module not in modules:
                modules.append(module)
        return modules

    def _wrap_module_functions(self) -> None:
        for module in self._get_function_modules():
            for name in MODULE_FUNCTIONS:
                function = module.__dict__.get(name)
                if not callable(function) or isinstance(function, type):
                    continue

                def record(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                           token: Any, name: str = name) -> None:
                    batch = args[0] if args else kwargs.get("batch")
                    self.on_call(f"overlap_utils.{name}", batch)

                self._wrap(module, name, record)

    def _wrap_scheduler(self) -> None:
        sched = self.scheduler
        if hasattr(sched, "get_next_batch_to_run"):
            def record_plan(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                            token: Any) -> None:
                batch, running = _get_plan_batches(result)
                self.on_call("Scheduler.get_next_batch_to_run", batch, requests=True,
                             running_batch=running)

            self._wrap(sched, "get_next_batch_to_run", record_plan)
        if hasattr(sched, "run_batch"):
            def record_launch(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                              token: Any) -> None:
                if self.with_requests:
                    self.on_launch(args[0], result)
                self.on_call("Scheduler.run_batch", args[0], requests=True)

            self._wrap(sched, "run_batch", record_launch)
        if hasattr(sched, "process_batch_result"):
            def enter_result(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                return self.before_result(args[0], args[1]) if self.with_requests else None

            def record_result(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                              token: Any) -> None:
                view = None if token is None else self.get_result_view(args[0], args[1],
                                                                       token)
                self.on_call("Scheduler.process_batch_result", None, requests=True,
                             result=view)

            self._wrap(sched, "process_batch_result", record_result, enter_result)

    def _wrap_request_hooks(self) -> None:
        """Where releases and the spec counters become visible (sglang 0.5.23)."""
        tree = getattr(self.scheduler, "tree_cache", None)
        if tree is not None and hasattr(tree, "on_release"):
            def enter_release(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self.on_release(_get_arg(args, kwargs, 0, "req"),
                                bool(_get_arg(args, kwargs, 1, "checkpointed", False)))

            self._wrap(tree, "on_release", lambda a, k, r, t: None, enter_release)
        reporter = getattr(self.scheduler, "metrics_reporter", None)
        if reporter is not None and hasattr(reporter, "update_spec_metrics"):
            def enter_metrics(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self.on_spec_metrics(int(_get_arg(args, kwargs, 0, "bs")),
                                     int(_get_arg(args, kwargs, 1, "num_correct_drafts")))

            self._wrap(reporter, "update_spec_metrics", lambda a, k, r, t: None,
                       enter_metrics)

    def __enter__(self) -> TraceShim:
        for name in BATCH_METHODS:
            if name in self.batch_class.__dict__:
                self._wrap_batch_method(name)
        if self.future_map is not None:
            self._wrap_future_map()
        self._wrap_module_functions()
        if self.scheduler is not None:
            self._wrap_scheduler()
            if self.with_requests:
                self._wrap_request_hooks()
            try:
                attach_recorder(self.scheduler, self.on_stream)
            except (TypeError, ValueError):
                pass  # no spec happens-before record (a live process): calls only
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for undo in reversed(self.restore):
            undo()
        self.restore.clear()
        self.launches.clear()
        self.events.append({"id": len(self.events), "event": "end",
                            "events": len(self.events) + 1})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n"
                                     for e in self.events))


# ----------------------------------------------------------------------------- scripts
def get_shim_targets(model: Any) -> tuple[Any, type, Any]:
    """(scheduler, ScheduleBatch class, FutureMap) of a model: the upstream adapter keeps
    the real Scheduler at ``model.scheduler``; the batch class is the ScheduleBatch the
    scheduler's module imported."""
    scheduler = getattr(model, "scheduler", model)
    batch_class = sys.modules[type(scheduler).__module__].ScheduleBatch
    return scheduler, batch_class, getattr(scheduler, "future_map", None)


def record_shim_trace(script: Script, path: Path) -> Path:
    """Run ``script`` on its implementation (reference or upstream) inside the shim and
    write the trace to ``path``; an implementation crash propagates after the trace is
    written."""
    config = script.get_config()
    model = get_factory(script.implementation)(config, frozenset(script.faults), None)
    scheduler, batch_class, future_map = get_shim_targets(model)
    admitted: list[RequestId] = []
    # Both implementations a script runs on forward through the stand-in model, so the
    # token values are the environment's and RP7 applies.
    with TraceShim(path, script.cell, script.preset, batch_class=batch_class,
                   scheduler=scheduler, future_map=future_map,
                   implementation=f"{script.implementation}-shim", faults=script.faults,
                   env_tokens=True, sizes=script.sizes):
        for index, op in enumerate(script.ops):
            model.set_step_index(index)
            apply_op(model, op, admitted)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.trace_shim SCRIPT -o TRACE``: a shim trace of an operation script
    (for the upstream implementation, run in the upstream environment, one cell per
    process). Check it with ``overlap-spec trace check TRACE``."""
    parser = argparse.ArgumentParser(prog="python -m harness.trace_shim")
    parser.add_argument("script")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    path = record_shim_trace(load_script(Path(args.script)), Path(args.output))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
