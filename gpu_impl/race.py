"""Cross-stream race detection without a GPU: virtual streams plus torch's sanitizer engine.

A :class:`RaceDetector` is a ``TorchDispatchMode``. While it is active, every aten op
is attributed to the stream that :class:`gpu_impl.streams.Streams` made current, its
tensor arguments are split into reads and writes from the operator schema, and the
accesses feed the vector-clock engine of ``torch.cuda._sanitizer`` (``EventHandler``,
which works on plain integer stream, event and data-pointer ids). Record, wait and
synchronize calls arrive from :class:`Streams`. This is the evaluation the issue asked
for: the engine is reused as it is; what is ours is listed here.

- ``ArgumentHandler`` skips non-CUDA tensors, so :class:`_CpuArgumentHandler` overrides
  ``_handle_argument`` to accept CPU tensors (the sanitizer's own rule otherwise).
- The host is one more participant (lane ``host``). Host tensors (pinned on CUDA) are
  accessed by the host thread in program order, so a host-only op is attributed to the
  host lane whatever stream is current; a copy between host and device runs on the
  current stream. Work the host enqueues is ordered after what the host did before
  (:meth:`_enqueue`), as in ``spec/happens_before.py``.
- Frees. The CUDA caching allocator hands a freed block to the next allocation on the
  block's stream at once. A device tensor whose last Python reference dies is therefore
  modelled as a write by its allocation stream at that moment; a read by another stream
  not ordered before it is a use-after-free race (ST4, B15). ``weakref.finalize`` on
  each newly allocated base tensor tells us when.
- Granularity is the whole tensor (the sanitizer keys on data pointers), coarser than
  the reference's per-row model: two streams touching different rows of one buffer
  without an order between them count as a race. The upstream protocol orders whole
  streams, so the clean model has none (asserted in every cell).

Torch versions: nothing here asks for a version. What is used of the sanitizer's private
API (:data:`SANITIZER_API`: classes, methods, the fields of ``Access`` in order, the
parameters of the constructors and handlers we call or override, the per-instance
state) is looked for at import by :func:`check_sanitizer_api`, which names each missing
internal and the torch version in one ``ImportError``. :data:`TESTED_TORCH` lists the
releases this module's CPU tests passed on, each in a venv of its own
(``bench/bench_torch_matrix.py``; ``bench/results/2026-11-28-torch-matrix.md``): 2.11.0
(the GPU machine's own torch), 2.12.0, 2.13.0 (the CPU build), 2.14.1 (sglang 0.5.23's
pin) and 2.15.0, the CUDA builds run on the CPU. ``pyproject.toml``'s torch range covers
them; ``tests/test_race_detector.py`` asserts that, and that this list is the newest
committed matrix's. On a device, the GPU evidence run (``harness/measure/gpu_evidence.py``)
decides on the machine's own torch whether the internals behave as on CPU; that is not a
claim made here. Read against PyTorch's source, every name in :data:`SANITIZER_API` is
also in ``torch/cuda/_sanitizer.py`` of the main-branch copy the project's code search
holds (commit 01c9f4fc; the file differs from 2.13.0's only in where ``TypeVar`` is
imported from).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import traceback
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.cuda._sanitizer as csan
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_spec.spec.happens_before import COPY, D2H, FORWARD, HOST, SCHEDULE, Access, Race
from overlap_spec.spec.invariants import classify_race

# The torch releases this module's tests passed on (bench/results/2026-11-28-torch-matrix.md).
TESTED_TORCH = ("2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
STREAM_IDS: dict[str, int] = {SCHEDULE: 1, FORWARD: 2, COPY: 3, D2H: 4, HOST: 5}
STREAM_NAMES = {number: name for name, number in STREAM_IDS.items()}
_SKIPPED_OPS = {"aten::record_stream", "aten::detach"}


def count_as_launch(func: Any) -> bool:
    """A device operation (kernel or copy): not a view, not bookkeeping."""
    return not func.is_view and func._schema.name not in _SKIPPED_OPS | {"aten::lift_fresh"}


# What this module (and the CUDA run's ``enable_cuda_sanitizer``) uses of
# ``torch.cuda._sanitizer``. Names are module attributes; "A.b" an attribute of class A;
# "A().b" one an instance has after ``A()``; "A(x, y)" the first parameters of A's
# constructor (a dataclass's fields) in order; "A.f(x, y)" those of method f.
SANITIZER_API: tuple[str, ...] = (
    "FACTORY_FUNCTION_REGEX", "enable_cuda_sanitizer",
    "AccessType.READ", "AccessType.WRITE",
    "Access(type, seq_num, stream, operator, aliases, is_output, stack_trace)",
    "UnsynchronizedAccessError(data_ptr, allocation_stack_trace, current_access, "
    "previous_access)",
    "ArgumentHandler._handle_argument(value, is_write, metadata_only, name, is_output)",
    "ArgumentHandler().dataptrs_read", "ArgumentHandler().dataptrs_written",
    "ArgumentHandler().tensor_aliases", "ArgumentHandler().outputs",
    "EventHandler._handle_kernel_launch(stream, read_only, read_write, outputs, operator, "
    "tensor_aliases)",
    "EventHandler._handle_stream_creation", "EventHandler._handle_event_creation",
    "EventHandler._handle_event_record", "EventHandler._handle_event_wait",
    "EventHandler._handle_event_synchronization", "EventHandler._handle_stream_synchronization",
    "EventHandler().seq_num", "EventHandler().syncs", "EventHandler().tensors_accessed",
    "StreamSynchronizations.update_seq_num", "StreamSynchronizations.is_ordered_after",
    "StreamSynchronizations._state_wait_for_other",
    "StreamSynchronizations().current_sync_states",
    "_TensorsAccessed.ensure_tensor_exists", "_TensorsAccessed.get_write",
    "_TensorsAccessed.add_read", "_TensorsAccessed.get_reads", "_TensorsAccessed.set_write",
    "_TensorsAccessed.were_there_reads_since_last_write", "_TensorsAccessed().accesses",
    "TensorInfo.reads", "TensorInfo.write",
)


def _parameters(target: Any) -> list[str]:
    """The parameter names of a callable (a dataclass's are its fields), ``self`` left out."""
    if dataclasses.is_dataclass(target):
        return [f.name for f in dataclasses.fields(target)]
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return []
    return names[1:] if names[:1] == ["self"] else names


def get_missing_sanitizer_api(module: Any = csan) -> list[str]:
    """The entries of :data:`SANITIZER_API` that ``module`` does not offer, as written there
    (a changed parameter list is missing too)."""
    missing: list[str] = []
    for entry in SANITIZER_API:
        path, params = entry, ""
        if entry.endswith(")"):
            path, _, params = entry[:-1].partition("(")
        wanted = [p.strip() for p in params.split(",")] if params else []
        instance = path.split(".")[0].endswith("()")
        owner_name, _, attribute = path.replace("()", "").partition(".")
        target = getattr(module, owner_name, None)
        if target is not None and instance:
            try:
                target = target()
            except Exception:  # noqa: BLE001 - a constructor that changed is a missing API
                target = None
        if target is not None and attribute:
            if dataclasses.is_dataclass(target) and not instance:
                fields = {f.name for f in dataclasses.fields(target)}
                target = target if attribute in fields else getattr(target, attribute, None)
            else:
                target = getattr(target, attribute, None)
        if target is None or (wanted and _parameters(target)[:len(wanted)] != wanted):
            missing.append(entry)
    return missing


def check_sanitizer_api(module: Any = csan) -> None:
    """Fail loudly, naming each missing internal, if this torch moved what we build on."""
    missing = get_missing_sanitizer_api(module)
    if missing:
        raise ImportError(
            f"torch {torch.__version__}: torch.cuda._sanitizer lacks "
            f"{'; '.join(missing)} (gpu_impl/race.py builds on these internals; it was "
            f"tested with torch {', '.join(TESTED_TORCH)})")


check_sanitizer_api()


@dataclass(frozen=True)
class AccessSite:
    stream: str
    operator: str
    kind: str  # "read" | "write" | "free"
    where: str  # the gpu_impl function that issued it


@dataclass(frozen=True)
class RaceReport:
    """Two conflicting accesses to one tensor with no happens-before edge between them."""

    tensor: str
    earlier: AccessSite
    later: AccessSite
    buffer: str = "tensor"  # the spec's buffer name (spec.invariants.classify_race)
    serial: int = 0  # which tensor: allocation order

    def to_spec_race(self) -> Race:
        """The same pair as a :class:`spec.happens_before.Race`, so the spec names its ID."""
        key = (self.buffer, self.serial)
        return Race(Access(self.earlier.stream, 0, self.earlier.kind, key,
                           f"{self.earlier.operator} in {self.earlier.where}"),
                    Access(self.later.stream, 0, self.later.kind, key,
                           f"{self.later.operator} in {self.later.where}"))

    def get_invariant(self) -> str:
        return classify_race(self.to_spec_race())

    def describe(self) -> str:
        return (f"{self.get_invariant()}: race on {self.tensor}: {self.later.kind} by "
                f"{self.later.operator} on stream "
                f"{self.later.stream} (in {self.later.where}) is not ordered after "
                f"{self.earlier.kind} by {self.earlier.operator} on stream "
                f"{self.earlier.stream} (in {self.earlier.where})")


class RaceError(AssertionError):
    def __init__(self, report: RaceReport) -> None:
        super().__init__(report.describe())
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.report,), self.__dict__)


