"""One real sglang ``Scheduler`` per process, its event loop on a thread, stepped.

Upstream allows one ``Scheduler`` per process (a second ``init_parallel_runtime`` raises),
and a cell fixes what the constructor reads (page size, speculative shape, overlap). So a
process drives one cell: :func:`get_session` builds the scheduler once, and every
:class:`~upstream.adapter.UpstreamScheduler` of that cell reuses it after a reset (abort
everything, run the loop until idle, ``flush_cache``: upstream's own reset).

Stepping: ``run_event_loop()`` runs unchanged on a daemon thread. Its per-iteration
ingest hook (``Scheduler.ingest_requests``) is replaced by a rendezvous: the loop thread
parks there, the driver applies admissions and aborts, then releases it for exactly one
iteration with the environment's choices. A crash of the loop is reported to the driver as
:class:`UpstreamCrash`; the session is then dead and says so.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.state import IterationChoices
from overlap_spec.upstream import hooks
from overlap_spec.upstream.bootstrap import UpstreamUnavailable, load_sglang
from overlap_spec.upstream.fields import (
    get_tree_core,
    get_undrivable_reason,
    is_rust_core,
    is_tree_on,
)
from overlap_spec.upstream.worker import EOS_TOKEN, StandInWorker

# The release's row is the model's with this current-upstream gate switched on (B23: the
# widening to the decode reserve on pages > 1 only; the catalogue lists it).
RELEASE_ROW_FAULTS: Final = frozenset({"B23"})

ITERATION_TIMEOUT_S = 120.0
DRAIN_ITERATIONS = 64


class UpstreamCrash(Exception):
    """sglang raised inside its event loop (or hung): a failure, never a pass."""

    def __init__(self, message: str, upstream_location: str = "") -> None:
        super().__init__(message)
        self.upstream_location = upstream_location


def describe_upstream_frame(tb: Any) -> str:
    """``file.py:line in function`` of the innermost sglang frame of a traceback."""
    frames = [f for f in traceback.extract_tb(tb) if "sglang" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('sglang/', 1)[-1]}:{f.lineno} in {f.name}"


def is_drivable(config: ModelConfig) -> str | None:
    """None when the adapter drives this cell, else the reason it is n/a
    (:func:`upstream.fields.get_undrivable_reason`)."""
    return get_undrivable_reason(config)


@dataclass
class Command:
    choices: IterationChoices


class Session:
    """The real scheduler of one cell, its loop thread and the rendezvous."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.dead: str | None = None
        self.choices = IterationChoices()
        self._to_loop: queue.Queue[Command] = queue.Queue()
        self._to_driver: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.scheduler = self._build()
        self.used = False

    # ------------------------------------------------------------------ construction
    def _build(self) -> Any:
        load_sglang()
        from sglang.srt.managers import scheduler as scheduler_module
        from sglang.srt.mem_cache import allocation
        from sglang.srt.server_args import PortArgs

        # Upstream's own runtime checks, strict: the adapter runs them after each iteration
        # (upstream/adapter.py run_upstream_checker), never inside the loop.
        os.environ["SGLANG_CHECK_KV_PAGE_INVARIANTS"] = "1"
        os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
        os.environ.pop("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", None)
        cfg = self.config
        preset = cfg.preset
        args = publish_config(cfg)
        port_args = PortArgs.init_new(args)
        # The gloo world listens on nccl_port; several cells run at once (one process
        # each), so take a port the OS just handed out rather than a guessed one.
        port_args.nccl_port = _get_free_port()

        # The pools are built where the release builds them: in init_model_worker, after
        # Scheduler.__init__ has applied SGLANG_DEBUG_REVERT_PR (maybe_revert_pr_fix), so a
        # reverted row sizing (26972) sizes this row too.
        built: dict[str, Any] = {}

        def init_model_worker(sched: Any) -> None:
            built.update(self._build_pools())
            _init_model_worker(sched, built["worker"], preset.max_running_requests,
                               cfg.kv_tokens, int(preset.max_context_len))

        allocation.assign_req_to_token_pool_func = _assign_req_to_token_pool
        scheduler_module.Scheduler.init_model_worker = init_model_worker
        scheduler_module.kv_cache_builder.build_kv_cache = lambda **_: SimpleNamespace(
            is_hybrid_swa=False, is_hybrid_ssm=False, sliding_window_size=None,
            full_tokens_per_layer=None, swa_tokens_per_layer=None,
            req_to_token_pool=built["r2t"], token_to_kv_pool_allocator=built["alloc"],
            disable_radix_cache=not is_tree_on(cfg), tree_cache=built["tree"])
        # Upstream's own retraction test knob, armed per iteration by the environment.
        scheduler_module.TEST_RETRACT_INTERVAL = 1
        scheduler_module.TEST_RETRACT_NO_PREFILL_BS = 1 << 30
        hooks.install(scheduler_module)
        try:
            sched = scheduler_module.Scheduler(args, port_args)
        except Exception as error:  # noqa: BLE001
            raise UpstreamUnavailable(
                f"sglang Scheduler.__init__ failed for {cfg.name}: {type(error).__name__}: "
                f"{str(error)[:200]} ({describe_upstream_frame(error.__traceback__)})"
            ) from None
        sched.ingest_requests = self._ingest
        hooks.watch_tree_cache(sched.tree_cache)
        if cfg.cell.overlap != bool(sched.enable_overlap):
            raise UpstreamUnavailable(
                f"{cfg.name}: the release resolved enable_overlap={sched.enable_overlap}")
        configure_chunking(cfg, sched)
        return sched

    def _build_pools(self) -> dict[str, Any]:
        """The release's pools and the stand-in worker. The req_to_token row is the
        preset's context plus the release's own ``get_req_to_token_extra_context_len()``,
        read now, as its ``_init_pools`` reads it."""
        import torch
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cfg = self.config
        preset = cfg.preset
        page = cfg.page_size
        width = int(preset.max_context_len) + int(get_req_to_token_extra_context_len())
        r2t = ReqToTokenPool(size=preset.max_running_requests, max_context_len=width,
                             device="cpu", enable_memory_saver=False)
        kv = MHATokenToKVPool(size=cfg.kv_tokens, page_size=page, dtype=torch.float16,
                              head_num=1, head_dim=8, layer_num=1, device="cpu",
                              enable_memory_saver=False)
        if page == 1:
            from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

            alloc: Any = TokenToKVPoolAllocator(size=cfg.kv_tokens, dtype=torch.float16,
                                                device="cpu", kvcache=kv, need_sort=False)
        else:
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

            alloc = PagedTokenToKVPoolAllocator(size=cfg.kv_tokens, page_size=page,
                                                dtype=torch.float16, device="cpu",
                                                kvcache=kv, need_sort=False)
        radix = is_tree_on(cfg)
        # A radix cell shares prefixes; the opt-in forces every other cell's matches to miss.
        os.environ["SGLANG_RADIX_FORCE_MISS"] = "0" if cfg.cell.radix or not radix else "1"
        # is_eagle as kv_cache_builder.py:401 sets it: a spec cell's tree keys bigrams.
        # A radix cell's tree on the core asked for (upstream/fields.py get_tree_core: python
        # unless --tree-core rust); the opt-in's force-miss tree stays on the python core,
        # whose unlocked pages it walks.
        core = get_tree_core() if cfg.cell.radix else "python"
        tree = UnifiedRadixCache(params=CacheInitParams(
            req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=page,
            disable=not radix, is_eagle=radix and cfg.cell.is_spec,
            tree_components=(ComponentType.FULL,), tree_core_backend=core if radix else None))
        if radix and is_rust_core(tree) != (core == "rust"):
            # The release falls back to python without a usable Rust extension or toolchain
            # (tree_core_registry.py _rust_fallback_reason): a cell asked for one core must
            # not silently run on the other.
            raise UpstreamUnavailable(
                f"{cfg.name}: asked for the {core} tree core, the release built "
                f"{type(tree.tree_core).__name__}")
        model_runner = _make_model_runner(kv, alloc, r2t, cfg.cell.needs_cpu_seq_lens)
        worker = StandInWorker(cfg, model_runner,
                               SimpleNamespace(use_ngram_embedding=False), hooks.HOST)
        return {"r2t": r2t, "alloc": alloc, "tree": tree, "worker": worker}

    # ------------------------------------------------------------------ stepping
    def _ingest(self, stop_at_pause: bool = False) -> list[Any]:
        """The loop's ingest hook: park until the driver releases one iteration."""
        from sglang.srt.managers import scheduler as scheduler_module

        self._to_driver.put(("boundary", None))
        command = self._to_loop.get()
        self.choices = command.choices
        scheduler_module.TEST_RETRACT = command.choices.retract > 0
        os.environ["SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"] = (
            "1" if command.choices.disable_overlap else "0")
        return []

    def _run_loop(self) -> None:
        try:
            self.scheduler.run_event_loop()
            self._to_driver.put(("crash", UpstreamCrash("the event loop returned")))
        except BaseException as error:  # noqa: BLE001 - reported to the driver, not lost
            where = describe_upstream_frame(error.__traceback__)
            self._to_driver.put(("crash", UpstreamCrash(
                f"sglang raised {type(error).__name__}: {str(error)[:300]}"
                + (f" at {where}" if where else ""), where)))

    def _wait(self) -> None:
        try:
            kind, payload = self._to_driver.get(timeout=ITERATION_TIMEOUT_S)
        except queue.Empty:
            self.dead = "the event loop did not reach its next iteration in time"
            raise UpstreamCrash(self.dead) from None
        if kind == "crash":
            self.dead = str(payload)
            raise payload

    def start(self) -> None:
        if self.dead is not None:
            raise UpstreamCrash(f"the scheduler of this cell is unusable: {self.dead}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_loop, name="sglang-event-loop",
                                            daemon=True)
            self._thread.start()
            self._wait()  # parked at its first ingest

    def step(self, choices: IterationChoices) -> None:
        """Run exactly one iteration of the real event loop."""
        self.start()
        self._to_loop.put(Command(choices))
        self._wait()

    def reset(self) -> None:
        """Back to an empty scheduler between examples: resume a paused one, abort all,
        drain, flush_cache."""
        from sglang.srt.managers.io_struct import AbortReq

        self.start()
        sched = self.scheduler
        hooks.HOST.detach()
        if not self.used:
            self.used = True
            return
        if sched._engine_paused:  # an example that ended in pause_generation
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput

            sched.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
        drain = IterationChoices(allow_prefill=False)
        for _ in range(DRAIN_ITERATIONS):
            # Again every pass: a retraction puts an aborted request back in the queue.
            sched.abort_request(AbortReq(abort_all=True))
            if sched.is_fully_idle() and not sched.waiting_queue:
                break
            self.step(drain)
        if not sched.flush_cache():
            self.dead = (
                "could not drain the scheduler between examples: "
                f"running={[r.rid for r in sched.running_batch.reqs]} "
                f"waiting={[r.rid for r in sched.waiting_queue]} "
                f"queued results={len(getattr(sched, 'result_queue', ()))} "
                f"last_batch={_rids(sched.last_batch)}")
            raise UpstreamCrash(self.dead)
        # What flush_cache keeps and admission or retraction reads: back to a new
        # scheduler's values, so an example replays the same whatever ran before it.
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        sched.new_token_ratio_tracker.reset()
        sched.forward_ct = 0
        # The waiting-prefix refresh (schedule_policy.py _touch_waiting_prefixes) touches
        # every waiting request's prefix on each 32nd scheduling pass it counts, and the
        # touch's walk splits tree nodes: its count restarts with the example, or a script
        # replays differently after other examples (found by the idle points, 2026-11-29).
        sched.policy._waiting_prefix_refresh_calls = 0
        # An emptied running batch keeps stale tensors (filter_batch, D6): give it the
        # constructor's fresh empty batch (Scheduler.init_running_status).
        sched.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)


