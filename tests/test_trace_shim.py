"""The live-process shim: wrap upstream-named methods of a scheduler, write a checkable trace.

The shim is exercised on the reference and on gpu_impl: both name their ScheduleBatch /
FutureMap / Scheduler methods as upstream does, so the same wrapping applies. The call
events a shim writes on a real sglang scheduler (request views without ghost, allocator,
results) are checked here from reference snapshots rewritten into that form; the shim on
sglang 0.5.23 itself is tests/test_upstream_trace_shim.py.
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import Script, apply_op, load_script
from overlap_spec.harness.trace.check import check_trace, check_trace_file, record_script_trace
from overlap_spec.harness.trace.format import OK, VIOLATION, TraceFormatError, parse_trace
from overlap_spec.harness.trace.shim import TraceShim
from overlap_spec.reference.schedule_batch import ScheduleBatch
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.units import RequestId

CORPUS_FILES = sorted((Path(__file__).parent / "data" / "mutant_scripts").glob("*.json"))
# Bugs whose kill needs no ghost truth: a call trace with request views rejects them too.
GHOST_FREE_KILLS = {"B3": "RP1", "B4": "RP3", "B10": "KV9", "B11": "KV9", "B12": "KV4"}


def _run(tmp_path: Path, cell: str, faults: frozenset[str], seed: int = 1,
         implementation: str = "reference") -> Path:
    """A random run of either implementation inside the shim (both use upstream names)."""
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    if implementation == "gpu_impl":
        from overlap_spec.gpu_impl.schedule_batch import ScheduleBatch as GpuScheduleBatch
        from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler

        scheduler: Any = GpuScheduler(config, faults)
        batch_class: type = GpuScheduleBatch
    else:
        scheduler, batch_class = Scheduler(config, faults, None), ScheduleBatch
    path = tmp_path / f"live-{implementation}.ndjson"
    ops = generate_random_ops(config, random.Random(seed), 14)
    admitted: list[RequestId] = []
    with TraceShim(path, cell, "minimal", batch_class=batch_class, scheduler=scheduler,
                   future_map=scheduler.future_map, implementation=f"{implementation}-shim",
                   faults=tuple(sorted(faults))):
        for op in ops:
            apply_op(scheduler, op, admitted)
    return path


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-v2chain-cpu-honest", "nov-p4-none",
                                  "ov-p1-v2tree-nocpu-preclaim"])
def test_shim_trace_of_a_clean_run_passes(cell: str, tmp_path: Path) -> None:
    path = _run(tmp_path, cell, frozenset())
    methods = {json.loads(line).get("method") for line in path.read_text().splitlines()}
    assert {"ScheduleBatch.prepare_for_extend", "ScheduleBatch.filter_batch",
            "Scheduler.run_batch", "FutureMap.stash"} <= methods
    verdict = check_trace_file(path)
    assert verdict.status == OK and verdict.observations > 10, verdict.describe()


@pytest.mark.parametrize(("fault", "cell", "expected"), [
    ("B1", "ov-p1-none", "SL3"), ("B8", "ov-p1-none", "ST2"),
    ("B6", "ov-p1-v2chain-cpu-honest", "SL2")])
def test_shim_trace_of_a_mutant_is_rejected(fault: str, cell: str, expected: str,
                                            tmp_path: Path) -> None:
    for seed in range(40):
        verdict = check_trace_file(_run(tmp_path, cell, frozenset({fault}), seed))
        if verdict.status == VIOLATION:
            assert verdict.violation is not None
            assert expected in verdict.violation.all_ids, verdict.describe()
            return
    pytest.fail(f"{fault} never rejected through the shim")


def test_shim_restores_the_wrapped_methods(tmp_path: Path) -> None:
    before = dict(ScheduleBatch.__dict__)
    _run(tmp_path, "ov-p1-none", frozenset())
    for name in ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"):
        assert ScheduleBatch.__dict__[name] is before[name]


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-v2chain-cpu-honest", "nov-p4-none"])
def test_shim_around_gpu_impl_writes_a_passing_trace(cell: str, tmp_path: Path) -> None:
    path = _run(tmp_path, cell, frozenset(), implementation="gpu_impl")
    methods = {json.loads(line).get("method") for line in path.read_text().splitlines()}
    assert {"ScheduleBatch.prepare_for_extend", "ScheduleBatch.filter_batch",
            "Scheduler.run_batch"} <= methods, methods
    verdict = check_trace_file(path)
    assert verdict.status == OK and verdict.observations > 10, verdict.describe()


def test_shim_around_a_faulted_gpu_impl_is_rejected(tmp_path: Path) -> None:
    for seed in range(40):
        verdict = check_trace_file(_run(tmp_path, "ov-p1-none", frozenset({"B1"}), seed,
                                        implementation="gpu_impl"))
        if verdict.status == VIOLATION:
            assert verdict.violation is not None
            assert "SL3" in verdict.violation.all_ids, verdict.describe()
            return
    pytest.fail("no seed in 0..39 made the B1 shim trace fail")


# ------------------------------------------------------------------ calls with request views
def _as_call_trace(text: str) -> str:
    """A full trace rewritten as the shim writes a live process: each snapshot becomes a
    call carrying its batch, request views with ``ghost`` null, the allocator and the
    result; no ops (nothing to re-execute), stream events kept."""
    events: list[dict[str, Any]] = []
    for line in text.splitlines():
        raw = json.loads(line)
        if raw["event"] == "header":
            events.append({**raw, "snapshots": False})
        elif raw["event"] == "stream":
            events.append({**raw, "step": -1})
        elif raw["event"] == "observe":
            state = raw["state"]
            call = {"event": "call", "step": -1, "method": f"reference.{raw['point']}",
                    "batch": state["batch"], "allocator": state["allocator"],
                    "requests": [{**r, "ghost": None} for r in state["requests"]]}
            if state.get("result") is not None:
                call["result"] = state["result"]
            events.append(call)
    events.append({"event": "end", "events": len(events) + 1})
    return "".join(json.dumps({**e, "id": i}) + "\n" for i, e in enumerate(events))


@pytest.mark.parametrize(("cell", "results"), [
    ("ov-p1-none", {"RP1"}), ("ov-p1-v2chain-cpu-honest", {"RP1", "RP3"}),
    ("nov-p4-none", set())])
def test_calls_with_request_views_judge_kv_and_rp(cell: str, results: set[str],
                                                  tmp_path: Path) -> None:
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    path = tmp_path / "full.ndjson"
    # Seed 2: a script whose stale results (an EOS finish, a retraction) reach RP1 in both
    # overlap cells; a length finish leaves none since the release skips its decode.
    record_script_trace(Script(cell, "minimal", generate_random_ops(config, random.Random(2),
                                                                    14)), path)
    verdict = check_trace(parse_trace(_as_call_trace(path.read_text())))
    assert verdict.status == OK, verdict.describe()
    judged = {i for i, n in verdict.exercised.items() if n > 0}
    assert {"KV1", "KV4", "KV7", "KV9", "ST5"} | results <= judged, verdict.exercised
    # Without the ghost, RP2 (output vs what the environment emitted) is not judged where
    # a request is live: counted as such, never passed on a guess.
    assert any("not judged" in n and "RP2" in n for n in verdict.notes), verdict.notes


@pytest.mark.parametrize("script_path", CORPUS_FILES, ids=lambda p: p.stem)
def test_call_trace_verdict_is_the_full_traces_or_not_judged(script_path: Path,
                                                             tmp_path: Path) -> None:
    """Dropping the ghost may leave a kill unjudged, never turn it into another ID."""
    path = tmp_path / "full.ndjson"
    full = record_script_trace(load_script(script_path), path)
    assert full.violation is not None
    verdict = check_trace(parse_trace(_as_call_trace(path.read_text())))
    if verdict.status == VIOLATION:
        assert verdict.violation is not None
        assert set(verdict.violation.all_ids) <= set(full.violation.all_ids), (
            verdict.describe())
    bug = script_path.stem.rsplit("-", 1)[-1]
    if bug in GHOST_FREE_KILLS:
        assert verdict.violation is not None, verdict.describe()
        assert GHOST_FREE_KILLS[bug] in verdict.violation.all_ids, verdict.describe()


def _call_line(request: dict[str, Any]) -> str:
    header = {"id": 0, "event": "header", "schema": "overlap-spec-trace", "version": 2,
              "cell": "ov-p1-none", "preset": "minimal", "faults": [], "seed": None,
              "implementation": "sglang-shim", "snapshots": False}
    call = {"id": 1, "event": "call", "step": -1, "method": "Scheduler.run_batch",
            "batch": None, "requests": [request]}
    return "".join(json.dumps(e) + "\n" for e in (header, call, {"id": 2, "event": "end",
                                                                   "events": 3}))


def _request(**fields: Any) -> dict[str, Any]:
    view = {"rid": 0, "prompt_len": 3, "output_len": 1, "max_new_tokens": 4,
            "kv_committed_len": 4, "kv_allocated_len": 4, "req_pool_idx": 1,
            "finished": False, "is_retracted": False, "waiting": False, "holds_kv": True,
            "row_slots": [1, 2, 3, 4], "owned_pages": [1, 2, 3, 4], "release_count": 0,
            "cached_len": None, "committed_at_release": None, "inflight_at_release": 0,
            "claimed_at_release": 0, "finish_reason": None, "spec_verify_ct": 0,
            "spec_num_correct_drafts": 0, "ghost": None}
    return {**view, **fields}


def test_request_views_without_ghost_are_checked_where_they_can_be() -> None:
    ok = check_trace(parse_trace(_call_line(_request())))
    assert ok.status == OK and ok.exercised["KV1"] == 1, ok.describe()
    # No allocator recorded: KV7 (and KV4, which reads the page size) are not judged.
    assert any("KV7 at 1 calls" in n for n in ok.notes), ok.notes
    bad = check_trace(parse_trace(_call_line(_request(kv_committed_len=5))))
    assert bad.violation is not None and bad.violation.invariant_id == "KV1", bad.describe()
    assert bad.violation.event_id == 1 and bad.violation.request == "r0"
    # A version-1 call without the optional fields is a batch-only call, as before.
    old = json.loads(_call_line(_request()).splitlines()[1])
    del old["requests"]
    lines = _call_line(_request()).splitlines()
    parsed = parse_trace("\n".join([lines[0], json.dumps(old), lines[2]]) + "\n")
    assert 1 in parsed.calls and not parsed.state_calls
    assert check_trace(parsed).exercised.get("KV1", 0) == 0


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"ghost": {"epoch": 0}}, "requests[0].ghost"),
    ({"kv_committed_len": "4"}, "requests[0].kv_committed_len"),
    ({"bogus": 1}, "requests[0].bogus")])
def test_malformed_request_views_name_the_field(request_fields: dict[str, Any],
                                                field: str) -> None:
    with pytest.raises(TraceFormatError) as caught:
        parse_trace(_call_line(_request(**request_fields)))
    assert caught.value.line == 2 and caught.value.field == field, str(caught.value)


# ------------------------------------------------------------------ sglang 0.5.23 shapes
_UPSTREAM_SHAPED = """
class Req:
    def __init__(self, rid, prompt):
        self.rid, self.prompt = rid, prompt


