"""Every sglang name the upstream tier relies on, and whether a tree still has it.

:data:`NEEDS` is the one list: each module, class, function, method and attribute that
``upstream/`` (the adapter, the hooks, the session, the stand-in worker and the stand-ins
of :mod:`upstream.standins`) imports, wraps, replaces, calls or reads, with the signature it
expects where it is a callable. :func:`check_compat` looks each one up in the imported
sglang, before anything is patched, and returns what is missing or changed; the tier refuses
to drive a tree with any (exit 3: ``cannot drive this sglang: <hook>: <what changed>``), so a
renamed private method is named as such instead of surfacing as an ``AttributeError``
somewhere inside the event loop. ``overlap-spec upstream compat`` prints the table.

A signature is compared exactly, as the parameter names and kinds (``(self, batch, *args,
**kwargs)``; annotations and default values are not compared): the hooks pass arguments
through by position and the stand-ins are called as the release calls the originals, so a
new or renamed parameter is a change to look at, not to guess past. A constructor the tier
calls with keywords lists those instead (``accepts``): the release's ``ServerArgs`` has
hundreds of fields and only the ones passed matter.

An instance attribute (``Scheduler.chunked_req``) is found as a class attribute, a
dataclass field or annotation, or an assignment ``self.<name> = ...`` in the source of
the class or one of its bases.

This module imports no sglang at import time (the offline tests read the table); the tests
check that every sglang import, every patched name and every attribute the adapter reads
off the release's objects is listed here (``tests/test_upstream_offline.py``), and that
the names a built session has patched are exactly listed ones (``tests/test_upstream_tier.py``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Final

SCHEDULER: Final = "sglang.srt.managers.scheduler"
BATCH: Final = "sglang.srt.managers.schedule_batch"
OVERLAP: Final = "sglang.srt.managers.overlap_utils"
RUNTIME: Final = "sglang.srt.runtime_context"
POOL: Final = "sglang.srt.mem_cache.memory_pool"
ALLOCATOR: Final = "sglang.srt.mem_cache.allocator"


@dataclass(frozen=True)
class Need:
    """One upstream name: ``module`` and the dotted ``name`` inside it ("" for the module).

    ``kind``: ``module``, ``class``, ``callable`` (with ``signature``, compared exactly, or
    ``accepts``, keywords it must take), ``attribute`` (on a class: its instances have it)
    or ``value`` (any object). ``use``: where the tier uses it and how."""

    module: str
    name: str
    kind: str
    use: str
    signature: str | None = None
    accepts: tuple[str, ...] = ()

    @property
    def hook(self) -> str:
        """The name a report shows: ``Scheduler.run_batch``, or the module's."""
        return self.name or self.module

    @property
    def expected(self) -> str:
        if self.signature is not None:
            return self.signature
        if self.accepts:
            return f"accepts {', '.join(self.accepts)}"
        return self.kind


def _m(module: str, use: str) -> Need:
    return Need(module, "", "module", use)


def _c(module: str, name: str, use: str) -> Need:
    return Need(module, name, "class", use)


def _f(module: str, name: str, signature: str, use: str) -> Need:
    return Need(module, name, "callable", use, signature=signature)


def _k(module: str, name: str, accepts: tuple[str, ...], use: str) -> Need:
    return Need(module, name, "callable", use, accepts=accepts)


def _a(module: str, cls: str, names: str, use: str) -> tuple[Need, ...]:
    return tuple(Need(module, f"{cls}.{n}", "attribute", use) for n in names.split())


def _v(module: str, name: str, use: str) -> Need:
    return Need(module, name, "value", use)


_HOOKED = "upstream/hooks.py: wrapped, the real method runs, then the spec observes"
_ADAPTER = "upstream/adapter.py: read for the spec's observation"
_SESSION = "upstream/session.py: builds the scheduler with the stand-ins"
_WORKER = "upstream/worker.py: the stand-in worker's forward"
_FORWARD = ("upstream/forward_batch.py: the release's ForwardBatch at each launch of the "
            "stand-in worker")