def configure_chunking(config: ModelConfig, sched: Any) -> None:
    """Chunked prefill and mixed chunks as the preset says (docs/coverage.md).

    ``chunked_prefill_size`` > 0: the built scheduler chunks at that size. ``ServerArgs``
    alone does not do it (0.5.23 resolves the size again from the memory tier,
    ``arg_groups/memory_hook.py``), so it is set on the scheduler, where
    ``init_chunked_prefill`` put it and ``_get_new_batch_prefill_raw`` reads it; the release's
    own checks of that size are run (``validation_hook``: a page multiple;
    ``check_truncation_align_fits_chunk``), and nothing may resize a chunk (no dynamic
    chunking). 0: the release must not chunk a prompt the preset can draw (up to
    ``max_context_len - 1`` tokens); it resolves 4096 here. ``mixed_chunk`` goes to
    ``ServerArgs.enable_mixed_chunk``, and the scheduler must have resolved
    ``is_mixed_chunk`` to it (the model mixes in non-spec cells only:
    ``harness.drive.cells.check_sizes``)."""
    size = config.preset.chunked_prefill_size
    if bool(sched.is_mixed_chunk) != bool(config.preset.mixed_chunk):
        raise UpstreamUnavailable(
            f"{config.name}: the release resolved is_mixed_chunk={sched.is_mixed_chunk}, the "
            f"preset says mixed_chunk={config.preset.mixed_chunk}")
    if size > 0:
        if size % config.page_size:
            raise UpstreamUnavailable(
                f"{config.name}: chunked_prefill_size={size} is not a multiple of the page "
                f"size {config.page_size} (the release's validation_hook asserts it)")
        if getattr(sched, "dynamic_chunk_sizer", None) is not None:
            raise UpstreamUnavailable(
                f"{config.name}: the release sizes chunks dynamically; the model does not")
        sched.chunked_prefill_size = size
        check = getattr(sched, "check_truncation_align_fits_chunk", None)
        try:
            if check is not None:
                check()
        except ValueError as error:
            raise UpstreamUnavailable(f"{config.name}: {str(error)[:200]}") from None
        return
    chunk = sched.chunked_prefill_size
    if chunk is not None and chunk < config.preset.max_context_len:
        raise UpstreamUnavailable(
            f"{config.name}: the release resolved chunked_prefill_size={chunk}: it would "
            f"chunk prompts of up to {config.preset.max_context_len - 1} tokens, and the "
            "preset says chunked_prefill_size=0 (no chunking)")


