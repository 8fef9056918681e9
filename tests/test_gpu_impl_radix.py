"""Radix prefix sharing in gpu_impl (issue 42, step 3 of ``docs/upstream-radix-sharing.md``
section 5): in a radix cell gpu_impl keeps the release's tree (``spec/radix.py``, host-side)
and follows the reference's match, admission, checkpoints, release, retraction and
evictions; the differential compares the tree and each request's ``cache_protected_len``.

- reference and gpu_impl agree, with no race, on random scripts whose prompts share (two
  families) in every radix cell, at the default sizes, with chunked prefill and with mixed
  chunks, and the scripts do share;
- the dedup of two identical prompts prefilled together, on the device: the row repointed
  to the tree's page, ``page_owner`` naming the tree's page, the duplicate freed;
- a mixed chunk's decode row writes a page its prefill's checkpoint already keyed (the
  release's order, which the reference keeps): gpu_impl agrees, and counting that write
  as a fault diverges at ``kv_write_faults``;
- gpu_impl's radix code broken (a checkpoint that skips the row repoint, a release that
  keeps its lock) fails the differential, at the field that shows it;
- ``flush_cache`` on the device agrees with the reference, and B35's flush (blind to the
  batch in flight) fails the differential at the flush.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import cast

import pytest
import torch

from overlap_spec.gpu_impl import mem_cache
from overlap_spec.gpu_impl.memory import TREE_OWNER
from overlap_spec.gpu_impl.req import Req
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler
from overlap_spec.gpu_impl.worker import RequestInputs
from overlap_spec.harness.differential.compare import DifferentialPair, run_differential
from overlap_spec.harness.drive.cells import check_sizes
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import Admit, Flush, Iterate, Op, Script
from overlap_spec.spec.config import MINIMAL, ModelConfig, enumerate_radix_cells, get_cell
from overlap_spec.spec.radix import RadixTree
from overlap_spec.spec.state import IterationChoices

EAGLE_P4 = "nov-p4-v2chain-cpu-honest-radix"
MIXED = {"chunked_prefill_size": 8, "mixed_chunk": 1}
# The default sizes, chunked prefill, and mixed chunks (where a cell has them).
SIZES: list[dict[str, int]] = [{}, {"chunked_prefill_size": 4}, MIXED]
SEEDS = range(3)


def iterate(**choices: object) -> Iterate:
    return Iterate(IterationChoices(**choices))  # type: ignore[arg-type]


def _family_ops(config: ModelConfig, seed: int, count: int) -> list[Op]:
    """generate_random_ops' draw with each prompt in one of two families (so prompts share;
    tests/test_radix_reference.py draws the same)."""
    rng = random.Random(seed)
    return [replace(op, family=rng.randrange(2)) if isinstance(op, Admit) else op
            for op in generate_random_ops(config, rng, count)]


def _slots(page_size: int, *pages: int) -> tuple[int, ...]:
    return tuple(page * page_size + k for page in pages for k in range(page_size))


@pytest.mark.parametrize("cell", [c.name for c in enumerate_radix_cells()])
def test_gpu_impl_agrees_with_the_reference_in_radix_cells(cell: str) -> None:
    """Op by op the same observable state (the tree's nodes, keys, pages, locks and sizes,
    each request's row and ``cache_protected_len``) and no race, on scripts whose prompts
    share; and they do share: a request holds a protected prefix, a node is locked twice or
    a waiting request shows a match."""
    shared = 0
    for sizes in SIZES:
        config = Script(cell, "minimal", sizes=dict(sizes)).get_config()
        if check_sizes(config) is not None:
            continue  # mixed chunks: not in a spec cell without the CPU mirror
        for seed in SEEDS:
            pair = DifferentialPair(config)
            for op in _family_ops(config, seed, 50):
                outcome = pair.apply(op)
                assert outcome.ok, f"sizes {sizes}, seed {seed}: {outcome.describe()}"
                state = pair.reference_state
                assert state is not None and state.tree is not None
                shared += (any(n.lock_ref > 1 for n in state.tree.nodes)
                           or any(r.cache_protected_len > 0 and r.status != "finished"
                                  for r in state.requests))
    assert shared > 0, f"no prefix was shared in {cell}"


def test_the_dedup_on_the_device() -> None:
    """Section 1.4's dedup (tests/test_radix_reference.py's twin): A and B, one 6-token
    prompt at page 4 under EAGLE, prefilled together; B's checkpoint frees its own copy of
    the first page (2) and repoints its row to A's (0), which ``page_owner`` now names the
    tree's; B keeps its second page (3)."""
    script = Script(EAGLE_P4, "minimal", [Admit(6, 3, 0), Admit(6, 3, 0), iterate()],
                    implementation="gpu_impl")
    pair = DifferentialPair(script.get_config())
    for op in script.ops:
        assert pair.apply(op).ok, pair.outcome.describe()
    state = pair.gpu.get_observable_state()
    a, b = state.requests
    assert a.cache_protected_len == b.cache_protected_len == 4
    assert b.req_to_token == _slots(4, 0, 3)[:6]
    assert state.tree is not None
    assert [(len(n.key), n.pages, n.lock_ref) for n in state.tree.nodes] == [(4, (0,), 2)]
    owner = pair.streams.read_for_observation(pair.gpu.rt.kv.page_owner)
    assert owner[:4] == [TREE_OWNER, a.rid, -1, b.rid]
    assert 2 in pair.gpu.rt.allocator.free_pages