FORWARD_BATCH: Final = "sglang.srt.model_executor.forward_batch_info"

NEEDS: Final[tuple[Need, ...]] = (
    # ------------------------------------------------------------------ the package
    _v("sglang", "__version__", "upstream/bootstrap.py: the version the report names"),
    # ------------------------------------------------------------------ the scheduler
    _c(SCHEDULER, "Scheduler", _SESSION),
    _f(SCHEDULER, "Scheduler.__init__", "(self, server_args, port_args)", _SESSION),
    _f(SCHEDULER, "Scheduler.init_model_worker", "(self)",
       "upstream/session.py: replaced by the stand-in worker and the attributes it sets"),
    _f(SCHEDULER, "Scheduler.ingest_requests", "(self, stop_at_pause=)",
       "upstream/session.py: replaced per instance by the iteration rendezvous"),
    _f(SCHEDULER, "Scheduler.run_event_loop", "(self)", "upstream/session.py: the loop thread"),
    _f(SCHEDULER, "Scheduler.get_new_batch_prefill", "(self, running_batch)", _HOOKED),
    _f(SCHEDULER, "Scheduler.process_pending_chunked_abort", "(self)", _HOOKED),
    _f(SCHEDULER, "Scheduler.update_running_batch", "(self, batch)", _HOOKED),
    _f(SCHEDULER, "Scheduler.is_disable_overlap_for_batch",
       "(self, batch, last_batch)", _HOOKED),
    _f(SCHEDULER, "Scheduler.run_batch", "(self, batch, pp_proxy_tensors=)", _HOOKED),
    _f(SCHEDULER, "Scheduler.process_batch_result", "(self, batch, result)", _HOOKED),
    _f(SCHEDULER, "Scheduler._add_request_to_queue", "(self, req, is_retracted=)",
       "upstream/adapter.py: admits a request"),
    _f(SCHEDULER, "Scheduler.abort_request", "(self, recv_req)",
       "upstream/adapter.py, upstream/session.py: aborts one request, or all between examples"),
    _f(SCHEDULER, "Scheduler.flush_cache", "(self, empty_cache=)",
       "upstream/session.py: the reset between examples"),
    _f(SCHEDULER, "Scheduler.pause_generation", "(self, recv_req)",
       "upstream/adapter.py: the script's pause_retract"),
    _f(SCHEDULER, "Scheduler.continue_generation", "(self, recv_req)",
       "upstream/adapter.py: the script's continue"),
    _f(SCHEDULER, "Scheduler.is_fully_idle",
       "(self, for_health_check=, ignore_waiting=)",
       "upstream/session.py: the drain between examples"),
    _f(SCHEDULER, "Scheduler.on_idle", "(self)",
       _HOOKED + "; its idle-time checks are UC's verdict at idle"),
    _f(SCHEDULER, "Scheduler.init_req_max_new_tokens", "(self, req)",
       "upstream/adapter.py: the release's max_new_tokens cap at admission"),
    _f(SCHEDULER, "Scheduler.get_num_allocatable_reqs",
       "(self, running_bs, beam_width=, running_batch=, num_held_rows=)",
       "upstream/adapter.py: the rows PrefillAdder may fill (KV11)"),
    _f(SCHEDULER, "Scheduler.check_truncation_align_fits_chunk", "(self)",
       "upstream/session.py configure_chunking: the release's own chunk-size check"),
    *_a(SCHEDULER, "Scheduler",
        "chunked_prefill_size chunked_req enable_overlap forward_ct future_map invariant_checker "
        "is_mixed_chunk last_batch max_req_input_len new_token_ratio_tracker "
        "req_to_token_pool running_batch token_to_kv_pool_allocator tree_cache waiting_queue "
        "_pending_chunked_abort_req dynamic_chunk_sizer _engine_paused",
        "upstream/adapter.py, upstream/hooks.py, upstream/session.py: read off the scheduler"),
    _v(SCHEDULER, "resolve_forward_inputs",
       "upstream/hooks.py: the scheduler module's imported name, wrapped (FM4, FM5)"),
    _f(SCHEDULER, "resolve_forward_inputs", "(batch, future_map)", _HOOKED),
    _v(SCHEDULER, "kv_cache_builder", "upstream/session.py: its build_kv_cache is replaced"),
    _f(SCHEDULER, "kv_cache_builder.build_kv_cache",
       "(*, server_args, model_config, tp_worker, page_size, spec_algorithm, enable_metrics, "
       "enable_kv_cache_events, enable_hierarchical_cache, hicache_draft_plan=, "
       "dynamo_kv_event_format=, kv_event_lora_names=, draft_swa_window=)",
       "upstream/session.py: replaced; returns the pools the stand-in worker built"),
    _v(SCHEDULER, "TEST_RETRACT", "upstream/session.py: upstream's retraction knob, per iteration"),
    _v(SCHEDULER, "TEST_RETRACT_INTERVAL", "upstream/session.py: set to 1"),
    _v(SCHEDULER, "TEST_RETRACT_NO_PREFILL_BS", "upstream/session.py: set out of reach"),
    _v("sglang.srt.environ", "envs.SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP",
       "upstream/session.py: the environment's disable_overlap choice, per iteration"),
    _v("sglang.srt.environ", "envs.SGLANG_CHECK_KV_PAGE_INVARIANTS",
       "upstream/session.py: upstream's own checker, strict (UC)"),
    _v("sglang.srt.environ", "envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE",
       "upstream/session.py: upstream's own checker, strict (UC)"),
    _c("sglang.srt.managers.scheduler_components.invariant_checker",
       "SchedulerInvariantChecker", "upstream/adapter.py: upstream's own checker (UC)"),
    _f("sglang.srt.managers.scheduler_components.invariant_checker",
       "SchedulerInvariantChecker.self_check_during_busy", "(self)",
       "upstream/adapter.py: called after every iteration (UC)"),
    _f("sglang.srt.managers.scheduler_components.new_token_ratio_tracker",
       "NewTokenRatioTracker.reset", "(self)", "upstream/session.py: the reset between examples"),
    *_a("sglang.srt.managers.scheduler_components.new_token_ratio_tracker",
        "NewTokenRatioTracker", "current", _ADAPTER),
    _f("sglang.srt.managers.scheduler_components.metrics_reporter",
       "SchedulerMetricsReporter.update_spec_metrics",
       "(self, bs, num_correct_drafts, num_accept_tokens, num_block_accept_tokens=, "
       "num_cap_tokens=)",
       _HOOKED + " (RP3)"),
    # ------------------------------------------------------------------ batches, requests
    _f(BATCH, "ScheduleBatch.prepare_for_extend", "(self)", _HOOKED),
    _f(BATCH, "ScheduleBatch.prepare_for_decode", "(self)", _HOOKED),
    _f(BATCH, "ScheduleBatch.filter_batch",
       "(self, reqs_to_exclude=, keep_indices=)", _HOOKED),
    _f(BATCH, "ScheduleBatch.merge_batch", "(self, other)", _HOOKED),
    _f(BATCH, "ScheduleBatch.mix_with_running", "(self, running_batch)", _HOOKED),
    _f(BATCH, "ScheduleBatch.retract_decode", "(self)",
       _HOOKED + "; returns (retracted, new ratio, to abort)"),
    _f(BATCH, "ScheduleBatch.is_empty", "(self)", _ADAPTER),
    _k(BATCH, "ScheduleBatch", ("reqs", "batch_is_full"),
       "upstream/session.py: a fresh empty running batch between examples"),
    *_a(BATCH, "ScheduleBatch",
        "batch_is_full chunked_req decoding_reqs enable_overlap forward_mode input_ids "
        "is_prefill_only mix_running_indices prefill_input_ids_cpu req_pool_indices reqs "
        "seq_lens seq_lens_cpu seq_lens_sum spec_info",
        "upstream/adapter.py, upstream/hooks.py, upstream/worker.py: read off a batch"),
    *_a(BATCH, "ScheduleBatch", "out_cache_loc spec_algorithm",
        "upstream/forward_batch.py, upstream/worker.py: a draft's slots (set as "
        "prepare_for_draft sets them), the runners' speculative algorithm"),
    _k(BATCH, "NextBatchPlan", ("batch_to_run", "running_batch"),
       "upstream/hooks.py: the empty plan when the environment allows no prefill"),
    _k(BATCH, "Req", ("rid", "origin_input_text", "origin_input_ids", "sampling_params",
                      "vocab_size", "eos_token_ids"),
       "upstream/adapter.py: admits a request"),
    _f(BATCH, "Req.finished", "(self)", _ADAPTER),
    _f(BATCH, "Req.owned_kv_len", "(self)", "upstream/adapter.py: the cached length at release"),
    _f(BATCH, "Req.set_finish_with_abort", "(self, error_msg, status_code=, err_type=)",
       "upstream/adapter.py: a refused prompt, as handle_generate_request does"),
    *_a(BATCH, "Req",
        "extend_end finished_reason inflight_middle_chunks is_retracted kv origin_input_ids "
        "output_ids output_ids_through_stop prefix_len rid sampling_params "
        "spec_num_correct_drafts spec_verify_ct decode_batch_idx retraction_count",
        "upstream/adapter.py, upstream/worker.py: read off a request"),
    *_a(BATCH, "ReqKvInfo", "holds_kv kv_allocated_len kv_committed_len req_pool_idx",
        "upstream/adapter.py: the request's KV lengths and row"),
    *_a(BATCH, "ReqKvInfo", "cache_protected_len",
        "upstream/adapter.py on_release: what the tree keyed (--radix-force-miss)"),
    _f("sglang.srt.managers.utils", "validate_input_length",
       "(req, max_req_input_len, allow_auto_truncate)",
       "upstream/adapter.py: the release's length check at admission"),
    _k("sglang.srt.managers.utils", "GenerationBatchResult",
       ("next_token_ids", "new_seq_lens", "next_draft_input", "accept_lens",
        "speculative_num_draft_tokens"), _WORKER),
    _k("sglang.srt.managers.io_struct", "AbortReq", ("rid", "abort_all"),
       "upstream/adapter.py, upstream/session.py: aborts"),
    _k("sglang.srt.managers.io_struct", "PauseGenerationReqInput", ("mode",),
       "upstream/adapter.py: pause_retract"),
    _k("sglang.srt.managers.io_struct", "ContinueGenerationReqInput", ("torch_empty_cache",),
       "upstream/adapter.py: continue"),
    _k("sglang.srt.sampling.sampling_params", "SamplingParams",
       ("max_new_tokens", "temperature"), "upstream/adapter.py: admits a request"),
    _f("sglang.srt.sampling.sampling_params", "SamplingParams.normalize",
       "(self, tokenizer)", "upstream/adapter.py: admits a request"),
    *_a("sglang.srt.sampling.sampling_params", "SamplingParams", "max_new_tokens", _ADAPTER),
    _f(FORWARD_BATCH, "ForwardMode.is_extend", "(self, include_draft_extend_v2=)", _ADAPTER),
    _f(FORWARD_BATCH, "ForwardMode.is_decode", "(self)", _ADAPTER),
    _f(FORWARD_BATCH, "ForwardMode.is_mixed", "(self)", _ADAPTER),
    _f(FORWARD_BATCH, "ForwardMode.is_target_verify", "(self)",
       "upstream/adapter.py, upstream/forward_batch.py: a verify's relabelled batch"),
    _f(FORWARD_BATCH, "ForwardMode.is_draft_extend_v2", "(self)",
       "upstream/adapter.py, upstream/forward_batch.py: a draft-extend's relabelled batch"),
    # ------------------------------------------------------------------ the forward batch
    _c(FORWARD_BATCH, "ForwardBatch", _FORWARD),
    _f(FORWARD_BATCH, "ForwardBatch.init_new",
       "(cls, batch, model_runner, *, capture_hidden_mode=, return_hidden_states_before_norm, "
       "extend_position_info=, spec_mrope_positions=, kv_loc_plan=, write_cols=)",
       _FORWARD + ": called as tp_worker.py:653 and prepare_for_draft call it (SL1's "
       "back-fill of seq_lens_sum)"),
    *_a(FORWARD_BATCH, "ForwardBatch", "batch_size forward_mode seq_lens seq_lens_cpu "
        "seq_lens_sum", "upstream/adapter.py on_forward_batch: the INIT_NEW / DRAFT_EXTEND "
        "observation"),
    _v(FORWARD_BATCH, "CaptureHiddenMode.NULL", _FORWARD),
    _v(FORWARD_BATCH, "CaptureHiddenMode.LAST", _FORWARD),
    _v(FORWARD_BATCH, "CaptureHiddenMode.FULL", _FORWARD),
    _k("sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator",
       ("req_to_token", "token_to_kv_pool_allocator", "token_to_kv_pool", "page_size",
        "device", "is_draft_worker"),
       "upstream/forward_batch.py: the stand-in runners' translator (model_runner.py:950-961)"),
    _f("sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator.plan",
       "(self, *, req_pool_indices, seq_lens, seq_lens_cpu, write_virtual, read_extent=, "
       "write_slots=, translated_writes=)",
       "upstream/forward_batch.py: a chain draft plans the iteration's window"),
    *_a("sglang.srt.mem_cache.kv_loc_plan", "KVLocPlan", "write_virtual",
        "upstream/forward_batch.py: the planned window, the verify's out_cache_loc"),
    _f("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm.is_standalone", "(self)",
       "upstream/forward_batch.py: the capture mode, as the release chooses it"),
    _f("sglang.srt.speculative.eagle_utils", "eagle_prepare_for_verify",
       "(verify_input, req_to_token_pool, batch, target_worker)",
       _FORWARD + ": runs; builds the verify ForwardBatch"),
    _f("sglang.srt.speculative.eagle_worker_common", "prepare_for_draft_extend",
       "(draft_extend_input, batch, predict, num_draft_tokens, draft_model_runner, "
       "cuda_graph_runner, *, return_hidden_states_before_norm, widened_out_cache_loc=, "
       "widened_positions=, kv_loc_plan=)",
       _FORWARD + ": runs; the draft-extend ForwardBatch and its +D_tok (SL10)"),
    _k("sglang.srt.speculative.eagle_info", "EagleVerifyInput",
       ("draft_token", "custom_mask", "positions", "retrieve_index", "retrieve_next_token",
        "retrieve_next_sibling", "retrieve_cum_len", "spec_steps", "topk", "draft_token_num",
        "capture_hidden_mode", "seq_lens_sum", "seq_lens_cpu", "prepared_out_cache_loc"),
       "upstream/forward_batch.py: the verify input build_eagle_verify_input would assemble"),
    *_a("sglang.srt.speculative.eagle_info", "EagleVerifyInput", "kv_loc_plan", _FORWARD),
    _k("sglang.srt.speculative.eagle_info", "EagleDraftExtendInput",
       ("hidden_states", "num_correct_drafts", "num_accept_tokens", "num_tokens_per_req",
        "num_tokens_for_logprob_per_req"),
       "upstream/forward_batch.py: _draft_extend_for_decode's input"),
    # ------------------------------------------------------------------ the relay
    _f(OVERLAP, "FutureMap.resolve_seq_lens_cpu", "(self, batch, stream_ordered=)", _HOOKED),
    _f(OVERLAP, "FutureMap.stash", "(self, future_indices, payload)", _HOOKED),
    _f(OVERLAP, "FutureMap.publish",
       "(self, future_indices, new_seq_lens, confidence=)", _HOOKED),
    *_a(OVERLAP, "FutureMap", "new_seq_lens_buf spec_algo",
        "upstream/adapter.py, upstream/hooks.py: the relay's buffers"),
    _k("sglang.srt.speculative.eagle_info", "EagleDraftInput", ("bonus_tokens",), _WORKER),
    *_a("sglang.srt.speculative.eagle_info", "EagleDraftInput",
        "bonus_tokens future_indices topk_index topk_p", _WORKER),
    # prepare_for_draft also sets ``positions`` on it (eagle_worker_common.py:357), a name
    # the class does not declare: nothing to look up.
    *_a("sglang.srt.speculative.eagle_info", "EagleDraftInput",
        "num_tokens_per_req num_tokens_for_logprob_per_req", _FORWARD),
    _f("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2.forward_batch_generation",
       "(self, batch, on_publish=, grammar_barrier=, pp_proxy_tensors=)",
       "upstream/worker.py: the stand-in is called as the release calls this"),
    # ------------------------------------------------------------------ pools, cache
    _f("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool_func",
       "(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)",
       "upstream/session.py: the triton kernel, replaced by the same writes in torch"),
    _f("sglang.srt.mem_cache.allocation_sizing", "get_req_to_token_extra_context_len", "()",
       "upstream/session.py: the row past the context (check_geometry)"),
    _f("sglang.srt.mem_cache.allocation_sizing", "get_alloc_len_per_decode", "()",
       "upstream/session.py: the decode reserve A (check_geometry)"),
    _k(POOL, "ReqToTokenPool", ("size", "max_context_len", "device", "enable_memory_saver"),
       _SESSION),
    *_a(POOL, "ReqToTokenPool", "free_slots req_to_token size", _ADAPTER),
    _k(POOL, "MHATokenToKVPool", ("size", "page_size", "dtype", "head_num", "head_dim",
                                  "layer_num", "device", "enable_memory_saver"), _SESSION),
    _k(ALLOCATOR, "TokenToKVPoolAllocator", ("size", "dtype", "device", "kvcache",
                                             "need_sort"), _SESSION),
    _k(ALLOCATOR, "PagedTokenToKVPoolAllocator", ("size", "page_size", "dtype", "device",
                                                  "kvcache", "need_sort"), _SESSION),
    _f(ALLOCATOR, "TokenToKVPoolAllocator.available_size", "(self)", _ADAPTER),
    _f(ALLOCATOR, "PagedTokenToKVPoolAllocator.get_all_free_pages", "(self)", _ADAPTER),
    *_a(ALLOCATOR, "TokenToKVPoolAllocator", "free_pages release_pages", _ADAPTER),
    _k("sglang.srt.mem_cache.cache_init_params", "CacheInitParams",
       ("req_to_token_pool", "token_to_kv_pool_allocator", "page_size", "disable",
        "tree_components", "is_eagle", "tree_core_backend"), _SESSION),
    _v("sglang.srt.mem_cache.unified_cache.component_type", "ComponentType.FULL", _SESSION),
    _k("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", ("params",), _SESSION),
    _f("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.on_release",
       "(self, req, *, checkpointed)",
       "upstream/hooks.py watch_tree_cache: wrapped per instance (release count, cached length)"),
    _f("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.evictable_size",
       "(self)", _ADAPTER),
    _f("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.protected_size",
       "(self)", "upstream/fields.py read_tree (radix cells)"),
    _f("sglang.srt.managers.schedule_policy", "PrefillAdder.add_one_req",
       "(self, req, has_chunked_req, truncation_align_size)",
       "upstream/hooks.py: wrapped, a radix cell's candidate prefix for KV11"),
    _f("sglang.srt.mem_cache.prefill_budget", "PrefillBudget.check_prefill",
       "(self, *, extend_input_len, total_tokens, max_new_tokens, input_tokens, "
       "swa_host_hit_length, chunk_limit, auxiliary_swa_host_hit_length=)",
       "upstream/hooks.py: wrapped, the free KV a radix cell's candidate saw (KV11)"),
    _f("sglang.srt.mem_cache.prefill_budget", "PrefillBudget._available_and_evictable",
       "(self)", "upstream/hooks.py: the free KV a candidate's check saw (KV11)"),
    *_a("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "tree_core",
        "upstream/fields.py read_unlocked_tree_pages (--radix-force-miss)"),
    *_a("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeNode",
        "children component_data",
        "upstream/fields.py read_unlocked_tree_pages: the walk (--radix-force-miss)"),
    *_a(SCHEDULER, "Scheduler", "policy",
        "upstream/session.py: its waiting-prefix refresh count, reset between examples"),
    *_a("sglang.srt.managers.schedule_policy", "SchedulePolicy",
        "_waiting_prefix_refresh_calls",
        "upstream/session.py: reset between examples (the refresh's touch splits nodes)"),
    # The Rust tree core (--tree-core rust): what upstream/fields.py read_rust_tree reads.
    _f("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.insert",
       "(self, params)",
       "upstream/hooks.py watch_tree_cache: wrapped per instance on the Rust core (each "
       "slot's key element, read_rust_tree)"),
    *_a("sglang.srt.mem_cache.base_prefix_cache", "InsertParams", "key value",
        "upstream/fields.py record_inserted_keys (Rust core)"),
    _f("sglang.srt.mem_cache.rust_tree_core.adapter", "RustUnifiedTreeCore.pretty_print",
       "(self)", "upstream/fields.py read_rust_tree: the nodes, nesting, key lengths, locks"),
    _f("sglang.srt.mem_cache.rust_tree_core.adapter",
       "RustUnifiedTreeCore.get_component_device_value", "(self, node_id, component_type)",
       "upstream/fields.py read_rust_tree: a node's slots"),
    _f("sglang.srt.mem_cache.rust_tree_core.adapter", "RustUnifiedTreeCore.root_node_handle",
       "(self, extra_key=)", "upstream/fields.py read_prefix: the root's handle (Rust core)"),
    _v("sglang.srt.environ", "envs.SGLANG_RADIX_FORCE_MISS",
       "upstream/session.py: every match forced to miss (--radix-force-miss)"),
    # ------------------------------------------------------------------ configuration
    _k("sglang.srt.server_args", "ServerArgs",
       ("model_path", "device", "skip_tokenizer_init", "load_format", "attention_backend",
        "disable_radix_cache", "page_size", "max_running_requests", "max_total_tokens",
        "disable_cuda_graph", "disable_overlap_schedule", "enable_mixed_chunk",
        "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens"), "upstream/session.py publish_config: the cell's args"),
    _f("sglang.srt.server_args", "PortArgs.init_new", "(server_args, dp_rank=, worker_ports=)",
       _SESSION),
    *_a("sglang.srt.server_args", "PortArgs", "nccl_port",
        "upstream/session.py: a port the OS just handed out"),
    _f(RUNTIME, "publish", "(server_args, *, role, hf_config=, ranks=)",
       "upstream/session.py publish_config: the scheduler process's config"),
    _k(RUNTIME, "SpawnRanks", ("world_rank", "dp_rank", "gpu_id"), _SESSION),
    _f(RUNTIME, "get_context", "()", _SESSION),
    _f(RUNTIME, "RuntimeContext.override", "(self, source, **fields)",
       "upstream/session.py: the tier's overrides (overlap for spec on CPU, the backend)"),
    _f(RUNTIME, "attention_backends", "()", "upstream/session.py check_backends"),
    _f(RUNTIME, "get_parallel", "()", "upstream/session.py: the process groups"),
    # Its fields (tp_group, pp_size, ...) are read through __getattr__ from the published
    # configuration: nothing to look up before a scheduler is built.
    _c(RUNTIME, "ParallelContext", "upstream/session.py: the process groups"),
    _f("sglang.srt.layers.dp_attention", "get_dp_tp_group", "()", _SESSION),
)