@dataclass(frozen=True)
class _Operator:
    """What the detector needs of an operator's schema, computed once per operator (the
    sanitizer recomputes it on every call)."""

    name: str
    arguments: tuple[tuple[str, bool, bool], ...]  # (name, is_write, is_aliased_read)
    positions: dict[str, int]
    has_returns: bool
    view_return: bool  # the first return aliases an input without writing it
    is_factory: bool
    is_skipped: bool
    counts_as_launch: bool


_OPERATORS: dict[Any, _Operator] = {}


def _get_operator(func: Any) -> _Operator:
    known = _OPERATORS.get(func)
    if known is None:
        schema = func._schema
        arguments = tuple((a.name, a.alias_info is not None and a.alias_info.is_write,
                           a.alias_info is not None and not a.alias_info.is_write)
                          for a in schema.arguments)
        first = schema.returns[0] if schema.returns else None
        known = _Operator(
            str(schema.name), arguments, {name: i for i, (name, _, _) in enumerate(arguments)},
            bool(schema.returns),
            first is not None and first.alias_info is not None and not first.alias_info.is_write,
            bool(csan.FACTORY_FUNCTION_REGEX.match(schema.name)),
            schema.name in _SKIPPED_OPS, count_as_launch(func))
        _OPERATORS[func] = known
    return known


