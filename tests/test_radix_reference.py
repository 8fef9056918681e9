"""Radix prefix sharing in the reference (issue 42): the radix cells (``Cell.radix``) keep
sglang 0.5.23's prefix tree (``spec/radix.py``) and follow the release's match, admission,
checkpoints, release and retraction (``docs/upstream-radix-sharing.md`` sections 1 and 2).

- the worked example of section 1.4 (page 4, EAGLE) and its page-1 non-spec twin, each step's
  prefix, ``cache_protected_len``, pages, locks and evictable / protected sizes counted by hand;
- the dedup: two identical prompts prefilled together, the second's checkpoint frees its copy
  of the shared page and repoints its row;
- a retraction of a request whose prefix another request holds, and its re-admission
  re-matching the prompt;
- ``flush_cache``: refused while a request waits, runs or is in flight, at full idle the
  tree reset and rows and pages in their first order again (RX8);
- every invariant on random scripts with prompt families, in every radix cell;
- KV11 reads the per-candidate prefix and free term (a view without them fails).

Every run here checks every applicable invariant at every observation
(``harness.drive.checker.InvariantChecker``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from overlap_spec.harness.drive.cells import check_sizes
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    apply_op,
)
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec import relation
from overlap_spec.spec.config import ModelConfig, enumerate_radix_cells, get_cell
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation, get_invariant
from overlap_spec.spec.relation import GuardViolation
from overlap_spec.spec.state import (
    AdmissionView,
    BatchView,
    IterationChoices,
    Observation,
    ObservationPoint,
    RequestView,
    TreeNodeView,
)
from overlap_spec.spec.units import PoolRow, RequestId, TokenCount

EAGLE_P4 = "nov-p4-v2chain-cpu-honest-radix"
PLAIN_P1 = "nov-p1-none-radix"


def iterate(*accept_lens: int, retract: int = 0, allow_prefill: bool = True) -> Iterate:
    return Iterate(IterationChoices(allow_prefill=allow_prefill, retract=retract,
                                    accept_lens=accept_lens or (1,)))


@dataclass
class Run:
    """A reference run op by op, every invariant checked; ``obs`` is the latest observation."""

    config: ModelConfig
    model: Scheduler
    seen: list[Observation]
    admitted: list[RequestId]
    checker: InvariantChecker | None = None  # its witness counts (exercised)

    @classmethod
    def start(cls, cell: str, sizes: dict[str, int] | None = None,
              also: Callable[[Observation], None] | None = None) -> Run:
        """``also``: a check of this test's own, after the invariants, at every observation."""
        config = Script(cell, "minimal", sizes=sizes or {}).get_config()
        checker = InvariantChecker(config)
        seen: list[Observation] = []

        def observe(obs: Observation) -> None:
            checker(obs)
            if also is not None:
                also(obs)
            seen.append(obs)

        run = cls(config, Scheduler(config, frozenset(), observe), seen, [])
        run.checker = checker
        return run

    def do(self, *ops: Op) -> None:
        for op in ops:
            apply_op(self.model, op, self.admitted)

    @property
    def obs(self) -> Observation:
        return self.seen[-1]

    def request(self, index: int) -> RequestView:
        return self.obs.get_request(self.admitted[index])

    def node(self, node_id: int | None) -> TreeNodeView:
        assert self.obs.tree is not None
        (node,) = [n for n in self.obs.tree.nodes if n.id == node_id]
        return node

    def tree(self) -> list[tuple[int | None, int, tuple[int, ...], int]]:
        """(parent, key length, pages, lock_ref) per node, in creation order."""
        assert self.obs.tree is not None
        return [(n.parent, len(n.key), n.pages, n.lock_ref) for n in self.obs.tree.nodes]

    def sizes(self) -> tuple[int, int]:
        assert self.obs.tree is not None
        return self.obs.tree.evictable_size, self.obs.tree.protected_size

    def free_pages(self) -> set[int]:
        return set(self.obs.allocator.free_pages)


def slots(page_size: int, *pages: int) -> tuple[int, ...]:
    """The row of ``pages``, whole pages."""
    return tuple(page * page_size + k for page in pages for k in range(page_size))


