"""alloc_for_extend / alloc_for_decode / release_kv_cache (upstream mem_cache/common.py),
and in a radix cell the prefix cache's match, checkpoint and release
(``docs/upstream-radix-sharing.md`` sections 1 and 2).

All allocator and req_to_token writes happen on the schedule stream (S).
"""

from __future__ import annotations

from overlap_spec.reference.memory import OutOfMemory, RadixCache, TreeCache
from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import Runtime
from overlap_spec.spec import relation
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.radix import Node, RadixTree
from overlap_spec.spec.transitions import (
    RETRACT_DECODE_STEPS,
    compute_first_own_page,
    compute_inserted_len,
    compute_ns_decode_pages_needed,
    compute_pages_for_len,
    compute_v2_decode_pages_needed,
)
from overlap_spec.spec.units import PageId


def alloc_pages(rt: Runtime, pages: int) -> list[PageId]:
    """Evict the tree first if short, then allocate (``alloc_token_slots`` / paged)."""
    rt.tree.evict(pages, rt.allocator)
    return rt.allocator.alloc(pages)


def get_available_pages(rt: Runtime) -> int:
    return rt.allocator.available_size() + rt.tree.evictable_size()


def get_radix(rt: Runtime) -> RadixTree | None:
    """The prefix tree of a radix cell; None where the tree cache is a sink."""
    return rt.tree.tree if isinstance(rt.tree, RadixCache) else None


def match_prefix(rt: Runtime, req: Req) -> tuple[int, Node]:
    """``init_next_round_input`` / ``match_kv_cache`` (schedule_batch.py:1692-1745,
    common.py:216-268): the fill ids capped at ``input_len - 1`` raw tokens
    (``_compute_max_prefix_len``), keyed (bigrams under EAGLE, whole pages) and matched:
    the prefix length and its deepest node (a split where it ends inside one)."""
    radix = get_radix(rt)
    assert radix is not None
    tokens = req.get_fill_tokens()
    return radix.match(radix.make_key(tokens[:len(tokens) - 1]))


