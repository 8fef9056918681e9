"""The one interface every implementation offers (reference/, gpu_impl/).

A driver (harness/) calls these operations; the implementation reports an
:class:`~spec.state.Observation` to its observer at every observation point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.state import IterationChoices, Observation, TreeView
from overlap_spec.spec.units import RequestId

Observer = Callable[[Observation], None]


@dataclass(frozen=True)
class RequestState:
    """What a differential run compares per request (req_to_token up to kv_allocated_len)."""

    rid: RequestId
    status: str  # "waiting" | "running" | "finished"
    output_ids: tuple[int, ...]
    kv_committed_len: int
    kv_allocated_len: int
    req_to_token: tuple[int, ...]  # the request's row, columns [0, kv_allocated_len)
    cached_len: int | None  # what the release handed the tree cache (KV9)
    finish_reason: str | None  # "stop" | "length" | "abort" (RP5), None while unfinished
    spec_verify_ct: int  # the request's verify count (RP6)
    spec_num_correct_drafts: int  # its accepted drafts (RP6)
    cache_protected_len: int = 0  # a radix cell's: row[0:cpl] is the tree's (RX4)
    # What each forward wrote where: per column of ``req_to_token``, the (writer,
    # position) of the last write into its slot (the writer: the request id and its epoch,
    # ``transitions.compute_kv_writer``) (a draft's tail copy, ``move_kv_cache``,
    # carries its source's), None where no forward wrote the slot. Below a radix cell's
    # cache_protected_len the tree's pages: another request's writes; a page reused after a
    # free keeps its content until overwritten. The whole field None: not reported (the
    # upstream tier's stand-in worker keeps no KV buffer: docs/upstream-tier.md).
    kv_contents: tuple[tuple[int, int] | None, ...] | None = None


@dataclass(frozen=True)
class BatchState:
    rids: tuple[RequestId, ...]  # in batch order
    seq_lens: tuple[int, ...]  # the device tensor
    seq_lens_cpu: tuple[int, ...] | None
    seq_lens_sum: int | None


@dataclass(frozen=True)
class ObservableState:
    """The state two implementations must agree on after every operation."""

    requests: tuple[RequestState, ...]
    running: BatchState | None  # the running batch (None when empty)
    last_batch: BatchState | None  # the batch launched by the last iteration
    free_pages: int  # allocator free list plus evictable cache
    kv_write_faults: int  # forward writes outside what the request owns, so far
    # (num_correct_drafts, metrics batch size) the last processed result fed the spec
    # metrics; (0, 0) when it fed none (non-spec, or a prefill result with spec).
    accept_counters: tuple[int, int]
    # Admission's state (PrefillAdder): NewTokenRatioTracker.current, and the running
    # batch's batch_is_full latch (False when that batch is empty: admission drops an empty
    # batch's latch before reading it, and a merge replaces an empty batch).
    new_token_ratio: float
    batch_is_full: bool
    tree_pages: int = 0  # of free_pages, those the tree cache holds (its insert's cut)
    tree: TreeView | None = None  # a radix cell's tree (None elsewhere)


class SchedulerModel(Protocol):
    config: ModelConfig

    def admit(self, prompt_len: int, max_new_tokens: int, *,
              family: int | None = None) -> RequestId:
        """A new request joins the waiting queue; its prompt is of ``family``
        (``compute_prompt_token``; None: its own id)."""
        ...

    def admit_prebuilt(self, prompt_len: int, max_new_tokens: int) -> RequestId:
        """A PD-decode request whose KV and first token were produced elsewhere."""
        ...

    def abort(self, rid: RequestId) -> None:
        """Abort: immediate if waiting, deferred to its next result if running."""
        ...

    def flush_cache(self) -> bool:
        """``Scheduler.flush_cache``: when fully idle, the tree reset and the pools cleared
        (True); otherwise refused, nothing changed (False)."""
        ...

    def pause_generation(self) -> None:
        """``Scheduler.pause_generation(mode="retract")``: the queued result processed, every
        unfinished request running, just prefilled or chunked retracted and re-queued; no
        batch is built until :meth:`continue_generation`."""
        ...

    def continue_generation(self) -> None:
        """``Scheduler.continue_generation``: iterations build batches again."""
        ...

    def run_iteration(self, choices: IterationChoices) -> None:
        """One pass of the event loop with the environment's choices."""
        ...

    def set_step_index(self, index: int) -> None:
        """Which script operation is running (stamped on observations)."""
        ...

    def get_observable_state(self) -> ObservableState:
        ...


SchedulerFactory = Callable[[ModelConfig, frozenset[str], Observer | None], SchedulerModel]
