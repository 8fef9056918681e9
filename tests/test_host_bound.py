"""SL11 as the release states it, and the seq_len_cpu_ub proposal (issue 12).

With the host mirror off (``needs_cpu_seq_lens=False``, PR 26128) sglang 0.5.23 keeps no
host length after ``resolve_seq_lens_cpu``: ``seq_lens_cpu`` and ``seq_lens_sum`` are None
and there is no ``seq_len_cpu_ub``. The closed PR #27979 kept that upper bound; it is the
``cpu_ub`` proposal's cell, where SL11 checks the bound instead. Each form is shown
holding on a run (gpu_impl agreeing) and failing on the other's state.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.script import Admit, Iterate, Script, apply_op, get_factory
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import InvariantViolation, get_invariant
from overlap_spec.spec.state import IterationChoices, Observation, ObservationPoint
from overlap_spec.spec.units import RequestId

RELEASE = "ov-p1-v2chain-nocpu-honest"
PROPOSAL = "ov-p1-v2chain-nocpu-honest-ub"
OPS = [Admit(3, 8), Admit(2, 8)] + [
    Iterate(IterationChoices(allow_prefill=True, accept_lens=(2, 3))) for _ in range(5)]


def _resolves(cell: str) -> tuple[ModelConfig, list[Observation]]:
    script = Script(cell, "minimal", OPS, ())
    config = script.get_config()
    seen: list[Observation] = []
    model = get_factory("reference")(config, frozenset(), seen.append)
    admitted: list[RequestId] = []
    for op in OPS:
        apply_op(model, op, admitted)
    assert run_differential(script).ok
    resolves = [o for o in seen if o.point is ObservationPoint.RESOLVE_SEQ_LENS_CPU
                and o.batch is not None and o.batch.seq_lens]
    assert resolves
    return config, resolves


def test_the_release_keeps_no_host_length_without_the_mirror() -> None:
    config, resolves = _resolves(RELEASE)
    sl11 = get_invariant("SL11")
    for obs in resolves:
        assert obs.batch is not None
        assert (obs.batch.seq_lens_cpu, obs.batch.seq_lens_sum,
                obs.batch.seq_len_cpu_ub) == (None, None, None)
        assert sl11.check(config, obs) == 1
    obs = resolves[-1]
    assert obs.batch is not None
    for stale in ({"seq_lens_sum": 5}, {"seq_lens_cpu": obs.batch.seq_lens},
                  {"seq_len_cpu_ub": max(obs.batch.seq_lens)}):
        with pytest.raises(InvariantViolation, match="host still holds lengths"):
            sl11.check(config, replace(obs, batch=replace(obs.batch, **stale)))


def test_the_proposal_keeps_an_upper_bound_and_sl11_holds_it_to_that() -> None:
    config, resolves = _resolves(PROPOSAL)
    sl11 = get_invariant("SL11")
    for obs in resolves:
        assert obs.batch is not None and obs.batch.seq_len_cpu_ub is not None
        assert obs.batch.seq_len_cpu_ub >= max(obs.batch.seq_lens)
        assert sl11.check(config, obs) == 1
    obs = resolves[-1]
    assert obs.batch is not None
    for wrong in (None, max(obs.batch.seq_lens) - 1):
        with pytest.raises(InvariantViolation, match="seq_len_cpu_ub"):
            sl11.check(config, replace(obs, batch=replace(obs.batch, seq_len_cpu_ub=wrong)))
