"""alloc_for_extend / alloc_for_decode / release_kv_cache (upstream mem_cache/common.py).

All allocator and req_to_token writes happen on the schedule stream (S).
"""

from __future__ import annotations

from overlap_spec.reference.memory import OutOfMemory
from overlap_spec.reference.req import Req
from overlap_spec.reference.runtime import Runtime
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.transitions import (
    compute_cached_len,
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


def grow_to(rt: Runtime, req: Req, new_allocated: int, operation: str) -> None:
    """Own enough pages for ``new_allocated`` positions and record them in the row."""
    p = rt.config.page_size
    extra = compute_pages_for_len(new_allocated, p) - len(req.pages)
    if extra > 0:
        req.pages.extend(alloc_pages(rt, extra))
    write_row_columns(rt, req, req.kv_allocated_len, new_allocated, operation)
    req.kv_allocated_len = new_allocated


def alloc_for_extend(rt: Runtime, req: Req, fill_len: int) -> None:
    """One pool row, pages for ``fill_len`` positions; committed = allocated = fill_len."""
    row = rt.req_to_token.alloc()
    if row is None:
        raise OutOfMemory("no free req_to_token row")
    req.req_pool_idx = row
    req.holds_kv = True
    req.kv_allocated_len = 0
    grow_to(rt, req, fill_len, "alloc_for_extend")
    req.kv_committed_len = fill_len


def alloc_for_decode(rt: Runtime, req: Req, seq_len: int) -> None:
    """Non-spec decode: one slot at column ``seq_len``; committed and allocated += 1.

    B10 moves the committed claim to result time (settle-at-result, #27971).
    """
    grow_to(rt, req, seq_len + 1, "alloc_for_decode")
    if not rt.has_fault("B10"):
        req.kv_committed_len += 1


def get_decode_pages_needed(rt: Runtime, req: Req, seq_len: int) -> int:
    """Per-request term of ``new_tokens_required_next_decode`` (in pages)."""
    cfg = rt.config
    if not cfg.cell.is_spec:
        return compute_ns_decode_pages_needed(seq_len, cfg.page_size)
    return compute_v2_decode_pages_needed(req.kv_committed_len, req.kv_allocated_len,
                                          rt.get_decode_reserve(), cfg.page_size)


def release_kv_cache(rt: Runtime, req: Req, is_insert: bool) -> None:
    """Release a request's KV once: committed part to the tree (finish), rest freed.

    Frame: frees the pool row and every page; with ``is_insert`` the pages covering
    ``effective_kv_committed_len`` go to the tree cache. kv_committed_len is unchanged.
    """
    assert req.holds_kv and req.req_pool_idx is not None, f"r{req.rid} released twice"
    req.release_count += 1
    p = rt.config.page_size
    cached_pages = 0
    if is_insert:
        committed = req.kv_committed_len
        if rt.has_fault("B11"):
            cached = committed
        else:
            cached = compute_cached_len(committed, req.prompt_len, len(req.output_ids))
        cached = max(0, min(cached, req.kv_allocated_len))
        cached_pages = compute_pages_for_len(cached, p)
        req.cached_len = cached
        req.committed_at_release = committed
        rt.ghost.on_release(req)
    rt.tree.cache_finished_req(req.pages[:cached_pages])
    rt.allocator.free(req.pages[cached_pages:])
    rt.req_to_token.free(req.req_pool_idx)
    req.pages = []
    req.holds_kv = False
    req.req_pool_idx = None
