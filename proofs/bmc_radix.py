"""The BMC's bounded radix tree (cells with ``radix``): ``reference/mem_cache.py``'s match,
checkpoint, release and eviction over symbolic requests of one prompt family, and the RX
claims (``spec/invariants/rx.py``) checked on it.

The abstraction. Every request of the unrolling belongs to one family (the decoder admits
them with ``Admit(family=0)``), so their prompts agree wherever both have a token, and an
output token (1..97) never equals a prompt token (100..899): a request's key leaves the
family's key at its divergence ``d`` (``prompt_len``, one less under EAGLE's bigrams). The
tree is then, in whole pages::

    root - trunk page 0 - trunk page 1 - ... - trunk page trunk-1      (shared, <= T pages)
                              \\ branch of r_b (D_b = d_b // page pages down the trunk)

- the **trunk**: the family's key, ``trunk`` pages held (a prefix: eviction takes leaves,
  an insert fills from the root), one lock count per page (``lock0`` .. ``lock{T-1}``),
  T = the widest prompt's shared pages (``get_trunk_bound``);
- per request a private **branch** below trunk page ``D_b - 1``: ``branch`` pages held,
  its lock count ``branch_ref`` over its first ``branch_locked`` pages (one count: exact
  while the request holds at most one lock, which RX2 keeps so up to its first violation);
- the allocator's ``free`` pages and the tree's ``evictable`` / ``protected`` counters
  (moved by the lock walks, as ``spec/radix.py``'s are);
- per request: ``cpl`` (cache_protected_len), ``matched`` (the prefix admission matched),
  its lock anchor (``has_lock``, ``lock_trunk`` trunk pages and ``lock_branch`` branch
  pages of its locked path), ``row_path`` (how many leading pages of its row are the
  tree's pages on its key) and ``extend_end``. Its own pages are ``page_count - cpl / p``.

Transitions, as the reference makes them: the match and lock per admission candidate
(``match_prefix``: the key over ``fill - 1`` tokens, whole pages); the prefill
allocation of the extend past the prefix; the checkpoint at prefill completion and the
finish release's (insert, duplicates freed, the row repointed, the lock moved, cpl = K);
the finish's free of ``[cpl, allocated)`` and unlock; a retraction's free from cpl and
unlock. Requests in one result are checkpointed in rid order: the counts an insert
leaves do not depend on the order (the first to insert a trunk page gives it, the others
free theirs as duplicates).

Abstracted: node boundaries (splits, the prompt-boundary split) are not kept, only pages;
the eviction order (LRU) is a free choice: at each allocation phase the tree evicts any
set of unlocked leaves of at least the phase's shortfall (or every one it can), and at
the decode path's other eviction points (``_fits``, ``release_req``) any such set. That
over-approximates the reference's evictions, never restricts them. Chunked prefill and
aborts are outside the BMC (``proofs/bmc.py``), so the chunk-stash checkpoint and an
abort's release are not modelled here.

``flush_cache`` (the script's ``flush``) is a free choice after each iteration: at full
idle it empties the tree and frees the pool; RX8 judges it.

Faults (catalogue IDs): B26 a release that does not unlock, B27 a release that frees the
row from 0, B28 a release that frees from the admission's match, B29 a checkpoint that
frees duplicates without repointing the row, B30 a checkpoint that keeps the lock on the
pre-insert node, B35 a flush blind to the batch in flight.
"""

from __future__ import annotations

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.bmc_state import (
    BmcState,
    add,
    compute_shared_pages,
    count,
    get_lock_names,
    violate,
)
from overlap_spec.proofs.model import Context, Record
from overlap_spec.proofs.solver import Term
from overlap_spec.proofs.symbolic import lift
from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import Cell

RADIX_IDS = ("RX1", "RX2", "RX3", "RX4", "RX8")
RADIX_FAULTS = ("B26", "B27", "B28", "B29", "B30", "B35")


def is_radix(ctx: Context) -> bool:
    return ctx.config.cell.radix


