"""KV13 (issue 43): the admission's running load re-derived from the requests.

KV11 judges a prefill's admission on the inputs the scheduler reports (``AdmissionView``),
so a scheduler that miscounts its own running load passes it. KV13 applies the same rule to
the running load, the free rows and the mixed step's set-aside re-derived from the requests
and the allocator: the release filters the running batch at every step before
``PrefillAdder`` sums it (scheduler.py:3963-3968), so a request that a processed result
finished no longer counts. B38 keeps counting it; KV13 names it, KV11 does not.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.spec.state import IterationChoices, Observation
from overlap_spec.spec.units import RequestId


def _random_ops(seed: int, count: int = 120) -> list[Op]:
    rng = random.Random(seed)
    ops: list[Op] = []
    for _ in range(count):
        x = rng.random()
        if x < 0.25:
            ops.append(Admit(rng.randint(1, 6), rng.randint(1, 8), rng.choice((None, 0))))
        elif x < 0.28:
            ops.append(Abort(rng.randint(0, 9)))
        else:
            ops.append(Iterate(IterationChoices(
                rng.random() < 0.7, int(rng.random() < 0.1), (1,),
                frozenset({rng.randint(0, 2)}) if rng.random() < 0.3 else frozenset())))
    return ops


# An overlap cell, one without overlap, chunked prefill (mixed too) and a radix cell.
@pytest.mark.parametrize(("cell", "sizes"), [
    ("ov-p1-none", {}),
    ("nov-p4-none", {}),
    ("ov-p1-none", {"chunked_prefill_size": 4}),
    ("ov-p1-v2chain-cpu-honest", {"chunked_prefill_size": 4, "mixed_chunk": 1}),
    ("ov-p1-none-radix", {"chunked_prefill_size": 8}),
])
def test_the_clean_reference_is_judged_by_kv13(cell: str, sizes: dict[str, int]) -> None:
    """The clean reference's admissions hold KV13 and it judges some of them; what KV13
    re-derives (the running requests' (max_new_tokens, output_len), the rows, the mixed
    set-aside) is exactly what the reference summed, at every admission. gpu_impl emits no
    observations: the differential holds it to the reference's admissions (below)."""
    config = Script(cell, "minimal", [], sizes=sizes).get_config()
    judged = compared = 0
    for seed in range(4):
        checker = InvariantChecker(config)
        observations: list[Observation] = []

        def observe(obs: Observation, checker: InvariantChecker = checker,
                    observations: list[Observation] = observations) -> None:
            observations.append(obs)
            checker(obs)

        model = get_factory("reference")(config, frozenset(), observe)
        admitted: list[RequestId] = []
        for index, op in enumerate(_random_ops(seed)):
            model.set_step_index(index)
            apply_op(model, op, admitted)
        judged += checker.exercised["KV13"]
        for obs in observations:
            view, batch = obs.admission, obs.batch
            if view is None or batch is None:
                continue
            # KV13's derivation, restated: who the release's PrefillAdder counts as running.
            running = sorted((r.max_new_tokens, r.output_len) for r in obs.requests
                             if r.holds_kv and not (r.finished or r.is_retracted or r.waiting)
                             and r.rid not in batch.rids)
            assert running == sorted(view.running)
            assert view.rows == min(config.preset.max_running_requests - len(running),
                                    len(obs.allocator.free_pool_rows) + len(batch.rids))
            assert view.mixed_decode_tokens == len(running) * config.preset.mixed_chunk
            compared += 1
    assert judged > 0 and compared > 0


def _finished_then_two_arrive(cell: str) -> Script:
    """r0 (prompt 2, 8 new) runs and stops at EOS after its second token; then r1 (1, 1)
    and r2 (8, 3) arrive in a 16-token pool. The release counts only the running batch
    left after the step's filter (nothing): r1 asks 3 < 16, r2 asks 12 < 16 - 3. With r0's
    6 tokens to go x 0.7 still counted (B38), r2 asks 12 < 8.8 and waits."""
    # With overlap r0's finishing result is processed a step later, behind the next launch.
    lag = [Iterate(IterationChoices(allow_prefill=False))] if cell.startswith("ov") else []
    return Script(cell, "minimal", [
        Admit(2, 8), Iterate(IterationChoices()),
        Iterate(IterationChoices(eos_positions=frozenset({0}))), *lag,
        Admit(1, 1), Admit(8, 3), Iterate(IterationChoices())], sizes={"kv_tokens": 16})


@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p1-none"])
def test_kv13_catches_a_finished_request_counted_as_running_load(cell: str) -> None:
    script = _finished_then_two_arrive(cell)
    assert run_script(script).violation is None
    outcome = run_script(replace(script, faults=("B38",)))
    assert outcome.violation is not None
    # KV11 judges the scheduler's own load, in which r0 is still counted: it passes.
    assert outcome.violation.all_ids == ("KV13",)
    assert "request r2: left waiting though it asks 12 tokens < 13.000 left" in str(
        outcome.violation)


@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p1-none"])
def test_gpu_impl_with_b38_leaves_the_request_out_and_diverges(cell: str) -> None:
    script = _finished_then_two_arrive(cell)
    assert run_differential(script).ok
    outcome = run_differential(replace(script, faults=("B38",), implementation="gpu_impl"))
    assert not outcome.ok and "request r2.status: reference='running' gpu_impl='waiting'" in (
        outcome.describe())
