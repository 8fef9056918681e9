"""The finish as sglang 0.5.23 does it, and the trimmed finish proposal (issue 12).

The release commits a finishing verify's whole accepted run (``_resolve_spec_v2_tokens``)
and caches ``Req.owned_kv_len()``: ``kv_committed_len`` cut at prompt + the visible
output, all of it for an abort (no ``finished_len``). KV8 holds the committed length at
the finish release to the settled truth, KV9 the cached length to ``owned_kv_len``. The
trimmed finish cell (#35694) cuts the run before committing and caches prompt + output
- 1, and KV9 holds it to that. Each rule is pinned on a run, gpu_impl agrees op by op,
and each check is shown failing on the other rule's numbers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    Iterate,
    Op,
    Script,
    apply_op,
    get_factory,
)
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import InvariantViolation, get_invariant
from overlap_spec.spec.state import IterationChoices, Observation, ObservationPoint, RequestView
from overlap_spec.spec.units import RequestId

RELEASE = "ov-p1-v2chain-cpu-honest"
TRIMMED = "ov-p1-v2chain-cpu-honest-trimmed"


def _iterate(eos: bool = False) -> Iterate:
    """Every verify accepts 4; with ``eos`` the stop token is the first of its run."""
    return Iterate(IterationChoices(allow_prefill=True, accept_lens=(4, 4, 4),
                                    eos_positions=frozenset({0}) if eos else frozenset(),
                                    eos_offset=3 if eos else 0))


# A 2-token prompt: the prefill emits one token (committed 2, its KV not yet written), the
# first verify accepts 4 and commits them all (6), whatever the client sees: with
# max_new_tokens=3 the cap keeps 2 of them; with the stop token first, 1; an abort
# requested while it flew leaves no finished_len (the reference still shows the cut run).
CAPPED = [Admit(2, 3), _iterate(), _iterate(), _iterate(), _iterate()]
STOPPED = [Admit(2, 8), _iterate(), _iterate(eos=True), _iterate(), _iterate()]
ABORTED = [Admit(2, 3), _iterate(), _iterate(), Abort(0), _iterate(), _iterate()]


def _run(cell: str, ops: list[Op]) -> tuple[Observation, RequestView]:
    """The first PROCESS_RESULT observation after the request's finish release, and the
    request there; gpu_impl must agree with the reference on the whole run."""
    script = Script(cell, "minimal", ops, ())
    config = script.get_config()
    seen: list[Observation] = []
    model = get_factory("reference")(config, frozenset(), seen.append)
    admitted: list[RequestId] = []
    for op in ops:
        apply_op(model, op, admitted)
    assert run_differential(script).ok
    for obs in seen:
        if obs.point is ObservationPoint.PROCESS_RESULT:
            released = [r for r in obs.requests if r.committed_at_release is not None]
            if released:
                return obs, released[0]
    raise AssertionError("the request never reached its finish release")


def _broken(obs: Observation, request: RequestView, **changes: object) -> Observation:
    return replace(obs, requests=tuple(replace(r, **changes) if r.rid == request.rid else r
                                       for r in obs.requests))


@pytest.mark.parametrize(("ops", "reason", "output", "committed", "cached"), [
    (CAPPED, "length", 3, 2 + 4, 2 + 3),  # the whole run committed, owned cut at 5
    (STOPPED, "stop", 2, 2 + 4, 2 + 2),  # tokens past the stop committed, not cached
    (ABORTED, "abort", 3, 2 + 4, 2 + 4),  # no finished_len: all of it cached
])
def test_the_release_commits_the_whole_run_and_caches_owned_kv_len(
        ops: list[Op], reason: str, output: int, committed: int, cached: int) -> None:
    obs, request = _run(RELEASE, ops)
    assert (request.finish_reason, request.output_len) == (reason, output)
    assert (request.committed_at_release, request.cached_len) == (committed, cached)
    config = _config(RELEASE)
    get_invariant("KV8").check(config, obs)
    get_invariant("KV9").check(config, obs)
    # The trimmed finish's numbers fail the release's rules.
    trimmed_cache = 2 + max(output, 1) - 1
    with pytest.raises(InvariantViolation, match="owned_kv_len|abort"):
        get_invariant("KV9").check(config, _broken(obs, request, cached_len=trimmed_cache))
    with pytest.raises(InvariantViolation, match="settled true length"):
        get_invariant("KV8").check(config, _broken(obs, request,
                                                   committed_at_release=trimmed_cache))


@pytest.mark.parametrize(("ops", "output"), [(CAPPED, 3), (STOPPED, 2), (ABORTED, 3)])
def test_the_trimmed_finish_commits_and_caches_prompt_plus_output_minus_one(
        ops: list[Op], output: int) -> None:
    obs, request = _run(TRIMMED, ops)
    with_kv = 2 + output - 1
    assert request.output_len == output
    assert (request.committed_at_release, request.cached_len) == (with_kv, with_kv)
    config = _config(TRIMMED)
    get_invariant("KV8").check(config, obs)
    get_invariant("KV9").check(config, obs)
    # The release's numbers fail the proposal's rule.
    with pytest.raises(InvariantViolation, match="trimmed finish"):
        get_invariant("KV9").check(config, _broken(obs, request, cached_len=with_kv + 1))
    with pytest.raises(InvariantViolation, match="prompt \\+ output - 1"):
        get_invariant("KV9").check(config, _broken(obs, request, committed_at_release=2 + 4))


def _config(cell: str) -> ModelConfig:
    return Script(cell, "minimal", [], ()).get_config()