def compute_match_pages(cell: Cell, fill_len: int) -> int:
    """Pages of the key ``match_prefix`` looks up: the fill capped at ``input_len - 1``
    tokens (``_compute_max_prefix_len``), keyed (bigrams under EAGLE), whole pages."""
    return tr.compute_inserted_len(cell, fill_len - 1) // cell.page_size


def compute_checkpoint_pages(cell: Cell, up_to: int) -> int:
    """Pages ``checkpoint_into_tree`` keys of the first ``up_to`` tokens (K / page)."""
    return tr.compute_inserted_len(cell, up_to) // cell.page_size


def _min(a: Term, b: Term) -> Term:
    return zs.If(a <= b, a, b)


def _page(ctx: Context) -> int:
    return ctx.config.page_size


# ---------------------------------------------------------------------- state
def get_own_pages(ctx: Context, r: Record) -> Term:
    """The pages a holder owns: its row's from cpl on (KV4 with the radix cache)."""
    return r["page_count"] - r["cpl_pages"]


def get_tree_pages(s: BmcState) -> Term:
    return s.glob["trunk"] + zs.Sum([r["branch"] for r in s.reqs])


def get_shared(ctx: Context, r: Record) -> Term:
    return lift(compute_shared_pages, ctx.config.cell, r["prompt_len"])


def get_match_pages(s: BmcState, r: Record) -> Term:
    """``match_prefix``: the held prefix of the request's key, in pages: the trunk, and past
    its divergence its own branch (only a retracted request's key reaches it)."""
    ctx = s.ctx
    fill = lift(tr.compute_fill_len, r["prompt_len"], r["output_len"])
    key = lift(compute_match_pages, ctx.config.cell, fill)
    shared = get_shared(ctx, r)
    trunk = s.glob["trunk"]
    held = zs.If(trunk >= shared, shared + r["branch"], trunk)
    return _min(key, held)


def _split_path(shared: Term, pages: Term) -> tuple[Term, Term]:
    """A path of ``pages`` along a request's key: (trunk pages, branch pages)."""
    on_trunk = _min(pages, shared)
    return on_trunk, pages - on_trunk


def _freed_from(ctx: Context, r: Record) -> Term:
    """Where a release starts freeing the row, in pages: cpl (B27: 0; B28: the match)."""
    if ctx.has("B27"):
        return zs.IntVal(0)
    if ctx.has("B28"):
        return r["matched_pages"]
    return r["cpl_pages"]


def get_available(s: BmcState, pinned: list[Term] | None = None,
                  pinned_pages: list[Term] | None = None,
                  released: list[Term] | None = None) -> Term:
    """``get_available_pages``: free + evictable, after the requests in ``pinned`` lock
    their matched paths (``pinned_pages`` pages each) and those in ``released`` free their
    own pages and unlock (as the release does under the cell's faults)."""
    ctx, g = s.ctx, s.glob
    n = len(s.reqs)
    pin = pinned or [zs.BoolVal(False)] * n
    pages = pinned_pages or [zs.IntVal(0)] * n
    rel = released or [zs.BoolVal(False)] * n
    total = g["free"] + g["evictable"]
    if released is not None:
        total = total + zs.Sum([zs.If(rel[c], r["page_count"] - _freed_from(ctx, r), 0)
                                for c, r in enumerate(s.reqs)])
    unlocks = not ctx.has("B26")
    paths = [_split_path(get_shared(ctx, r), pages[c]) for c, r in enumerate(s.reqs)]
    for j, name in enumerate(get_lock_names(ctx)):
        base = g[name]
        minus = count([zs.And(rel[c], r["has_lock"], r["lock_trunk"] > j)
                       for c, r in enumerate(s.reqs)]) if unlocks else zs.IntVal(0)
        plus = count([zs.And(pin[c], paths[c][0] > j) for c in range(n)])
        after = base - minus + plus
        in_tree = g["trunk"] > j
        total = (total + zs.If(zs.And(in_tree, base > 0, after <= 0), 1, 0)
                 - zs.If(zs.And(in_tree, base <= 0, after > 0), 1, 0))
    for c, r in enumerate(s.reqs):
        base = r["branch_ref"]
        minus = zs.If(zs.And(rel[c], r["has_lock"], r["lock_branch"] > 0), 1, 0) if unlocks \
            else zs.IntVal(0)
        plus = zs.If(zs.And(pin[c], paths[c][1] > 0), 1, 0)
        after = base - minus + plus
        total = (total + zs.If(zs.And(base > 0, after <= 0), r["branch_locked"], 0)
                 - zs.If(zs.And(base <= 0, after > 0), paths[c][1], 0))
    return total


