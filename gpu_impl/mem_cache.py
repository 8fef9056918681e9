"""alloc_for_extend / alloc_for_decode / release_kv_cache (upstream mem_cache/common.py),
and in a radix cell the prefix cache's match, checkpoint, release and evictions
(``docs/upstream-radix-sharing.md`` sections 1 and 2, as ``reference/mem_cache.py`` does).

Allocation is batched as upstream does it: the pages of every request of a prepare are
taken in one allocator call (evicting the tree first if short), then one scatter writes
all new ``req_to_token`` columns and one scatter records the new pages' owner. Taking
them in one call hands out the same pages, in the same order, as one call per request:
both take a prefix of "free list, then evicted chunks in FIFO order", and both evict the
fewest whole chunks that cover the total (an ``OutOfMemory`` is raised in the same
situations, though the reference may have allocated for earlier requests before it).
A radix cell's tree evicts its least recently used unlocked leaves in one fixed order that
no allocation changes, so the same holds: evicting for the total frees the same prefix of
that order as evicting for each request's shortfall in turn, and the free list then hands
out the same pages. All of it runs on the schedule stream.
"""

from __future__ import annotations

from dataclasses import replace

from overlap_spec.gpu_impl.memory import TREE_OWNER, OutOfMemory, RadixCache, TreeCache
from overlap_spec.gpu_impl.req import Req
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.spec.radix import Node, RadixTree
from overlap_spec.spec.transitions import (
    RETRACT_DECODE_STEPS,
    compute_cached_len,
    compute_first_own_page,
    compute_inserted_len,
    compute_ns_decode_pages_needed,
    compute_pages_for_len,
    compute_v2_decode_pages_needed,
)
from overlap_spec.spec.units import PageId


def get_available_pages(rt: Runtime) -> int:
    return rt.allocator.available_size() + rt.tree.evictable_size()


def get_radix(rt: Runtime) -> RadixTree | None:
    """The prefix tree of a radix cell; None where the tree cache is a sink."""
    return rt.tree.tree if isinstance(rt.tree, RadixCache) else None


def match_prefix(rt: Runtime, req: Req) -> tuple[int, Node]:
    """``match_kv_cache`` (schedule_batch.py:1692-1745): the fill ids capped at
    ``input_len - 1`` raw tokens, keyed (bigrams under EAGLE, whole pages) and matched: the
    prefix length and its deepest node (a split where it ends inside one)."""
    radix = get_radix(rt)
    assert radix is not None
    tokens = req.get_fill_tokens()
    return radix.match(radix.make_key(tokens[:len(tokens) - 1]))


def evict_for_batch(rt: Runtime, tokens: int, requests: int) -> None:
    """A radix cell's eviction before a batch's allocation, for the release's demand: on
    pages > 1 the batch's new tokens plus a page per request (``alloc_paged_token_slots_
    extend`` / ``_decode``, allocation.py:186-199,582-585); on page 1 nothing more than the
    allocation's own. Elsewhere nothing: the sink evicts when it allocates."""
    p = rt.config.page_size
    if get_radix(rt) is not None and p > 1 and requests:
        rt.tree.evict(compute_pages_for_len(tokens + requests * p, p), rt.allocator)


def evict_after_retract(rt: Runtime, remaining: int) -> None:
    """``release_req`` (schedule_batch.py:2389-2392): a retraction evicts at once for the
    shortfall of ``remaining`` x SGLANG_RETRACT_DECODE_STEPS tokens (a radix cell only)."""
    if get_radix(rt) is not None:
        rt.tree.evict(compute_pages_for_len(remaining * RETRACT_DECODE_STEPS,
                                            rt.config.page_size), rt.allocator)


def alloc_pages(rt: Runtime, pages: int) -> list[PageId]:
    """Evict the tree first if short, then allocate (``alloc_token_slots`` / paged)."""
    rt.tree.evict(pages, rt.allocator)
    return rt.allocator.alloc(pages)