def publish_config(config: ModelConfig) -> Any:
    """The cell's ``ServerArgs``, published as the scheduler process's config (the release
    resolves it there), with the tier's overrides; then the resolved backends and the
    model's geometry are checked against the release's (:func:`check_backends`,
    :func:`check_geometry`). Returns the ``ServerArgs``."""
    from sglang.srt.runtime_context import SpawnRanks, get_context, publish
    from sglang.srt.server_args import ServerArgs

    cfg = config
    preset = cfg.preset
    page = cfg.page_size
    spec_kwargs: dict[str, Any] = {}
    if cfg.cell.is_spec:
        spec_kwargs = dict(speculative_algorithm="EAGLE",
                           speculative_num_steps=cfg.spec_steps,
                           speculative_eagle_topk=cfg.topk,
                           speculative_num_draft_tokens=cfg.draft_tokens)
    # A tree on pages > 1 passes 0.5.23's EAGLE gate only on a backend with the two-pass
    # cascade draft-decode (speculative_hook.py _PAGE_TREE_SPEC_BACKENDS): resolve with
    # triton, then run torch_native like every other cell (no backend is built here).
    backend = "triton" if cfg.is_paged_tree else "torch_native"
    args = ServerArgs(
        model_path=_write_tiny_model(), device="cpu", skip_tokenizer_init=True,
        load_format="dummy", attention_backend=backend,
        disable_radix_cache=not is_tree_on(cfg),
        page_size=page, max_running_requests=preset.max_running_requests,
        max_total_tokens=cfg.kv_tokens, disable_cuda_graph=True,
        disable_overlap_schedule=not cfg.cell.overlap,
        enable_mixed_chunk=bool(preset.mixed_chunk), **spec_kwargs)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    overrides: dict[str, Any] = {}
    if cfg.cell.is_spec and cfg.cell.overlap:
        # 0.5.23 resolves disable_overlap_schedule=True for spec on device=cpu
        # (arg_groups/speculative_hook); the cell asks for overlap, so force it back on.
        overrides["disable_overlap_schedule"] = False
    if backend != "torch_native":
        overrides["attention_backend"] = "torch_native"
    if overrides:
        get_context().override("overlap-spec", **overrides)
    check_backends()
    check_geometry(cfg)
    return args