@dataclass(frozen=True)
class Mismatch:
    """A listed name this sglang lacks, or has with another signature."""

    hook: str
    change: str

    def line(self) -> str:
        return f"cannot drive this sglang: {self.hook}: {self.change}"

    def to_json(self) -> dict[str, str]:
        return {"hook": self.hook, "change": self.change}


def describe_signature(obj: Any) -> str:
    """Parameter names and kinds only: ``(self, batch, *args, key=, **kwargs)``; a
    parameter with a default ends in ``=`` (its value is not compared)."""
    parts: list[str] = []
    star = False
    positional_only = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.POSITIONAL_ONLY:
            positional_only = True
        elif positional_only:
            parts.append("/")
            positional_only = False
        default = "=" if p.default is not p.empty else ""
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                parts.append("*")
                star = True
            parts.append(p.name + default)
        else:
            parts.append(p.name + default)
    if positional_only:
        parts.append("/")
    return f"({', '.join(parts)})"


def _accepts(obj: Any, names: tuple[str, ...]) -> list[str]:
    """The keywords of ``names`` a call of ``obj`` would refuse."""
    params = inspect.signature(obj).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [n for n in names if n not in params or params[n].kind is params[n].POSITIONAL_ONLY]


@functools.cache
def _assigned_names(cls: type) -> frozenset[str]:
    """``self.<name>`` assigned anywhere in the class's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return frozenset()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return frozenset(names)


def has_instance_attribute(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if klass is object:
            continue
        if name in vars(klass) or name in getattr(klass, "__annotations__", {}):
            return True
        if name in getattr(klass, "__dataclass_fields__", {}):
            return True
        if name in (getattr(klass, "__struct_fields__", ()) or ()):
            return True
        if name in _assigned_names(klass):
            return True
    return False


def check_need(need: Need) -> str | None:
    """None when this sglang has ``need`` as listed, else what changed (one line)."""
    try:
        obj: Any = importlib.import_module(need.module)
    except Exception as error:  # noqa: BLE001 - any failure: the module is not usable
        return f"module {need.module} does not import ({type(error).__name__}: {error})"[:300]
    parts = need.name.split(".") if need.name else []
    where = need.module
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if last and need.kind == "attribute":
            if not isinstance(obj, type):
                return f"{where} is no longer a class"
            if not has_instance_attribute(obj, part):
                return f"missing: {where} no longer has an attribute {part!r}"
            return None
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            return f"missing: {where} has no {part!r}"
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        where = f"{where}.{part}"
    if need.kind == "class" and not isinstance(obj, type):
        return f"{where} is no longer a class"
    if need.kind != "callable":
        return None
    if not callable(obj):
        return f"{where} is no longer callable"
    try:
        actual = describe_signature(obj)
    except (TypeError, ValueError):
        return None if need.signature is None else f"{where} has no readable signature"
    if need.signature is not None and actual != need.signature:
        return f"signature changed: now {actual}, the tier expects {need.signature}"
    refused = _accepts(obj, need.accepts)
    if refused:
        return f"no longer accepts {', '.join(refused)} (signature now {actual})"
    return None


def check_compat(needs: tuple[Need, ...] = NEEDS) -> list[tuple[Need, str | None]]:
    """Every need with what changed (None: present as listed). Call after sglang imported
    (:func:`upstream.bootstrap.load_sglang`) and before anything patched it."""
    return [(need, check_need(need)) for need in needs]


def get_mismatches(needs: tuple[Need, ...] = NEEDS) -> list[Mismatch]:
    return [Mismatch(need.hook, change) for need, change in check_compat(needs)
            if change is not None]


def render_compat(rows: list[tuple[Need, str | None]]) -> str:
    """The table ``overlap-spec upstream compat`` prints: hook, kind, status, expected."""
    width = max(len(n.hook) for n, _ in rows)
    lines = [f"{'hook':<{width}}  {'kind':<9}  status   expected / what changed"]
    for need, change in rows:
        status = "ok" if change is None else "MISSING" if change.startswith(
            ("missing", "module")) else "CHANGED"
        lines.append(f"{need.hook:<{width}}  {need.kind:<9}  {status:<7}  "
                     f"{need.expected if change is None else change}")
    bad = sum(change is not None for _, change in rows)
    lines.append(f"\n{len(rows) - bad}/{len(rows)} names present as the tier expects"
                 + (f"; {bad} missing or changed: the tier cannot drive this sglang"
                    if bad else ""))
    return "\n".join(lines)