def _mixed_script() -> Script:
    """tests/test_radix_reference.py's ``test_a_mixed_decode_writes_below_the_checkpoint_it_
    follows``: a 7-token prefill at page 4 whose result, processed early, keys 8 positions
    (``mix_with_running`` set its ``extend_end`` to its decode's length), before the mixed
    batch's decode row writes position 7."""
    return Script("ov-p4-none-radix", "minimal",
                  [Admit(7, 4, 0), iterate(), Admit(5, 2, 1), iterate(disable_overlap=True)],
                  sizes=dict(MIXED), implementation="gpu_impl")


def test_a_mixed_decode_row_writes_the_tree_page_its_prefill_keyed() -> None:
    """That write is the release's order: gpu_impl lets a mixed batch's decode row write a
    tree page of its own row, as the reference does, and agrees."""
    outcome = run_differential(_mixed_script())
    assert outcome.ok, outcome.describe()


def test_a_write_into_a_tree_page_is_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same write counted as a fault, as any other write into a tree page is
    (``page_owner`` names the tree's pages): the differential diverges when the decode row
    writes, first at the request's KV contents (position 7, which the reference wrote and
    gpu_impl masked), and at ``kv_write_faults``."""
    def owned_only(self: RequestInputs, owner: torch.Tensor) -> torch.Tensor:
        return owner == self.rid[:, None]

    monkeypatch.setattr(RequestInputs, "is_own", owned_only)
    outcome = run_differential(_mixed_script())
    assert outcome.divergence is not None, outcome.describe()
    assert (outcome.divergence.step, outcome.divergence.field) == (3, "request r0.kv_contents")
    assert outcome.divergence.reference[7] == (0, 7) and outcome.divergence.gpu_impl[7] is None
    pair = DifferentialPair(_mixed_script().get_config())
    for op in _mixed_script().ops:
        pair.apply(op)
    assert pair.reference_state is not None
    faults = (pair.reference_state.kv_write_faults, pair.gpu.get_observable_state().kv_write_faults)
    assert faults == (0, 1)


def test_a_checkpoint_without_the_repoint_fails_the_differential(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """mini-sglang #142's mistake in gpu_impl: the checkpoint frees B's duplicate page but
    leaves B's row pointing at it. The differential names B's row at the prefill."""
    monkeypatch.setattr(mem_cache, "repoint_row", lambda *args: None)
    script = Script(EAGLE_P4, "minimal", [Admit(6, 3, 0), Admit(6, 3, 0), iterate()],
                    implementation="gpu_impl")
    outcome = run_differential(script)
    assert outcome.divergence is not None, outcome.describe()
    assert (outcome.divergence.step, outcome.divergence.field) == (2, "request r1.req_to_token")
    assert outcome.divergence.reference == _slots(4, 0, 3)[:6]
    assert outcome.divergence.gpu_impl == _slots(4, 2, 3)[:6]


def test_a_release_that_keeps_its_lock_fails_the_differential(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """#32170 / #40681's mistake in gpu_impl: a finish release that never drops the tree lock.
    A's prefix stays protected where the reference made it evictable: the free KV the
    differential compares first, then the tree's lock counts."""
    release = mem_cache.release_into_tree

    class NoUnlock:
        """The tree as the release's last step sees it: its unlock does nothing (the
        checkpoint before it reads the runtime's own tree)."""

        def unlock(self, node: object) -> None:
            del node

    def keeping_the_lock(rt: Runtime, radix: RadixTree, req: Req, is_insert: bool) -> None:
        release(rt, cast(RadixTree, NoUnlock()), req, is_insert)

    monkeypatch.setattr(mem_cache, "release_into_tree", keeping_the_lock)
    script = Script("nov-p1-none-radix", "minimal", [Admit(3, 1, 0), iterate()],
                    implementation="gpu_impl")
    outcome = run_differential(script)
    assert outcome.divergence is not None, outcome.describe()
    assert (outcome.divergence.step, outcome.divergence.field) == (1, "free_pages")


def test_a_flush_on_the_device_and_one_blind_to_the_batch_in_flight() -> None:
    """``flush_cache`` in gpu_impl: refused while the prefill is in flight, then at idle the
    tree reset, every page owned by no one and the rows and pages handed out in their first
    order, as the reference; B35 (#12107's idle check) flushes under the prefill in flight
    and the differential names the batch in flight it dropped, at the flush."""
    drain = [iterate() for _ in range(5)]
    ops: list[Op] = [Admit(6, 2, 0), iterate(), Flush(), *drain, Flush(), Admit(6, 2, 0),
                     iterate()]
    script = Script("ov-p1-none-radix", "minimal", ops, implementation="gpu_impl")
    outcome = run_differential(script)
    assert outcome.ok, outcome.describe()
    pair = DifferentialPair(script.get_config())
    for op in ops[:-2]:
        assert pair.apply(op).ok
    gpu = cast(GpuScheduler, pair.gpu)
    assert not gpu.rt.tree.get_pages() and gpu.rt.allocator.free_pages == list(
        range(gpu.rt.allocator.total_pages))
    assert bool((gpu.rt.kv.page_owner == -1).all())
    blind = run_differential(replace(script, faults=("B35",)))
    assert blind.divergence is not None, blind.describe()
    assert (blind.divergence.step, blind.divergence.field) == (2, "last_batch")


def test_non_radix_cells_show_no_tree_and_no_protected_prefix() -> None:
    config = ModelConfig(get_cell("ov-p4-v2chain-cpu-honest"), MINIMAL)
    gpu = GpuScheduler(config)
    gpu.admit(6, 3, family=0)
    gpu.admit(6, 3, family=0)
    gpu.run_iteration(IterationChoices())
    state = gpu.get_observable_state()
    assert state.tree is None
    assert [r.cache_protected_len for r in state.requests] == [0, 0]
