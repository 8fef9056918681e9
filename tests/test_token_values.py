"""RP7 (issue 13, token values): each request receives the tokens the environment produced
for it, in order, and the token relayed to the next forward is the one produced.

The stand-in model is a model: a token is a function of the request, its absolute position
and the token before it (``spec.state.compute_env_token``). The expected values here are
written out independently of that function, so a shared mistake cannot pass. Each forward
reads its input token where the release puts it (the relay under overlap, the last result
without it), so a wrong relay shows in the tokens after it: in the reference as RP7, in
gpu_impl through the differential, in the release through the upstream tier
(tests/test_upstream_tier.py, ``input-token-from-the-wrong-buffer``).

The forward's KV write footprint (draft ``topk * steps``, verify ``D_tok`` positions from
``seq_lens``) is pinned here too: KV3 pre-empts a short write from the state, so the
instrument itself was untested (mutation survivors of reference/ and gpu_impl/ workers).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from overlap_spec.gpu_impl import future_map as gpu_future_map
from overlap_spec.gpu_impl import worker as gpu_worker
from overlap_spec.gpu_impl.req import compute_env_tokens_tensor, get_env_chain_coefficients
from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
    run_script,
)
from overlap_spec.reference import future_map as ref_future_map
from overlap_spec.reference import worker as ref_worker
from overlap_spec.spec.state import IterationChoices, Observation, get_env_tokens
from overlap_spec.spec.units import RequestId


def _prompt_token(rid: int, index: int) -> int:
    return 100 + (rid * 13 + index) % 800


def _chain(rid: int, prompt_len: int, previous: int, count: int) -> list[int]:
    """The environment's output, written out here: token i at position prompt_len + i."""
    tokens = []
    for i in range(count):
        previous = 1 + (rid * 31 + (prompt_len + i) * 7 + previous * 11) % 97
        tokens.append(previous)
    return tokens


def _run(script: Script) -> tuple[Observation, InvariantChecker]:
    """The reference, every invariant checked; the last observation and the witnesses."""
    config = script.get_config()
    checker = InvariantChecker(config)
    seen: list[Observation] = []

    def observe(obs: Observation) -> None:
        seen.append(obs)
        checker(obs)

    model = get_factory("reference")(config, frozenset(), observe)
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    return seen[-1], checker


def _iterate(prefill: bool = False, accept: tuple[int, ...] = (2, 3, 1),
             retract: int = 0) -> Iterate:
    return Iterate(IterationChoices(allow_prefill=prefill, accept_lens=accept,
                                    retract=retract))


# Two requests, a decode that retracts one (it re-prefills from prompt + output), more
# decodes; spec cells accept runs of 2 and 3. Nine new tokens each (seven at page 4, where
# the budget admits both at once only then: 2 + 9 + 4 would ask more than 32 - 17 leaves).
def _ops(cell: str) -> list[Op]:
    budget = 7 if "-p4-" in cell else 9
    return [Admit(3, budget), Admit(2, budget), _iterate(prefill=True), _iterate(),
            _iterate(), _iterate(retract=1), _iterate(prefill=True), _iterate(), _iterate(),
            _iterate(), _iterate(), _iterate()]


CELLS = ["ov-p1-none", "nov-p1-none", "ov-p4-none", "ov-p1-v2chain-cpu-honest",
         "ov-p4-v2chain-nocpu-honest", "nov-p1-v2chain-cpu-honest"]


@pytest.mark.parametrize("cell", CELLS)
def test_output_ids_are_the_environments_chain(cell: str) -> None:
    script = Script(cell, "minimal", _ops(cell))
    last, checker = _run(script)
    assert checker.exercised["RP7"] > 0
    assert any(r.ghost.epoch for r in last.requests), "no retraction ran"
    for r in last.requests:
        assert r.output_ids is not None and len(r.output_ids) >= 2, r
        expected = _chain(r.rid, r.prompt_len, _prompt_token(r.rid, r.prompt_len - 1),
                          len(r.output_ids))
        assert list(r.output_ids) == expected, (r.rid, r.output_ids, expected)
    differential = run_differential(script)
    assert differential.ok, differential.describe()


