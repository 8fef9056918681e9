"""The trace shim on sglang 0.5.23's own ``Scheduler``: record, then ``trace check``.

Each cell runs in a subprocess (upstream allows one ``Scheduler`` per process): the real
event loop, driven by the upstream adapter with its stand-in worker, runs a short script
inside :class:`harness.trace_shim.TraceShim`. The trace must carry request views, so the
checker judges the KV and RP families besides SL2-SL5, and its verdict must be one the
upstream tier knows (``overlap_spec.harness.conformance.findings``). Needs the upstream environment
(``./dev upstream``); skipped with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overlap_spec.harness.conformance.findings import match_finding
from overlap_spec.harness.drive.script import Abort, Admit, Iterate, Op, Script, save_script
from overlap_spec.harness.trace.check import TraceVerdict, check_trace
from overlap_spec.harness.trace.format import OK, VIOLATION, parse_trace
from overlap_spec.spec.config import get_cell
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.state import IterationChoices

pytestmark = pytest.mark.upstream

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = 77  # the child's exit code when sglang does not import
TIMEOUT_S = 600
# The child: import sglang the way the tier does (torchvision stand-in, version check),
# then record the script inside the shim.
CHILD = """
import sys
from pathlib import Path

from overlap_spec.upstream.bootstrap import UpstreamUnavailable, load_sglang

try:
    load_sglang()
except UpstreamUnavailable as error:
    print(f"sglang does not import here: {error}")
    sys.exit(77)
from overlap_spec.harness.drive.script import load_script
from overlap_spec.harness.trace.shim import record_shim_trace

record_shim_trace(load_script(Path(sys.argv[1])), Path(sys.argv[2]))
"""
NON_SPEC, SPEC = "ov-p1-none", "ov-p1-v2chain-cpu-honest"
# What the tier knows each run to show first (harness/conformance/findings.py): nothing
# without speculation (U1, an emptied batch's stale tensors, is retired); the accept
# counters count a retracted row (U3).
EXPECTED_FINDING = {NON_SPEC: None, SPEC: "U3"}
# The non-spec cell runs chunked, as the release serves: its 5-token prompt takes two
# chunks, so the views carry the chunked-prefill fields.
SIZES: dict[str, dict[str, int]] = {NON_SPEC: {"chunked_prefill_size": 4}, SPEC: {}}


def _ops(cell: str) -> list[Op]:
    """Two requests; a retraction while a decode of the retracted one is in flight (a stale
    result: RP1); without speculation also a request aborted while waiting."""
    choose = IterationChoices
    if cell == NON_SPEC:
        ops: list[Op] = [Admit(5, 8), Admit(3, 8), Iterate(choose()), Admit(4, 4),
                         Iterate(choose(allow_prefill=False)), Abort(2), Iterate(choose()),
                         Iterate(choose(retract=1))]
    else:
        ops = [Admit(5, 8), Admit(3, 8), Iterate(choose()), Iterate(choose()),
               Iterate(choose(accept_lens=(2, 3))), Iterate(choose(retract=1))]
    # Accept lengths above 1 only where a cell speculates: a script is range-checked
    # against its cell on load (non-spec: 1).
    tail = (1,) if cell == NON_SPEC else (2, 1)
    return ops + [Iterate(choose(accept_lens=tail)) for _ in range(14)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both cells recorded at once, one process each."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this environment: the upstream environment "
                    "(./dev upstream) runs these tests")
    folder = tmp_path_factory.mktemp("upstream-shim")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    running: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for cell in (NON_SPEC, SPEC):
        script = save_script(Script(cell, "minimal", _ops(cell), implementation="upstream",
                                    sizes=SIZES[cell]), folder / f"{cell}.json")
        trace = folder / f"{cell}.ndjson"
        running[cell] = (subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", CHILD, str(script), str(trace)], cwd=ROOT,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), trace)
    try:
        for cell, (process, _trace) in running.items():
            output, _ = process.communicate(timeout=TIMEOUT_S)
            if process.returncode == UNAVAILABLE:
                pytest.skip(output.strip().splitlines()[-1])
            lines = [line for line in output.splitlines() if not line.startswith("[20")]
            assert process.returncode == 0, (f"{cell}: the recording run failed:\n"
                                             + "\n".join(lines[-30:]))
    finally:
        for process, _trace in running.values():
            if process.poll() is None:  # a skip or failure above: do not leave it running
                process.kill()
                process.wait()
    return {cell: trace for cell, (_, trace) in running.items()}


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check(events: list[dict[str, Any]]) -> TraceVerdict:
    return check_trace(parse_trace("".join(json.dumps(e) + "\n" for e in events)))


def _get_finding(verdict: TraceVerdict, cell: str) -> str | None:
    """The listed upstream finding the trace's violation is, or None for an unknown one."""
    assert verdict.violation is not None
    violation = InvariantViolation(verdict.violation.invariant_id, verdict.violation.actual)
    known = match_finding(violation, get_cell(cell))
    return None if known is None else known.id


