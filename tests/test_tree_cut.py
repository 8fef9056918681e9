"""The tree-cache sink keeps the release's cut (issue 42, step 0).

sglang 0.5.23's finish release keys ``owned_kv_len`` into its tree, as bigrams under EAGLE
(one position shorter), cut to whole pages, and frees the rest, the partial page included
(``docs/upstream-radix-sharing.md`` section 1.4): ``floor_p(owned - 1)`` positions under
EAGLE, ``floor_p(owned)`` otherwise. ``compute_inserted_len`` states it once; the reference's
and gpu_impl's sinks take exactly that many pages, and the differential compares the tree's
page count, so a sink that kept the old ``ceil_p(owned)`` is caught in either.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap_spec.harness.differential.compare import run_differential
from overlap_spec.harness.drive.script import Admit, Iterate, Script, apply_op, get_factory
from overlap_spec.spec.config import get_cell
from overlap_spec.spec.invariants import InvariantViolation, get_invariant
from overlap_spec.spec.state import IterationChoices, Observation
from overlap_spec.spec.transitions import compute_inserted_len, compute_pages_for_len
from overlap_spec.spec.units import RequestId

NON_SPEC_P1, NON_SPEC_P4 = "ov-p1-none", "ov-p4-none"
SPEC_P1, SPEC_P4 = "ov-p1-v2chain-cpu-honest", "ov-p4-v2chain-cpu-honest"


@pytest.mark.parametrize(("cell", "handed", "inserted"), [
    (NON_SPEC_P1, 0, 0), (NON_SPEC_P1, 1, 1), (NON_SPEC_P1, 7, 7),
    (NON_SPEC_P4, 3, 0), (NON_SPEC_P4, 4, 4), (NON_SPEC_P4, 7, 4), (NON_SPEC_P4, 8, 8),
    (SPEC_P1, 0, 0), (SPEC_P1, 1, 0), (SPEC_P1, 8, 7),
    (SPEC_P4, 4, 0), (SPEC_P4, 5, 4), (SPEC_P4, 8, 4), (SPEC_P4, 9, 8), (SPEC_P4, 13, 12),
])
def test_inserted_len_by_hand(cell: str, handed: int, inserted: int) -> None:
    """Whole pages of the key; the bigram key one shorter (at page 4, EAGLE, a 5-token
    hand-over keeps one page, the release's worked example; 4 keep none)."""
    assert compute_inserted_len(get_cell(cell), handed) == inserted


def _iterate() -> Iterate:
    return Iterate(IterationChoices(allow_prefill=True, accept_lens=(4, 4, 4)))


def _script(cell: str, prompt_len: int, max_new_tokens: int) -> Script:
    return Script(cell, "minimal", [Admit(prompt_len, max_new_tokens)]
                  + [_iterate() for _ in range(8)], ())


def _last_observation(script: Script) -> Observation:
    seen: list[Observation] = []
    model = get_factory("reference")(script.get_config(), frozenset(), seen.append)
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    return seen[-1]


# (cell, prompt, max_new_tokens, the length handed over at the finish, the tree's pages).
# Non-spec hands prompt + output - 1 (the newest token has no KV); the honest spec release
# commits the whole accepted run and hands prompt + visible output.
RUNS = [
    (NON_SPEC_P1, 5, 3, 7, 7),
    (NON_SPEC_P4, 5, 3, 7, 1),  # ceil_p would keep 2: the partial page [4, 7) is freed
    (NON_SPEC_P4, 3, 2, 4, 1),  # a full page is kept
    (SPEC_P1, 5, 3, 8, 7),  # the bigram key is one short even at page 1
    (SPEC_P4, 5, 3, 8, 1),  # floor4(7): the full second page [4, 8) is not kept
    (SPEC_P4, 4, 1, 4, 0),  # floor4(3): nothing
    (SPEC_P4, 5, 8, 13, 3),
]


@pytest.mark.parametrize(("cell", "prompt_len", "max_new_tokens", "handed", "tree_pages"), RUNS)
def test_sink_keeps_the_release_cut(cell: str, prompt_len: int, max_new_tokens: int,
                                    handed: int, tree_pages: int) -> None:
    """One request to its finish: the reference's tree holds the hand-counted pages, every
    other page is free again (KV7 at the last observation), and gpu_impl agrees op by op,
    the tree's page count included."""
    script = _script(cell, prompt_len, max_new_tokens)
    obs = _last_observation(script)
    (request,) = obs.requests
    assert request.cached_len == handed
    assert request.inserted_len == tree_pages * get_cell(cell).page_size
    assert len(obs.allocator.tree_pages) == tree_pages
    assert len(obs.allocator.free_pages) + tree_pages == obs.allocator.total_pages
    outcome = run_differential(script)
    assert outcome.ok, outcome.divergence


def test_differential_sees_a_sink_with_the_old_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_impl caching ``ceil_p(handed)`` pages, the sink's rule before this step, keeps
    the same number of pages free-or-cached: only the tree's page count tells them apart."""
    from overlap_spec.gpu_impl import mem_cache

    def old_cut(cell: object, handed: int) -> int:
        page = get_cell(SPEC_P4).page_size
        return compute_pages_for_len(handed, page) * page

    monkeypatch.setattr(mem_cache, "compute_inserted_len", old_cut)
    outcome = run_differential(_script(SPEC_P4, 5, 3))
    assert outcome.divergence is not None
    assert outcome.divergence.field == "tree_pages"
    assert (outcome.divergence.reference, outcome.divergence.gpu_impl) == (1, 2)


@pytest.mark.parametrize("cell", [NON_SPEC_P4, SPEC_P1, SPEC_P4])
def test_kv9_judges_the_inserted_half(cell: str) -> None:
    """KV9 holds the keyed length to compute_inserted_len: the old sink's ``ceil_p`` cut,
    and a bigram cell keyed as plain tokens, each fail it, naming both values."""
    obs = _last_observation(_script(cell, 5, 3))
    (request,) = obs.requests
    config = _script(cell, 5, 3).get_config()
    kv9 = get_invariant("KV9")
    assert kv9.check(config, obs) > 0
    page = get_cell(cell).page_size
    assert request.cached_len is not None
    wrong = (compute_pages_for_len(request.cached_len, page) * page if page > 1
             else request.cached_len)  # at page 1 the old cut was the bigram's miss
    assert wrong != request.inserted_len
    broken = replace(obs, requests=(replace(request, inserted_len=wrong),))
    with pytest.raises(InvariantViolation, match=f"keyed {wrong} of the {request.cached_len}"):
        kv9.check(config, broken)
    unsaid = replace(obs, requests=(replace(request, inserted_len=None),))
    assert kv9.check(config, unsaid) > 0  # not said: only the handed half is judged