def check_backends() -> None:
    """The resolved attention backends the scheduler path reads (``attention_backends()``:
    ``alloc_for_extend``'s row writer, ``get_last_loc``) are torch_native, the only pair
    with a CPU path here; a page-tree cell resolves with triton and is overridden."""
    from sglang.srt.runtime_context import attention_backends

    pair = tuple(attention_backends())
    if pair != ("torch_native", "torch_native"):
        raise UpstreamUnavailable(f"the release resolved attention backends {pair}; the "
                                  "tier runs ('torch_native', 'torch_native')")


def check_geometry(config: ModelConfig) -> None:
    """The model's reserve and row against the release's own numbers, read after publish:
    ``get_alloc_len_per_decode()`` is A (``alloc_len_per_decode``) and
    ``get_req_to_token_extra_context_len()`` is the row past the context
    (``row_width - max_context_len``) with the release's own page gate on the widening
    (B23, current upstream: no widening on page 1). A disagreement is the model's geometry
    being wrong, so the cell is not run."""
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_len_per_decode,
        get_req_to_token_extra_context_len,
    )

    release = (int(get_alloc_len_per_decode()), int(get_req_to_token_extra_context_len()))
    model = (int(config.alloc_len_per_decode),
             int(config.get_row_width(RELEASE_ROW_FAULTS)) - int(config.preset.max_context_len))
    if release != model:
        raise UpstreamUnavailable(
            f"{config.name}: the release's geometry (A, row extra) = {release}, the model's "
            f"(alloc_len_per_decode, row_width - max_context_len) = {model}")