@pytest.mark.parametrize("cell", [NON_SPEC, SPEC])
def test_real_scheduler_trace_carries_request_views(cell: str,
                                                    traces: dict[str, Path]) -> None:
    calls = [e for e in _events(traces[cell]) if e["event"] == "call"]
    methods = {e["method"] for e in calls}
    assert {"ScheduleBatch.prepare_for_extend", "ScheduleBatch.prepare_for_decode",
            "ScheduleBatch.filter_batch", "ScheduleBatch.merge_batch",
            "ScheduleBatch.retract_decode", "Scheduler.get_next_batch_to_run",
            "Scheduler.run_batch", "Scheduler.process_batch_result",
            "FutureMap.resolve_seq_lens_cpu", "overlap_utils.resolve_forward_inputs"
            } <= methods, methods
    # 0.5.23's prepare_for_extend returns None: the batch recorded is the one prepared.
    assert all(e["batch"] is not None and e["batch"]["rids"] for e in calls
               if e["method"] == "ScheduleBatch.prepare_for_extend")
    # get_next_batch_to_run returns a NextBatchPlan: its running batch rides along.
    assert all("running_batch" in e for e in calls
               if e["method"] == "Scheduler.get_next_batch_to_run")
    with_views = [e for e in calls if e.get("requests")]
    assert len(with_views) > len(calls) // 2
    assert all("allocator" in e for e in with_views)
    assert any(r["holds_kv"] and r["row_slots"] for e in with_views for r in e["requests"])
    assert any(r["is_retracted"] and r["waiting"] for e in with_views for r in e["requests"])
    results = [e["result"] for e in calls if e.get("result")]
    assert any(entry["stale"] for result in results for entry in result["entries"])
    if SIZES[cell]:  # the chunk's fields, read from the release (upstream/fields.py)
        assert any(r["prefix_len"] > 0 for e in with_views for r in e["requests"])
        assert any(0 < r["extend_end"] < r["prompt_len"] for e in with_views
                   for r in e["requests"])
        assert any(r["inflight_middle_chunks"] > 0 for e in with_views for r in e["requests"])


@pytest.mark.parametrize("cell", [NON_SPEC, SPEC])
def test_trace_check_judges_kv_and_rp_and_knows_the_verdict(cell: str,
                                                            traces: dict[str, Path]) -> None:
    verdict = _check(_events(traces[cell]))
    judged = {i for i, n in verdict.exercised.items() if n > 0}
    assert {"KV1", "KV4", "KV5"} <= judged, verdict.exercised
    # RP7: the stand-in's tokens are the environment's, so the views carry their values.
    assert {"RP1", "RP7"} | ({"RP3"} if get_cell(cell).is_spec else set()) <= judged, (
        verdict.exercised)
    if not get_cell(cell).is_spec:
        assert {"KV2", "KV9"} <= judged, verdict.exercised  # KV9: the finish releases
    expected = EXPECTED_FINDING[cell]
    assert verdict.status in ((OK,) if expected is None else (OK, VIOLATION)), (
        verdict.describe())
    if verdict.status == VIOLATION:
        assert _get_finding(verdict, cell) == expected, verdict.describe()


def _first(events: list[dict[str, Any]], accept: Any) -> int:
    return next(i for i, e in enumerate(events) if e["event"] == "call" and accept(e))


def test_corrupted_request_view_is_rejected_as_kv1(traces: dict[str, Path]) -> None:
    events = _events(traces[NON_SPEC])
    index = _first(events, lambda e: any(r["holds_kv"] for r in e.get("requests", ())))
    request = next(r for r in events[index]["requests"] if r["holds_kv"])
    request["kv_committed_len"] = request["kv_allocated_len"] + 1
    verdict = _check(events)
    assert verdict.violation is not None, verdict.describe()
    assert verdict.violation.invariant_id == "KV1", verdict.describe()
    assert verdict.violation.event_id == events[index]["id"]
    assert verdict.violation.request == f"r{request['rid']}"


def test_corrupted_stale_result_is_rejected_as_rp1(traces: dict[str, Path]) -> None:
    events = _events(traces[NON_SPEC])
    index = _first(events, lambda e: any(x["stale"] for x in (e.get("result") or {}).get(
        "entries", ())))
    entry = next(x for x in events[index]["result"]["entries"] if x["stale"])
    entry["output_after"] = entry["output_before"] + 1  # a late result appended a token
    verdict = _check(events)
    assert verdict.violation is not None, verdict.describe()
    assert verdict.violation.invariant_id == "RP1", verdict.describe()
    assert verdict.violation.event_id == events[index]["id"]


def test_a_corrupted_token_value_is_rejected_as_rp7(traces: dict[str, Path]) -> None:
    """A view whose last output token is not the environment's (a relay handing the
    forward the wrong token would show so) fails RP7 at that event."""
    events = _events(traces[SPEC])
    index = _first(events, lambda e: any(len(r.get("output_ids") or ()) >= 2
                                         for r in e.get("requests", ())))
    request = next(r for r in events[index]["requests"] if len(r["output_ids"]) >= 2)
    request["output_ids"][-1] = request["output_ids"][-1] % 97 + 1 + 97  # never the chain's
    verdict = _check(events)
    assert verdict.violation is not None, verdict.describe()
    assert verdict.violation.invariant_id == "RP7", verdict.describe()
    assert verdict.violation.event_id == events[index]["id"]