def test_worked_example_page_4_eagle() -> None:
    """Section 1.4's table: A and B, one 6-token prompt, page 4, EAGLE (bigram keys), no
    overlap. The pool's pages are handed out in order 0, 1, 2, ..."""
    run = Run.start(EAGLE_P4)
    run.do(Admit(6, 3, family=0), iterate(4))
    # A prefilled (row [P0 x4, P1 x2]); its result checkpoints up_to=6: K = floor4(5) = 4,
    # the leaf L = [0, 4) on P0, locked by A; A keeps P1 ([4, 6) and the rest of the page).
    a = run.request(0)
    assert (a.prefix_len, a.cache_protected_len, a.kv_committed_len) == (6, 4, 6)
    assert a.row_slots == slots(4, 0, 1)[:6] and a.owned_pages == (1,)
    assert run.tree() == [(None, 4, (0,), 1)] and a.lock_node == run.obs.tree.nodes[0].id
    assert run.sizes() == (0, 4)
    leaf = a.lock_node

    run.do(Admit(6, 3, family=0), iterate(4))
    # B matched the fill's first 5 raw tokens, 4 bigrams: prefix 4 on L, its row's [0, 4)
    # are P0's slots and only [4, 6) is allocated (Q = page 2). Its own checkpoint
    # (up_to=6, K=4) inserts nothing new: L is locked twice.
    b = run.request(1)
    admission = next(o.admission for o in run.seen if o.admission is not None
                     and o.admission.waiting and o.admission.waiting[0][0] == b.rid)
    assert admission.prefixes == (4,)
    assert admission.frees == (6 * 4,)  # 6 free pages; L is A's, locked: nothing evictable
    assert (b.prefix_len, b.cache_protected_len, b.lock_node) == (6, 4, leaf)
    assert b.row_slots == slots(4, 0, 2)[:6] and b.owned_pages == (2,)
    assert run.tree() == [(None, 4, (0,), 2)] and run.sizes() == (0, 4)

    run.do(iterate(4, 1))
    # Both decode (each reserves to 16: A takes pages 3, 4, B 5, 6). A accepts 4, shows 2
    # (max_new_tokens 3) and finishes with owned_kv_len = min(6 + 4, 6 + 3) = 9: its
    # checkpoint up_to=9 keys floor4(8) = 8 positions, [4, 8) on P1 a new leaf L2 under L;
    # it frees [8, 9)'s page and the rest (pages 3, 4) and unlocks L2 and L.
    a, b = run.request(0), run.request(1)
    assert a.finished and (a.cached_len, a.inserted_len, a.cache_protected_len) == (9, 8, 8)
    assert a.lock_node is None and not a.owned_pages
    assert run.tree() == [(None, 4, (0,), 1), (leaf, 4, (1,), 0)]
    assert run.sizes() == (4, 4)  # L2 evictable, L protected by B
    assert (b.kv_committed_len, b.output_len, b.owned_pages) == (7, 2, (2, 5, 6))
    assert run.free_pages() == {3, 4, 7}

    run.do(iterate(1))
    # B finishes: owned = min(7 + 1, 6 + 3) = 8, K = floor4(7) = 4: nothing new is keyed;
    # its own pages are freed and L unlocked. The tree keeps both nodes, evictable.
    b = run.request(1)
    assert b.finished and (b.cached_len, b.inserted_len, b.cache_protected_len) == (8, 4, 4)
    assert run.tree() == [(None, 4, (0,), 0), (leaf, 4, (1,), 0)]
    assert run.sizes() == (8, 0)
    assert run.free_pages() == {2, 3, 4, 5, 6, 7}


