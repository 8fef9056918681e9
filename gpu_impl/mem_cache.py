"""alloc_for_extend / alloc_for_decode / release_kv_cache (upstream mem_cache/common.py).

Allocation is batched as upstream does it: the pages of every request of a prepare are
taken in one allocator call (evicting the tree first if short), then one scatter writes
all new ``req_to_token`` columns and one scatter records the new pages' owner. Taking
them in one call hands out the same pages, in the same order, as one call per request:
both take a prefix of "free list, then evicted chunks in FIFO order", and both evict the
fewest whole chunks that cover the total (an ``OutOfMemory`` is raised in the same
situations, though the reference may have allocated for earlier requests before it).
All of it runs on the schedule stream.
"""

from __future__ import annotations

from dataclasses import replace

from overlap_spec.gpu_impl.memory import OutOfMemory
from overlap_spec.gpu_impl.req import Req
from overlap_spec.gpu_impl.runtime import Runtime
from overlap_spec.spec.transitions import (
    compute_cached_len,
    compute_inserted_len,
    compute_ns_decode_pages_needed,
    compute_pages_for_len,
    compute_v2_decode_pages_needed,
)
from overlap_spec.spec.units import PageId


def get_available_pages(rt: Runtime) -> int:
    return rt.allocator.available_size() + rt.tree.evictable_size()


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
    rt.tree.cache_finished_req(req.pages[:inserted_pages])
    rt.allocator.free(req.pages[inserted_pages:recorded_pages])
    rt.req_to_token_pool.free(req.req_pool_idx)
    req.pages = []
    req.holds_kv = False
    req.req_pool_idx = None
    req.kv_allocated_len = 0  # ReqKvInfo.mark_kv_released
