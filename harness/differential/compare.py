"""Differential testing: reference and gpu_impl driven by one operation sequence.

After every operation both implementations report :class:`spec.interface.ObservableState`;
the first field that differs is a :class:`Divergence` (step, operation, field, both
values). gpu_impl runs under a :class:`gpu_impl.race.RaceDetector` on CPU (virtual
streams) and under torch's CUDA sanitizer on CUDA when asked; a race is a finding too.
The reference also checks every spec invariant on the way (it is the oracle).

A mutant of gpu_impl (``faults``) runs against the *clean* reference: a historical bug
is caught by this checker when the values diverge or a race is reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from overlap_spec.gpu_impl.race import RaceDetector, RaceReport
from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.harness.crash import Crash
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import Abort, Iterate, Op, Script, apply_op, op_to_json
from overlap_spec.harness.drive.stateful import Profile, get_machine_test, make_machine
from overlap_spec.reference.scheduler import Scheduler as ReferenceScheduler
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.interface import ObservableState
from overlap_spec.spec.units import RequestId


@dataclass(frozen=True)
class Divergence:
    """The first disagreement between reference and gpu_impl."""

    step: int  # index of the operation in the script
    operation: str
    field: str
    reference: Any
    gpu_impl: Any
    # gpu_impl raised where the reference did not: the crash, as the matrix matches it.
    gpu_crash: Crash | None = None

    def describe(self) -> str:
        return (f"divergence at step {self.step} ({self.operation}): {self.field}: "
                f"reference={self.reference!r} gpu_impl={self.gpu_impl!r}")


@dataclass
class DifferentialOutcome:
    ops: int
    divergence: Divergence | None = None
    races: list[RaceReport] = field(default_factory=list)
    race_step: int | None = None
    races_checked: bool = True  # False: real CUDA streams with no detector watching them
    # int() / bool() / .item() of a device tensor outside gpu_impl/streams.py: a host sync
    # the sync contract cannot count (ST3), with where it happened.
    hidden_host_reads: list[str] = field(default_factory=list)
    hidden_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.races and not self.hidden_host_reads

    def describe(self) -> str:
        if self.divergence is not None:
            return self.divergence.describe()
        if self.races:
            return f"race at step {self.race_step}: {self.races[0].describe()}"
        if self.hidden_host_reads:
            return (f"hidden host sync at step {self.hidden_step}: a device tensor read on "
                    f"the host in {self.hidden_host_reads[0]}, outside gpu_impl/streams.py, "
                    "so the sync contract does not count it (ST3)")
        races = "no race" if self.races_checked else "races not checked"
        return f"reference and gpu_impl agree on all {self.ops} ops; {races}"


class DifferentialFailure(AssertionError):
    """Raised inside Hypothesis so it can shrink; carries the outcome and script."""

    def __init__(self, outcome: DifferentialOutcome, script: Script) -> None:
        super().__init__(outcome.describe())
        self.outcome = outcome
        self.script = script
        self.script_path: Path | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, so a finding crosses a process boundary intact.
        return (type(self), (self.outcome, self.script), self.__dict__)


GPU_MUTANT_EXAMPLES = {"quick": 200, "ci": 200, "dev": 600, "thorough": 2000}
DIFFERENTIAL_EXAMPLES = {"quick": 20, "ci": 20, "dev": 200, "thorough": 1000}


def get_differential_examples(profile: Profile) -> int:
    """Sequences per cell for the clean differential tier (each runs both implementations)."""
    return DIFFERENTIAL_EXAMPLES.get(profile.name, profile.max_examples)


def get_gpu_mutant_examples(profile: Profile) -> int:
    """Examples per gpu_impl mutant and cell: fewer than the reference's (each is slower)."""
    return GPU_MUTANT_EXAMPLES.get(profile.name, profile.mutant_examples)


