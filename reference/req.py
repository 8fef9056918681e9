"""``Req``: one request's host-side state, held as the spec's :class:`RequestRecord`.

Upstream: ``managers/schedule_batch.py`` (Req, reset_for_retract,
update_finish_state), fields later moved under ``req.kv.*`` (M2).

Every per-request update is a transition of ``spec/relation.py``, applied with
:meth:`Req.apply`; the fields read as before but cannot be assigned, so no update
bypasses a transition's guard and frame. The pages that back the row are the
allocator's and stay here (``reference/mem_cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec

from overlap_spec.spec.radix import Node
from overlap_spec.spec.relation import Ghost, RequestRecord, admit
from overlap_spec.spec.state import get_prompt_tokens
from overlap_spec.spec.units import PageId, PoolRow, RequestId, TokenCount

P = ParamSpec("P")


class Req:
    def __init__(self, rid: RequestId, prompt_len: TokenCount, max_new_tokens: TokenCount,
                 prebuilt: bool = False, refused: bool = False, family: int | None = None) -> None:
        self.state = admit(rid, prompt_len, max_new_tokens, prebuilt, refused, family)
        self.family = rid if family is None else family  # the prompt's tokens (spec.state)
        self.refused = refused
        # Page k holds columns [k*p, (k+1)*p); below cache_protected_len the tree's pages.
        self.pages: list[PageId] = []
        self.inserted_len: int | None = None  # what the tree keyed at the finish release
        # The radix cache: the node the request's tree lock holds (``Req.lock``, taken at
        # admission, moved by each checkpoint, dropped at the release; the root: no prefix).
        self.lock: Node | None = None
        # The last result's accepted tokens past the visible output (an abort's run past the
        # cap or EOS): committed KV that a finish release keys, as the release's
        # ``output_ids`` hold them behind ``finished_len``.
        self.hidden_ids: tuple[int, ...] = ()
        self.matched_len = 0  # the last match's length while waiting (get_protected_len)

    def apply(self, transition: Callable[Concatenate[RequestRecord, P], RequestRecord],
              *args: P.args, **kwargs: P.kwargs) -> None:
        self.state = transition(self.state, *args, **kwargs)

    def finished(self) -> bool:
        return self.state.is_finished()

    def get_protected_len(self) -> int:
        """``req.kv.cache_protected_len`` as the release shows it: a waiting request's is its
        last match's length (``match_kv_cache`` sets it, schedule_batch.py:1742, whether
        or not admission takes it); the record holds it from the prefill on."""
        held = self.holds_kv or self.release_count > 0
        return self.cache_protected_len if held else self.matched_len

    def get_fill_tokens(self) -> list[int]:
        """``full_untruncated_fill_ids``: the prompt's tokens and every output token."""
        return get_prompt_tokens(self.family, self.prompt_len, self.refused) + list(
            self.output_ids)

    # Read-only views of the record, under upstream's names.
    @property
    def rid(self) -> RequestId:
        return self.state.rid

    @property
    def prompt_len(self) -> TokenCount:
        return self.state.prompt_len

    @property
    def max_new_tokens(self) -> TokenCount:
        return self.state.max_new_tokens

    @property
    def last_prompt_token(self) -> int:
        return self.state.last_prompt_token

    @property
    def output_ids(self) -> tuple[int, ...]:
        return self.state.output_ids

    @property
    def kv_committed_len(self) -> int:
        return self.state.kv_committed_len

    @property
    def kv_allocated_len(self) -> int:
        return self.state.kv_allocated_len

    @property
    def req_pool_idx(self) -> PoolRow | None:
        return self.state.req_pool_idx

    @property
    def finished_reason(self) -> str | None:
        return self.state.finished_reason

    @property
    def spec_verify_ct(self) -> int:
        return self.state.spec_verify_ct

    @property
    def spec_num_correct_drafts(self) -> int:
        return self.state.spec_num_correct_drafts

    @property
    def is_retracted(self) -> bool:
        return self.state.is_retracted

    @property
    def prebuilt(self) -> bool:
        return self.state.prebuilt

    @property
    def waiting(self) -> bool:
        return self.state.waiting

    @property
    def holds_kv(self) -> bool:
        return self.state.holds_kv

    @property
    def release_count(self) -> int:
        return self.state.release_count

    @property
    def cached_len(self) -> int | None:
        return self.state.cached_len

    @property
    def committed_at_release(self) -> int | None:
        return self.state.committed_at_release

    @property
    def prefix_len(self) -> int:
        return self.state.prefix_len

    @property
    def cache_protected_len(self) -> int:
        return self.state.cache_protected_len

    @property
    def extend_end(self) -> int:
        return self.state.extend_end

    @property
    def inflight_middle_chunks(self) -> int:
        return self.state.inflight_middle_chunks

    @property
    def ghost(self) -> Ghost:
        return self.state.ghost