def grow_to(rt: Runtime, reqs: list[Req], targets: list[int]) -> None:
    """Each request owns pages for ``targets[j]`` positions and its row records them.

    Changes pages, page_owner, req_to_token columns [kv_allocated_len, target) and
    kv_allocated_len (which a target below it shrinks: the B12 mistake, kept as is).
    """
    p = rt.config.page_size
    width = rt.req_to_token_pool.width  # the row as built (B21: narrower than the release's)
    extra = [compute_pages_for_len(t, p) - len(req.pages) for req, t in zip(reqs, targets,
                                                                          strict=True)]
    fresh = alloc_pages(rt, sum(n for n in extra if n > 0)) if any(n > 0 for n in extra) else []
    owned_pages: list[int] = []
    owners: list[int] = []
    rows: list[int] = []
    columns: list[int] = []
    slots: list[int] = []
    for req, target, count in zip(reqs, targets, extra, strict=True):
        if count > 0:
            taken, fresh = fresh[:count], fresh[count:]
            req.pages += taken
            owned_pages += taken
            owners += [req.rid] * count
        new_columns = range(req.kv_allocated_len, min(target, width))
        assert req.req_pool_idx is not None or not new_columns
        rows += [req.req_pool_idx or 0] * len(new_columns)
        columns += new_columns
        slots += [req.pages[c // p] * p + c % p for c in new_columns]
        req.kv_allocated_len = target
    rt.kv.set_owner(owned_pages, owners)
    rt.req_to_token_pool.write(rows, columns, slots)


def alloc_for_extend(rt: Runtime, reqs: list[Req], ends: list[int],
                     fill_lens: list[int]) -> None:
    """A pool row each and pages up to each extend's end (``fill_len``, or a chunk's end);
    committed = allocated = end. The chunked request's next chunk keeps its row (the
    release's ``ReqToTokenPool.alloc`` reuses a held one) and backs only the new columns;
    a chunk short of ``fill_len`` is a middle chunk (``inflight_middle_chunks`` + 1; B18,
    sglang-jax #971, leaves a continuing one uncounted)."""
    counted = [True] * len(reqs)
    radix = get_radix(rt)
    for j, req in enumerate(reqs):
        if req.holds_kv:  # a continuing chunk, from its checkpointed prefix
            assert req.prefix_len == req.extend_end == req.kv_committed_len, (
                f"r{req.rid}: the last chunk is not checkpointed")
            counted[j] = not rt.has_fault("B18")
            continue
        row = rt.req_to_token_pool.alloc()
        if row is None:
            raise OutOfMemory("no free req_to_token row")
        req.req_pool_idx = row
        req.holds_kv = True
        req.kv_allocated_len = 0
        stale = req.prefix_len if rt.has_fault("B36") and req.is_retracted else 0
        req.prefix_len = 0
        if radix is not None:
            # Admission locked the matched prefix: the row's [0, prefix_len) are the tree
            # path's slots (written with the extend's), and only the extend past it is
            # allocated (allocation.py:363-488); both the prefix and cpl start there.
            req.pages = [] if req.lock is None else radix.get_path_pages(req.lock)
            req.prefix_len = req.cache_protected_len = len(req.pages) * rt.config.page_size
        if req.prefix_len < stale < ends[j]:  # B36: the forward's writes start late
            req.prefix_len = stale
    grow_to(rt, reqs, ends)
    for req, end, fill_len, count in zip(reqs, ends, fill_lens, counted, strict=True):
        req.kv_committed_len = end
        req.extend_end = end
        req.inflight_middle_chunks += end < fill_len and count


def alloc_for_decode(rt: Runtime, reqs: list[Req], seq_lens: list[int]) -> None:
    """Non-spec decode: the slot at column ``seq_lens[j]``; committed claimed now."""
    grow_to(rt, reqs, [s + 1 for s in seq_lens])
    for req in reqs:
        req.kv_committed_len += 1


def get_decode_pages_needed(rt: Runtime, req: Req, seq_len: int | None) -> int:
    """Per-request term of ``new_tokens_required_next_decode`` in pages (seq_len: non-spec)."""
    cfg = rt.config
    if not cfg.cell.is_spec:
        assert seq_len is not None
        return compute_ns_decode_pages_needed(seq_len, cfg.page_size)
    return compute_v2_decode_pages_needed(req.kv_committed_len, req.kv_allocated_len,
                                          rt.get_decode_reserve(), cfg.page_size)


def release_kv_cache(rt: Runtime, req: Req, is_insert: bool) -> None:
    """Release once: the whole pages the release's tree keys from the cached length to the
    tree (finish: compute_inserted_len), the rest freed, row cleared.

    kv_committed_len is unchanged; B11 caches kv_committed_len instead of
    ``Req.owned_kv_len()`` (compute_cached_len); B10 caches ``owned_kv_len`` in a trimmed
    finish's cell (#24590).
    """
    assert req.holds_kv and req.req_pool_idx is not None, f"r{req.rid} released twice"
    radix = get_radix(rt)
    if radix is not None:
        release_into_tree(rt, radix, req, is_insert)
        return
    req.release_count += 1
    inserted_pages = 0
    if is_insert:
        rule = (replace(rt.config.cell, trimmed_finish=False) if rt.has_fault("B10")
                else rt.config.cell)
        cached = req.kv_committed_len if rt.has_fault("B11") else compute_cached_len(
            rule, req.kv_committed_len, req.prompt_len, len(req.output_ids),
            req.finished_reason == "abort")
        cached = max(0, min(cached, req.kv_allocated_len))
        # The tree keeps the whole pages of the key (one position short under EAGLE); the
        # partial page is freed with the rest (common.py:433).
        inserted_pages = compute_inserted_len(rt.config.cell, cached) // rt.config.page_size
        req.cached_len = cached
    elif req.finished():  # a chunked request's abort (checkpoint=False): nothing cached
        req.cached_len = 0
    # Only the pages the row records, [0, kv_allocated_len), are found and freed (upstream
    # reads them from req_to_token); a page stranded past a shrunk allocation leaks (B12).
    recorded_pages = compute_pages_for_len(req.kv_allocated_len, rt.config.page_size)
    rt.kv.set_owner(list(req.pages), [-1] * len(req.pages))
    assert isinstance(rt.tree, TreeCache)
    rt.tree.cache_finished_req(req.pages[:inserted_pages])
    rt.allocator.free(req.pages[inserted_pages:recorded_pages])
    rt.req_to_token_pool.free(req.req_pool_idx)
    req.pages = []
    req.holds_kv = False
    req.req_pool_idx = None
    req.kv_allocated_len = 0  # ReqKvInfo.mark_kv_released


def compute_owned_len(rt: Runtime, req: Req) -> int:
    """What a finish release caches (``Req.owned_kv_len()``, never past the allocation):
    B11 caches ``kv_committed_len``; B10 ``owned_kv_len`` in a trimmed finish's cell."""
    rule = (replace(rt.config.cell, trimmed_finish=False) if rt.has_fault("B10")
            else rt.config.cell)
    cached = req.kv_committed_len if rt.has_fault("B11") else compute_cached_len(
        rule, req.kv_committed_len, req.prompt_len, len(req.output_ids),
        req.finished_reason == "abort")
    return max(0, min(cached, req.kv_allocated_len))


def checkpoint_kv_cache(rt: Runtime, req: Req, up_to: int, finish: bool = False
                        ) -> int:
    """``checkpoint_into_tree`` (unified_radix_cache.py:1164-1318) of a radix cell: the fill
    ids up to ``up_to`` are keyed (K positions: whole pages, one short under EAGLE) and
    inserted with the row's pages, ``cache_protected_len`` as ``prev_prefix_len``. The
    pages the tree already held are freed (duplicates) and row[cpl, K) repointed to the
    tree's path: one more ``index_put_`` on S, behind the WAR fence of the launch before
    it, like every row write. The leaf is split at the prompt's page-aligned end; the lock
    moves onto the insert's node and K becomes the protected prefix. The request's pages
    the tree took become the tree's (``page_owner``: :data:`TREE_OWNER`), the duplicates
    free (-1). Returns K."""
    radix = get_radix(rt)
    assert radix is not None and req.req_pool_idx is not None
    p = rt.config.page_size
    fill = req.get_fill_tokens()
    tokens = (fill + list(req.hidden_ids))[:up_to]
    if not tokens:  # effective_cache_len <= 0: nothing changes (:1219-1224)
        return req.cache_protected_len
    key = radix.make_key(tokens)
    inserted, protected = len(key), req.cache_protected_len
    assert protected <= inserted <= req.kv_committed_len, (
        f"r{req.rid}: checkpoint of {inserted} with cpl {protected}, "
        f"committed {req.kv_committed_len}")
    own = req.pages[protected // p:inserted // p]
    # B32: a finish's insert is handed the key uncut, with the whole pages' values.
    handed = (radix.make_key(tokens, whole_pages=False) if finish and rt.has_fault("B32")
              else key)
    _, node, duplicates = radix.insert(handed, req.pages[:inserted // p], protected)
    rt.allocator.free(duplicates)
    dropped = set(duplicates)
    rt.kv.set_owner(list(own), [-1 if page in dropped else TREE_OWNER for page in own])
    prompt_key = radix.make_key(fill[:req.prompt_len])
    if 0 < len(prompt_key) < inserted:
        radix.insert(prompt_key, req.pages[:len(prompt_key) // p], len(prompt_key))
    path = radix.get_path_pages(node)
    assert len(path) * p == inserted, f"path of {len(path)} pages, key of {inserted}"
    if not rt.has_fault("B29"):  # B29: the duplicates are freed, the row still names them
        repoint_row(rt, req, path, protected, inserted)
    if not rt.has_fault("B30"):  # B30: the lock stays on the node the request held before
        if req.lock is not None:
            radix.unlock(req.lock)
        req.lock = radix.lock(node)
    req.cache_protected_len = inserted
    return inserted


def repoint_row(rt: Runtime, req: Req, path: list[PageId], start: int, end: int) -> None:
    """The checkpoint's row repoint (unified_radix_cache.py:1287-1299): columns [start, end)
    of the request's row, and its pages, become the tree path's (the same pages where the
    tree adopted the request's own, the tree's where they were duplicates): one scatter on
    S."""
    assert req.req_pool_idx is not None
    p = rt.config.page_size
    req.pages[start // p:end // p] = path[start // p:end // p]
    columns = list(range(start, min(end, rt.req_to_token_pool.width)))
    rt.req_to_token_pool.write([req.req_pool_idx] * len(columns), columns,
                               [req.pages[c // p] * p + c % p for c in columns])


def release_into_tree(rt: Runtime, radix: RadixTree, req: Req, is_insert: bool) -> None:
    """``release_kv_cache`` of a radix cell (common.py:400-476; section 1.4's table): a
    finish or a running abort (``is_insert``, checkpoint=True) first checkpoints up to
    ``owned_kv_len``; then the request's own pages, from ``cache_protected_len`` to the
    allocation's end, are freed (a page stranded past a shrunk allocation leaks, B12) and
    its lock dropped. The prefix below it is the tree's: unlocked, never freed here."""
    assert req.req_pool_idx is not None
    p = rt.config.page_size
    recorded_pages = compute_pages_for_len(req.kv_allocated_len, p)
    owned = compute_owned_len(rt, req) if is_insert else 0
    if is_insert and owned:
        checkpoint_kv_cache(rt, req, owned, finish=True)
    req.release_count += 1
    if is_insert:
        req.cached_len = owned
    elif req.finished():  # a chunked request's abort (checkpoint=False): nothing cached
        req.cached_len = 0
    first_own = compute_first_own_page(req.cache_protected_len, req.matched_len, p, rt.faults)
    rt.kv.set_owner(list(req.pages[first_own:]), [-1] * len(req.pages[first_own:]))
    rt.allocator.free(req.pages[first_own:recorded_pages])
    if req.lock is not None:
        if not rt.has_fault("B26"):  # B26: the release leaves its lock behind (#32170)
            radix.unlock(req.lock)
        req.lock = None
    rt.req_to_token_pool.free(req.req_pool_idx)
    req.pages = []
    req.holds_kv = False
    req.req_pool_idx = None
    req.kv_allocated_len = 0  # ReqKvInfo.mark_kv_released