class ScheduleBatch:
    def __init__(self, reqs):
        self.reqs, self.forward_mode, self.seq_lens_sum = reqs, None, None
        self.seq_lens = self.seq_lens_cpu = self.req_pool_indices = []

    def prepare_for_extend(self):  # 0.5.23: an instance method returning None
        self.seq_lens = [r.prompt for r in self.reqs]
        self.seq_lens_cpu = list(self.seq_lens)
        self.seq_lens_sum = sum(self.seq_lens)
        self.req_pool_indices = list(range(1, len(self.reqs) + 1))


class NextBatchPlan:
    def __init__(self, batch_to_run, running_batch):
        self.batch_to_run, self.running_batch = batch_to_run, running_batch


def resolve_forward_inputs(batch, future_map):  # 0.5.23: a module function
    batch.input_ids = list(batch.req_pool_indices)


class Scheduler:
    future_map = None

    def __init__(self):
        self.running_batch = ScheduleBatch([])

    def get_next_batch_to_run(self, running_batch, last_batch):
        batch = ScheduleBatch([Req("a", 3), Req("b", 2)])
        batch.prepare_for_extend()
        return NextBatchPlan(batch_to_run=batch, running_batch=running_batch)

    def run_batch(self, batch):
        resolve_forward_inputs(batch, self.future_map)  # through this module's global
        return object()