class _CpuArgumentHandler(csan.ArgumentHandler):
    """The sanitizer's argument parser, accepting tensors on any device.

    ``parse_inputs`` / ``parse_outputs`` are the sanitizer's rules (torch 2.13,
    ``torch/cuda/_sanitizer.py``) without its per-call ``pytree.tree_map_`` and schema
    walk: the flags are cached per operator and only tensors and (nested) lists and
    tuples of them are visited, the only containers an aten schema passes. Profiled: the
    generic walk was a fifth of a differential run's time.
    """

    def _handle_argument(self, value: Any, is_write: bool, metadata_only: bool,
                         name: str | None = None, is_output: bool = False) -> None:
        if not isinstance(value, torch.Tensor):
            if isinstance(value, list | tuple):
                for item in value:
                    self._handle_argument(item, is_write, metadata_only, name, is_output)
            return
        data_ptr = value.data_ptr()
        if not data_ptr:
            # No memory (no element): nothing to race on. Keying it by id() instead, as
            # before, left an access under a Python object's address that no free ever
            # cleared; a block the allocator later placed there inherited that history, a
            # false race that depended on where malloc put things (a flake under load).
            return
        if is_write:
            self.dataptrs_written.add(data_ptr)
        elif not metadata_only:
            self.dataptrs_read.add(data_ptr)
        self.tensor_aliases.setdefault(data_ptr, [])
        if name is not None:
            self.tensor_aliases[data_ptr].append(name)
        if is_output:
            self.outputs.add(data_ptr)

    def parse_operator_inputs(self, operator: _Operator, args: Any,
                              kwargs: dict[str, Any]) -> None:
        metadata = operator.is_factory
        for (name, is_write, aliased_read), value in zip(operator.arguments, args,
                                                         strict=False):
            self._handle_argument(value, is_write, metadata or aliased_read, name)
        for key, value in kwargs.items():
            position = operator.positions.get(key)
            if position is not None and position >= len(args):
                name, is_write, aliased_read = operator.arguments[position]
                self._handle_argument(value, is_write, metadata or aliased_read, name)

    def parse_operator_outputs(self, operator: _Operator, outputs: Any) -> None:
        if operator.has_returns:
            metadata_only = operator.is_factory or operator.view_return
            self._handle_argument(outputs, not metadata_only, metadata_only, None, True)