def test_a_refused_prompt_chains_from_the_token_the_release_leaves() -> None:
    """``set_finish_with_abort`` shrinks a refused prompt to ``[0]``: its one token is the
    environment's at position 1 after token 0."""
    script = Script("ov-p1-none", "minimal", [Admit(23, 4), _iterate(prefill=True),
                                               _iterate()])
    last, _ = _run(script)
    (request,) = last.requests
    assert (request.prompt_len, request.last_prompt_token) == (1, 0)
    assert list(request.output_ids or ()) == _chain(request.rid, 1, 0, 1)


def test_the_spec_chain_and_gpu_impls_closed_form_agree() -> None:
    """gpu_impl computes a whole run at once from the solved recurrence."""
    rng = random.Random(7)
    for _ in range(300):
        rid, position = rng.randrange(40), rng.randrange(600)
        previous, count = rng.choice([0, rng.randrange(900)]), rng.randrange(1, 10)
        g, s, t = (torch.tensor(c) for c in get_env_chain_coefficients(count))
        n = torch.full((count,), 1, dtype=torch.int64)
        got = compute_env_tokens_tensor(n * rid, n * position, n * previous, g, s, t)
        assert got.tolist() == get_env_tokens(rid, position, previous, count) == _chain(
            rid, position, previous, count)


def _off_by_one_reference_stash(original: Any) -> Any:
    def stash(self: Any, reqs: Any, rows: Any, tokens: list[int], *rest: Any,
              **kwargs: Any) -> Any:
        return original(self, reqs, rows, [t % 97 + 1 for t in tokens], *rest, **kwargs)
    return stash


def _off_by_one_gpu_stash(original: Any) -> Any:
    def stash(self: Any, rows: Any, tokens: torch.Tensor, stream: str) -> Any:
        with self.rt.streams.use(stream):  # on the stream that produced the tokens
            wrong = tokens % 97 + 1
        return original(self, rows, wrong, stream)
    return stash


@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-v2chain-cpu-honest"])
def test_a_relay_of_the_wrong_token_is_caught(cell: str, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """The stash hands the next forward a token one off the one produced (the mutation
    survivor ``j // stride`` in ``_relay_tokens`` did the like): RP7 in the reference, the
    differential in gpu_impl."""
    script = Script(cell, "minimal", _ops(cell))
    with monkeypatch.context() as patch:
        patch.setattr(ref_future_map.FutureMap, "stash",
                      _off_by_one_reference_stash(ref_future_map.FutureMap.stash))
        outcome = run_script(script)
    assert outcome.violation is not None and outcome.violation.invariant_id == "RP7", (
        outcome.violation)
    with monkeypatch.context() as patch:
        patch.setattr(gpu_future_map.FutureMap, "stash",
                      _off_by_one_gpu_stash(gpu_future_map.FutureMap.stash))
        differential = run_differential(script)
    assert differential.divergence is not None, differential.describe()
    assert "output_ids" in differential.divergence.describe(), differential.describe()


def test_without_overlap_no_relay_is_read() -> None:
    """The same broken stash changes nothing without overlap: the forward takes the last
    result's token, which is why RP7's relay claim is stated for overlap."""
    script = Script("nov-p1-none", "minimal", _ops("nov-p1-none"))
    original = ref_future_map.FutureMap.stash
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ref_future_map.FutureMap, "stash", _off_by_one_reference_stash(original))
        outcome = run_script(script)
    assert outcome.violation is None, outcome.violation


# --- the forward's KV write footprint --------------------------------------------------
TREE = "ov-p1-v2tree-cpu-honest"  # realistic tree: topk 4 x steps 3 = 12 > D_tok = 8
TREE_OPS: list[Op] = [Admit(10, 30), _iterate(prefill=True), _iterate(), _iterate()]