def get_finding_kind(outcome: DifferentialOutcome) -> str:
    """"race:<ID>" (the spec's classify_race), "crash:<Type>@<function>" (gpu_impl alone
    raised) or "diff:<field>": a gpu_impl kill's label."""
    if outcome.races:
        return "race:" + outcome.races[0].get_invariant()
    if outcome.hidden_host_reads:
        return "hidden-sync:ST3"
    if outcome.divergence is not None and outcome.divergence.gpu_crash is not None:
        return outcome.divergence.gpu_crash.label
    if outcome.divergence is not None:
        field_path = outcome.divergence.field
        if field_path.startswith("request "):  # "request r3.kv_committed_len": any request
            field_path = field_path.split(".", 1)[1]
        return "diff:" + field_path
    return "none"


def get_default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def compare_states(reference: ObservableState, gpu: ObservableState) -> tuple[str, Any, Any] | None:
    """The first differing field as (path, reference value, gpu_impl value), or None."""
    if len(reference.requests) != len(gpu.requests):
        return ("requests", len(reference.requests), len(gpu.requests))
    for ref_req, gpu_req in zip(reference.requests, gpu.requests, strict=True):
        for name in (f.name for f in fields(ref_req)):
            ref_value, gpu_value = getattr(ref_req, name), getattr(gpu_req, name)
            if ref_value != gpu_value:
                return (f"request r{ref_req.rid}.{name}", ref_value, gpu_value)
    for batch_name in ("running", "last_batch"):
        ref_batch, gpu_batch = getattr(reference, batch_name), getattr(gpu, batch_name)
        if ref_batch is None or gpu_batch is None:
            if ref_batch != gpu_batch:
                return (batch_name, ref_batch, gpu_batch)
            continue
        for name in (f.name for f in fields(ref_batch)):
            ref_value, gpu_value = getattr(ref_batch, name), getattr(gpu_batch, name)
            if ref_value != gpu_value:
                return (f"{batch_name}.{name}", ref_value, gpu_value)
    for name in (f.name for f in fields(reference)):
        if name in ("requests", "running", "last_batch"):
            continue
        ref_value, gpu_value = getattr(reference, name), getattr(gpu, name)
        if ref_value != gpu_value:
            return (name, ref_value, gpu_value)
    return None


def describe_op(op: Op) -> str:
    raw = op_to_json(op)
    kind = raw.pop("op")
    return f"{kind} {raw}" if raw else str(kind)


class DifferentialPair:
    """A reference (clean, invariant-checked) and a gpu_impl (maybe faulted) in lock step."""

    def __init__(self, config: ModelConfig, faults: frozenset[str] = frozenset(),
                 device: torch.device | None = None, detect_races: bool = True) -> None:
        self.config = config
        self.device = device or get_default_device()
        self.checker = InvariantChecker(config)
        self.reference = ReferenceScheduler(config, frozenset(), self.checker)
        # On CUDA the real streams run; races there are torch's CUDA sanitizer's business.
        virtual = self.device.type == "cpu"
        self.detector = RaceDetector() if detect_races and virtual else None
        self.streams = Streams(self.device, self.detector)
        with self._watching():
            self.gpu = GpuScheduler(config, faults, None, streams=self.streams)
        self.ref_admitted: list[RequestId] = []
        self.gpu_admitted: list[RequestId] = []
        self.outcome = DifferentialOutcome(0, races_checked=self.detector is not None)
        self.reference_state: ObservableState | None = None  # after the last compared op

    @contextmanager
    def _watching(self) -> Iterator[None]:
        with self.detector if self.detector is not None else nullcontext():
            yield

    def apply(self, op: Op) -> DifferentialOutcome:
        """Apply ``op`` to both; record the first divergence or race in ``outcome``."""
        step = self.outcome.ops
        self.outcome.ops += 1
        self.reference.set_step_index(step)
        self.gpu.set_step_index(step)
        ref_error = gpu_error = None
        try:
            apply_op(self.reference, op, self.ref_admitted)
        except Exception as error:  # noqa: BLE001 - compared below, never swallowed
            ref_error = error
        races_before = len(self.detector.races) if self.detector is not None else 0
        reads_before = len(self.detector.hidden_host_reads) if self.detector is not None else 0
        try:
            with self._watching():
                apply_op(self.gpu, op, self.gpu_admitted)
        except Exception as error:  # noqa: BLE001
            gpu_error = error
        if self.detector is not None and len(self.detector.races) > races_before:
            self.outcome.races = list(self.detector.races[races_before:])
            self.outcome.race_step = step
            return self.outcome
        if self.detector is not None and len(self.detector.hidden_host_reads) > reads_before:
            self.outcome.hidden_host_reads = self.detector.hidden_host_reads[reads_before:]
            self.outcome.hidden_step = step
            return self.outcome
        if ref_error is not None or gpu_error is not None:
            ref_kind = None if ref_error is None else type(ref_error).__name__
            gpu_kind = None if gpu_error is None else type(gpu_error).__name__
            if ref_kind != gpu_kind:
                self.outcome.divergence = Divergence(
                    step, describe_op(op), "exception",
                    None if ref_error is None else f"{ref_kind}: {ref_error}",
                    None if gpu_error is None else f"{gpu_kind}: {gpu_error}",
                    Crash.of(gpu_error) if gpu_error is not None and ref_error is None
                    else None)
                return self.outcome
            raise ref_error  # type: ignore[misc]  # both failed alike: the reference's error
        self.reference_state = self.reference.get_observable_state()
        difference = compare_states(self.reference_state, self.gpu.get_observable_state())
        if difference is not None:
            self.outcome.divergence = Divergence(step, describe_op(op), *difference)
        return self.outcome


