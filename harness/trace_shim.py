"""Recording shim for a live scheduler: wrap upstream-named methods, write the trace format.

For a running SGLang scheduler process (or ``gpu_impl``/``reference``, whose
method names mirror upstream), :class:`TraceShim` wraps

- ``ScheduleBatch.prepare_for_extend / prepare_for_decode / filter_batch / merge_batch``
  (on the class: batches are created on the fly),
- ``FutureMap.publish / stash / resolve_seq_lens_cpu / resolve_forward_inputs``,
- ``Scheduler.get_next_batch_to_run / run_batch / process_batch_result``,

and writes one ``call`` event after each returns, with the batch's upstream fields
(``seq_lens``, ``seq_lens_cpu``, ``seq_lens_sum``, ``req_pool_indices``,
``spec_info.future_indices``, ``seq_len_cpu_ub``, ``forward_mode``, ``reqs[].rid``).
When the object keeps a spec happens-before record (``rt.hb``), stream events are
recorded too. ``trace check`` then checks each call with the invariants that read
only the batch or the races (``harness.trace.CALL_INVARIANTS``): a live process has
no ghost truth and no request views, so the KV and RP families need a full trace.

Usage in a live process (sketch)::

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    with TraceShim(Path("live.ndjson"), "ov-p1-v2chain-cpu-honest", "realistic",
                   batch_class=ScheduleBatch, scheduler=scheduler,
                   future_map=scheduler.future_map, implementation="sglang"):
        scheduler.event_loop_overlap()
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.trace import TraceHeader, attach_recorder
from harness.trace_codec import encode_value
from spec.state import BatchView
from spec.units import PoolRow, RequestId

BATCH_METHODS = ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch")
FUTURE_MAP_METHODS = ("publish", "stash", "resolve_seq_lens_cpu", "resolve_forward_inputs")
SCHEDULER_METHODS = ("get_next_batch_to_run", "run_batch", "process_batch_result")


def _to_list(value: Any) -> list[int] | None:
    """A device tensor (torch ``tolist``, reference ``values``) or a list, as ints."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    elif hasattr(value, "values") and not callable(value.values):
        value = value.values
    return [int(v) for v in value]


def _forward_mode(batch: Any) -> str:
    mode = getattr(batch, "forward_mode", None)
    name = getattr(mode, "name", mode)  # upstream: ForwardMode.DECODE
    text = str(name).lower()
    return text if text in ("extend", "decode", "idle") else "idle" if mode is None else text


class TraceShim:
    """A context manager that wraps the upstream-named methods and writes a trace."""

    def __init__(self, path: Path, cell: str, preset: str, *, batch_class: type,
                 scheduler: Any = None, future_map: Any = None,
                 implementation: str = "live", faults: tuple[str, ...] = ()) -> None:
        self.path = path
        self.header = TraceHeader(cell, preset, faults, None, implementation, False)
        self.batch_class = batch_class
        self.scheduler = scheduler
        self.future_map = future_map
        self.events: list[dict[str, Any]] = [self.header.to_json()]
        self.restore: list[Callable[[], None]] = []
        self.rids: dict[Any, int] = {}

    # -- events --------------------------------------------------------------------
    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append({"id": len(self.events), "event": event, "step": -1, **fields})

    def on_stream(self, fields: dict[str, Any]) -> None:
        self._emit("stream", fields)

    def get_batch_view(self, batch: Any) -> BatchView:
        """Upstream ScheduleBatch fields -> spec BatchView (request ids numbered by the shim:
        upstream rids are strings)."""
        rids = tuple(self.rids.setdefault(req.rid, len(self.rids)) for req in batch.reqs)
        spec_info = getattr(batch, "spec_info", None)
        future = getattr(spec_info, "future_indices", None) if spec_info is not None \
            else getattr(batch, "future_indices", None)
        indices = _to_list(batch.req_pool_indices) or []
        indices_cpu = _to_list(getattr(batch, "req_pool_indices_cpu", None)) or indices
        cpu = _to_list(batch.seq_lens_cpu)
        return BatchView(
            forward_mode=_forward_mode(batch), rids=tuple(RequestId(r) for r in rids),
            seq_lens=tuple(_to_list(batch.seq_lens) or []),
            seq_lens_cpu=None if cpu is None else tuple(cpu),
            seq_lens_sum=batch.seq_lens_sum,
            req_pool_indices=tuple(PoolRow(i) for i in indices),
            req_pool_indices_cpu=tuple(PoolRow(i) for i in indices_cpu),
            future_indices=None if future is None else tuple(
                PoolRow(i) for i in _to_list(future) or []),
            seq_len_cpu_ub=getattr(batch, "seq_len_cpu_ub", None))

    def on_call(self, method: str, batch: Any) -> None:
        fields: dict[str, Any] = {"method": method}
        fields["batch"] = None if batch is None else encode_value(self.get_batch_view(batch))
        self._emit("call", fields)

    # -- wrapping ------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str, label: str,
              pick: Callable[[tuple[Any, ...], dict[str, Any], Any], Any]) -> None:
        original: Any = owner.__dict__.get(name) if isinstance(owner, type) else None
        bound = getattr(owner, name)
        shim = self

        @functools.wraps(bound)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = bound(*args, **kwargs) if not isinstance(owner, type) or isinstance(
                original, classmethod | staticmethod) else original(*args, **kwargs)
            shim.on_call(label, pick(args, kwargs, result))
            return result

        if isinstance(owner, type):
            replacement: Any = wrapper
            if isinstance(original, classmethod):
                replacement = classmethod(lambda cls, *a, **k: wrapper(*a, **k))
            elif isinstance(original, staticmethod):
                replacement = staticmethod(wrapper)
            setattr(owner, name, replacement)
            self.restore.append(lambda: setattr(owner, name, original))
        else:
            setattr(owner, name, wrapper)
            self.restore.append(lambda: owner.__dict__.pop(name, None))

    def __enter__(self) -> TraceShim:
        cls = self.batch_class
        for name in BATCH_METHODS:
            if name in cls.__dict__:
                label = f"ScheduleBatch.{name}"
                if name == "prepare_for_extend":
                    self._wrap(cls, name, label, lambda a, k, r: r)
                else:
                    self._wrap(cls, name, label, lambda a, k, r: a[0])
        if self.future_map is not None:
            for name in FUTURE_MAP_METHODS:
                if hasattr(self.future_map, name):
                    pick = (lambda a, k, r: a[0]) if name == "resolve_seq_lens_cpu" \
                        else (lambda a, k, r: None)
                    self._wrap(self.future_map, name, f"FutureMap.{name}", pick)
        if self.scheduler is not None:
            for name in SCHEDULER_METHODS:
                if hasattr(self.scheduler, name):
                    pick = (lambda a, k, r: a[0]) if name == "run_batch" else (
                        (lambda a, k, r: r) if name == "get_next_batch_to_run"
                        else (lambda a, k, r: None))
                    self._wrap(self.scheduler, name, f"Scheduler.{name}", pick)
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
        self.events.append({"id": len(self.events), "event": "end",
                            "events": len(self.events) + 1})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n"
                                     for e in self.events))