def test_worked_example_page_1_plain() -> None:
    """The same at page 1 without speculation: keys are the raw tokens, K = up_to. B's match
    (2 of 3, capped at input_len - 1) splits A's leaf; B's checkpoint then finds its third
    token's page already in the tree (the duplicate is freed, B's row repointed)."""
    run = Run.start(PLAIN_P1)
    run.do(Admit(3, 2, family=0), iterate())
    a = run.request(0)
    assert (a.cache_protected_len, a.row_slots, a.owned_pages) == (3, (0, 1, 2), ())
    assert run.tree() == [(None, 3, (0, 1, 2), 1)] and run.sizes() == (0, 3)
    whole = a.lock_node

    run.do(Admit(3, 2, family=0))
    # The admission's match splits L at 2: a new parent L' (pages 0, 1) keeps the lock.
    run.do(iterate())
    b = run.request(1)
    admission = next(o.admission for o in run.seen if o.admission is not None
                     and o.admission.waiting and o.admission.waiting[0][0] == b.rid)
    assert admission.prefixes == (2,)
    # B's prefill wrote [2, 3) on page 3, its result keyed [0, 3): position 2 was the tree's
    # (page 2), so page 3 is freed and the row points at page 2.
    assert (b.cache_protected_len, b.row_slots, b.owned_pages) == (3, (0, 1, 2), ())
    assert b.lock_node == whole == a.lock_node
    top = run.node(whole).parent
    assert run.tree() == [(top, 1, (2,), 2), (None, 2, (0, 1), 2)]
    assert run.sizes() == (0, 3) and 3 in run.free_pages()

    run.do(iterate())
    # Both finish (max_new_tokens 2) with owned = 4: each keys its first output's position,
    # a leaf of its own under L (the outputs differ by request); every lock is gone.
    a, b = run.request(0), run.request(1)
    assert a.finished and b.finished and a.inserted_len == b.inserted_len == 4
    assert [(length, lock) for _, length, _, lock in run.tree()] == [(1, 0), (2, 0), (1, 0),
                                                                       (1, 0)]
    assert run.sizes() == (5, 0)
    assert len(run.free_pages()) == run.obs.allocator.total_pages - 5


def test_dedup_of_two_identical_prompts_prefilled_together() -> None:
    """A and B, one prompt, admitted in one prefill: both match nothing and prefill their own
    copy. A's checkpoint inserts L = P0; B's finds L, frees its own first page as a
    duplicate and repoints row[0:4] to P0 (unified_radix_cache.py:1287-1299)."""
    before: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def remember(obs: Observation) -> None:
        if obs.point is ObservationPoint.PREPARE_FOR_EXTEND:
            before.extend((r.row_slots, r.owned_pages) for r in obs.requests)

    run = Run.start(EAGLE_P4, also=remember)
    run.do(Admit(6, 3, family=0), Admit(6, 3, family=0), iterate())
    assert before == [(slots(4, 0, 1)[:6], (0, 1)), (slots(4, 2, 3)[:6], (2, 3))]
    a, b = run.request(0), run.request(1)
    assert a.cache_protected_len == b.cache_protected_len == 4
    assert a.lock_node == b.lock_node is not None
    assert b.row_slots == slots(4, 0, 3)[:6] and b.owned_pages == (3,)
    assert run.tree() == [(None, 4, (0,), 2)]
    assert 2 in run.free_pages()  # B's duplicate of P0
    assert set(run.obs.allocator.tree_pages) == {0}


def test_retraction_of_a_shared_prefix_and_its_rematch() -> None:
    """B holds A's prompt page as its prefix and is retracted while A still runs: it frees
    only its own pages, unlocks L (A keeps it locked, so nothing is evicted), and comes back
    to re-match the same prefix (fill = prompt + its one output: 7 tokens, 6 matched raw,
    5 bigrams, 4 keyed), prefilling only past it."""
    run = Run.start(EAGLE_P4, {"kv_tokens": 64})
    run.do(Admit(6, 8, family=0), iterate(), Admit(6, 8, family=0), iterate())
    leaf = run.request(0).lock_node
    assert run.request(1).lock_node == leaf and run.node(leaf).lock_ref == 2
    free_before = run.free_pages()
    b_pages = run.request(1).owned_pages
    # A forced retraction: the policy takes the later of two equal requests, B.
    run.do(iterate(1, 1, retract=1, allow_prefill=False))
    b, obs = run.request(1), run.obs
    assert obs.tree is not None
    assert b.is_retracted and not b.holds_kv and b.waiting
    assert (b.cache_protected_len, b.prefix_len, b.lock_node) == (0, 0, None)
    assert run.node(leaf).lock_ref == 1 and run.tree()[0] == (None, 4, (0,), 1)
    assert set(b_pages) <= run.free_pages() | set(run.request(0).owned_pages)
    assert free_before | set(b_pages) >= run.free_pages()
    assert obs.tree.protected_size == 4

    run.do(iterate(1))  # B is prefilled again
    b = run.request(1)
    admission = [o.admission for o in run.seen if o.admission is not None
                 and o.admission.waiting and o.admission.waiting[0][0] == b.rid][-1]
    assert admission.prefixes == (4,)
    assert b.kv_committed_len == 7 and b.cache_protected_len == 4 and b.lock_node == leaf
    assert b.row_slots[:4] == slots(4, 0) and run.node(leaf).lock_ref == 2
    # Its ghost started at the matched prefix: the forward wrote [4, 7) only.
    assert b.ghost.kv_len_true == 7


