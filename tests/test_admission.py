"""Admission-time length rules (issue 12: "a request that cannot fit is aborted, not a
crash"; issue 13: lengths up to ``max_context_len``).

sglang 0.5.23's ``handle_generate_request`` calls ``init_req_max_new_tokens`` (the cap:
``max_req_len - prompt - 1``, with ``max_req_len = min(context_len, pool) - 1`` from
``tp_worker.py``, then what an empty pool holds after the paged prompt and one page) and
``validate_input_length``, which refuses a prompt of ``max_req_len - 5`` tokens or more:
``set_finish_with_abort`` shrinks it to one token and sets a deferred abort, and the
request is queued anyway. It runs a one-token prefill, keeps the sampled token and
finishes by abort at that result. The spec's rule is
:func:`overlap_spec.spec.transitions.compute_admission`; the upstream tier checks it
against the release's own functions (tests/test_upstream_tier.py).
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.generate import get_prompt_lens
from overlap_spec.harness.drive.script import (
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.spec.config import PRESETS
from overlap_spec.spec.interface import ObservableState
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.transitions import compute_admission, compute_output_budget
from overlap_spec.spec.units import RequestId


# Written out from sglang 0.5.23 (init_req_max_new_tokens + validate_input_length, run on
# the minimal preset: context 24, pool 32 tokens; max_req_len 23, inputs of 18 refused).
@pytest.mark.parametrize(("prompt", "requested", "page", "expected"), [
    (3, 30, 1, (19, False)),  # 23 - 3 - 1
    (3, 30, 4, (19, False)),  # the pool allows 32 - 4 - 4 - 1 = 23
    (17, 8, 4, (5, False)),  # 23 - 17 - 1; the last accepted prompt
    (18, 8, 1, (4, True)),  # the first refused one
    (20, 8, 4, (2, True)),
    (22, 8, 1, (0, True)),
    (23, 8, 1, (0, True)),
    (5, 8, 1, (8, False)),  # nothing to cap
])
def test_the_admission_rule_is_the_releases(prompt: int, requested: int, page: int,
                                            expected: tuple[int, bool]) -> None:
    assert compute_admission(prompt, requested, 24, 32, page) == expected


def test_the_pool_caps_before_the_context_does() -> None:
    # context 256, pool 32: max_req_len 31; a 17-token prompt on pages of 4 leaves
    # 32 - 20 - 4 - 1 = 7 tokens, below the length cap 31 - 17 - 1 = 13.
    assert compute_admission(17, 30, 256, 32, 4) == (7, False)
    assert compute_admission(26, 30, 256, 32, 1) == (4, True)  # 31 - 5 = 26 is refused


def test_a_cap_of_zero_keeps_the_prefills_token_only_for_an_abort() -> None:
    """The prefill appends its token before any finish check; a length or stop finish
    then sets finished_len = max_new_tokens = 0 (nothing visible), an abort sets none."""
    assert compute_output_budget(0, 0, aborting=True) == 1
    assert compute_output_budget(0, 0) == 0
    assert compute_output_budget(3, 1) == 2 == compute_output_budget(3, 1, aborting=True)


# A prompt of 9 in a 16-token page-4 pool: accepted (9 < 15 - 5), but the pool leaves no
# room after its 3 pages and one more: max_new_tokens is capped to 0 (compute_admission).
CAP_ZERO = [Admit(9, 4)] + [Iterate(IterationChoices())] * 3


@pytest.mark.parametrize("cell", ["ov-p4-none", "nov-p4-none", "ov-p4-v2chain-cpu-honest"])
def test_an_accepted_prompt_capped_to_zero_finishes_by_length_with_nothing_visible(
        cell: str) -> None:
    """As the release: one prefill, a length finish at its result with no visible token,
    the prompt's KV cached whole; without speculation the batch is prefill-only, never
    decoded, and the finished request leaves the running batch at the next step's filter."""
    script = Script(cell, "minimal", list(CAP_ZERO), sizes={"kv_tokens": 16})
    assert compute_admission(9, 4, 24, 16, 4) == (0, False)
    assert run_script(script).violation is None
    model = get_factory("reference")(script.get_config(), frozenset(), None)
    admitted: list[RequestId] = []
    launches = 0
    running_after: list[object] = []
    for op in script.ops:
        apply_op(model, op, admitted)
        state = model.get_observable_state()
        launches += isinstance(op, Iterate) and state.last_batch is not None
        running_after.append(state.running)
    (request,) = model.get_observable_state().requests
    assert (request.status, request.finish_reason, request.output_ids) == (
        "finished", "length", ())
    assert request.cached_len == 9 and launches == 1
    overlap = script.get_config().cell.overlap
    # Under overlap its result comes one step after the launch; the release's prefill-only
    # batch keeps the finished request in the running batch until the next filter.
    assert (running_after[2] is not None) == (overlap and "v2" not in cell)
    assert running_after[-1] is None
    assert run_differential(script).ok


