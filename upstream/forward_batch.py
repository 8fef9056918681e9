"""The release's ``ForwardBatch.init_new`` at every launch of the stand-in worker.

The stand-in worker (:mod:`upstream.worker`) replaces the model, not the release's forward
batch: at each launch it calls ``ForwardBatch.init_new`` (0.5.23
``model_executor/forward_batch_info.py:958``) where the release's workers call it, on the
``ScheduleBatch`` that ``Scheduler.run_batch`` handed the worker. So the lazy
``seq_lens_sum`` is back-filled by the release's own code (``:1019-1020``, PR #25818: SL1),
and the spec observes the ``ForwardBatch`` the release built (``ObservationPoint.INIT_NEW``;
the draft-extend's after its +D_tok, ``ObservationPoint.DRAFT_EXTEND``)::

    launch        where the release builds it                          purpose
    non-spec      tp_worker.py:653 forward_batch_generation            extend | mixed | decode
    spec prefill  eagle_worker_v2.py:1557 _forward_prefill_batch
                  → tp_worker.py:653 (capture FULL)                    extend | mixed
    spec decode   eagle_worker_common.py:241 prepare_for_draft :362    draft
                  eagle_utils.py:305 eagle_prepare_for_verify :389     verify
                  (publish)
                  eagle_worker_common.py:112 prepare_for_draft_extend  draft_extend (+D_tok)

What runs is the release's: ``init_new`` at every row of that table;
``eagle_prepare_for_verify``, whose edits of the batch (``TARGET_VERIFY``, the draft tokens
as ``input_ids``, the verify window as ``out_cache_loc``) the scheduler's
``_forward_isolation`` must undo (SL9); and ``prepare_for_draft_extend``, which relabels the
batch ``DRAFT_EXTEND_V2`` and puts the +D_tok on the ``ForwardBatch`` only (SL10, #26020).
What the stand-in reproduces is what needs a kernel with no CPU driver or a model
(docs/upstream-model-runner.md, section c): ``prepare_for_draft``'s slot copy
(``assign_draft_cache_locs_contiguous``, a ``@triton.jit`` kernel), the verify window
(``assign_extend_cache_locs_uniform``, triton), handed to ``eagle_prepare_for_verify`` as
``prepared_out_cache_loc`` as the release's own chain draft hands it
(``eagle_worker_v2.py:734``), and the verify input itself (``build_eagle_verify_input``: the
tree builder has no CPU branch, ``spec_tree.py:427-431``; the draft tokens are the
environment's).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from overlap_spec.spec.config import SpecShape

__all__ = ["StandInForwards", "StandInRunner", "get_purpose", "read_row_window"]


class _NoAttentionBackend:
    """The draft runner's attention backend, which ``prepare_for_draft_extend`` asks to
    plan the draft-extend (``eagle_worker_common.py:227``). No attention runs here; the
    release's backend builds its metadata from ``req_to_token``, the draft-extend's last
    read of it (the WAR fence's read-done point, ST2: streams need CUDA)."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        return None


class StandInRunner:
    """The ``ModelRunner`` attributes ``ForwardBatch.init_new`` reads
    (docs/upstream-model-runner.md, section b) and the spec preparations around it, and no
    others: there is no ``__getattr__`` default, so an attribute a later release starts
    reading raises inside the loop (a crash, never a pass).

    ``init_new`` reads ``watermark_state`` only off a real ``ModelRunner``
    (``forward_batch_info.py:1033-1037``), and ``get_parallel()`` /
    ``get_server_return_hidden_states_mode()`` from the published configuration."""

    device = "cpu"  # forward_batch_info.py:1128
    lora_manager = None  # :1181, :1288
    # compute_position (:1250): torch_native takes compute_position_torch (:2397).
    prefill_attention_backend_str = "torch_native"
    decode_cuda_graph_runner = None  # eagle_utils.py:400: no graph is captured on CPU

    def __init__(self, pools: Any, page_size: int, is_draft_worker: bool,
                 spec_algorithm: Any) -> None:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        self.is_draft_worker = is_draft_worker  # :983, :1124, :1169, :1173
        self.spec_algorithm = spec_algorithm  # capture modes, eagle_utils.py:384
        # :1131 (_maybe_build_forward_token_modalities) and :1178, :1264: a text model.
        self.model_config = SimpleNamespace(model_is_mrope=False,
                                            requires_mm_token_modalities=False)
        self.ngram_embedding_manager = SimpleNamespace(enabled=False)  # :1261
        self.attn_backend = _NoAttentionBackend()
        # :1139-1142 own_plan / bind: the release's translator over the tier's pools,
        # built as model_runner.py:950-961 builds it (a plain pool translates nothing).
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=pools.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
            token_to_kv_pool=pools.token_to_kv_pool, page_size=page_size, device="cpu",
            is_draft_worker=is_draft_worker)


