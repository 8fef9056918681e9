"""The CPU race detector (gpu_impl/race.py) can fail, names what raced, and stays quiet
when the accesses are ordered by an event, a wait_stream or a host synchronize."""

from __future__ import annotations

import gc
import json
import random
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.cuda._sanitizer as csan
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from overlap_spec.gpu_impl import race
from overlap_spec.gpu_impl.race import TESTED_TORCH, RaceDetector, RaceError, check_sanitizer_api
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.harness.differential.compare import DifferentialPair, run_differential
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import Script
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.happens_before import COPY, D2H, FORWARD, SCHEDULE


def _setup() -> tuple[RaceDetector, Streams]:
    detector = RaceDetector()
    return detector, Streams(torch.device("cpu"), detector)


ROOT = Path(__file__).resolve().parents[1]


def _get_torch_requirement() -> SpecifierSet:
    """pyproject.toml's torch range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(text) for text in project["dependencies"]
                      if Requirement(text).name == "torch"]
    return requirement.specifier


def test_torch_version_is_in_the_range_the_detector_was_tested_over() -> None:
    release = torch.__version__.split("+")[0]
    assert _get_torch_requirement().contains(release, prereleases=True), (
        torch.__version__, str(_get_torch_requirement()))
    check_sanitizer_api()


def test_tested_torch_is_the_committed_matrix_result() -> None:
    """TESTED_TORCH lists exactly the releases the newest committed torch matrix
    (bench/bench_torch_matrix.py) passed on; pyproject's range covers each of them and
    none the matrix saw fail."""
    results = sorted((ROOT / "bench" / "results").glob("*-torch-matrix.json"))
    assert results, "no bench/results/*-torch-matrix.json: run bench/bench_torch_matrix.py"
    matrix = json.loads(results[-1].read_text())["versions"]
    passed = [entry["torch_version"].split("+")[0] for entry in matrix
              if entry["result"] == "pass"]
    assert sorted(TESTED_TORCH) == sorted(passed), (TESTED_TORCH, passed, results[-1].name)
    supported = _get_torch_requirement()
    assert all(supported.contains(version) for version in TESTED_TORCH), str(supported)
    failed = [entry["requested"] for entry in matrix
              if entry["result"] not in ("pass", "absent")]
    assert not [version for version in failed if supported.contains(version)], (
        failed, str(supported))


def test_unsynchronised_cross_stream_read_is_a_race_naming_both_accesses() -> None:
    detector, streams = _setup()
    with detector:
        buf = streams.device_tensor([0] * 8)  # written on S
        detector.name(buf, "new_seq_lens_buf")
        streams.wait_stream(FORWARD, SCHEDULE)
        with streams.use(FORWARD):
            buf[torch.tensor([1, 2])] = torch.tensor([5, 6])
        with streams.use(SCHEDULE):
            _ = buf[torch.tensor([1])]  # S reads what F wrote, no fence
    assert len(detector.races) == 1
    text = detector.races[0].describe()
    for expected in ("new_seq_lens_buf", "forward", "schedule", "index_put_", "index"):
        assert expected in text, text
    assert detector.races[0].get_invariant() == "FM1"  # spec.invariants.classify_race


def test_event_record_and_wait_order_the_accesses() -> None:
    detector, streams = _setup()
    with detector:
        buf = streams.device_tensor([0] * 8)
        streams.wait_stream(FORWARD, SCHEDULE)
        with streams.use(FORWARD):
            buf[torch.tensor([1, 2])] = torch.tensor([5, 6])
        streams.record("publish_ready", FORWARD)
        streams.wait_event(D2H, "publish_ready")
        with streams.use(D2H):
            _ = buf[torch.tensor([1])]
    assert detector.races == []


def test_raise_mode_stops_at_the_first_race() -> None:
    detector = RaceDetector(raise_on_race=True)
    streams = Streams(torch.device("cpu"), detector)
    with pytest.raises(RaceError, match="race on"), detector:
        buf = streams.device_tensor([0] * 4)
        with streams.use(FORWARD):
            buf.add_(1)


def test_host_read_of_a_d2h_copy_needs_a_synchronize() -> None:
    for synchronize in (False, True):
        detector, streams = _setup()
        with detector:
            device = streams.device_tensor([3, 4])
            host = streams.host_tensor(2)
            streams.wait_stream(D2H, SCHEDULE)
            streams.copy_to_host(device, host, D2H)
            if synchronize:
                streams.synchronize_stream(D2H)
            assert streams.to_list(host) == [3, 4]
        assert bool(detector.races) != synchronize, detector.races
        assert streams.counters.d2h_copies == [D2H]


def test_free_before_the_reader_stream_is_ordered_is_a_use_after_free() -> None:
    for ordered in (False, True):
        detector, streams = _setup()
        with detector:
            tensor = streams.device_tensor([1, 2, 3])  # allocated on S
            streams.wait_stream(FORWARD, SCHEDULE)
            with streams.use(FORWARD):
                _ = tensor.sum()
            streams.record("done", FORWARD)
            if ordered:
                streams.wait_event(SCHEDULE, "done")
            del tensor
            gc.collect()
        frees = [r for r in detector.races if r.later.kind == "free"]
        assert bool(frees) != ordered, detector.races


def test_host_work_is_ordered_before_what_the_host_enqueues_next() -> None:
    detector, streams = _setup()
    with detector:
        host = streams.host_tensor([1, 2, 3])
        streams.host_write(host, [4, 5, 6])
        with streams.use(COPY):
            device = host.to(torch.int64) + 0  # read on COPY after the host's write
        streams.synchronize_stream(COPY)
        streams.host_write(host, [7, 8, 9])
    assert detector.races == [], [r.describe() for r in detector.races]
    assert device.tolist() == [4, 5, 6]


def test_a_result_read_before_copy_done_is_st5(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processing a result without waiting for its copy_done races the copy stream's D2H
    write on the host's read: the spec names that ST5 (results after copy_done), not ST2."""
    from overlap_spec.harness.differential.compare import run_differential
    from overlap_spec.harness.drive.script import Admit, Iterate, Script
    from overlap_spec.spec.state import IterationChoices

    original = Streams.synchronize_event

    def skip_copy_done(self: Streams, event: str) -> None:
        if not event.startswith("copy_done"):
            original(self, event)

    monkeypatch.setattr(Streams, "synchronize_event", skip_copy_done)
    ops = [Admit(3, 4), *[Iterate(IterationChoices()) for _ in range(3)]]
    outcome = run_differential(Script("ov-p1-none", "minimal", ops), device=torch.device("cpu"))
    assert outcome.races, outcome.describe()
    assert outcome.races[0].get_invariant() == "ST5", outcome.races[0].describe()