def test_every_preset_accepted_prompt_can_generate() -> None:
    """A prompt the scheduler accepts always gets at least one new token (else the
    presets would admit requests that cannot run)."""
    for preset in PRESETS.values():
        for prompt in range(1, preset.max_context_len):
            capped, refused = compute_admission(prompt, preset.max_new_tokens,
                                                preset.max_context_len, preset.kv_tokens, 4)
            assert refused or capped >= 1, (preset.name, prompt)


def test_the_drawn_prompts_reach_the_context_length_and_favour_short_ones() -> None:
    for preset in PRESETS.values():
        lens = get_prompt_lens(preset)
        assert set(lens) == set(range(1, preset.max_context_len)), preset.name
        long = sum(1 for n in lens if n > preset.max_prompt_len)
        assert 0.2 < long / len(lens) < 0.5, preset.name
        assert lens[0] == 1  # Hypothesis shrinks a sampled_from toward its first element


def _run(cell: str, ops: list[Op]) -> tuple[ObservableState, InvariantChecker]:
    script = Script(cell, "minimal", ops, ())
    config = script.get_config()
    checker = InvariantChecker(config)
    model = get_factory("reference")(config, frozenset(), checker)
    admitted: list[RequestId] = []
    for op in ops:
        apply_op(model, op, admitted)
    outcome = run_differential(script)
    assert outcome.ok, outcome
    return model.get_observable_state(), checker


def _iterate() -> Iterate:
    return Iterate(IterationChoices(allow_prefill=True, accept_lens=(4, 4, 4)))


CELLS = ["ov-p1-none", "nov-p4-none", "ov-p1-v2chain-cpu-honest", "ov-p4-v2chain-nocpu-honest"]


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("prompt", [18, 23])
def test_a_refused_prompt_runs_one_token_and_finishes_by_abort(cell: str, prompt: int) -> None:
    state, _ = _run(cell, [Admit(prompt, 8), Admit(3, 2), _iterate(), _iterate(), _iterate(),
                           _iterate()])
    refused, other = state.requests
    assert refused.status == "finished" and refused.finish_reason == "abort"
    assert len(refused.output_ids) == 1  # the prefill's token, kept before the finish
    # An abort sets no finished_len: owned_kv_len keys all it committed, its 1-token prompt
    # and, under non-spec overlap, the slot the decode prepared before the abort landed
    # (at 23 the cap is 0: a prefill-only batch, no decode is prepared).
    claimed = 1 if cell == "ov-p1-none" and prompt == 18 else 0
    assert refused.kv_allocated_len == 0
    assert refused.cached_len == refused.kv_committed_len == 1 + claimed
    assert other.status == "finished" and other.finish_reason == "length"


@pytest.mark.parametrize("cell", CELLS)
def test_a_long_prompt_is_capped_to_the_context_and_finishes_there(cell: str) -> None:
    state, checker = _run(cell, [Admit(17, 8)] + [_iterate() for _ in range(8)])
    (req,) = state.requests
    assert req.finish_reason == "length" and len(req.output_ids) == 5  # 23 - 17 - 1
    assert checker.exercised["KV1"] > 0 and checker.exercised["RP5"] > 0


