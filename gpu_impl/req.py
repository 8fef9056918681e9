"""``Req``: one request's host-side state in gpu_impl (upstream managers/schedule_batch.py).

Upstream keeps ``Req`` a plain Python object on the scheduler thread (fields later moved
under ``req.kv.*``, M2); so does gpu_impl. What lives in tensors is the batch state
(``ScheduleBatch``), the pools and the FutureMap relay. Unlike the reference there is no
ghost beside the request: gpu_impl is checked by the differential run and the race
detector, not by the invariant observer.

The stand-in model's tokens are the environment's (``spec.state``): the forward computes them
as a tensor expression (:func:`compute_env_tokens_tensor`), checked against the spec's
definition by the differential run and ``tests/test_gpu_impl.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overlap_spec.spec.radix import Node
from overlap_spec.spec.state import get_prompt_tokens
from overlap_spec.spec.units import PageId, PoolRow, RequestId, TokenCount


def get_env_chain_coefficients(stride: int) -> tuple[list[int], list[int], list[int]]:
    """(G, S, T) with ``t_k - 1 = (G[k] w + S[k] b + T[k]) mod 97`` for the k-th token of a
    chain of ``spec.state.compute_env_token`` (``t_k = 1 + (31 rid + 7 (p + k) + 11 t_{k-1})
    mod 97``), where ``w = (31 rid + 7 p + 11 previous) mod 97`` and ``b = 31 rid + 7 p +
    11``: the recurrence solved, so a forward computes every token of a run at once."""
    g, s, t = [1], [0], [0]
    for k in range(1, stride):
        g.append(g[-1] * 11 % 97)
        s.append((s[-1] * 11 + 1) % 97)
        t.append((t[-1] * 11 + 7 * k) % 97)
    return g, s, t


def compute_env_tokens_tensor(rid: torch.Tensor, position: torch.Tensor, previous: torch.Tensor,
                              g: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``spec.state.get_env_tokens`` elementwise on int64 tensors: the token at offset k of a
    run that starts at ``position`` after ``previous``, with ``g, s, t`` the coefficients of
    each element's offset (:func:`get_env_chain_coefficients`)."""
    base = rid * 31 + position * 7
    return 1 + (g * ((base + previous * 11) % 97) + s * (base + 11) + t) % 97


@dataclass
class Req:
    rid: RequestId
    prompt_len: TokenCount
    max_new_tokens: TokenCount
    last_prompt_token: int  # origin_input_ids[-1]: where the token chain starts
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
    # Chunked prefill (spec.state.RequestRecord): the checkpointed prefix the next chunk
    # starts from, where the extend scheduled last ends, and the middle chunks launched
    # with their results unprocessed.
    prefix_len: int = 0
    extend_end: int = 0
    epoch: int = 0  # retractions so far (the reference's ghost epoch)
    inflight_middle_chunks: int = 0
    # The prompt's tokens (spec.state.get_prompt_tokens): its family's, one token if refused.
    family: int = 0
    refused: bool = False
    # The radix cache (a radix cell): row[0:cache_protected_len] holds the tree path's slots
    # (pages[:cpl // page] are the tree's); ``lock`` is the node the request's tree lock
    # holds (taken at admission, moved by each checkpoint, dropped at the release; the
    # root: no prefix); ``matched_len`` the last match while waiting; ``hidden_ids`` the last
    # result's accepted tokens past the visible output, which a finish release keys.
    cache_protected_len: int = 0
    lock: Node | None = None
    matched_len: int = 0
    hidden_ids: tuple[int, ...] = ()

    def finished(self) -> bool:
        return self.finished_reason is not None

    def get_protected_len(self) -> int:
        """``req.kv.cache_protected_len`` as the release shows it (reference ``Req``): a
        waiting request's is its last match's; from its prefill on, the request's own."""
        held = self.holds_kv or self.release_count > 0
        return self.cache_protected_len if held else self.matched_len

    def get_fill_tokens(self) -> list[int]:
        """``full_untruncated_fill_ids``: the prompt's tokens and every output token."""
        return get_prompt_tokens(self.family, self.prompt_len, self.refused) + self.output_ids

    def update_finish_state(self, hit_eos: bool) -> None:
        """A deferred abort wins, then EOS, then the length limit."""
        if self.to_finish is not None:
            self.finished_reason = self.to_finish
        elif hit_eos:
            self.finished_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = "length"

    def reset_for_retract(self, keep_prefix: bool = False) -> None:
        """Back to the waiting queue with no KV; output_ids are kept for the re-prefill.
        A new epoch: the writer its KV writes name (``compute_kv_writer``). ``keep_prefix``:
        B36, the last prefill's end kept as ``prefix_len`` (the reference checkpoints it
        there at the prefill's result; this port only for a chunked request)."""
        self.epoch += 1
        self.is_retracted = True
        self.prebuilt = False
        self.waiting = True
        self.holds_kv = False
        self.req_pool_idx = None
        self.pages = []
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.release_count = 0
        self.prefix_len = max(self.prefix_len, self.extend_end) if keep_prefix else 0
        self.extend_end = 0
        self.inflight_middle_chunks = 0
        self.cache_protected_len = 0
        self.lock = None