FREE_OPERATION = "free (block reusable by its allocation stream)"


def _site(access: Any) -> AccessSite:
    operation = str(access.operator)
    kind = "free" if operation == FREE_OPERATION else access.type.name.lower()
    where = access.aliases[0] if access.aliases else "?"
    return AccessSite(STREAM_NAMES.get(access.stream, str(access.stream)), operation, kind, where)


def _caller(skip_files: tuple[str, ...] = ("race.py", "streams.py")) -> str:
    """The innermost gpu_impl function outside this module and streams.py."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "gpu_impl" in filename and not filename.endswith(skip_files):
            short = filename[filename.rfind("gpu_impl"):]
            return f"{frame.f_code.co_name} ({short}:{frame.f_lineno})"
        frame = frame.f_back
    return "outside gpu_impl"


@dataclass
class _TensorInfo:
    name: str
    stream: str
    host: bool
    nbytes: int
    serial: int
    buffer: str = "tensor"


class _LeanEventHandler(csan.EventHandler):
    """``EventHandler`` without the per-launch Python stack capture.

    The sanitizer walks the whole stack on every kernel launch; that was half of the
    detector's cost (profiled: about 130 of 260 us per op). Our reports name the gpu_impl
    function instead (:func:`_caller`, computed only for the accesses we keep). The
    conflict rule below is the sanitizer's, unchanged.
    """

    def _handle_kernel_launch(self, stream: int, read_only: set[int], read_write: set[int],
                              outputs: set[int], operator: str,
                              tensor_aliases: dict[int, list[str]]) -> list[Any]:
        errors: list[Any] = []
        self.seq_num += 1
        self.syncs.update_seq_num(stream, self.seq_num)
        accessed = self.tensors_accessed
        no_stack = traceback.StackSummary()

        def check(data_ptr: int, current: Any, previous: Any) -> None:
            if previous is not None and not self.syncs.is_ordered_after(
                    current.stream, previous.seq_num, previous.stream):
                errors.append(csan.UnsynchronizedAccessError(data_ptr, None, current, previous))

        for data_ptr in read_only:
            accessed.ensure_tensor_exists(data_ptr)
            current = csan.Access(csan.AccessType.READ, self.seq_num, stream, operator,
                                  tensor_aliases[data_ptr], data_ptr in outputs, no_stack)
            check(data_ptr, current, accessed.get_write(data_ptr))
            accessed.add_read(data_ptr, current)
        for data_ptr in read_write:
            accessed.ensure_tensor_exists(data_ptr)
            current = csan.Access(csan.AccessType.WRITE, self.seq_num, stream, operator,
                                  tensor_aliases[data_ptr], data_ptr in outputs, no_stack)
            if accessed.were_there_reads_since_last_write(data_ptr):
                for previous in accessed.get_reads(data_ptr):
                    check(data_ptr, current, previous)
            else:
                check(data_ptr, current, accessed.get_write(data_ptr))
            accessed.set_write(data_ptr, current)
        return errors


class RaceDetector(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """See the module header. ``raise_on_race`` raises at the first race; else collects."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this
        # says False; nothing here is compiled, and the wrapper imported torch._dynamo
        # (about 2 s per worker process) and cost a frame switch on every operator.
        return False

    def __init__(self, raise_on_race: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.raise_on_race = raise_on_race
        self.handler = _LeanEventHandler()
        for stream_id in STREAM_IDS.values():
            self.handler._handle_stream_creation(stream_id)
        self.events: dict[str, int] = {}
        self.current = SCHEDULE
        self.races: list[RaceReport] = []
        self.launches: dict[str, int] = {}
        self.tensors: dict[int, _TensorInfo] = {}
        self.serial = 0  # tensors tracked so far
        self._freeing: _TensorInfo | None = None  # the tensor being freed, for its report
        self.host_mode = 0  # > 0 while Streams runs host-thread work (host_tensor, host_write)
        # Device-to-host reads outside Streams: int(), bool(), float() or .item() of a
        # device tensor (aten::_local_scalar_dense), each a hidden host sync on a GPU that
        # the sync contract would not count. Where they happened, in gpu_impl.
        self.hidden_host_reads: list[str] = []

    # ------------------------------------------------------------------ stream events
    def set_current_stream(self, stream: str) -> None:
        self.current = stream

    def _event_id(self, event: str) -> int:
        number = self.events.get(event)
        if number is None:
            number = len(self.events) + 1
            self.events[event] = number
            self.handler._handle_event_creation(number)
        return number

    def on_record(self, event: str, stream: str) -> None:
        self._enqueue(stream)
        self.handler._handle_event_record(self._event_id(event), STREAM_IDS[stream])

    def on_wait_event(self, stream: str, event: str) -> None:
        self._enqueue(stream)
        self.handler._handle_event_wait(self._event_id(event), STREAM_IDS[stream])

    def on_wait_stream(self, waiter: str, waitee: str) -> None:
        # torch's wait_stream records a fresh event on the waitee and waits on it.
        self._enqueue(waiter)
        syncs = self.handler.syncs
        waitee_state = dict(syncs.current_sync_states[STREAM_IDS[waitee]])
        syncs._state_wait_for_other(syncs.current_sync_states[STREAM_IDS[waiter]], waitee_state)

    def on_synchronize_event(self, event: str) -> None:
        self.handler._handle_event_synchronization(self._event_id(event))

    def on_synchronize_stream(self, stream: str) -> None:
        self.handler._handle_stream_synchronization(STREAM_IDS[stream])

    def _enqueue(self, stream: str) -> None:
        """Work the host enqueues now is ordered after the host's own earlier accesses."""
        if stream == HOST:
            return
        syncs = self.handler.syncs
        host_state = syncs.current_sync_states[STREAM_IDS[HOST]]
        syncs._state_wait_for_other(syncs.current_sync_states[STREAM_IDS[stream]],
                                    {STREAM_IDS[HOST]: host_state.get(STREAM_IDS[HOST], 0)})

    # ------------------------------------------------------------------ tensors
    def mark_host(self, tensor: torch.Tensor) -> None:
        self._track(tensor, HOST, "host tensor", host=True)

    def enter_host(self) -> None:
        """Host-thread work starts: ops are the host's, outputs are host tensors."""
        self.host_mode += 1

    def exit_host(self) -> None:
        self.host_mode -= 1

    def on_host_access(self, tensor: torch.Tensor, operation: str, write: bool) -> None:
        pointer = tensor.data_ptr()
        if not pointer:
            return  # no element, no memory (see _CpuArgumentHandler._handle_argument)
        self._launch(HOST, set() if write else {pointer}, {pointer} if write else set(),
                     operation, set())

    def name(self, tensor: torch.Tensor, name: str) -> None:
        """Name a long-lived buffer with the spec's buffer name (``new_seq_lens_buf``, ...)."""
        info = self.tensors.get(tensor.data_ptr())
        if info is not None:
            info.name = info.buffer = name

    def _track(self, tensor: torch.Tensor, stream: str, origin: str, host: bool) -> None:
        pointer = tensor.data_ptr()
        if not pointer or tensor._base is not None or pointer in self.tensors:
            if pointer in self.tensors and host:
                self.tensors[pointer].host = True
            return
        nbytes = tensor.untyped_storage().nbytes()
        # A block tracked from now on starts with no history, whatever was recorded at its
        # address before (a free clears its block; this covers anything a free never saw).
        self.handler.tensors_accessed.accesses.pop(pointer, None)
        self.serial += 1
        self.tensors[pointer] = _TensorInfo(f"{origin} at {_caller()}", stream, host, nbytes,
                                            self.serial)
        weakref.finalize(tensor, self._on_free, pointer)

    def _on_free(self, pointer: int) -> None:
        info = self.tensors.pop(pointer, None)
        if info is None:
            return
        self._freeing = info
        if not info.host and self._used_elsewhere(pointer, info.stream):
            # The block is reusable by its allocation stream from now on.
            self._launch(info.stream, set(), {pointer}, FREE_OPERATION, set(),
                         tensor_name=info.name)
        self._freeing = None
        # Forget every access inside the block (views at an offset have their own pointer),
        # so the next tensor placed there starts with a clean history.
        accesses = self.handler.tensors_accessed.accesses
        for key in [k for k in accesses if pointer <= k < pointer + max(info.nbytes, 1)]:
            del accesses[key]

    def _used_elsewhere(self, pointer: int, stream: str) -> bool:
        """Whether an access the free would be checked against (the reads since the last
        write, else the last write) ran on a stream other than ``stream``. When none did,
        the free cannot race (accesses on one stream are ordered), and its launch, whose
        record the cleanup below deletes at once, is skipped: most frees are of
        temporaries used on one stream, and skipping them was a third of the detector's
        launches. A free's other effects (the stream's clock, the host's ordering of its
        work) every later launch or event record on that stream applies itself."""
        entry = self.handler.tensors_accessed.accesses.get(pointer)
        if entry is None:
            return False
        stream_id = STREAM_IDS[stream]
        previous = entry.reads if entry.reads else [entry.write] if entry.write else []
        return any(access.stream != stream_id for access in previous)

    def is_host(self, pointer: int) -> bool:
        info = self.tensors.get(pointer)
        return info is not None and info.host

    # ------------------------------------------------------------------ kernel launches
    def _launch(self, stream: str, reads: set[int], writes: set[int], operation: str,
                outputs: set[int], tensor_name: str | None = None) -> None:
        self._enqueue(stream)
        # The sanitizer's per-argument alias list carries our site: where it was issued.
        where = [_caller()]
        aliases: dict[int, list[str]] = {p: where for p in reads | writes}
        errors = self.handler._handle_kernel_launch(
            STREAM_IDS[stream], reads - writes, writes, outputs, operation, aliases)
        for error in errors:
            self._report(error, tensor_name)

    def _report(self, error: Any, tensor_name: str | None) -> None:
        info = self.tensors.get(error.data_ptr) or self._freeing
        name = tensor_name or (info.name if info is not None else f"tensor@{error.data_ptr:#x}")
        report = RaceReport(name, _site(error.previous_access), _site(error.current_access),
                            info.buffer if info is not None else "tensor",
                            info.serial if info is not None else 0)
        self.races.append(report)
        if self.raise_on_race and self._freeing is None:  # a finalizer cannot raise
            raise RaceError(report)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        operator = _get_operator(func)
        if operator.is_skipped:
            return func(*args, **kwargs)
        is_factory = operator.is_factory
        handler = _CpuArgumentHandler()
        handler.parse_operator_inputs(operator, args, kwargs)
        inputs = handler.dataptrs_read | handler.dataptrs_written
        outputs = func(*args, **kwargs)
        handler.parse_operator_outputs(operator, outputs)
        host_only = self.host_mode > 0 or (bool(inputs) and all(self.is_host(p) for p in inputs))
        if operator.name == "aten::lift_fresh":
            # torch.tensor(data): a fresh tensor filled from Python (an H2D copy on CUDA).
            for out in _tensors(outputs):
                self._track(out, HOST if host_only else self.current, "torch.tensor",
                            host=host_only)
                pointer = out.data_ptr()
                if not pointer:
                    continue  # torch.tensor([]): no memory to write
                self._launch(HOST if host_only else self.current, set(), {pointer},
                             "torch.tensor", {pointer})
            return outputs
        if is_factory:
            # zeros_like / new_zeros / ...: the sanitizer parses their outputs as metadata
            # only; a fresh block filled on this stream is a write, and it must be tracked
            # so its history dies with it.
            for out in _tensors(outputs):
                pointer = out.data_ptr()
                if pointer and pointer not in inputs:
                    handler.dataptrs_written.add(pointer)
                    handler.outputs.add(pointer)
        if operator.name == "aten::_local_scalar_dense" and not host_only:
            self.hidden_host_reads.append(_caller())
        touched = handler.dataptrs_read | handler.dataptrs_written
        if not touched:
            return outputs  # a view or a metadata-only op: no kernel
        stream = HOST if host_only else self.current
        for out in _tensors(outputs):
            pointer = out.data_ptr()
            if pointer and pointer not in inputs:
                self._track(out, stream, operator.name, host=host_only)
        if stream != HOST and operator.counts_as_launch:
            self.launches[stream] = self.launches.get(stream, 0) + 1
        self._launch(stream, handler.dataptrs_read, handler.dataptrs_written,
                     operator.name, handler.outputs)
        return outputs


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []

