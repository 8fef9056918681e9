"""The WAR fence's read-done point: the release's, and the early fence proposal (issue 12).

sglang 0.5.23 records the read-done event that ``_apply_war_barrier`` makes the schedule
stream wait on after the spec-v2 draft-extend, whose attention metadata re-reads
``req_to_token`` after the FutureMap publish (``eagle_worker_v2.py:1365``,
``eagle_draft_extend_cuda_graph_runner.py:670``); an EAGLE prefill records none, so the
barrier is the coarse ``S.wait_stream(F)`` there. The ``early_fence`` proposal (cell
``ov-p1-v2chain-cpu-honest-earlyfence``) records it before the publish, as this model did
until 2026-11-26: sound only for a draft-extend that does not re-read the table, which is
shown failing ST2 here. Under the release's fence B9 keeps its hazard as an FM3 race of the
stashes (#35748), shown in every column.
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.catalogue import get_bug
from overlap_spec.harness.differential.compare import get_finding_kind, run_differential
from overlap_spec.harness.drive.script import (
    Admit,
    Iterate,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.harness.mutants.z3 import get_stream_scenarios, replay_counterexample
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.streams import prove_protocol
from overlap_spec.reference.worker import ModelWorker
from overlap_spec.spec.config import get_cell
from overlap_spec.spec.happens_before import FORWARD, SCHEDULE, HappensBefore
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.units import RequestId

RELEASE = "ov-p1-v2chain-cpu-honest"
PROPOSAL = "ov-p1-v2chain-cpu-honest-earlyfence"
DECODES = [Admit(1, 8)] + [Iterate(IterationChoices()) for _ in range(4)]


def _forward_log(cell: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the forward and the schedule stream's fences do, in host order."""
    log: list[str] = []
    access, record = HappensBefore.access, HappensBefore.record
    wait_event, wait_stream = HappensBefore.wait_event, HappensBefore.wait_stream

    def logged_access(hb: HappensBefore, participant: str, kind: str, key: tuple[str, int],
                      operation: str) -> list[object]:
        if participant == FORWARD:
            log.append(f"{kind} {key[0]} {operation}")
        return access(hb, participant, kind, key, operation)  # type: ignore[return-value]

    def logged_record(hb: HappensBefore, event: str, stream: str) -> None:
        log.append(f"record {event}")
        record(hb, event, stream)

    def logged_wait_event(hb: HappensBefore, stream: str, event: str) -> bool:
        if stream == SCHEDULE:
            log.append(f"S waits {event}")
        return wait_event(hb, stream, event)

    def logged_wait_stream(hb: HappensBefore, waiter: str, waited: str) -> None:
        if waiter == SCHEDULE:
            log.append(f"S waits stream {waited}")
        wait_stream(hb, waiter, waited)

    monkeypatch.setattr(HappensBefore, "access", logged_access)
    monkeypatch.setattr(HappensBefore, "record", logged_record)
    monkeypatch.setattr(HappensBefore, "wait_event", logged_wait_event)
    monkeypatch.setattr(HappensBefore, "wait_stream", logged_wait_stream)
    script = Script(cell, "minimal", DECODES[:3], ())
    model = get_factory("reference")(script.get_config(), frozenset(), lambda obs: None)
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    return log


def _first(log: list[str], prefix: str, start: int = 0) -> int:
    return next(i for i in range(start, len(log)) if log[i].startswith(prefix))


def test_the_release_records_read_done_after_the_draft_extend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = _forward_log(RELEASE, monkeypatch)
    # The prefill records none: the barrier waits on the whole forward stream.
    assert log[_first(log, "S waits")] == "S waits stream forward"
    decode = _first(log, "read req_to_token forward KV write", _first(log, "S waits"))
    publish = _first(log, "write new_seq_lens_buf", decode)
    reread = _first(log, "read req_to_token draft_extend attention metadata", publish)
    done = _first(log, "record shared_read_done", decode)
    stash = _first(log, "write output_tokens_buf", decode)
    assert publish < reread < done < stash
    assert log[_first(log, "S waits", done)] == "S waits shared_read_done"


def test_the_early_fence_records_it_before_the_publish_with_no_reread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = _forward_log(PROPOSAL, monkeypatch)
    assert log[_first(log, "S waits")] == "S waits shared_read_done"  # the prefill's too
    decode = _first(log, "read req_to_token forward KV write", _first(log, "S waits"))
    done = _first(log, "record shared_read_done", decode)
    assert done < _first(log, "write new_seq_lens_buf", decode)
    assert not any("draft_extend attention metadata" in line for line in log)


def test_the_early_fence_is_unsound_for_a_draft_extend_that_rereads_the_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proposal's premise: with 0.5.23's re-read, the next prepare_for_decode rewrites
    a row the in-flight draft-extend still reads (ST2); the release's fence orders it."""
    draft_extend = ModelWorker._draft_extend

    def rereading(worker: ModelWorker, batch: object) -> None:
        draft_extend(worker, batch)  # type: ignore[arg-type]
        for req in batch.reqs:  # type: ignore[attr-defined]
            if req.req_pool_idx is not None:
                worker.rt.hb.read(worker.rt.forward_stream, ("req_to_token", req.req_pool_idx),
                                  "draft_extend attention metadata")

    monkeypatch.setattr(ModelWorker, "_draft_extend", rereading)
    outcome = run_script(Script(PROPOSAL, "minimal", DECODES, ()))
    assert outcome.violation is not None
    assert outcome.violation.invariant_id == "ST2"
    assert "draft_extend attention metadata" in str(outcome.violation)
    assert run_script(Script(RELEASE, "minimal", DECODES, ())).violation is None


# B9 under the release's fence: the prebuilt's stash on S races the in-flight forward's
# stash to a row it reuses (FM3); FM1 and FM2 hold, since the barrier already waited past
# that forward's publish. The hand scenario is the z3 column's last one.
RELEASE_B9_CELLS = ["ov-p1-v2chain-cpu-honest", "ov-p1-v2tree-nocpu-honest",
                    "ov-p4-v2chain-cpu-honest"]


@pytest.mark.parametrize("cell", RELEASE_B9_CELLS)
def test_b9_with_the_releases_fence_is_the_stash_race_in_every_column(cell: str) -> None:
    scenario = get_stream_scenarios(get_cell(cell))[-1]
    script = Script(cell, "minimal", list(scenario), ("B9",))
    outcome = run_script(script)
    assert outcome.violation is not None and outcome.violation.all_ids == ("FM3",)
    assert "output_tokens_buf" in str(outcome.violation)
    assert replay_counterexample(script, get_bug("B9").invariants)[0]
    assert run_script(Script(cell, "minimal", list(scenario), ())).violation is None
    proofs = {r.invariant: r.verdict for r in prove_protocol(get_cell(cell),
                                                             frozenset({"B9"}))}
    assert proofs["FM3"] == zs.COUNTEREXAMPLE
    assert proofs["FM1"] == proofs["FM2"] == zs.PROVED
    assert get_finding_kind(run_differential(script)) == "race:FM3"  # gpu_impl, faulted


def test_b9_with_the_early_fence_breaks_fm1_and_fm2_too() -> None:
    proofs = {r.invariant: r.verdict for r in prove_protocol(get_cell(PROPOSAL),
                                                             frozenset({"B9"}))}
    assert proofs["FM1"] == proofs["FM2"] == proofs["FM3"] == zs.COUNTEREXAMPLE