def test_the_bmc_domain_lies_where_admission_neither_caps_nor_refuses() -> None:
    """The BMC draws prompts up to max_prompt_len (proofs/bmc.py), where the rule is the
    identity, so it needs no admission of its own; the Hypothesis and upstream tiers
    cover the long prompts."""
    for preset in PRESETS.values():
        for page in (1, 4):
            assert compute_admission(preset.max_prompt_len, preset.max_new_tokens,
                                     preset.max_context_len, preset.kv_tokens,
                                     page) == (preset.max_new_tokens, False), preset.name


def test_a_page_1_tree_near_the_context_length_outgrows_its_row() -> None:
    """U7, B23 (predicted here, then seen on the release with the same numbers:
    tests/test_upstream_tier.py): the release widens the
    req_to_token row to the decode reserve only on pages > 1 (allocation_sizing.py
    get_req_to_token_extra_context_len, #26972); on page 1 the headroom stays 4 + D_tok
    = 12 while a tree's reserve 2 * steps * topk is 24. A request capped just below the
    context length then allocates past its row; KV1 reports it at the prepare (the model
    never clamps it away). The model's row, widened on every page size, holds it."""
    ops: list[Op] = [Admit(240, 96)] + [
        Iterate(IterationChoices(allow_prefill=True, accept_lens=(1,) * 16))
        for _ in range(20)]
    assert run_script(Script("ov-p1-v2tree-cpu-honest", "realistic", ops, ())).violation is None
    outcome = run_script(Script("ov-p1-v2tree-cpu-honest", "realistic", ops, ("B23",)))
    assert outcome.violation is not None
    assert outcome.violation.invariant_id == "KV1"
    assert "kv_committed_len=245, kv_allocated_len=269, row width=268" in str(outcome.violation)
    # The chain's reserve 2 * D_tok fits the same headroom exactly: no overflow.
    chain = run_script(Script("ov-p1-v2chain-cpu-honest", "realistic", [Admit(240, 96)] + [
        Iterate(IterationChoices(allow_prefill=True, accept_lens=(1,) * 16))
        for _ in range(20)], ()))
    assert chain.violation is None


# --- which waiting requests a prefill admits: the release's PrefillAdder ------------------
# Written out from sglang 0.5.23 (schedule_policy.py PrefillAdder.add_one_req,
# mem_cache/prefill_budget.py, scheduler.py get_new_batch_prefill / update_running_batch,
# new_token_ratio_tracker.py); the upstream tier compares the same decisions, the new-token
# ratio and the batch_is_full latch with the release's, operation by operation.
def _states_after(cell: str, requests: list[tuple[int, int]], iterations: int = 1,
                  sizes: dict[str, int] | None = None,
                  choices: IterationChoices | None = None) -> list[ObservableState]:
    script = Script(cell, "minimal", [Admit(p, n) for p, n in requests], sizes=sizes or {})
    model = get_factory("reference")(script.get_config(), frozenset(),
                                     InvariantChecker(script.get_config()))
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    states = []
    for _ in range(iterations):
        apply_op(model, Iterate(choices or IterationChoices()), admitted)
        states.append(model.get_observable_state())
    return states


def _statuses(state: ObservableState) -> list[str]:
    return [r.status for r in state.requests]


def test_admission_counts_the_running_total_not_each_request_alone() -> None:
    """Prompts of 3 with max_new_tokens 8 ask 3 + 8 + 1 = 12 tokens each and reserve
    3 + 1 + 8 = 12: in a 32-token pool the first two fit (12 < 32, 12 < 20) and the third
    waits (12 < 8 fails) though three rows are free and its prompt's pages are too."""
    first = _states_after("ov-p1-none", [(3, 8), (3, 8), (3, 8)])[0]
    assert _statuses(first) == ["running", "running", "waiting"]
    assert first.batch_is_full is False  # the latch sits on the running batch, empty yet
    # Two prompts of 9 in a 16-token pool (max_new_tokens capped to 5): the first asks
    # 9 + 5 + 1 = 15 < 16 and reserves 15; the second asks 15 < 1 and waits.
    assert _statuses(_states_after("ov-p1-none", [(9, 8), (9, 8)],
                                   sizes={"kv_tokens": 16})[0]) == ["running", "waiting"]


