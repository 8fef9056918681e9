"""What every reference component shares: config, pools, the stream record, device tensors,
the KV slots' content.

A :class:`DeviceTensor` stands for a GPU tensor: a value list plus an id the
happens-before record tracks. The forward stream is the schedule stream when
overlap is off (upstream runs the non-overlap forward on the schedule stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from overlap_spec.reference.memory import (
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    TreeCache,
)
from overlap_spec.spec.config import ModelConfig, SpecShape
from overlap_spec.spec.happens_before import FORWARD, SCHEDULE, HappensBefore


@dataclass
class DeviceTensor:
    tensor_id: int
    values: list[int]


@dataclass
class Runtime:
    config: ModelConfig
    faults: frozenset[str]
    hb: HappensBefore = field(default_factory=HappensBefore)
    next_tensor_id: int = 0
    live_tensors: set[int] = field(default_factory=set)
    # The KV slots' content: slot -> (writer, position) of the forward write that last
    # stored it (a tail copy: its source's; None: copied from nothing written); a slot never
    # written is absent. Never cleared: a freed page keeps it until overwritten (gpu_impl's
    # ``kv_cache``, the same model; ``spec.interface.RequestState.kv_contents``).
    kv_cache: dict[int, tuple[int, int] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.config
        self.allocator = TokenToKVPoolAllocator(cfg.page_size, cfg.kv_pages)
        # A radix cell keeps the release's prefix tree; the others a sink (memory.py). B33:
        # the tree keys plain tokens under EAGLE (before #10846).
        self.tree: TreeCache | RadixCache = (
            RadixCache(cfg.page_size, cfg.cell.is_spec and not self.has_fault("B33"),
                       self.faults) if cfg.cell.radix else TreeCache())
        self.req_to_token = ReqToTokenPool(cfg.preset.max_running_requests,
                                           cfg.get_row_width(self.faults))
        self.shape: SpecShape = cfg.get_shape()  # the adaptive rung of this iteration

    @property
    def forward_stream(self) -> str:
        return FORWARD if self.config.cell.overlap else SCHEDULE

    def has_fault(self, bug_id: str) -> bool:
        return bug_id in self.faults

    def get_decode_reserve(self) -> int:
        """The v2 reserve ahead of kv_committed_len for this iteration's rung."""
        return self.config.get_decode_reserve(self.shape, self.faults)

    def new_tensor(self, values: Sequence[int], operation: str,
                   stream: str = SCHEDULE) -> DeviceTensor:
        """A fresh device tensor written by ``stream`` (an H2D copy or a gather)."""
        self.next_tensor_id += 1
        tensor = DeviceTensor(self.next_tensor_id, list(values))
        self.live_tensors.add(tensor.tensor_id)
        self.hb.write(stream, ("tensor", tensor.tensor_id), operation)
        return tensor

    def read_tensor(self, stream: str, tensor: DeviceTensor, operation: str) -> list[int]:
        self.hb.read(stream, ("tensor", tensor.tensor_id), operation)
        return list(tensor.values)

    def release_tensors(self, referenced: set[int], operation: str) -> None:
        """Python drops tensors nothing references any more; memory may be reused (ST4)."""
        for tensor_id in sorted(self.live_tensors - referenced):
            self.hb.free(("tensor", tensor_id), operation)
        self.live_tensors &= referenced
