"""``Req``: one request's host-side state in gpu_impl (upstream managers/schedule_batch.py).

Upstream keeps ``Req`` a plain Python object on the scheduler thread (fields later moved
under ``req.kv.*``, M2); so does gpu_impl. What lives in tensors is the batch state
(``ScheduleBatch``), the pools and the FutureMap relay. Unlike the reference there is no
ghost beside the request: gpu_impl is checked by the differential run and the race
detector, not by the invariant observer.

The stand-in model's token function is defined here because the host (PD prebuilt
requests) and the forward (a tensor expression) both evaluate it: written with operators
only, the same expression works on Python ints and on int64 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch

from overlap_spec.spec.units import PageId, PoolRow, RequestId, TokenCount

EOS_TOKEN = 0

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def compute_token(rid: IntOrTensor, index: IntOrTensor) -> IntOrTensor:
    """The stand-in model's non-EOS token for output position ``index`` of request ``rid``."""
    return 1 + (rid * 31 + index * 7) % 97


@dataclass
class Req:
    rid: RequestId
    prompt_len: TokenCount
    max_new_tokens: TokenCount
    output_ids: list[int] = field(default_factory=list)
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    req_pool_idx: PoolRow | None = None
    # Pages in column order (page k holds columns [k*p, (k+1)*p)); upstream recovers them
    # from req_to_token, which cannot see pages stranded past a shrunk allocation (B12).
    pages: list[PageId] = field(default_factory=list)
    finished_reason: str | None = None
    to_finish: str | None = None  # deferred abort, promoted by update_finish_state
    is_retracted: bool = False
    prebuilt: bool = False
    waiting: bool = True
    holds_kv: bool = False
    release_count: int = 0
    cached_len: int | None = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self, hit_eos: bool) -> None:
        """A deferred abort wins, then EOS, then the length limit."""
        if self.to_finish is not None:
            self.finished_reason = self.to_finish
        elif hit_eos:
            self.finished_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"

    def reset_for_retract(self) -> None:
        """Back to the waiting queue with no KV; output_ids are kept for the re-prefill."""
        self.is_retracted = True
        self.prebuilt = False
        self.waiting = True
        self.holds_kv = False
        self.req_pool_idx = None
        self.pages = []
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.release_count = 0