class _SanitizerRules(csan.ArgumentHandler):
    """torch's own argument parser, taught to accept CPU tensors: the rules the
    detector's cached parser must reproduce."""

    def _handle_argument(self, value: Any, is_write: bool, metadata_only: bool,
                         name: str | None = None, is_output: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            data_ptr = value.data_ptr()
            if not data_ptr:
                return  # the detector's one departure: a tensor with no memory is skipped
            if is_write:
                self.dataptrs_written.add(data_ptr)
            elif not metadata_only:
                self.dataptrs_read.add(data_ptr)
            self.tensor_aliases.setdefault(data_ptr, [])
            if name is not None:
                self.tensor_aliases[data_ptr].append(name)
            if is_output:
                self.outputs.add(data_ptr)


def test_cached_argument_parser_agrees_with_the_sanitizers_on_a_differential_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every operator call of a spec-v2 differential run parses to the same reads,
    writes, outputs and names under the detector's cached parser as under torch's."""
    calls: list[Any] = []
    mismatches: list[str] = []
    real_get_operator = race._get_operator
    real_inputs = race._CpuArgumentHandler.parse_operator_inputs
    real_outputs = race._CpuArgumentHandler.parse_operator_outputs

    def get_operator(func: Any) -> Any:
        calls.append(func)
        return real_get_operator(func)

    def compare(ours: Any, theirs: Any, what: str) -> None:
        got = (ours.dataptrs_read, ours.dataptrs_written, ours.outputs, ours.tensor_aliases)
        want = (theirs.dataptrs_read, theirs.dataptrs_written, theirs.outputs,
                theirs.tensor_aliases)
        if got != want:
            mismatches.append(f"{what} of {calls[-1]}: {got} != {want}")

    def parse_inputs(self: Any, operator: Any, args: Any, kwargs: Any) -> None:
        real_inputs(self, operator, args, kwargs)
        theirs = _SanitizerRules()
        theirs.parse_inputs(calls[-1]._schema, args, kwargs, is_factory=operator.is_factory)
        compare(self, theirs, "inputs")

    def parse_outputs(self: Any, operator: Any, outputs: Any) -> None:
        before = _SanitizerRules()
        before.dataptrs_read, before.dataptrs_written = set(self.dataptrs_read), set(
            self.dataptrs_written)
        before.outputs, before.tensor_aliases = set(self.outputs), {
            k: list(v) for k, v in self.tensor_aliases.items()}
        real_outputs(self, operator, outputs)
        before.parse_outputs(calls[-1]._schema, outputs, is_factory=operator.is_factory)
        compare(self, before, "outputs")

    monkeypatch.setattr(race, "_get_operator", get_operator)
    monkeypatch.setattr(race._CpuArgumentHandler, "parse_operator_inputs", parse_inputs)
    monkeypatch.setattr(race._CpuArgumentHandler, "parse_operator_outputs", parse_outputs)
    for cell in ("ov-p1-v2chain-cpu-honest", "ov-p4-none"):
        config = ModelConfig(get_cell(cell), PRESETS["minimal"])
        script = Script(cell, "minimal", generate_random_ops(config, random.Random(7), 60))
        run_differential(script, device=torch.device("cpu"))
    assert len(calls) > 1000, "the run dispatched too few operators to compare"
    assert not mismatches, mismatches[:3]


def _untracked_accesses(detector: RaceDetector) -> list[int]:
    """Access keys that lie in no block the detector tracks: history no free will clear."""
    blocks = [(pointer, max(info.nbytes, 1)) for pointer, info in detector.tensors.items()]
    return [key for key in detector.handler.tensors_accessed.accesses
            if not any(start <= key < start + size for start, size in blocks)]


def test_a_tensor_without_elements_leaves_no_access_behind() -> None:
    """An empty index result or ``torch.tensor([])`` has no memory. The detector once keyed
    them by ``id()``, a Python object's address that no free cleared, so a block malloc
    later placed there inherited a stale access: a false race that came and went with
    the allocator (the differential's flake in ``check``)."""
    detector, streams = _setup()
    with detector:
        buf = streams.device_tensor([0] * 8)
        streams.wait_stream(FORWARD, SCHEDULE)
        with streams.use(FORWARD):
            empty = buf[torch.tensor([], dtype=torch.int64)]
            nothing = torch.tensor([], dtype=torch.int64)
        assert empty.numel() == 0 and nothing.numel() == 0
    assert _untracked_accesses(detector) == []
    assert not detector.races


def test_a_fresh_block_starts_without_history() -> None:
    """Whatever was recorded at an address before, a block tracked there starts clean:
    here the forward wrote at the address while the detector was not tracking it."""
    detector, streams = _setup()
    with detector:
        with streams.use(FORWARD):
            block = torch.zeros(8, dtype=torch.int64)  # written by the forward
        info = detector.tensors.pop(block.data_ptr())  # the detector loses track of it
        detector._track(block, SCHEDULE, "a fresh allocation", host=False)
        with streams.use(SCHEDULE):
            block.fill_(1)  # the new owner's first write: nothing earlier to race with
    assert info is not None
    assert not detector.races, detector.races[0].describe()


@pytest.mark.parametrize("cell", ["ov-p4-none", "ov-p1-none", "nov-p1-none",
                                  "ov-p1-v2chain-cpu-honest", "ov-p4-v2chain-nocpu-honest",
                                  "ov-p1-v2tree-nocpu-honest", "nov-p1-v2tree-cpu-honest"])
def test_every_access_the_detector_keeps_is_inside_a_tracked_block(
        cell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After every operation of a random differential run, no access history lies outside
    the blocks the detector tracks (so none can leak onto a later allocation)."""
    detectors: list[RaceDetector] = []
    real_init = RaceDetector.__init__

    def init(self: RaceDetector, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        detectors.append(self)

    monkeypatch.setattr(RaceDetector, "__init__", init)
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    leaks: list[tuple[int, list[int]]] = []
    for seed in range(4):
        ops = generate_random_ops(config, random.Random(seed), 40)
        pair = DifferentialPair(config, device=torch.device("cpu"))
        for step, op in enumerate(ops):
            outcome = pair.apply(op)
            assert outcome.ok, outcome.describe()
            stale = _untracked_accesses(detectors[-1])
            if stale:
                leaks.append((step, stale))
    assert not leaks, leaks[:3]