def test_retraction_evicts_what_it_unlocked() -> None:
    """A retraction's ``release_req`` evicts at once for remaining x 20 tokens' shortfall
    (schedule_batch.py:2389-2392): with another family running, the victim's prompt node,
    unlocked and evictable, is evicted at once when the free pages fall short."""
    run = Run.start(EAGLE_P4, {"kv_tokens": 28})
    run.do(Admit(5, 8, family=1), iterate(), Admit(6, 3, family=0), iterate())
    victim = run.request(1)
    assert victim.lock_node is not None and run.node(victim.lock_node).lock_ref == 1
    run.do(iterate(1, 1, retract=1, allow_prefill=False))
    assert run.request(1).is_retracted
    # 1 remaining request x 20 tokens = 5 pages; the free list fell short of that, so
    # the unlocked leaf went; the runner's own path stays (locked).
    assert victim.lock_node not in {n.id for n in run.obs.tree.nodes}
    assert run.node(run.request(0).lock_node).lock_ref == 1


@pytest.mark.parametrize(("cell", "tree"), [
    # prompt 5, output 4: owned 8 keyed at once; the prompt's end splits the leaf at 5...
    ("nov-p1-none-radix", [(2, 3, (5, 6, 7), 0), (None, 5, (0, 1, 2, 3, 4), 0)]),
    # ... at page 4 at its page-aligned key, 4 (the output's page a leaf of its own).
    ("nov-p4-none-radix", [(2, 4, (1,), 0), (None, 4, (0,), 0)]),
])
def test_prompt_boundary_split(cell: str, tree: list[tuple[int | None, int, tuple[int, ...],
                                                           int]]) -> None:
    """A PD-decode request is never prefilled here, so nothing is checkpointed before its
    finish: the release's one insert keys prompt and output together, and the second insert
    of the page-aligned prompt key splits the leaf there "so eviction can drop the output KV
    without the prompt" (unified_radix_cache.py:1257-1282)."""
    run = Run.start(cell)
    run.do(AdmitPrebuilt(5, 4), *[iterate()] * 5)
    request = run.request(0)
    assert request.finished and request.cached_len == request.inserted_len == 8
    assert run.tree() == tree and run.sizes() == (8, 0)


def test_a_mixed_decode_writes_below_the_checkpoint_it_follows() -> None:
    """The release's order, mirrored: ``mix_with_running`` sets a running request's
    ``extend_end`` to its decode's length (schedule_batch.py:3274-3284) before its prefill's
    result is processed, and that result's checkpoint keys up to ``extend_end``
    (``checkpoint_kv_cache``, common.py:271-280). Processed early (``disable_overlap``), the
    prefill of 7 tokens at page 4 is keyed to 8, both pages, before the mixed batch's decode
    row writes position 7: the tree holds a page whose last KV is not yet written (under
    overlap the write is launched just before the checkpoint). The reference does not flag
    a write below ``cache_protected_len``: it keeps the release's order."""
    run = Run.start("ov-p4-none-radix", {"chunked_prefill_size": 8, "mixed_chunk": 1})
    run.do(Admit(7, 4, family=0), iterate(), Admit(5, 2, family=1))
    start = len(run.seen)
    run.do(Iterate(IterationChoices(disable_overlap=True)))
    (launch,) = [o for o in run.seen[start:] if o.point is ObservationPoint.LAUNCH]
    assert launch.launch is not None and launch.launch.forward_mode == "mixed"
    decode = next(m for m in launch.launch.members if m.rid == run.admitted[0])
    assert decode.seq_len == 8  # it writes position 7
    assert launch.get_request(run.admitted[0]).cache_protected_len == 8


def test_checkpoint_guard() -> None:
    """The tree never takes back a protected prefix, nor keys past the committed KV."""
    record = relation.prepare_for_extend(relation.admit(RequestId(1), TokenCount(6),
                                                        TokenCount(3)), PoolRow(1), None, 4)
    assert (record.prefix_len, record.cache_protected_len, record.ghost.kv_len_true) == (4, 4, 4)
    for bad in (0, 7):
        with pytest.raises(GuardViolation, match="checkpoint_into_tree"):
            relation.checkpoint_into_tree(record, bad)
    released = relation.release_kv_cache(record, get_cell(EAGLE_P4), False)
    with pytest.raises(GuardViolation, match="holds_kv"):
        relation.checkpoint_into_tree(released, 4)
    with pytest.raises(GuardViolation, match="extend"):  # a prefix covering the whole fill
        relation.prepare_for_extend(relation.admit(RequestId(1), TokenCount(6), TokenCount(3)),
                                    PoolRow(1), None, 6)