def test_admission_is_first_come_and_stops_at_the_first_that_does_not_fit() -> None:
    """Waiting order, no skipping: a small request behind one that does not fit waits too
    (head of line), and no more are admitted than the request rows."""
    assert _statuses(_states_after("ov-p1-none", [(9, 8), (9, 8), (2, 1)],
                                   sizes={"kv_tokens": 16})[0]) == [
        "running", "waiting", "waiting"]
    # One new token each: 2 + 1 + 1 = 4 asked and reserved; the rows stop it (3 here).
    assert _statuses(_states_after("ov-p1-none", [(2, 1)] * 4)[0]) == [
        "running", "running", "running", "waiting"]
    assert _statuses(_states_after("ov-p1-none", [(2, 1)] * 4,
                                   sizes={"max_running_requests": 2})[0]) == [
        "running", "running", "waiting", "waiting"]


def test_a_request_that_did_not_fit_latches_admission_until_one_leaves() -> None:
    """r0 (prompt 10, 8 new) runs; r1 asks 19 tokens of the 32 - 11 (r0's KV) - 8 x 0.7
    left and does not fit, which latches batch_is_full on the running batch: r1 and the
    small r2 behind it wait, however much the decodes' ratio decays, until r0 finishes."""
    states = _states_after("ov-p1-none", [(10, 8), (10, 8), (3, 2)], iterations=12)
    finished_at = next(i for i, s in enumerate(states) if s.requests[0].status == "finished")
    for state in states[1:finished_at]:
        assert _statuses(state)[1:] == ["waiting", "waiting"]
        assert state.batch_is_full
    assert "running" in _statuses(states[finished_at + 1])[1:]


def test_the_new_token_ratio_decays_per_decode_and_is_re_estimated_at_a_retraction() -> None:
    decay = (0.7 - 0.7 * 0.14) / 600
    states = _states_after("nov-p1-none", [(3, 8), (3, 8)], iterations=4)
    assert [s.new_token_ratio for s in states] == [0.7, 0.7 - decay, 0.7 - decay - decay,
                                                   0.7 - decay - decay - decay]
    # A forced retraction keeps one request: min(1, (its outputs + 20) / (8 + 1)) = 1.0.
    retracted = _states_after("nov-p1-none", [(3, 8), (3, 8)], iterations=2, choices=(
        IterationChoices(retract=1)))[-1]
    assert _statuses(retracted).count("waiting") == 1 and retracted.new_token_ratio == 1.0


def test_the_new_token_ratio_starts_over_when_the_scheduler_is_idle() -> None:
    states = _states_after("ov-p1-none", [(3, 2)], iterations=8)
    assert states[2].new_token_ratio < 0.7  # decoded
    assert all(r.status == "finished" for r in states[-1].requests)
    assert states[-1].new_token_ratio == 0.7


def test_kv11_catches_an_admission_that_ignores_the_running_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """r0 runs; r1 and r2 arrive together: the release admits r1 and holds r2 (10 tokens
    asked, 7.4 left after r0's 8 x 0.7 and r1's 14). An admission that leaves the running
    requests' estimate out admits r2 too, and KV11, which states the rule with its own
    arithmetic, names it."""
    from overlap_spec.reference import scheduler

    step = Iterate(IterationChoices())
    ops = [Admit(5, 8), step, Admit(5, 8), Admit(1, 8), step]
    assert run_script(Script("ov-p1-none", "minimal", ops)).violation is None
    monkeypatch.setattr(scheduler, "compute_running_token_offset", lambda *args: 0.0)
    outcome = run_script(Script("ov-p1-none", "minimal", ops))
    assert outcome.violation is not None and outcome.violation.invariant_id == "KV11"
    assert "request r2: admitted asking 10 tokens" in str(outcome.violation)