"""


def test_shim_records_sglang_0_5_23_shapes_and_restores_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("upstream_shaped_scheduler")
    exec(_UPSTREAM_SHAPED, module.__dict__)  # its functions' globals are the module's
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original = module.resolve_forward_inputs
    prepare = vars(module.ScheduleBatch)["prepare_for_extend"]
    scheduler = module.Scheduler()
    path = tmp_path / "shaped.ndjson"
    with TraceShim(path, "ov-p1-none", "minimal", batch_class=module.ScheduleBatch,
                   scheduler=scheduler, implementation="shaped"):
        plan = scheduler.get_next_batch_to_run(scheduler.running_batch, None)
        scheduler.run_batch(plan.batch_to_run)
    calls = {e["method"]: e for e in map(json.loads, path.read_text().splitlines())
             if e["event"] == "call"}
    assert list(calls) == ["ScheduleBatch.prepare_for_extend", "Scheduler.get_next_batch_to_run",
                           "overlap_utils.resolve_forward_inputs", "Scheduler.run_batch"]
    assert calls["ScheduleBatch.prepare_for_extend"]["batch"]["seq_lens"] == [3, 2]
    plan_call = calls["Scheduler.get_next_batch_to_run"]
    assert plan_call["batch"]["rids"] == [0, 1] and plan_call["running_batch"]["rids"] == []
    assert calls["overlap_utils.resolve_forward_inputs"]["batch"]["seq_lens_sum"] == 5
    assert "requests" not in plan_call  # no pools on this scheduler: batch-only calls
    assert module.resolve_forward_inputs is original
    assert "run_batch" not in vars(scheduler)
    assert vars(module.ScheduleBatch)["prepare_for_extend"] is prepare
    assert check_trace_file(path).status == OK