def _rids(batch: Any) -> list[str] | None:
    return None if batch is None else [r.rid for r in batch.reqs]


_SESSION: Session | None = None
_BUILD_ERROR: Exception | None = None


def get_death() -> str | None:
    """Why this process's scheduler became unusable (a crash of the release), or None."""
    return None if _SESSION is None else _SESSION.dead


def get_session(config: ModelConfig) -> Session:
    """The process's session; a failed build is remembered and raised again, never retried
    (a second Scheduler construction cannot succeed in the same process)."""
    global _SESSION, _BUILD_ERROR
    if _BUILD_ERROR is not None:
        raise _BUILD_ERROR
    if _SESSION is None:
        try:
            _SESSION = Session(config)
        except Exception as error:
            _BUILD_ERROR = error
            raise
    elif _SESSION.config != config:
        raise UpstreamUnavailable(
            f"this process already drives {_SESSION.config.name}; one cell per process "
            "(upstream allows one Scheduler per process)")
    return _SESSION


# ---------------------------------------------------------------------- stand-ins
def _get_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_tiny_model() -> str:
    """A one-layer llama config.json, no weights (load_format=dummy reads only this)."""
    folder = Path(tempfile.mkdtemp(prefix="overlap-spec-model-"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "eos_token_id": EOS_TOKEN,
        "bos_token_id": 1, "tie_word_embeddings": False,
    }))
    return str(folder)