# ---------------------------------------------------------------------- tree operations
def _lock_walk(s: BmcState, b: int, trunk_pages: Term, branch_pages: Term, sign: int,
               when: Term) -> None:
    """``lock`` (sign 1) / ``unlock`` (-1) of request b's path: each page's count moves,
    and a page whose count leaves (reaches) 0 moves from evictable to protected (back)."""
    g, r = s.glob, s.reqs[b]
    for j, name in enumerate(get_lock_names(s.ctx)):
        covered = zs.And(when, trunk_pages > j)
        before = g[name]
        after = before + zs.If(covered, sign, 0)
        moved = zs.And(covered, before == 0) if sign > 0 else zs.And(covered, after == 0)
        g["evictable"] = g["evictable"] - zs.If(moved, sign, 0)
        g["protected"] = g["protected"] + zs.If(moved, sign, 0)
        g[name] = after
    covered = zs.And(when, branch_pages > 0)
    before = r["branch_ref"]
    after = before + zs.If(covered, sign, 0)
    moved = zs.And(covered, before == 0) if sign > 0 else zs.And(covered, after == 0)
    g["evictable"] = g["evictable"] - zs.If(moved, sign * branch_pages, 0)
    g["protected"] = g["protected"] + zs.If(moved, sign * branch_pages, 0)
    r["branch_ref"] = after
    if sign > 0:
        r["branch_locked"] = zs.If(covered, branch_pages, r["branch_locked"])


def lock_request(s: BmcState, b: int, pages: Term, when: Term) -> None:
    r = s.reqs[b]
    on_trunk, on_branch = _split_path(get_shared(s.ctx, r), pages)
    _lock_walk(s, b, on_trunk, on_branch, 1, when)
    r["has_lock"] = zs.If(when, True, r["has_lock"])
    r["lock_trunk"] = zs.If(when, on_trunk, r["lock_trunk"])
    r["lock_branch"] = zs.If(when, on_branch, r["lock_branch"])


def unlock_request(s: BmcState, b: int, when: Term) -> None:
    r = s.reqs[b]
    fires = zs.And(when, r["has_lock"])
    _lock_walk(s, b, r["lock_trunk"], r["lock_branch"], -1, fires)
    r["has_lock"] = zs.If(when, False, r["has_lock"])


def evict(s: BmcState, label: str, when: Term, shortfall: Term | None) -> None:
    """The tree evicts unlocked leaves (order abstracted): a free choice of the trunk and
    branches left, leaf-closed and keeping every locked page; with a ``shortfall`` (an
    allocation's), at least that many pages or all it can."""
    ctx, g = s.ctx, s.glob
    trunk = zs.Int(f"{label}.trunk")
    branches = [zs.Int(f"{label}.r{c}.branch") for c in range(len(s.reqs))]
    keeps = [zs.If(r["branch_ref"] > 0, _min(r["branch_locked"], r["branch"]), 0)
             for r in s.reqs]
    shared = [get_shared(ctx, r) for r in s.reqs]
    facts = [0 <= trunk, trunk <= g["trunk"]]
    for j, name in enumerate(get_lock_names(ctx)):
        facts.append(zs.Implies(zs.And(g[name] > 0, g["trunk"] > j), trunk > j))
    for c, r in enumerate(s.reqs):
        facts += [keeps[c] <= branches[c], branches[c] <= r["branch"],
                  zs.Implies(branches[c] > 0, trunk >= shared[c])]
    add(s, zs.If(when, zs.And(*facts),
                 zs.And(trunk == g["trunk"],
                        *[x == r["branch"] for x, r in zip(branches, s.reqs, strict=True)])))
    evicted = g["trunk"] - trunk + zs.Sum([r["branch"] - x
                                           for x, r in zip(branches, s.reqs, strict=True)])
    if shortfall is not None:
        # Everything evictable is gone: each trunk page left is locked or holds a branch.
        needed = [zs.Implies(trunk > j, zs.Or(g[name] > 0, *[
            zs.And(branches[c] > 0, shared[c] > j) for c in range(len(s.reqs))]))
            for j, name in enumerate(get_lock_names(ctx))]
        all_gone = zs.And(*needed, *[x == k for x, k in zip(branches, keeps, strict=True)])
        add(s, zs.Implies(when, zs.Or(evicted >= shortfall, all_gone)))
    g["free"] = g["free"] + evicted
    g["evictable"] = g["evictable"] - evicted
    g["trunk"] = trunk
    for x, r in zip(branches, s.reqs, strict=True):
        r["branch"] = x


