"""The refinement function: reference state → spec :class:`Observation`.

Field mapping (reference → spec): ``Req`` → :class:`RequestView` (same field
names as upstream), ``ScheduleBatch`` → :class:`BatchView`, ``ForwardBatch`` →
:class:`ForwardView`, the allocator / tree / req_to_token pool →
:class:`AllocatorView`, ``Req.ghost`` → :class:`GhostView`. Races are the ones
the happens-before record found since the previous observation.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol, cast

from overlap_spec.reference.memory import RadixCache
from overlap_spec.reference.runtime import Runtime
from overlap_spec.spec.interface import Observer
from overlap_spec.spec.relation import RequestRecord, count_middle_chunks
from overlap_spec.spec.state import (
    AllocatorView,
    BatchView,
    ForwardView,
    GhostView,
    Observation,
    ObservationPoint,
    RequestView,
    TreeView,
)
from overlap_spec.spec.units import PageId, PoolRow, RequestId, SlotId, TokenCount

if TYPE_CHECKING:
    from overlap_spec.reference.req import Req
    from overlap_spec.reference.schedule_batch import ScheduleBatch
    from overlap_spec.reference.worker import ForwardBatch


class Observed(Protocol):
    """What an observation reads off the scheduler (reference/scheduler.py), named here
    so that the refinement does not import the scheduler that owns it."""

    step_index: int
    requests: dict[RequestId, Req]
    chunked_req: Req | None
    paused: bool


class Refinement:
    def __init__(self, rt: Runtime, observer: Observer | None) -> None:
        self.rt = rt
        self.observer = observer
        self.races_seen = 0
        self.checked_seen = 0
        # Per request: the record, row, pages, lock and KV contents its last view was built
        # from, and the view.
        self._views: dict[RequestId, tuple[RequestRecord, tuple[SlotId, ...],
                                           tuple[PageId, ...], int | None,
                                           tuple[tuple[int, int] | None, ...], RequestView]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The view cache is not state: a copy (the exhaustive tier's pickled states, its
        # state keys) starts without it, so equal states pickle equal whatever was viewed.
        return {k: v for k, v in self.__dict__.items() if k != "_views"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Names interned, as pickle's default restore does: a copy must pickle exactly as
        # the original (shared strings are memoised), or equal states get different keys.
        for name, value in state.items():
            setattr(self, sys.intern(name), value)
        self._views = {}

    def get_request_view(self, req: Req) -> RequestView:
        """The request's view; the previous one again when nothing it reads changed (the
        record is immutable, so the same object is the same state; the row and the pages
        are compared by value). This runs for every request at every observation point."""
        state = req.state
        row: tuple[SlotId, ...] = ()
        if state.req_pool_idx is not None and state.holds_kv:
            values = self.rt.req_to_token.rows[state.req_pool_idx][
                : max(state.kv_allocated_len, 0)]
            # SlotId is a NewType (the identity at run time): a cast, not a per-slot call.
            row = cast("tuple[SlotId, ...]", tuple(values))
        pages = tuple(req.pages)
        # The held lock's node (a lock on the root, no prefix, shows as none: the root is
        # not one of TreeView's nodes).
        lock = None if req.lock is None or req.lock.parent is None else req.lock.id
        contents = tuple(self.rt.kv_cache.get(slot) for slot in row)
        previous = self._views.get(state.rid)
        if (previous is not None and previous[0] is state and previous[1] == row
                and previous[2] == pages and previous[3] == lock and previous[4] == contents):
            return previous[5]
        view = self._build_request_view(req, row, pages, lock, contents)
        self._views[state.rid] = (state, row, pages, lock, contents, view)
        return view

    def _build_request_view(self, req: Req, row: tuple[SlotId, ...],
                            pages: tuple[PageId, ...], lock: int | None,
                            contents: tuple[tuple[int, int] | None, ...]) -> RequestView:
        g = req.ghost
        radix = isinstance(self.rt.tree, RadixCache)
        return RequestView(
            rid=req.rid,
            prompt_len=req.prompt_len,
            output_len=TokenCount(len(req.output_ids)),
            max_new_tokens=req.max_new_tokens,
            kv_committed_len=req.kv_committed_len,
            kv_allocated_len=req.kv_allocated_len,
            req_pool_idx=req.req_pool_idx,
            finished=req.finished(),
            is_retracted=req.is_retracted,
            waiting=req.waiting,
            holds_kv=req.holds_kv,
            row_slots=row,
            # Its own pages: below cache_protected_len the row holds the tree's.
            owned_pages=pages[req.cache_protected_len // self.rt.config.page_size:],
            release_count=req.release_count,
            cached_len=req.cached_len,
            inserted_len=req.inserted_len,
            committed_at_release=req.committed_at_release,
            inflight_at_release=g.inflight_at_release,
            claimed_at_release=g.claimed_at_release,
            finish_reason=req.finished_reason,
            spec_verify_ct=req.spec_verify_ct,
            spec_num_correct_drafts=req.spec_num_correct_drafts,
            output_ids=req.output_ids,
            last_prompt_token=req.last_prompt_token,
            prefix_len=req.prefix_len,
            extend_end=req.extend_end,
            inflight_middle_chunks=req.inflight_middle_chunks,
            cache_protected_len=req.cache_protected_len,
            lock_node=lock,
            prompt_family=req.family if radix else None,
            kv_contents=contents,
            prebuilt=req.state.prebuilt,
            ghost=GhostView(
                epoch=g.epoch,
                kv_len_true=TokenCount(g.kv_len_true),
                settled_len=TokenCount(g.settled_len),
                inflight_steps=g.inflight_steps + g.prepared_steps,
                extend_inflight=g.extend_inflight,
                output_len_true=TokenCount(g.output_len_true),
                finished=g.finished,
                finish_reason=g.finish_reason,
                verify_ct=g.verify_ct,
                correct_drafts=g.correct_drafts,
                middle_chunks=count_middle_chunks(g), finished_at_tail=g.finished_at_tail,
            ),
        )

    def get_batch_view(self, batch: ScheduleBatch) -> BatchView:
        return BatchView(
            forward_mode=batch.forward_mode,
            rids=tuple(req.rid for req in batch.reqs),
            seq_lens=tuple(batch.seq_lens.values),
            seq_lens_cpu=None if batch.seq_lens_cpu is None else tuple(batch.seq_lens_cpu),
            seq_lens_sum=batch.seq_lens_sum,
            req_pool_indices=tuple(PoolRow(r) for r in batch.req_pool_indices.values),
            req_pool_indices_cpu=tuple(batch.req_pool_indices_cpu),
            future_indices=None if batch.future_indices is None else tuple(batch.future_indices),
            seq_len_cpu_ub=batch.seq_len_cpu_ub,
            is_prefill_only=batch.is_prefill_only,
        )

    def get_forward_view(self, fb: ForwardBatch, batch: ScheduleBatch) -> ForwardView:
        return ForwardView(
            purpose=fb.purpose,
            draft_tokens=fb.draft_tokens,
            batch_size=fb.batch_size,
            seq_lens=tuple(fb.seq_lens),
            seq_lens_cpu=None if fb.seq_lens_cpu is None else tuple(fb.seq_lens_cpu),
            seq_lens_sum=fb.seq_lens_sum,
            schedule_batch=self.get_batch_view(batch),
        )

    def get_allocator_view(self) -> AllocatorView:
        rt = self.rt
        return AllocatorView(
            total_pages=rt.allocator.total_pages,
            page_size=rt.config.page_size,
            free_pages=tuple(rt.allocator.free_pages),
            tree_pages=tuple(rt.tree.get_pages()),
            free_pool_rows=tuple(rt.req_to_token.free_slots),
            pool_rows=rt.req_to_token.size,
            row_width=rt.req_to_token.width,
        )

    def get_tree_view(self) -> TreeView | None:
        """The radix tree of a radix cell (every node, locked ones too); None elsewhere."""
        tree = self.rt.tree
        return tree.tree.view() if isinstance(tree, RadixCache) else None

    def observe(self, point: ObservationPoint, scheduler: Observed, **parts: Any) -> None:
        if self.observer is None:
            return
        hb = self.rt.hb
        races = hb.races[self.races_seen:]
        self.races_seen = len(hb.races)
        checked = tuple(hb.checked[self.checked_seen:])
        self.checked_seen = len(hb.checked)
        batch = parts.pop("batch", None)
        obs = Observation(
            point=point,
            step_index=scheduler.step_index,
            requests=tuple(self.get_request_view(r) for r in scheduler.requests.values()),
            batch=None if batch is None else self.get_batch_view(batch),
            allocator=self.get_allocator_view(),
            races=tuple(races),
            checked_pairs=checked,
            chunked_rid=None if scheduler.chunked_req is None else scheduler.chunked_req.rid,
            tree=self.get_tree_view(),
            paused=scheduler.paused,
            **parts,
        )
        self.observer(obs)