def _assign_req_to_token_pool(req_pool_indices: Any, req_to_token: Any, start_offset: Any,
                              end_offset: Any, out_cache_loc: Any, batch_size: int) -> None:
    """The triton kernel's row writes, in torch (there is no CPU triton driver).

    The kernel stores at ``req_to_token + row * width + column`` with no bound on the
    column, so an end past the row writes the next row's first columns (finding U7);
    this does the same through the flat view. Past the whole pool it would write outside
    the tensor: that is raised, not truncated."""
    flat = req_to_token.view(-1)
    width = req_to_token.shape[1]
    taken = 0
    for i in range(int(batch_size)):
        row, start, end = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        if row * width + end > flat.numel():
            raise IndexError(f"assign_req_to_token_pool: row {row} columns [{start}, {end}) "
                             f"run past the req_to_token pool ({flat.numel()} entries)")
        flat[row * width + start:row * width + end] = out_cache_loc[
            taken:taken + end - start].to(req_to_token.dtype)
        taken += end - start


class _ModelRunner:
    """What ``Scheduler.__init__`` reads off ``tp_worker.model_runner``."""

    device = "cpu"
    canary_manager = None
    prefill_aware_swa = None
    weight_load_mem_usage = None

    def __init__(self, kv: Any, alloc: Any, r2t: Any, needs_cpu_seq_lens: bool) -> None:
        import torch

        self.forward_stream = torch.cpu.Stream()
        self.attn_backend = SimpleNamespace(needs_cpu_seq_lens=needs_cpu_seq_lens)
        self.token_to_kv_pool = kv
        self.token_to_kv_pool_allocator = alloc
        self.req_to_token_pool = r2t
        self.ngram_embedding_manager = SimpleNamespace(
            prepare_for_forward=lambda batch, chunked_req=None: batch)

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return None  # model-side features the scheduler asks about: absent


def _make_model_runner(kv: Any, alloc: Any, r2t: Any, needs_cpu_seq_lens: bool) -> Any:
    return _ModelRunner(kv, alloc, r2t, needs_cpu_seq_lens)


def _init_model_worker(sched: Any, worker: StandInWorker, max_running: int, kv_tokens: int,
                       context_len: int) -> None:
    """The attributes the real ``init_model_worker`` sets, around the stand-in worker."""
    import torch
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.runtime_context import get_context, get_parallel

    sched.tp_worker = worker
    sched.model_worker = worker
    sched.draft_worker = None
    sched.max_total_num_tokens = kv_tokens
    sched.max_running_requests = max_running
    sched.max_prefill_tokens = kv_tokens
    # tp_worker.py get_worker_info: min(context_len - 1, kv_capacity - 1), inputs 5 less;
    # the preset's max_context_len is the model's context length.
    sched.max_req_len = min(context_len - 1, kv_tokens - 1)
    sched.max_req_input_len = sched.max_req_len - 5
    sched.device = "cpu"
    sched.random_seed = 0
    sched.max_queued_requests = None
    sched.min_free_slots_delayer = None
    sched.forward_stream = torch.cpu.Stream()
    sched.schedule_stream = torch.cpu.Stream()
    parallel = get_parallel()
    sched.tp_group = parallel.tp_group
    sched.tp_cpu_group = sched.tp_group.cpu_group
    sched.attn_tp_group = parallel.attn_tp_group
    sched.attn_tp_cpu_group = sched.attn_tp_group.cpu_group
    sched.attn_cp_group = parallel.attn_cp_group
    sched.attn_cp_cpu_group = sched.attn_cp_group.cpu_group
    sched.pp_group = parallel.pp_group
    sched.world_group = parallel.world_group
    sched.dp_tp_group = get_dp_tp_group()
    sched.dp_tp_cpu_group = sched.dp_tp_group.cpu_group
    sched.pad_input_ids_func = None
    sched.kv_cache_allocation_time = 0.0
    if not parallel.pp_max_micro_batch_size:
        get_context().override("overlap-spec-pp", pp_max_micro_batch_size=max(
            max_running // parallel.pp_size, 1))