def run_differential(script: Script, faults: frozenset[str] | None = None,
                     device: torch.device | None = None,
                     detect_races: bool = True) -> DifferentialOutcome:
    """Replay ``script`` on both implementations; stop at the first finding."""
    pair = DifferentialPair(script.get_config(),
                            frozenset(script.faults) if faults is None else faults,
                            device, detect_races)
    for op in script.ops:
        outcome = pair.apply(op)
        if not outcome.ok:
            return outcome
    return pair.outcome


# The least a cell's differential must compare before its agreement means anything:
# operations whose states were compared, and iterations that launched a non-empty batch
# (the ci profile compares thousands; a run under these compared almost nothing).
MIN_COMPARED_OPS = 200
MIN_LAUNCHES = 50
MAX_TOP_UPS = 3  # extra rounds of sequences a clean cell may run to reach the minimum


def get_share_minimum(share: float) -> tuple[int, int]:
    """The minimum (compared operations, launches) of a configuration holding ``share`` of
    its cell's budget (cells.get_budget_shares): the cell's minimum split like its budget,
    so that a cell's size sets together compare at least MIN_COMPARED_OPS and MIN_LAUNCHES
    (each at least one of each: a size set that compared nothing is vacuous)."""
    return (max(1, math.ceil(MIN_COMPARED_OPS * share)),
            max(1, math.ceil(MIN_LAUNCHES * share)))


@dataclass
class DifferentialResult:
    config: ModelConfig
    faults: frozenset[str]
    seed: int
    seconds: float
    failure: DifferentialFailure | None = None
    error: BaseException | None = None
    examples: int = 0
    compared_ops: int = 0  # operations after which both states were compared
    launches: int = 0  # iterations that launched a non-empty batch
    aborts: int = 0  # abort operations compared (of requests finished or not)
    rounds: int = 1  # rounds of sequences run: more than 1 when topped up to the minimum
    # what this configuration had to compare (get_share_minimum): ops, launches
    minimum: tuple[int, int] = (MIN_COMPARED_OPS, MIN_LAUNCHES)
    # A finding Hypothesis could not reproduce when it replayed the same draws (its
    # FlakyFailure): the run is inconclusive, and this first finding is kept to replay.
    unreplayed: DifferentialFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.error is None

    @property
    def exercised_enough(self) -> bool:
        """Whether agreement here is evidence: at least the minimum budget compared."""
        return self.compared_ops >= self.minimum[0] and self.launches >= self.minimum[1]