def checkpoint(s: BmcState, b: int, up_to: Term, when: Term) -> Term:
    """``checkpoint_kv_cache`` of request b up to ``up_to`` tokens: insert K pages of its
    key with its row's pages from cpl on; the pages the tree already held past cpl are
    duplicates, freed and the row repointed (B29: not repointed); the new pages become the
    tree's; the lock moves onto the insert's node (B30: stays); cpl = K. Returns K pages."""
    ctx, g, r = s.ctx, s.glob, s.reqs[b]
    pages = lift(compute_checkpoint_pages, ctx.config.cell, up_to)
    fires = zs.And(when, up_to > 0)
    shared = get_shared(ctx, r)
    on_trunk, on_branch = _split_path(shared, pages)
    held_trunk = _min(on_trunk, g["trunk"])
    held_branch = zs.If(zs.And(on_branch > 0, g["trunk"] >= shared),
                        _min(on_branch, r["branch"]), 0)
    held = held_trunk + held_branch
    protected = r["cpl_pages"]
    duplicates = zs.If(held > protected, held - protected, 0)
    added = pages - held
    g["free"] = g["free"] + zs.If(fires, duplicates, 0)
    g["evictable"] = g["evictable"] + zs.If(fires, added, 0)
    g["trunk"] = zs.If(zs.And(fires, on_trunk > g["trunk"]), on_trunk, g["trunk"])
    r["branch"] = zs.If(zs.And(fires, on_branch > r["branch"]), on_branch, r["branch"])
    repointed = zs.If(r["row_path"] >= protected, pages, r["row_path"])
    if ctx.has("B29"):  # the duplicates are freed, the row still points at them
        repointed = zs.If(duplicates > 0, _min(r["row_path"], protected), repointed)
    r["row_path"] = zs.If(fires, repointed, r["row_path"])
    if not ctx.has("B30"):
        unlock_request(s, b, fires)
        lock_request(s, b, pages, fires)
    r["cpl_pages"] = zs.If(fires, pages, r["cpl_pages"])
    return pages


def release(s: BmcState, b: int, pre: Record, when: Term, cached: Term | None) -> None:
    """``release_into_tree``: a finish (``cached``: its owned length) checkpoints first;
    then the row's pages from cpl to the allocation's end are freed and the lock dropped
    (B26: kept on the tree; B27, B28: freed from elsewhere)."""
    r = s.reqs[b]
    if cached is not None:
        checkpoint(s, b, cached, when)
    recorded = pre["page_count"]
    g = s.glob
    g["free"] = g["free"] + zs.If(when, recorded - _freed_from(s.ctx, r), 0)
    if s.ctx.has("B26"):
        r["has_lock"] = zs.If(when, False, r["has_lock"])  # the node keeps the count
    else:
        unlock_request(s, b, when)
    for name in ("cpl_pages", "matched_pages", "row_path", "extend_end"):
        r[name] = zs.If(when, 0, r[name])