def _family_ops(config: ModelConfig, seed: int, count: int) -> list[Op]:
    """generate_random_ops' draw with each prompt in one of two families (so prompts share)."""
    rng = random.Random(seed)
    return [replace(op, family=rng.randrange(2)) if isinstance(op, Admit) else op
            for op in generate_random_ops(config, rng, count)]


SIZES = [{}, {"chunked_prefill_size": 4}, {"kv_tokens": 64, "max_running_requests": 4},
         {"chunked_prefill_size": 8, "mixed_chunk": 1}]


def check_tree_agrees(obs: Observation) -> None:
    """What the reference keeps of the tree agrees with the tree: each holding request's lock
    is on the path of exactly its protected prefix and its row below it holds that path's
    slots, and the tree's sizes are its unlocked and locked nodes' keys."""
    tree = obs.tree
    assert tree is not None
    p = obs.allocator.page_size
    for r in obs.get_holding():
        path = tree.get_path(r.lock_node)
        assert sum(len(n.key) for n in path) == r.cache_protected_len, r
        pages = [page for n in path for page in n.pages]
        assert r.row_slots[:r.cache_protected_len] == slots(p, *pages), r
    assert tree.evictable_size == sum(len(n.key) for n in tree.nodes if n.lock_ref == 0)
    assert tree.protected_size == sum(len(n.key) for n in tree.nodes if n.lock_ref > 0)


@pytest.mark.parametrize("cell", [c.name for c in enumerate_radix_cells()])
def test_every_invariant_holds_on_random_scripts_with_families(cell: str) -> None:
    """Random scripts whose prompts share (two families) pass every invariant in every radix
    cell, with and without chunked prefill and with a larger pool, and the reference's
    prefixes, rows and locks agree with its tree throughout; and every RX invariant is
    exercised in every radix cell, at the default sizes alone (a witness that does not
    depend on the larger runs)."""
    exercised: Counter[str] = Counter()
    for sizes in SIZES:
        if check_sizes(Script(cell, "minimal", sizes=dict(sizes)).get_config()) is not None:
            continue  # mixed chunks: not in a spec cell without the CPU mirror
        for seed in range(6):
            run = Run.start(cell, dict(sizes), also=check_tree_agrees)
            for index, op in enumerate(_family_ops(run.config, seed, 40)):
                run.model.set_step_index(index)
                try:
                    run.do(op)
                except InvariantViolation as violation:
                    raise AssertionError(f"sizes {sizes}, seed {seed}: {violation}") from None
            if not sizes and run.checker is not None:
                exercised.update(run.checker.exercised)
    vacuous = [inv.id for inv in INVARIANTS if inv.id.startswith("RX") and not exercised[inv.id]]
    assert not vacuous, f"no witness in {cell} for {vacuous}"


def test_sharing_happens_in_random_scripts() -> None:
    """The random scripts above do share: over the cells and seeds they run at the default
    sizes, some admissions match a prefix and some requests hold a lock another request
    holds too (the count is over them all: in one cell a few seeds may share nothing)."""
    prefixes = shared = 0
    for cell in enumerate_radix_cells():
        config = Script(cell.name, "minimal").get_config()
        for seed in range(6):
            seen: list[Observation] = []
            model = Scheduler(config, frozenset(), seen.append)
            admitted: list[RequestId] = []
            for op in _family_ops(config, seed, 40):
                apply_op(model, op, admitted)
            prefixes += sum(1 for o in seen
                            if o.admission is not None and any(o.admission.prefixes))
            shared += sum(1 for o in seen if o.tree is not None
                          and any(n.lock_ref > 1 for n in o.tree.nodes))
    assert prefixes > 0 and shared > 0


def _admission(prefixes: tuple[int, ...], frees: tuple[int, ...]) -> Observation:
    """One waiting request (fill 12, max_new_tokens 4) admitted from 20 free tokens at page 4:
    it asks 12 + 4 + 4 = 20, which fits only past a matched prefix."""
    view = AdmissionView(0.7, 20, 2, (), ((RequestId(0), 12, 4, 0),), 1, ends=(12,),
                         prefixes=prefixes, frees=frees)
    batch = BatchView("extend", (RequestId(0),), (12,), (12,), 12, (PoolRow(1),),
                      (PoolRow(1),), None, None)
    return Observation(point=ObservationPoint.PREPARE_FOR_EXTEND, step_index=0, requests=(),
                       batch=batch, allocator=None, races=(),  # type: ignore[arg-type]
                       admission=view)


