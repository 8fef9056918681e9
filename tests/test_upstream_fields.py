"""One field map from a live scheduler to the spec's views (``upstream/fields.py``), used by
both the upstream tier's adapter and the trace shim: every view field is read there or
named here as one a reader adds, and the shim reads the same values the adapter does
(until 2026-11-28 the shim left the three chunked-prefill fields at 0)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from overlap_spec.harness.trace.shim import TraceShim, _Track
from overlap_spec.spec.state import BatchView, RequestView
from overlap_spec.spec.units import RequestId
from overlap_spec.upstream.fields import (
    BATCH_FIELDS,
    REQUEST_FIELDS,
    TOKEN_FIELDS,
    read_allocator,
    read_placement,
    read_request,
)

# What each reader adds from what it tracks around the calls, not from the request.
READER_FIELDS = {"rid", "finished", "release_count", "cached_len", "inserted_len",
                 "committed_at_release", "inflight_at_release", "claimed_at_release",
                 "finish_reason", "ghost"}
PLACEMENT_FIELDS = {"waiting", "row_slots", "owned_pages"}
# A radix cell's prefix (upstream.fields.read_prefix) and the prompt family the adapter
# admitted the request with.
PREFIX_FIELDS = {"cache_protected_len", "lock_node", "prompt_family"}
# What the upstream tier does not report (KV14 is not judged on the release: the stand-in
# worker keeps no KV buffer; the tier drives no PD prebuilt arrival), left at the default.
NOT_REPORTED_FIELDS = {"kv_contents", "prebuilt"}


def _fields(view: type) -> set[str]:
    return {f.name for f in dataclasses.fields(view)}


def test_every_request_view_field_is_read_in_one_place() -> None:
    mapped = [f.view for f in REQUEST_FIELDS + TOKEN_FIELDS]
    assert len(mapped) == len(set(mapped))
    assert not set(mapped) & (READER_FIELDS | PLACEMENT_FIELDS | PREFIX_FIELDS)
    assert set(mapped) | READER_FIELDS | PLACEMENT_FIELDS | PREFIX_FIELDS | NOT_REPORTED_FIELDS \
        == _fields(RequestView)


def test_every_batch_view_field_is_read_in_one_place() -> None:
    mapped = {f.view for f in BATCH_FIELDS}
    assert mapped | {"forward_mode", "rids"} == _fields(BatchView)
    assert all(f.upstream for f in REQUEST_FIELDS + TOKEN_FIELDS + BATCH_FIELDS)


def _release_like_scheduler(chunked: bool) -> tuple[Any, Any]:
    """An object with 0.5.23's names: a request in the middle of a chunked prefill (its
    KV fields in ``Req.kv``), on a page-2 pool, the tree cache disabled."""
    kv = SimpleNamespace(kv_committed_len=4, kv_allocated_len=4, req_pool_idx=1,
                         holds_kv=True)
    req = SimpleNamespace(
        rid="r0", origin_input_ids=[3, 5, 7, 9, 11, 13], output_ids=[], kv=kv,
        output_ids_through_stop=[], sampling_params=SimpleNamespace(max_new_tokens=8),
        is_retracted=False, spec_verify_ct=0, spec_num_correct_drafts=0,
        prefix_len=2 if chunked else 0, extend_end=4 if chunked else None,
        inflight_middle_chunks=1 if chunked else 0, finished_reason=None,
        finished=lambda: False)
    table = torch.zeros((3, 8), dtype=torch.int64)
    table[1, :4] = torch.tensor([4, 5, 6, 7])
    alloc = SimpleNamespace(size=16, page_size=2, free_pages=torch.tensor([4, 5, 6, 7]),
                            release_pages=torch.tensor([], dtype=torch.int64),
                            get_all_free_pages=lambda: torch.tensor([4, 5, 6, 7]))
    sched = SimpleNamespace(
        waiting_queue=[], token_to_kv_pool_allocator=alloc,
        req_to_token_pool=SimpleNamespace(req_to_token=table, free_slots=[0, 2], size=3),
        tree_cache=SimpleNamespace(disable=True))
    return sched, req


def test_the_shim_reads_the_chunked_fields_the_adapter_reads() -> None:
    sched, req = _release_like_scheduler(chunked=True)
    fields = read_request(req, tokens=False)
    assert (fields["prefix_len"], fields["extend_end"], fields["inflight_middle_chunks"]) == (
        2, 4, 1)
    shim = TraceShim.__new__(TraceShim)
    shim.scheduler, shim.env_tokens = sched, False
    view = shim.get_request_view(_Track(req, RequestId(0)))
    assert (view.prefix_len, view.extend_end, view.inflight_middle_chunks) == (2, 4, 1)
    assert view.row_slots == (4, 5, 6, 7) and view.owned_pages == (2, 3)
    assert read_placement(sched, req, 2)["owned_pages"] == view.owned_pages
    # A first chunk not yet launched: extend_end None reads as 0, as the adapter's did.
    _, plain = _release_like_scheduler(chunked=False)
    assert read_request(plain, tokens=False)["extend_end"] == 0


def test_the_allocator_view_says_the_row_width_and_stands_down_for_a_radix_tree() -> None:
    sched, _ = _release_like_scheduler(chunked=False)
    view = read_allocator(sched)
    assert view is not None
    assert (view.total_pages, view.page_size, view.row_width) == (8, 2, 8)
    assert view.free_pages == (4, 5, 6, 7) and view.free_pool_rows == (0, 2)
    sched.tree_cache = SimpleNamespace(disable=False)  # the radix cache holds pages
    assert read_allocator(sched) is None


def test_a_reference_request_keeps_its_kv_fields_on_itself() -> None:
    req = SimpleNamespace(
        origin_input_ids=[1, 2], output_ids=[9], kv_committed_len=3, kv_allocated_len=3,
        req_pool_idx=None, sampling_params=SimpleNamespace(max_new_tokens=None))
    fields = read_request(req, tokens=True)
    assert fields["holds_kv"] is False and fields["req_pool_idx"] is None
    assert fields["output_ids"] == (9,) and fields["last_prompt_token"] == 2
    assert fields["max_new_tokens"] > 1 << 30  # no cap: unbounded
    assert (fields["prefix_len"], fields["extend_end"], fields["spec_verify_ct"]) == (0, 0, 0)
