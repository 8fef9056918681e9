"""Every stand-in and monkeypatch the upstream tier applies to sglang, in one place.

The tier drives the release's own ``Scheduler`` (``__init__``, ``run_event_loop`` →
``event_loop_overlap`` / ``event_loop_normal``), ``ScheduleBatch``, ``Req``,
``ReqToTokenPool``, the token-to-KV allocators, ``release_kv_cache``, ``EagleDraftInput``
and its reserve (``eagle_prepare_for_decode``), ``FutureMap``, the batch result processor,
and at every launch ``ForwardBatch.init_new`` with, for a spec decode,
``eagle_prepare_for_verify`` and ``prepare_for_draft_extend`` (upstream/forward_batch.py).
What is replaced is what needs a model or a GPU, plus hooks that only observe.
:data:`STAND_INS` is the list a reader checks; ``overlap-spec upstream stand-ins`` prints it
and the JSON report of ``overlap-spec upstream check`` carries it.

Blocker for the release's model runner (measured, docs/upstream-model-runner.md). The registry
has no CPU build of sgl-kernel: ``sglang-kernel`` 0.4.10 and ``sgl-kernel`` 0.3.21 are CUDA
manylinux wheels, whose ``common_ops.abi3.so`` needs ``libcuda.so.1``, ``libc10_cuda.so`` and
``libtorch_cuda.so``. So sglang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``intel_amx``) fails
at import, in ``kernels/ops/kvcache/cache_move.py:10``:
``No module named 'sgl_kernel'``. Without that engine, ``device="cpu"`` takes the pure-torch
``forward_native`` ops. The real ``ModelRunner`` then builds and runs a tiny llama
(``load_format=dummy``, torch_native) once ``vllm._custom_ops`` is importable, which
``layers/rotary_embedding/base.py:138`` imports and never calls on that path. EAGLE v2 has
three more blockers:

* ``draft_utils.py:64`` raises ``EAGLE is not supported in decode attention backend
  torch_native``.
* The spec KV pool warms a ``@triton.jit`` kernel (``memory_pool.py:2420``): ``0 active
  drivers``.
* ``spec_tree.py:427-431`` has no tree builder on this platform: ``NameError
  sgl_build_tree_kernel_efficient``.

The first two go away under ``TRITON_INTERPRET=1`` with ``attention_backend="triton"``, and the
third with the release's XPU triton branch. Step 1 of that document's plan is done: the
release's ``ForwardBatch.init_new`` runs at every launch (SL1 and SL10 are judged on the
release); steps 2 and 3 (the release's ``ModelRunner``, its ``EAGLEWorkerV2``) are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class StandIn:
    target: str  # the upstream name replaced or wrapped
    kind: str  # "replaced" (behaviour differs from upstream) | "observed" (wrapped, unchanged)
    reason: str


STAND_INS: Final[tuple[StandIn, ...]] = (
    StandIn("torchvision (module)", "replaced",
            "the registry's torchvision builds are CUDA builds that do not load on torch "
            "2.13.0+cpu; sglang imports torchvision.transforms at module level and never "
            "calls it on this path (upstream/bootstrap.py)"),
    StandIn("Scheduler.init_model_worker", "replaced",
            "needs a model: replaced by the stand-in worker (upstream/worker.py) plus the "
            "attributes the real method sets (limits, streams, process groups)"),
    StandIn("scheduler.kv_cache_builder.build_kv_cache", "replaced",
            "needs model shapes: returns the real ReqToTokenPool, MHATokenToKVPool, "
            "TokenToKVPoolAllocator / PagedTokenToKVPoolAllocator and a disabled "
            "UnifiedRadixCache sized from the preset, built by the init_model_worker "
            "stand-in (where the release's _init_pools runs)"),
    StandIn("mem_cache.allocation.assign_req_to_token_pool_func", "replaced",
            "a @triton.jit kernel on the spec-decode reserve path; replaced by the same "
            "writes in torch (no CPU triton driver), through the flat view as the kernel "
            "stores them: past a row into the next one (U7), past the pool a crash"),
    StandIn("model forward (tp_worker.forward_batch_generation, ModelRunner.forward)",
            "replaced",
            "the environment: tokens, accept lengths, EOS; publishes where eagle_worker_v2 "
            "does; writes KV slots through req_to_token (a spec decode: the draft's slots "
            "and tail copies, spec.transitions.compute_draft_writes, then the verify window "
            "[s, s + D_tok); a tree on pages > 1 first gathers what prepare_for_draft "
            "gathers from the row, which raises past it as the release's torch.gather does "
            "on CPU) and counts writes outside what a request owns; keeps the ghost truth "
            "(upstream/worker.py). The ForwardBatch is the release's: each launch calls "
            "ForwardBatch.init_new on the ScheduleBatch run_batch handed the worker, where "
            "tp_worker.py:653 calls it (upstream/forward_batch.py), and the spec observes it "
            "(INIT_NEW)"),
    StandIn("ModelRunner (the runner ForwardBatch.init_new is handed)", "replaced",
            "a target and a draft StandInRunner carrying only what init_new, "
            "eagle_prepare_for_verify and prepare_for_draft_extend read (is_draft_worker, "
            "device, a text model_config, the release's KVIndexTranslator over the tier's "
            "pools, lora_manager None, prefill_attention_backend_str torch_native, "
            "ngram_embedding_manager.enabled False, spec_algorithm, no decode cuda graph): "
            "no default for any other name, so a new read crashes the loop "
            "(docs/upstream-model-runner.md, section b; upstream/forward_batch.py)"),
    StandIn("draft runner attn_backend.init_forward_metadata", "replaced",
            "prepare_for_draft_extend (eagle_worker_common.py:227) asks the draft's attention "
            "backend to plan the draft-extend; no attention runs on the tier, so the "
            "stand-in backend plans nothing (the release's reads req_to_token there: the WAR "
            "fence's read-done point, ST2, needs CUDA)"),
    StandIn("eagle_worker_v2 bookkeeping: EAGLEWorkerV2.draft / verify "
            "(run_eagle_verify) / _draft_extend_for_decode, _forward_prefill_batch's "
            "_draft_extend_for_prefill", "replaced",
            "what the stand-in reproduces around the release's own init_new, "
            "eagle_prepare_for_verify and prepare_for_draft_extend (which run): "
            "prepare_for_draft's slot copy (assign_draft_cache_locs_contiguous, a "
            "@triton.jit kernel with no CPU driver) in torch through the flat view, the "
            "chain's window plan (KVIndexTranslator.plan) and the draft input's positions; "
            "the verify input build_eagle_verify_input would assemble (no tree: its builder "
            "has no CPU branch, spec_tree.py:427-431), with the window "
            "assign_extend_cache_locs_uniform (triton) would read handed in as "
            "prepared_out_cache_loc, as the chain draft does (eagle_worker_v2.py:734); the "
            "draft tokens, the verify's accept lengths and new_seq_lens (run_eagle_verify: "
            "target forward, eagle_sample, prepare_verify_commit_outputs / "
            "seq_lens + accept_lens, fill_bonus_tokens; so SL8 is not judged), "
            "_draft_extend_for_decode's non-CUDA inputs (eagle_worker_v2.py:1133-1146) and "
            "its draft forward; a prefill's draft-extend is not built. Blocker for running "
            "EAGLEWorkerV2 itself (docs/upstream-model-runner.md, 'Plan', step 3, 3-5 days): "
            "set TRITON_INTERPRET=1 before load_sglang() (the forking cell server too) and "
            "build it with attention_backend=triton (draft_utils.py:64 refuses "
            "torch_native), which also needs the release's real TpModelWorker/ModelRunner "
            "(step 2: the vllm._custom_ops import stand-in, rotary_embedding/base.py:138); "
            "take the release's XPU triton tree builder and greedy verify "
            "(spec_tree._is_xpu, a listed stand-in); put the environment at eagle_sample "
            "(eagle_utils.py:521: predict, accept_index, num_correct_drafts from its accept "
            "lengths and EOS); then drop compute_draft_writes' KV mirror and the stand-in's "
            "on_publish; first measure pages > 1 and topk > 1, the overlap loop on its "
            "thread with the real worker, the interpreter on a store past a tensor's end "
            "(U7) and its run time against the 30 s a cell"),
    StandIn("Scheduler.ingest_requests", "replaced",
            "the per-iteration request-ingest hook is the iteration boundary: the loop "
            "thread parks there; admissions and aborts are applied by the driver while it "
            "is parked (Scheduler._add_request_to_queue, Scheduler.abort_request)"),
    StandIn("Scheduler.get_new_batch_prefill", "observed",
            "returns an empty plan when the environment's choice allow_prefill is False "
            "(the PrefillAdder budget is the environment's, as in the reference); otherwise "
            "the real method"),
    StandIn("Scheduler.process_pending_chunked_abort", "observed",
            "tells the adapter, before the real method tears the chunked request down, "
            "that an abort marked it (the ghost finishes \"abort\" as in the spec's "
            "finish_chunked_abort); the real method runs unchanged"),
    StandIn("Scheduler.chunked_prefill_size", "replaced",
            "set on the built scheduler to the preset's chunked_prefill_size when it is > 0 "
            "(ServerArgs alone is resolved again from the memory tier, 4096 here); 0 keeps "
            "the release's value, which must not chunk a drawable prompt; "
            "ServerArgs.enable_mixed_chunk is the preset's mixed_chunk and is_mixed_chunk must "
            "resolve to it (upstream/session.py configure_chunking)"),
    StandIn("ScheduleBatch.mix_with_running", "observed",
            "wrapped so its inner merge_batch is not observed as a running-batch merge; the "
            "real method runs unchanged"),
    StandIn("scheduler.TEST_RETRACT / TEST_RETRACT_INTERVAL", "replaced",
            "upstream's own retraction test knob, set for one iteration when the "
            "environment asks for a retraction (choices.retract > 0)"),
    StandIn("envs.SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP", "replaced",
            "set for one iteration when the environment asks to disable overlap "
            "(choices.disable_overlap): upstream's only non-grammar early-processing path"),
    StandIn("speculative_hook: disable_overlap_schedule for spec on CPU", "replaced",
            "0.5.23 turns overlap off for speculative decoding on device=cpu; the "
            "ov-*-v2chain cells force it back on (runtime_context override)"),
    StandIn("ScheduleBatch.prepare_for_extend / prepare_for_decode / filter_batch / "
            "merge_batch / retract_decode, Scheduler.update_running_batch, "
            "FutureMap.resolve_seq_lens_cpu, Scheduler.process_batch_result, "
            "Scheduler.run_batch", "observed",
            "wrapped to build the spec's observation after the real call (retraction is "
            "observed once update_running_batch has re-queued the retracted requests); the "
            "real method runs unchanged"),
    StandIn("FutureMap.stash / FutureMap.publish, scheduler.resolve_forward_inputs",
            "observed",
            "record which relay rows were stashed, published and gathered, and for which "
            "owner (FM4, FM5); the real calls run unchanged"),
    StandIn("tree_cache.on_release (instance)", "observed",
            "every release_kv_cache calls it: records the release count, committed length "
            "and (checkpointed) cached length per request"),
    StandIn("SchedulerMetricsReporter.update_spec_metrics", "observed",
            "records the (batch size, num_correct_drafts) upstream feeds its accept counters "
            "(RP3)"),
    StandIn("SchedulerInvariantChecker.self_check_during_busy", "observed",
            "called by the adapter after every iteration with "
            "SGLANG_CHECK_KV_PAGE_INVARIANTS=1 and strict idle checks (UC), never inside "
            "the loop"),
    StandIn("Scheduler.on_idle", "observed",
            "wrapped: the real method runs, its idle-time checks included (every pool page "
            "free or the tree's, every req_to_token row free, the allocator's byte "
            "accounting; strict, they raise ValueError); the adapter takes a raise as UC's "
            "verdict at idle and the loop goes on. The tier makes idle periods on purpose: "
            "after each example's last op it iterates with the default choices until the "
            "loop has run on_idle's checks (harness/conformance/tier.py, the idle point)"),
    StandIn("Scheduler state between examples", "replaced",
            "abort_request(abort_all) and drained iterations, flush_cache, then the "
            "constructor's values for what flush_cache keeps (running_batch, "
            "new_token_ratio, forward_ct, the policy's waiting-prefix refresh count), so an "
            "example replays the same after any other"),
    StandIn("ServerArgs.attention_backend for a tree on pages > 1", "replaced",
            "0.5.23 refuses torch_native for speculative_eagle_topk > 1 at page_size > 1 "
            "(speculative_hook.py _handle_eagle_family, _PAGE_TREE_SPEC_BACKENDS: "
            "flashinfer, fa3, triton); the *-p4-v2tree cells resolve with triton and, right "
            "after publish, override attention_backend to torch_native (runtime_context "
            "override), so attention_backends() is (torch_native, torch_native) as in every "
            "other cell; no attention backend is built here (upstream/session.py)"),
    StandIn("ReqToTokenPool width", "replaced",
            "built by the kv-cache stand-in at the preset's max_context_len plus the "
            "release's own get_req_to_token_extra_context_len(), read inside "
            "init_model_worker as the release's _init_pools reads it (after "
            "SGLANG_DEBUG_REVERT_PR is applied); after publish the release's "
            "get_alloc_len_per_decode() and that extra must equal the model's "
            "alloc_len_per_decode and row_width - max_context_len, or the cell is not run "
            "(upstream/session.py check_geometry)"),
    StandIn("PortArgs.nccl_port", "replaced",
            "a port the OS just handed out: several cells (one process each) run at once"),
    StandIn("model_config (hf config.json)", "replaced",
            "a one-layer llama config written to a temporary folder; no weights are loaded"),
)


def describe_stand_ins() -> str:
    """One block per stand-in: the upstream name and kind, then the reason, indented."""
    import textwrap

    blocks = []
    for stand_in in STAND_INS:
        reason = textwrap.fill(stand_in.reason, width=88, initial_indent="    ",
                               subsequent_indent="    ")
        blocks.append(f"{stand_in.target} [{stand_in.kind}]\n{reason}")
    return "\n".join(blocks)