def find_differential_failure(error: BaseException) -> DifferentialFailure | None:
    """The first DifferentialFailure inside ``error`` (itself, or one of the exceptions a
    Hypothesis FlakyFailure groups), or None."""
    if isinstance(error, DifferentialFailure):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = find_differential_failure(inner)
        if found is not None:
            return found
    return None


def get_top_up_seed(run_seed: int, round_index: int) -> int:
    """The seed of a top-up round: round 0 is the run's own; the rest derive from it, so
    the printed seed still reproduces the whole search."""
    return run_seed if round_index == 0 else (run_seed * 1_000_003 + round_index) % 2**32


def check_cell_differential(config: ModelConfig, profile: Profile, run_seed: int,
                            faults: frozenset[str] = frozenset(),
                            max_examples: int | None = None,
                            device: torch.device | None = None,
                            shrink: bool = True, top_up: bool = False,
                            top_ups: int = MAX_TOP_UPS,
                            minimum: tuple[int, int] = (MIN_COMPARED_OPS, MIN_LAUNCHES),
                            detect_races: bool = True) -> DifferentialResult:
    """Hypothesis-generated operation sequences (the stateful checker's rules) in one cell.

    ``top_up``: when a clean pass compared less than ``minimum`` (operations, launches:
    MIN_COMPARED_OPS and MIN_LAUNCHES, or a size set's share of them), run up to
    ``top_ups`` more rounds of as many sequences under seeds derived from ``run_seed``,
    until it has. Some seeds draw sequences that seldom
    launch (Hypothesis tries its simplest example first, prefill off): without the
    top-up the minimum failed such a seed as vacuous in half the cells. ``detect_races``
    False: the CPU race detector is off (a search for a divergence, about a quarter of the
    cost; the outcome then says races were not checked)."""
    base = make_machine(config, frozenset(), "reference")
    counter = {"examples": 0, "compared_ops": 0, "launches": 0, "aborts": 0}

    class DifferentialMachine(base):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            counter["examples"] += 1
            self.pair = DifferentialPair(config, faults, device, detect_races)
            # The rules' preconditions read the admitted list: the pair's (the abort rule
            # never held while this stayed the unused machine's own, empty list).
            self.admitted = self.pair.ref_admitted
            self.script.faults = tuple(sorted(faults))
            self.script.implementation = "gpu_impl"

        def _apply(self, op: Op) -> None:
            self.script.ops.append(op)
            outcome = self.pair.apply(op)
            if not outcome.ok:
                raise DifferentialFailure(outcome, Script.for_config(
                    config, list(self.script.ops), tuple(sorted(faults)), "gpu_impl"))
            counter["compared_ops"] += 1
            counter["aborts"] += isinstance(op, Abort)
            if isinstance(op, Iterate):
                assert self.pair.reference_state is not None
                launched = self.pair.reference_state.last_batch
                counter["launches"] += int(launched is not None and bool(launched.rids))

    DifferentialMachine.__name__ = f"DifferentialMachine[{config.name}]"
    examples = max_examples if max_examples is not None else profile.max_examples
    started = time.perf_counter()
    result = DifferentialResult(config, faults, run_seed, 0.0, minimum=minimum)
    for round_index in range(1 + (top_ups if top_up else 0)):
        seed = get_top_up_seed(run_seed, round_index)
        test = get_machine_test(DifferentialMachine, examples, profile.step_count, seed, shrink)
        result.rounds = round_index + 1
        try:
            test()
        except DifferentialFailure as failure:
            failure.script.set_search_seed(seed)
            result.failure = failure
            break
        except Exception as error:  # a crash is inconclusive, never a pass
            result.error = error
            result.unreplayed = find_differential_failure(error)
            if result.unreplayed is not None:
                result.unreplayed.script.set_search_seed(seed)
            break
        if counter["compared_ops"] >= minimum[0] and counter["launches"] >= minimum[1]:
            break
    result.seconds = time.perf_counter() - started
    result.examples = counter["examples"]
    result.compared_ops = counter["compared_ops"]
    result.launches = counter["launches"]
    result.aborts = counter["aborts"]
    return result