def get_purpose(forward_mode: Any, is_draft_worker: bool) -> str:
    """The spec's name for a ``ForwardBatch`` (``ForwardView.purpose``) from the mode the
    release built it with and the runner it was built for."""
    if forward_mode.is_target_verify():
        return "verify"
    if forward_mode.is_draft_extend_v2():
        return "draft_extend"
    if forward_mode.is_mixed():
        return "mixed"
    if forward_mode.is_extend():
        return "extend"
    if forward_mode.is_decode():
        return "draft" if is_draft_worker else "decode"
    raise ValueError(f"the stand-in builds no ForwardBatch in mode {forward_mode!r}")


def read_row_window(req_to_token: Any, rows: Any, starts: Any, width: int) -> Any:
    """``width`` slots of each row from its start, read as the release's triton copies
    (``assign_draft_cache_locs_contiguous``, ``assign_extend_cache_locs_uniform``) load
    them: ``req_to_token + row * stride + start + i``, no column bound, so a window past a
    row reads the next row's first columns (U7); past the whole pool it raises."""
    import torch

    flat = req_to_token.view(-1)
    stride = req_to_token.shape[1]
    offsets = (rows.to(torch.int64) * stride + starts.to(torch.int64)).reshape(-1, 1)
    index = (offsets + torch.arange(width, dtype=torch.int64)).reshape(-1)
    if index.numel() and int(index.max()) >= flat.numel():
        raise IndexError(f"a {width}-slot window from columns {starts.tolist()} of rows "
                         f"{rows.tolist()} runs past the req_to_token pool "
                         f"({flat.numel()} entries)")
    return flat[index].to(torch.int64)


