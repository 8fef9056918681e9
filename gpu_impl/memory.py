"""KV pools on the device: the req_to_token table, page ownership, the KV cache itself.

Upstream: ``mem_cache/memory_pool.py`` (``ReqToTokenPool``: a device int32 table
``[size + 1, max_context_len + extra]`` written by the scheduler, read by attention),
``mem_cache/allocator.py`` (``TokenToKVPoolAllocator`` / the paged allocator) and
``mem_cache/radix_cache.py`` (``cache_finished_req``).

What is a tensor here and what is not:

- ``req_to_token`` is a device int64 table ``[rows + 1, row_width]`` filled with -1; row
  0 is the CUDA-graph padding row and is never handed out. Only the schedule stream
  writes it (``index_put_`` / ``index_fill_`` on the whole table, so the race detector
  sees one buffer); the forward reads it.
- ``page_owner[page]`` is the request id that owns a KV page, :data:`TREE_OWNER` for a
  page of a radix cell's tree, or -1. Upstream has no such table; the stand-in forward
  needs it to decide on the device whether a slot it writes belongs to the request (the
  reference asks ``slot // page_size in req.pages``). A tree page sits in a request's row
  below its ``cache_protected_len``: readable, never a write target of the request (the
  one exception, a mixed chunk's decode row, is ``gpu_impl/worker.py``'s).
- ``kv_cache`` is the KV slot buffer the forward writes; after the pages' slots come a
  trash slot that masked writes land in, so a wrong write is counted, never a crash, and a
  slot nothing writes, read by a copy through an unset entry. A write stores
  who wrote which position, ``writer * KV_POSITION_STRIDE + position`` (the writer:
  ``compute_kv_writer``, the request id and its epoch; :func:`decode_kv` reads it
  back), a draft's tail copy its source's value (``move_kv_cache``); a slot no
  forward ever wrote holds :data:`UNWRITTEN_KV`. Nothing clears it: a freed page keeps its
  content until a write overwrites it (the reference's ``Runtime.kv_cache`` is the same
  model, a dict).
- The free page list and the tree cache's FIFO of evictable chunks stay on the host, as
  Python lists: the allocation order must match the reference exactly (front of the free
  list first, frees appended, whole chunks evicted oldest first), and host-side page ids
  are what the scheduler's admission arithmetic reads.

Outside a radix cell, as in the reference, the radix tree is a sink that takes the whole
pages the release's tree keys at a finish (``compute_inserted_len``); nothing is matched
and nothing is checkpointed before the release. A radix cell (``Cell.radix``) keeps the
release's prefix tree (:class:`RadixCache`, over ``spec/radix.py``, host-side like the
free list); what the scheduler does with it is ``gpu_impl/mem_cache.py``'s.
"""

from __future__ import annotations

from collections import deque

import torch

from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.radix import RadixTree
from overlap_spec.spec.units import PageId, PoolRow

# page_owner of a page the radix tree holds (a radix cell): no request's to write.
TREE_OWNER = -2
# The KV slot buffer's content: writer * KV_POSITION_STRIDE + position, the writer and the
# position it wrote; larger than any row width (ReqToTokenPool asserts it), so a value
# decodes back to the pair. UNWRITTEN_KV: no forward ever wrote the slot.
KV_POSITION_STRIDE = 1 << 24
UNWRITTEN_KV = -1


def decode_kv(value: int) -> tuple[int, int] | None:
    """A ``kv_cache`` value as the observation's (writer, position), None unwritten
    (``spec.interface.RequestState.kv_contents``)."""
    if value == UNWRITTEN_KV:
        return None
    rid, position = divmod(value, KV_POSITION_STRIDE)
    return rid, position


class OutOfMemory(Exception):
    """The allocator cannot satisfy a request even after evicting the tree."""


class TokenToKVPoolAllocator:
    """The page free list: allocation takes from the front, frees append at the back."""

    def __init__(self, total_pages: int) -> None:
        self.total_pages = total_pages
        self.clear()

    def clear(self) -> None:
        """``clear`` (``flush_cache``): every page free again, in the first order."""
        self.free_pages: list[PageId] = [PageId(page) for page in range(self.total_pages)]

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, pages: int) -> list[PageId]:
        if pages > len(self.free_pages):
            raise OutOfMemory(f"need {pages} pages, {len(self.free_pages)} free")
        taken = self.free_pages[:pages]
        del self.free_pages[:pages]
        return taken

    def free(self, pages: list[PageId]) -> None:
        self.free_pages += pages


