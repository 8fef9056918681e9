"""What every gpu_impl component shares: the cell, the faults, the streams and the pools.

The forward stream is the schedule stream when overlap is off (upstream runs the
non-overlap forward on the scheduler's own stream), exactly as in the reference.
"""

from __future__ import annotations

from overlap_spec.gpu_impl.memory import (
    KvPages,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    TreeCache,
)
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.spec.config import ModelConfig, SpecShape
from overlap_spec.spec.happens_before import FORWARD, SCHEDULE


class Runtime:
    def __init__(self, config: ModelConfig, faults: frozenset[str], streams: Streams) -> None:
        self.config = config
        self.faults = faults
        self.streams = streams
        self.allocator = TokenToKVPoolAllocator(config.kv_pages)
        # The release's row, or one not widened on pages > 1 (B21: #26972 reverted).
        self.req_to_token_pool = ReqToTokenPool(streams, config.preset.max_running_requests,
                                                config.get_row_width(faults))
        self.kv = KvPages(streams, config.kv_pages, config.page_size)
        # A radix cell keeps the release's prefix tree; the others a sink (memory.py). B33:
        # the tree keys plain tokens under EAGLE (before #10846).
        self.tree: TreeCache | RadixCache = (
            RadixCache(config.page_size, config.cell.is_spec and "B33" not in faults,
                       self.kv, faults) if config.cell.radix else TreeCache())
        self.shape: SpecShape = config.get_shape()  # this iteration's adaptive rung
        # "B" is today's design; "A" the pre-#25465 baseline that ``bench gpu`` compares.
        self.era = "B"

    @property
    def forward_stream(self) -> str:
        return FORWARD if self.config.cell.overlap else SCHEDULE

    def has_fault(self, bug_id: str) -> bool:
        return bug_id in self.faults

    def get_decode_reserve(self) -> int:
        """The v2 reserve ahead of kv_committed_len for this iteration's rung (spec/config.py)."""
        return self.config.get_decode_reserve(self.shape, self.faults)
