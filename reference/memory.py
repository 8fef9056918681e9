"""KV pools: the paged token-to-KV allocator, the req_to_token rows and a tree-cache sink.

Upstream: ``mem_cache/memory_pool.py`` (ReqToTokenPool), ``mem_cache/allocator.py``
(paged allocator), ``mem_cache/common.py`` (alloc_for_extend / alloc_for_decode /
release_kv_cache), ``mem_cache/radix_cache.py`` (cache_finished_req).

Modelling compromises:
- The allocator works in pages; with page_size 1 a page is a slot.
- A radix cell (``Cell.radix``) keeps the release's prefix tree (:class:`RadixCache`, over
  ``spec/radix.py``); what the scheduler does with it is ``reference/mem_cache.py``'s.
- Elsewhere the radix tree is a sink: a finish release hands it the whole pages the release's
  tree would key (``compute_inserted_len``: ``floor_p(owned)``, ``floor_p(owned - 1)``
  under EAGLE) and frees the partial page; they stay evictable and are evicted
  first-in first-out when the allocator runs short. No prefix is ever matched, so no
  request starts with shared pages, and nothing is checkpointed before the release (the
  release's prefill-completion and chunk checkpoints, ``docs/upstream-radix-sharing.md``
  section 1.3, are not modelled).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from overlap_spec.spec.radix import RadixTree
from overlap_spec.spec.units import PageId, PoolRow


class OutOfMemory(Exception):
    """The allocator cannot satisfy a request even after evicting the tree."""


@dataclass
class TokenToKVPoolAllocator:
    page_size: int
    total_pages: int
    free_pages: list[PageId] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clear()

    def available_size(self) -> int:
        return len(self.free_pages)

    def clear(self) -> None:
        """``clear`` (``flush_cache``): every page free again, in the first order."""
        self.free_pages = [PageId(p) for p in range(self.total_pages)]

    def alloc(self, pages: int) -> list[PageId]:
        if pages > len(self.free_pages):
            raise OutOfMemory(f"need {pages} pages, {len(self.free_pages)} free")
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return taken

    def free(self, pages: list[PageId]) -> None:
        self.free_pages.extend(pages)


@dataclass
class TreeCache:
    """Holds the pages finished requests cached; all of them are evictable."""

    chunks: deque[list[PageId]] = field(default_factory=deque)

    def evictable_size(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)

    def cache_finished_req(self, pages: list[PageId]) -> None:
        if pages:
            self.chunks.append(list(pages))

    def evict(self, pages_needed: int, allocator: TokenToKVPoolAllocator) -> None:
        while allocator.available_size() < pages_needed and self.chunks:
            allocator.free(self.chunks.popleft())

    def get_pages(self) -> list[PageId]:
        return [page for chunk in self.chunks for page in chunk]

    def reset(self) -> None:
        """``flush_cache``'s ``tree_cache.reset``: the sink forgets its pages (the
        allocator's clear frees them)."""
        self.chunks.clear()


class RadixCache:
    """The radix prefix cache of a radix cell (``UnifiedRadixCache``, enabled), behind the
    sink's interface in pages: the evictable pages are the unlocked nodes', every node's
    pages are the tree's, and an allocation evicts least recently used leaves for its
    shortfall (``evict_to_free_tokens``, allocator/base.py:155-169)."""

    def __init__(self, page_size: int, is_eagle: bool,
                 faults: frozenset[str] = frozenset()) -> None:
        self.tree = RadixTree(page_size, is_eagle, faults)

    def evictable_size(self) -> int:
        return self.tree.evictable_size // self.tree.page_size

    def evict(self, pages_needed: int, allocator: TokenToKVPoolAllocator) -> None:
        shortfall = pages_needed - allocator.available_size()
        if shortfall > 0:
            allocator.free(self.tree.evict(shortfall))

    def get_pages(self) -> list[PageId]:
        return self.tree.get_pages()

    def reset(self) -> None:
        self.tree.reset()


@dataclass
class ReqToTokenPool:
    """``size + 1`` rows; row 0 is the CUDA-graph padding row and is never handed out."""

    size: int
    width: int
    rows: list[list[int]] = field(default_factory=list)
    free_slots: list[PoolRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = [[-1] * self.width for _ in range(self.size + 1)]
        self.clear()

    def clear(self) -> None:
        """``clear`` (``flush_cache``): every row free again, in the first order; the rows'
        contents are left as they are (the release's are)."""
        self.free_slots = [PoolRow(r) for r in range(1, self.size + 1)]

    def alloc(self) -> PoolRow | None:
        if not self.free_slots:
            return None
        return self.free_slots.pop(0)

    def free(self, row: PoolRow) -> None:
        self.rows[row] = [-1] * self.width
        self.free_slots.append(row)