def flush_cache(s: BmcState, i: int) -> Term:
    """``Scheduler.flush_cache`` after iteration i (the script's ``flush``): a free choice
    that runs when the scheduler is fully idle, no request waiting or in the
    running batch and no batch in flight (B35: the batch in flight unseen, #12107). It
    empties the tree, frees every page and zeroes every lock and both sizes; RX8 judges
    what it found. Returns whether it ran."""
    ctx, g = s.ctx, s.glob
    busy = [zs.Or(r["waiting"], r["in_running_batch"]) for r in s.reqs]
    if not ctx.has("B35"):
        busy.append(g["last_launched"])  # last_batch, and under overlap its queued result
    ran = zs.And(zs.Bool(f"i{i}.flush"), zs.Not(zs.Or(*busy)))
    violate(s, "RX8", i, "flush_cache", zs.And(ran, zs.Or(*[
        zs.Or(r["waiting"], r["holds_kv"]) for r in s.reqs])),
        zs.And(ran, zs.Or(*[r["finished"] for r in s.reqs])))
    for name in ("trunk", "evictable", "protected", *get_lock_names(ctx)):
        g[name] = zs.If(ran, 0, g[name])
    g["free"] = zs.If(ran, s.kv_pages, g["free"])
    for r in s.reqs:
        for name in ("branch", "branch_ref", "branch_locked"):
            r[name] = zs.If(ran, 0, r[name])
    check_radix(s, i, "flush_cache")
    return ran


# ---------------------------------------------------------------------- checks
def check_radix(s: BmcState, i: int, where: str) -> None:
    """RX1..RX4 on the bounded tree (their page-count forms), after every sub-step (RX8 is
    :func:`flush_cache`'s)."""
    ctx, g = s.ctx, s.glob
    p = _page(ctx)
    tree = get_tree_pages(s)
    own = zs.Sum([zs.If(r["holds_kv"], get_own_pages(ctx, r), 0) for r in s.reqs])
    # RX1: every page free, the tree's or one holder's own: the counts add up to the pool.
    violate(s, "RX1", i, where,
            zs.Or(g["free"] < 0, g["free"] + tree + own != s.kv_pages,
                  *[zs.And(r["holds_kv"], get_own_pages(ctx, r) < 0) for r in s.reqs]),
            tree > 0)
    # RX2: a node's lock count is its holders; no lock without KV; a locked page is held.
    facts = []
    for j, name in enumerate(get_lock_names(ctx)):
        holders = count([zs.And(r["has_lock"], r["lock_trunk"] > j) for r in s.reqs])
        facts.append(zs.And(g[name] == holders, zs.Implies(g[name] > 0, g["trunk"] > j)))
    for r in s.reqs:
        locks_branch = zs.And(r["has_lock"], r["lock_branch"] > 0)
        facts += [zs.Implies(r["has_lock"], r["holds_kv"]),
                  r["branch_ref"] == zs.If(locks_branch, 1, 0),
                  zs.Implies(locks_branch, zs.And(r["branch_locked"] == r["lock_branch"],
                                                  r["lock_branch"] <= r["branch"]))]
    locked = zs.Or(*[g[name] > 0 for name in get_lock_names(ctx)],
                   *[r["branch_ref"] > 0 for r in s.reqs])
    violate(s, "RX2", i, where, zs.Not(zs.And(*facts)), locked)
    # RX3: protected is the locked pages, evictable + protected the tree.
    protected = zs.Sum([zs.If(zs.And(g[name] > 0, g["trunk"] > j), 1, 0)
                        for j, name in enumerate(get_lock_names(ctx))]
                       + [zs.If(r["branch_ref"] > 0, r["branch_locked"], 0) for r in s.reqs])
    violate(s, "RX3", i, where,
            zs.Or(g["protected"] != protected, g["evictable"] + g["protected"] != tree),
            tree > 0)
    # RX4: a holder's cpl is whole pages, at most committed, its locked path's length, and
    # its row below it is that path.
    for b, r in enumerate(s.reqs):
        path = r["lock_trunk"] + r["lock_branch"]
        bad = zs.Or(r["cpl_pages"] * p > r["kv_committed_len"],
                    zs.If(r["has_lock"], path, 0) != r["cpl_pages"],
                    r["row_path"] < r["cpl_pages"])
        violate(s, "RX4", i, f"{where} r{b}", zs.And(r["holds_kv"], bad),
                zs.And(r["holds_kv"], r["cpl_pages"] > 0))