class StandInForwards:
    """The target and draft runners of the stand-in worker, and the release's
    ``ForwardBatch`` constructions at its launches (the table in the module's header)."""

    def __init__(self, pools: Any, page_size: int, spec_algorithm: Any) -> None:
        self.pools = pools
        self.page_size = page_size
        self.target = StandInRunner(pools, page_size, False, spec_algorithm)
        self.draft = StandInRunner(pools, page_size, True, spec_algorithm)
        # What eagle_prepare_for_verify reads off its target_worker.
        self.target_worker = SimpleNamespace(model_runner=self.target)

    def init_new(self, batch: Any, spec: bool) -> Any:
        """``TpModelWorker.forward_batch_generation``'s call (``tp_worker.py:653``): a
        non-spec launch, or a spec prefill's target forward, which captures every hidden
        state for the draft-extend (``eagle_worker_v2.py:1552-1556``)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        capture = None
        if spec:
            capture = (CaptureHiddenMode.NULL if self.target.spec_algorithm.is_standalone()
                       else CaptureHiddenMode.FULL)
        return ForwardBatch.init_new(batch, self.target, capture_hidden_mode=capture,
                                     return_hidden_states_before_norm=False)

    def prepare_draft(self, batch: Any, shape: SpecShape, slots: list[list[int]]
                      ) -> tuple[Any, Any]:
        """``prepare_for_draft`` (``eagle_worker_common.py:241-375``) with its slot copy in
        torch: ``out_cache_loc`` is each row's ``topk * cols`` slots from ``seq_lens``
        (page 1 or a chain), or on a tree with pages > 1 the row gathered at the draft's
        ``slots`` (``spec.transitions.compute_draft_writes``: ``:316-333``). A chain whose
        verify is wider than its steps plans the iteration's whole window with the
        target's translator, writing its first ``steps`` columns (``plans_window``,
        ``:265-307``; ``_is_cpu`` is sglang's CPU engine, not this tier). Then the release's
        ``init_new`` with the draft runner. Returns the ``ForwardBatch`` and the plan."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        draft_input = batch.spec_info
        req_to_token = self.pools.req_to_token_pool.req_to_token
        plans_window = shape.topk == 1 and shape.draft_tokens > shape.steps
        cols = shape.draft_tokens if plans_window else shape.steps
        if self.page_size == 1 or shape.topk == 1:
            batch.out_cache_loc = read_row_window(req_to_token, batch.req_pool_indices,
                                                  batch.seq_lens, shape.topk * cols)
        else:
            rows = req_to_token[batch.req_pool_indices.long()]
            positions = torch.tensor(slots, dtype=torch.int64)
            batch.out_cache_loc = torch.gather(rows, 1, positions).reshape(-1).to(
                torch.int64)
        plan = None
        if plans_window:
            plan = self.target.kv_index_translator.plan(
                req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                seq_lens_cpu=batch.seq_lens_cpu, write_virtual=batch.out_cache_loc,
                read_extent=shape.draft_tokens)
        draft_input.num_tokens_per_req = shape.topk
        draft_input.num_tokens_for_logprob_per_req = shape.topk
        draft_input.positions = batch.seq_lens.repeat_interleave(shape.topk, dim=0)
        capture = (CaptureHiddenMode.NULL if self.draft.spec_algorithm.is_standalone()
                   else CaptureHiddenMode.LAST)
        forward_batch = ForwardBatch.init_new(
            batch, self.draft, capture_hidden_mode=capture,
            return_hidden_states_before_norm=False, spec_mrope_positions=None,
            kv_loc_plan=plan, write_cols=None if plan is None else slice(0, shape.steps))
        return forward_batch, plan

    def prepare_verify(self, batch: Any, shape: SpecShape, draft_tokens: Any,
                       plan: Any) -> Any:
        """The verify input ``build_eagle_verify_input`` would assemble
        (``eagle_worker_common.py:472-489``), put on the batch as
        ``forward_batch_generation`` puts it (``eagle_worker_v2.py:1482``), then the
        release's ``eagle_prepare_for_verify`` (``eagle_utils.py:305``), which builds the
        verify ``ForwardBatch``. The window ``[s, s + D_tok)`` is handed in as
        ``prepared_out_cache_loc``: the plan's, as the chain draft hands it
        (``eagle_worker_v2.py:732-734``), else read as ``assign_extend_cache_locs_uniform``
        would. No tree is built (no mask, retrieve indices or positions: the tree builder
        has no CPU branch, ``spec_tree.py:427-431``), so ``init_new`` takes
        ``clamp_position(seq_lens)`` (``forward_batch_info.py:1225-1228``); the spec
        observes no position."""
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        from sglang.srt.speculative.eagle_utils import eagle_prepare_for_verify

        if plan is not None:
            window = plan.write_virtual
        else:
            window = read_row_window(self.pools.req_to_token_pool.req_to_token,
                                     batch.req_pool_indices, batch.seq_lens,
                                     shape.draft_tokens)
        verify_input = EagleVerifyInput(
            draft_token=draft_tokens, custom_mask=None, positions=None, retrieve_index=None,
            retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
            spec_steps=shape.steps, topk=shape.topk, draft_token_num=shape.draft_tokens,
            capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None,
            prepared_out_cache_loc=window)
        verify_input.kv_loc_plan = plan
        batch.spec_info = verify_input
        forward_batch, _ = eagle_prepare_for_verify(
            verify_input, self.pools.req_to_token_pool, batch, self.target_worker)
        return forward_batch

    def prepare_draft_extend(self, batch: Any, shape: SpecShape, accept_lens: Any,
                             next_token_ids: Any, plan: Any) -> Any:
        """``_draft_extend_for_decode``'s inputs as its non-CUDA branch computes them (plain
        torch, ``eagle_worker_v2.py:1133-1146``; no hidden states: no model), then the
        release's ``prepare_for_draft_extend`` (``eagle_worker_common.py:112``): the batch
        relabelled ``DRAFT_EXTEND_V2`` with its extend lengths, ``init_new`` with the draft
        runner, and the +D_tok on the ``ForwardBatch`` only (``:213-218``)."""
        import torch
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
        from sglang.srt.speculative.eagle_worker_common import prepare_for_draft_extend

        draft_extend_input = EagleDraftExtendInput(
            hidden_states=None, num_correct_drafts=accept_lens - 1,
            num_accept_tokens=accept_lens, num_tokens_per_req=shape.draft_tokens,
            num_tokens_for_logprob_per_req=shape.draft_tokens)
        return prepare_for_draft_extend(
            draft_extend_input, batch, next_token_ids.to(torch.int64), shape.draft_tokens,
            self.draft, None, return_hidden_states_before_norm=False, kv_loc_plan=plan)