def test_kv11_reads_the_prefix_and_the_free_term_per_candidate() -> None:
    """KV11 charges the extend past the matched prefix and judges each candidate against the
    free KV its own check saw: the admission holds with both, and fails without the prefix
    (the whole fill asked) or with a free term its own pin shrank."""
    config = Script(EAGLE_P4, "minimal").get_config()
    kv11 = get_invariant("KV11")
    assert kv11.check(config, _admission((8,), (20,))) == 1
    with pytest.raises(InvariantViolation, match="admitted asking 20 tokens"):
        kv11.check(config, _admission((), ()))
    with pytest.raises(InvariantViolation, match="admitted asking 12 tokens, 8.000 left"):
        kv11.check(config, _admission((8,), (8,)))


@pytest.mark.parametrize("cell", ["ov-p1-none-radix", EAGLE_P4])
def test_flush_cache_runs_only_at_full_idle_and_leaves_the_first_state(cell: str) -> None:
    """``flush_cache`` (scheduler.py:5518) is refused, changing nothing, while a request waits,
    runs or is in the batch in flight (the overlap's last batch: #12107's case); at full idle
    it resets the tree and hands out rows and pages in their first order again, and RX8
    judges the state it leaves."""
    admissions: list[AdmissionView] = []
    run = Run.start(cell, also=lambda obs: admissions.extend(
        [obs.admission] if obs.admission is not None else []))
    run.do(Admit(6, 2, family=0), iterate(allow_prefill=False))
    assert run.request(0).waiting and not run.model.flush_cache()  # waiting
    run.do(iterate())
    before = run.model.get_observable_state()
    assert not run.model.flush_cache()  # the prefill in flight (or its request running)
    assert run.model.get_observable_state() == before
    refused = 1
    for _ in range(8):
        run.do(iterate())
        if run.model.flush_cache():
            break
        refused += 1
    else:
        raise AssertionError("never fully idle")
    assert refused >= 2 and run.request(0).finished
    assert run.obs.point is ObservationPoint.FLUSH_CACHE
    assert run.tree() == [] and run.sizes() == (0, 0)
    alloc = run.obs.allocator
    assert alloc.free_pages == tuple(range(alloc.total_pages)) and not alloc.tree_pages
    assert alloc.free_pool_rows == tuple(PoolRow(r) for r in range(1, alloc.pool_rows + 1))
    assert run.checker is not None and run.checker.exercised["RX8"] == 1
    # The same prompt again: nothing to match, the first row and the first pages.
    assert admissions[0].prefixes == (0,)
    admissions.clear()
    run.do(Admit(6, 2, family=0), iterate())
    again = run.request(1)
    assert admissions[0].prefixes == (0,) and again.req_pool_idx == 1
    page = run.config.page_size
    assert again.row_slots == slots(page, *range(-(-6 // page)))[:6]


def test_non_radix_cells_show_no_tree() -> None:
    """A cell without the radix cache keeps its sink: no tree in the observation, no family,
    no protected prefix."""
    script = Script(get_cell("nov-p4-v2chain-cpu-honest").name, "minimal",
                    [Admit(6, 3, family=0), iterate(), Admit(6, 3, family=0), iterate()])
    seen: list[Observation] = []
    model = Scheduler(script.get_config(), frozenset(), seen.append)
    admitted: list[RequestId] = []
    for op in script.ops:
        apply_op(model, op, admitted)
    assert all(o.tree is None for o in seen)
    assert all(r.cache_protected_len == 0 and r.lock_node is None and r.prompt_family is None
               for o in seen for r in o.requests)


def test_cells_lists_the_radix_cells_with_the_serving_defaults_marked(
        capsys: pytest.CaptureFixture[str]) -> None:
    from overlap_spec.harness.cli import main

    assert main(["cells", "--radix"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [c.name for c in enumerate_radix_cells()]
    marked = {line.split()[0] for line in lines if line.endswith("serving default")}
    assert marked == {c.name for c in enumerate_radix_cells() if c.overlap}