class TreeCache:
    """Pages of finished requests, all evictable, evicted in whole chunks oldest first."""

    def __init__(self) -> None:
        self.chunks: deque[list[PageId]] = deque()

    def evictable_size(self) -> int:
        return sum(map(len, self.chunks))

    def cache_finished_req(self, pages: list[PageId]) -> None:
        if pages:
            self.chunks.append(pages)

    def evict(self, pages_needed: int, allocator: TokenToKVPoolAllocator) -> None:
        while self.chunks and allocator.available_size() < pages_needed:
            allocator.free(self.chunks.popleft())

    def reset(self) -> None:
        """``flush_cache``: the sink forgets its pages (the allocator's clear frees them)."""
        self.chunks.clear()


class RadixCache:
    """The radix prefix cache of a radix cell (``UnifiedRadixCache``, enabled), behind the
    sink's interface in pages (``reference.memory.RadixCache``): the evictable pages are the
    unlocked nodes', every node's pages are the tree's, and an allocation evicts least
    recently used leaves for its shortfall (``evict_to_free_tokens``); an evicted page's
    ``page_owner`` goes back to -1 (on S)."""

    def __init__(self, page_size: int, is_eagle: bool, kv: KvPages,
                 faults: frozenset[str] = frozenset()) -> None:
        self.tree = RadixTree(page_size, is_eagle, faults)
        self.kv = kv

    def evictable_size(self) -> int:
        return self.tree.evictable_size // self.tree.page_size

    def evict(self, pages_needed: int, allocator: TokenToKVPoolAllocator) -> None:
        shortfall = pages_needed - allocator.available_size()
        if shortfall > 0:
            freed = self.tree.evict(shortfall)
            self.kv.set_owner(list(freed), [-1] * len(freed))
            allocator.free(freed)

    def get_pages(self) -> list[PageId]:
        return self.tree.get_pages()

    def reset(self) -> None:
        """``flush_cache``: a new root (the scheduler clears the pages' owners)."""
        self.tree.reset()


class ReqToTokenPool:
    """The device table of KV slots per pool row, plus the host list of free rows."""

    def __init__(self, streams: Streams, size: int, width: int) -> None:
        assert width < KV_POSITION_STRIDE, f"row width {width}: kv_cache values would collide"
        self.streams = streams
        self.size = size
        self.width = width
        with streams.use(SCHEDULE):
            self.req_to_token = torch.full((size + 1, width), -1, dtype=torch.int64,
                                           device=streams.device)
        streams.name(self.req_to_token, "req_to_token")
        self.clear()

    def clear(self) -> None:
        """``clear`` (``flush_cache``): every row free again, in the first order; the table
        is left as it is (the release's is)."""
        self.free_slots: list[PoolRow] = [PoolRow(row) for row in range(1, self.size + 1)]

    def alloc(self) -> PoolRow | None:
        return self.free_slots.pop(0) if self.free_slots else None

    def write(self, rows: list[int], columns: list[int], slots: list[int]) -> None:
        """``req_to_token[rows, columns] = slots``: one H2D and one scatter on S."""
        if not rows:
            return
        streams = self.streams
        index = (streams.device_tensor(rows), streams.device_tensor(columns))
        self.req_to_token.index_put_(index, streams.device_tensor(slots))

    def free(self, row: PoolRow) -> None:
        """The row goes back to the free list, cleared to -1 (on S)."""
        self.req_to_token.index_fill_(0, self.streams.device_tensor([row]), -1)
        self.free_slots.append(row)


class KvPages:
    """Device-side page ownership and the KV slot buffer the stand-in forward writes."""

    def __init__(self, streams: Streams, total_pages: int, page_size: int) -> None:
        self.streams = streams
        self.page_size = page_size
        self.trash_slot = total_pages * page_size
        # Never written: what a copy through an unset req_to_token entry reads.
        self.unwritten_slot = self.trash_slot + 1
        with streams.use(SCHEDULE):
            self.page_owner = torch.full((max(total_pages, 1),), -1, dtype=torch.int64,
                                         device=streams.device)
            self.kv_cache = torch.full((self.unwritten_slot + 1,), UNWRITTEN_KV,
                                       dtype=torch.int64, device=streams.device)
        streams.name(self.page_owner, "page_owner")
        streams.name(self.kv_cache, "kv_cache")

    def set_owner(self, pages: list[int], owners: list[int]) -> None:
        """``page_owner[pages] = owners`` on S (a request id, -1 when freed or in the sink, or
        :data:`TREE_OWNER`)."""
        if pages:
            streams = self.streams
            self.page_owner.index_put_((streams.device_tensor(pages),),
                                       streams.device_tensor(owners))
