"""alloc_for_extend / alloc_for_decode / release_kv_cache (upstream mem_cache/common.py).

All allocator and req_to_token writes happen on the schedule stream (S).
"""

from __future__ import annotations

from overlap_spec.reference.memory import OutOfMemory
from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import Runtime
from overlap_spec.spec import relation
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.transitions import (
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
    req.apply(relation.prepare_for_extend, row, extend_end)
    back_columns(rt, req, 0, "alloc_for_extend")


def alloc_for_decode(rt: Runtime, req: Req, seq_len: int) -> None:
    """Non-spec decode: one slot at column ``seq_len``; committed and allocated += 1
    (spec.relation.prepare_for_decode)."""
    allocated = req.kv_allocated_len
    req.apply(relation.prepare_for_decode, seq_len)
    back_columns(rt, req, allocated, "alloc_for_decode")


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
    (finish), the rest freed.

    The record's update is spec.relation.release_kv_cache; here the memory follows it:
    the pool row and the pages the row records are freed, and with ``is_insert`` the
    pages the release's tree keys from the cached length (compute_inserted_len: whole
    pages, one position short under EAGLE) go to the tree cache; the partial page is freed
    (common.py:433). Upstream finds the pages to free in
    ``req_to_token[row, :kv_allocated_len]`` (``_release_overallocated_kv_indices``), so a
    page past a shrunk allocation (B12's stranded tail) is never freed: it leaks (KV7).
    """
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