def write_row_columns(rt: Runtime, req: Req, start: int, end: int, operation: str) -> None:
    """``req_to_token[row, start:end] = slots`` on S; slots come from the request's pages."""
    if end <= start:
        return
    assert req.req_pool_idx is not None
    p = rt.config.page_size
    row = rt.req_to_token.rows[req.req_pool_idx]
    for column in range(start, min(end, len(row))):
        row[column] = req.pages[column // p] * p + column % p
    rt.hb.write(SCHEDULE, ("req_to_token", req.req_pool_idx), operation)


def back_columns(rt: Runtime, req: Req, start: int, operation: str) -> None:
    """Back the columns the relation just allocated, [start, kv_allocated_len), with pages
    and record them in the row (``alloc_token_slots`` / paged, then the row write)."""
    p = rt.config.page_size
    extra = compute_pages_for_len(req.kv_allocated_len, p) - len(req.pages)
    if extra > 0:
        req.pages.extend(alloc_pages(rt, extra))
    write_row_columns(rt, req, start, req.kv_allocated_len, operation)


def alloc_for_extend(rt: Runtime, req: Req, extend_end: int | None = None) -> None:
    """One pool row, pages for the extend's positions; committed = allocated = its end
    (fill_len unless a chunk). The chunked request's next chunk keeps its row (the release's
    ``ReqToTokenPool.alloc`` reuses a held one) and backs only the new columns."""
    if req.holds_kv:
        assert extend_end is not None, "a continuing chunk needs its end"
        allocated = req.kv_allocated_len
        req.apply(relation.prepare_next_chunk, extend_end, rt.faults)
        back_columns(rt, req, allocated, "alloc_for_extend")
        return
    row = rt.req_to_token.alloc()
    if row is None:
        raise OutOfMemory("no free req_to_token row")
    # A radix cell's admission locked the matched prefix: the row's [0, prefix_len) are
    # the tree path's slots, and only the extend past it is allocated (allocation.py:363-488).
    radix = get_radix(rt)
    prefix = [] if radix is None or req.lock is None else radix.get_path_pages(req.lock)
    req.apply(relation.prepare_for_extend, row, extend_end, len(prefix) * rt.config.page_size,
              rt.faults)
    req.pages = prefix
    back_columns(rt, req, 0, "alloc_for_extend")


def alloc_for_decode(rt: Runtime, req: Req, seq_len: int) -> None:
    """Non-spec decode: one slot at column ``seq_len``; committed and allocated += 1
    (spec.relation.prepare_for_decode)."""
    allocated = req.kv_allocated_len
    req.apply(relation.prepare_for_decode, seq_len)
    back_columns(rt, req, allocated, "alloc_for_decode")


def evict_for_batch(rt: Runtime, tokens: int, requests: int) -> None:
    """A radix cell's eviction before a batch's allocation, for the release's demand: on
    pages > 1 the batch's new tokens plus a page per request (``alloc_paged_token_slots_
    extend`` / ``_decode``, allocation.py:186-199,582-585; a decode's new tokens are 0);
    on page 1 the new tokens alone (``alloc_token_slots``), which the per-request
    allocations evict for anyway. Elsewhere nothing: the sink evicts when it allocates."""
    p = rt.config.page_size
    if get_radix(rt) is not None and p > 1 and requests:
        rt.tree.evict(compute_pages_for_len(tokens + requests * p, p), rt.allocator)


def get_spec_decode_demand(rt: Runtime, reqs: list[Req]) -> int:
    """``num_needed_tokens`` of ``alloc_for_spec_decode``: what the batch's reserve targets
    add to its allocations (the relation's own target, read without applying it)."""
    cfg = rt.config
    targets = [relation.prepare_for_decode_spec_v2(req.state, rt.get_decode_reserve(),
                                                   cfg.page_size, cfg.cell.preclaim,
                                                   rt.faults).kv_allocated_len
               for req in reqs]
    return sum(t - req.kv_allocated_len for t, req in zip(targets, reqs, strict=True))


def alloc_for_decode_spec_v2(rt: Runtime, req: Req) -> None:
    """Spec v2: grow to the reserve target (spec.relation.prepare_for_decode_spec_v2)."""
    cfg = rt.config
    allocated = req.kv_allocated_len
    req.apply(relation.prepare_for_decode_spec_v2, rt.get_decode_reserve(), cfg.page_size,
              cfg.cell.preclaim, rt.faults)
    back_columns(rt, req, allocated, "prepare_for_decode")


def get_decode_pages_needed(rt: Runtime, req: Req, seq_len: int) -> int:
    """Per-request term of ``new_tokens_required_next_decode`` (in pages)."""
    cfg = rt.config
    if not cfg.cell.is_spec:
        return compute_ns_decode_pages_needed(seq_len, cfg.page_size)
    return compute_v2_decode_pages_needed(req.kv_committed_len, req.kv_allocated_len,
                                          rt.get_decode_reserve(), cfg.page_size)


def release_kv_cache(rt: Runtime, req: Req, is_insert: bool) -> None:
    """Release a request's KV once: the whole pages of the cached length to the tree
    (finish), the rest freed (a radix cell: :func:`release_into_tree`).

    The record's update is spec.relation.release_kv_cache; here the memory follows it:
    the pool row and the pages the row records are freed, and with ``is_insert`` the
    pages the release's tree keys from the cached length (compute_inserted_len: whole
    pages, one position short under EAGLE) go to the tree cache; the partial page is freed
    (common.py:433). Upstream finds the pages to free in
    ``req_to_token[row, :kv_allocated_len]`` (``_release_overallocated_kv_indices``), so a
    page past a shrunk allocation (B12's stranded tail) is never freed: it leaks (KV7).
    """
    if isinstance(rt.tree, RadixCache):
        release_into_tree(rt, rt.tree.tree, req, is_insert)
        return
    assert isinstance(rt.tree, TreeCache)
    row = req.req_pool_idx
    cell = rt.config.cell
    recorded_pages = compute_pages_for_len(req.kv_allocated_len, cell.page_size)
    # its guard: released twice
    req.apply(relation.release_kv_cache, cell, is_insert, rt.faults)
    assert row is not None
    cached = req.cached_len if is_insert else None
    inserted = 0 if cached is None else compute_inserted_len(cell, cached)
    inserted_pages = inserted // cell.page_size
    req.inserted_len = None if req.cached_len is None else inserted
    rt.tree.cache_finished_req(req.pages[:inserted_pages])
    rt.allocator.free(req.pages[inserted_pages:recorded_pages])
    rt.req_to_token.free(row)
    req.pages = []


def checkpoint_kv_cache(rt: Runtime, req: Req, up_to: int, finish: bool = False
                        ) -> int:
    """``checkpoint_into_tree`` (unified_radix_cache.py:1164-1318), of a radix cell: the fill
    ids up to ``up_to`` are keyed (K positions: whole pages, one short under EAGLE) and
    inserted with the row's pages, ``cache_protected_len`` as ``prev_prefix_len``; the pages
    the tree already held are freed (duplicates) and row[cpl, K) repointed to the tree's
    path; the leaf is split at the prompt's page-aligned end (:1257-1282); the lock moves
    onto the insert's node and K becomes the protected prefix. Returns K."""
    radix = get_radix(rt)
    assert radix is not None
    p = rt.config.page_size
    tokens = (req.get_fill_tokens() + list(req.hidden_ids))[:up_to]
    if not tokens:  # effective_cache_len <= 0: nothing changes (:1219-1224)
        return req.cache_protected_len
    key = radix.make_key(tokens)
    inserted, protected = len(key), req.cache_protected_len
    # B32: a finish's insert is handed the key uncut, with the whole pages' values.
    handed = (radix.make_key(tokens, whole_pages=False) if finish and rt.has_fault("B32")
              else key)
    _, node, duplicates = radix.insert(handed, req.pages[:inserted // p], protected)
    rt.allocator.free(duplicates)
    prompt_key = radix.make_key(req.get_fill_tokens()[:req.prompt_len])
    if 0 < len(prompt_key) < inserted:
        radix.insert(prompt_key, req.pages[:len(prompt_key) // p], len(prompt_key))
    path = radix.get_path_pages(node)
    assert len(path) * p == inserted, f"path of {len(path)} pages, key of {inserted}"
    if not rt.has_fault("B29"):  # B29: the duplicates are freed, the row still names them
        req.pages[protected // p:inserted // p] = path[protected // p:]
        write_row_columns(rt, req, protected, inserted, "checkpoint_into_tree")
    if not rt.has_fault("B30"):  # B30: the lock stays on the node the request held before
        if req.lock is not None:
            radix.unlock(req.lock)
        req.lock = radix.lock(node)
    req.apply(relation.checkpoint_into_tree, inserted)
    return inserted


def release_into_tree(rt: Runtime, radix: RadixTree, req: Req, is_insert: bool) -> None:
    """``release_kv_cache`` of a radix cell (common.py:400-476; the table of section 1.4): a
    finish or a running abort (``is_insert``, checkpoint=True) first checkpoints up to
    ``owned_kv_len`` (the relation's cached length); then the request's own pages, from
    ``cache_protected_len`` to the allocation's end, are freed and its lock dropped. The
    prefix below it is the tree's: unlocked, never freed here."""
    p = rt.config.page_size
    row = req.req_pool_idx
    assert row is not None
    recorded_pages = compute_pages_for_len(req.kv_allocated_len, p)
    owned = relation.release_kv_cache(req.state, rt.config.cell, is_insert, rt.faults).cached_len
    inserted = checkpoint_kv_cache(rt, req, owned, finish=True) if is_insert and owned else 0
    req.apply(relation.release_kv_cache, rt.config.cell, is_insert, rt.faults)
    req.inserted_len = None if req.cached_len is None else inserted
    first_own = compute_first_own_page(req.cache_protected_len, req.matched_len, p, rt.faults)
    rt.allocator.free(req.pages[first_own:recorded_pages])
    if req.lock is not None:
        if not rt.has_fault("B26"):  # B26: the release leaves its lock behind (#32170)
            radix.unlock(req.lock)
        req.lock = None
    rt.req_to_token.free(row)
    req.pages = []


def evict_after_retract(rt: Runtime, remaining: int) -> None:
    """``release_req`` (schedule_batch.py:2389-2392): a retraction uses what it made evictable
    at once, evicting for the shortfall of ``remaining`` x SGLANG_RETRACT_DECODE_STEPS
    tokens (``evict_from_tree_cache``). Only a radix cell's tree evicts here."""
    if get_radix(rt) is not None:
        rt.tree.evict(compute_pages_for_len(remaining * RETRACT_DECODE_STEPS,
                                            rt.config.page_size), rt.allocator)