def _record_reference_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The [start, end) ranges every reference forward writes KV for, from now on (each
    write contiguous: a page-1 tree's)."""
    writes: list[tuple[int, int]] = []
    original = ref_worker.ModelWorker._write_kv_at

    def spy(self: Any, req: Any, positions: Any, faults: Any, stored: Any,
            sources: Any = ()) -> None:
        positions = list(positions)
        assert positions == list(range(positions[0], positions[-1] + 1)), positions
        writes.append((positions[0], positions[-1] + 1))
        original(self, req, positions, faults, stored, sources)

    monkeypatch.setattr(ref_worker.ModelWorker, "_write_kv_at", spy)
    return writes


def test_the_reference_forward_writes_the_draft_and_verify_widths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    writes = _record_reference_writes(monkeypatch)
    _run(Script(TREE, "realistic", list(TREE_OPS)))
    decode = writes[1:]  # the first write is the prefill's [0, 10)
    assert writes[0] == (0, 10)  # seq_lens from 10: bit 3 set, so s ^ 8 != s + 8
    assert decode and len(decode) % 2 == 0
    for draft, verify in zip(decode[::2], decode[1::2], strict=True):
        s = draft[0]
        assert draft == (s, s + 4 * 3) and verify == (s, s + 8), (draft, verify)


def test_gpu_impl_forward_writes_the_draft_and_verify_widths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[tuple[list[int], int]] = []
    original = gpu_worker.ModelWorker._write_kv

    def spy(self: Any, fb: Any, inputs: Any, starts: Any, lengths: Any,
            max_width: int) -> Any:
        widths.append((lengths.tolist(), max_width))
        return original(self, fb, inputs, starts, lengths, max_width)

    monkeypatch.setattr(gpu_worker.ModelWorker, "_write_kv", spy)
    differential = run_differential(Script(TREE, "realistic", list(TREE_OPS)),
                                    detect_races=False)
    assert differential.ok, differential.describe()
    decode = widths[1:]
    assert decode and len(decode) % 2 == 0
    for draft, verify in zip(decode[::2], decode[1::2], strict=True):
        assert draft == ([12], 12) and verify == ([8], 8), (draft, verify)


def test_the_reference_non_spec_decode_writes_the_position_it_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-spec decode at seq_lens = s writes the KV of the token it processes, at s - 1
    (the slot claimed at prepare time); the prefill writes its whole fill."""
    writes = _record_reference_writes(monkeypatch)
    ops: list[Op] = [Admit(3, 4)] + [_iterate(prefill=True, accept=(1, 1, 1))] * 4
    _run(Script("nov-p1-none", "minimal", ops))
    assert writes == [(0, 3), (3, 4), (4, 5), (5, 6)], writes


def test_a_forward_write_outside_what_the_request_owns_is_recorded() -> None:
    """The stand-in forward's own instrument (KV3 / KV4 evidence), exercised directly: a
    position past kv_allocated_len, past the row (no slot: -1), into a slot the request
    does not own, and a request with no pool row each leave a KvWrite with the reason."""
    from overlap_spec.reference.scheduler import Scheduler
    from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell

    scheduler = Scheduler(ModelConfig(get_cell("nov-p1-none"), MINIMAL))
    scheduler.admit(3, 4)
    scheduler.admit(2, 4)
    scheduler.run_iteration(IterationChoices())  # both prefilled: 3 and 2 positions
    first, second = scheduler.requests[RequestId(0)], scheduler.requests[RequestId(1)]
    width = len(scheduler.rt.req_to_token.rows[first.req_pool_idx])
    faults: list[Any] = []
    stored: list[Any] = []  # the good writes' (slot, content), not stored in the KV map
    worker = scheduler.worker
    worker._write_kv(first, 0, first.kv_allocated_len, faults, stored)
    assert faults == []  # its own positions: nothing recorded
    row = scheduler.rt.req_to_token.rows[first.req_pool_idx]
    assert stored == [(row[k], (0, k)) for k in range(first.kv_allocated_len)]
    stored.clear()
    worker._write_kv(first, first.kv_allocated_len, first.kv_allocated_len + 1, faults, stored)
    worker._write_kv(first, width, width + 1, faults, stored)
    assert stored == []  # a fault writes nothing
    assert [(f.rid, f.position, f.slot, f.reason) for f in faults] == [
        (0, first.kv_allocated_len, -1, "beyond kv_allocated_len"),
        (0, width, -1, "beyond kv_allocated_len")]
    faults.clear()
    row[0] = scheduler.rt.req_to_token.rows[second.req_pool_idx][0]  # someone else's slot
    worker._write_kv(first, 0, 1, faults, stored)
    assert [(f.position, f.slot, f.reason) for f in faults] == [
        (0, row[0], "slot not owned by the request")]
    faults.clear()
    scheduler.admit(1, 1)
    worker._write_kv(scheduler.requests[RequestId(2)], 0, 1, faults, stored)  # still waiting
    assert [(f.rid, f.slot, f.reason) for f in faults] == [(2, None, "request holds no pool row")]
    assert stored == []
